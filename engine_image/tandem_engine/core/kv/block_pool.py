"""The block pool: the single owner of KV block ids, reference counts, the free queue
and the prefix cache's hash -> block map.

A block is a fixed-size run of token slots in the preallocated KV tensor; the pool
never touches that tensor. Invariants: a block is exactly one of referenced
(ref_count > 0), free (in the free queue) or quarantined; a quarantined block (the
destination of a transfer whose state is unknown: a late write may still land in it)
holds no reference and no cached hash, so allocation never hands it out and the prefix
cache never matches it until `release_quarantined` puts it back in the free queue. A
free block that still holds a cached hash stays matchable until allocation takes it
from the front of the queue (LRU eviction).
Callers free a request's blocks tail first, so a chain's children are always evicted
before their parents.

Every change of the hash -> block map goes to `events` (`events.KVEventLog`), which the
engine process publishes to its routers (their exact prefix index).
"""

from __future__ import annotations

from collections import OrderedDict

from tandem_engine.core.kv.events import KVEventBatch, KVEventLog


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # Least recently freed first: allocation takes from the front, frees append.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._quarantined: set[int] = set()
        self.evictions = 0
        # Pending changes, bounded by a few pools' worth of hashes (events.py).
        self.events = KVEventLog(limit=4 * num_blocks + 1024)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantined)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (ref_count becomes 1), evicting their cached hashes.
        All or nothing."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            old = self._hash_of[block_id]
            if old is not None:
                del self._cached[old]
                self._hash_of[block_id] = None
                self.evictions += 1
                self.events.removed(old)
            self._ref_counts[block_id] = 1
            out.append(block_id)
        return out

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        """Take one more reference to each block (a prefix-cache hit)."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block with no references is free again
        (still matchable if it holds a cached hash)."""
        for b in block_ids:
            count = self._ref_counts[b]
            if count <= 0:
                raise RuntimeError(f"KV block {b} freed more often than it was allocated")
            self._ref_counts[b] = count - 1
            if count == 1:
                self._free[b] = None

    def quarantine(self, block_ids: list[int]) -> None:
        """Drop the one reference to each block without freeing it: it is neither
        allocatable nor matchable until `release_quarantined`. Each block must be held by
        exactly one reference (a freshly allocated block nobody else shares)."""
        for b in block_ids:
            if self._ref_counts[b] != 1 or b in self._quarantined:
                raise RuntimeError(f"KV block {b} is shared or already quarantined; only a "
                                   "block with exactly one owner can be quarantined")
        for b in block_ids:
            self._ref_counts[b] = 0
            self._quarantined.add(b)
            old = self._hash_of[b]
            if old is not None:
                del self._cached[old]
                self._hash_of[b] = None
                self.events.removed(old)

    def release_quarantined(self, block_ids: list[int]) -> None:
        """Quarantined blocks are safe again: back to the free queue."""
        for b in block_ids:
            self._quarantined.remove(b)
            self._free[b] = None

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Make a fully computed block matchable by its hash (first writer wins)."""
        if self._hash_of[block_id] is None and block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self._hash_of[block_id] = block_hash
            self.events.stored(block_hash)

    def reset_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their contents and owners."""
        for b in self._cached.values():
            self._hash_of[b] = None
        self._cached.clear()
        self.events.cleared()

    def cached_hashes(self) -> list[int]:
        """Every hash the prefix cache matches now (a router's snapshot)."""
        return list(self._cached)

    def drain_events(self) -> KVEventBatch | None:
        """The prefix cache's changes since the last call, as the next numbered batch."""
        return self.events.drain(self.cached_hashes)
