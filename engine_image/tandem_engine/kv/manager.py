"""Per-request block tables on top of the block pool.

The scheduler asks this manager every memory question ("can this request grow to
N tokens?") and gets yes/no answers; it never sees block ids it does not own.
"""

from __future__ import annotations

from tandem_engine.kv.block_pool import BlockPool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's table cover `num_tokens` slots. False (and no change) if the
        pool has too few free blocks."""
        table = self._tables.setdefault(request_id, [])
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing <= 0:
            return True
        if missing > self.pool.num_free:
            if not table:
                del self._tables[request_id]
            return False
        table.extend(self.pool.allocate(missing))
        return True

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            # Free the tail first so a later LRU eviction drops leaves before parents.
            self.pool.free(list(reversed(table)))
