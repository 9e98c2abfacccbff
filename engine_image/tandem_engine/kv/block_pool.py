"""The block pool: the single owner of KV block ids, their reference counts and the free queue.

A block is a fixed-size run of token slots in the preallocated KV tensor. The pool
never touches that tensor; it only decides which block ids are in use. Invariant:
every block id is either referenced (ref_count > 0) or in the free queue, never both.
"""

from __future__ import annotations

from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # Oldest-freed first: allocation takes from the front, frees append at the back.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (ref_count becomes 1). All or nothing."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._ref_counts[block_id] = 1
            out.append(block_id)
        return out

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block with no references is free again."""
        for b in block_ids:
            count = self._ref_counts[b]
            if count <= 0:
                raise RuntimeError(f"KV block {b} freed more often than it was allocated")
            self._ref_counts[b] = count - 1
            if count == 1:
                self._free[b] = None
