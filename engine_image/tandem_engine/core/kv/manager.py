"""Per-request block tables and the prefix cache, on top of the block pool.

The scheduler asks this manager every memory question ("which leading tokens of this
request are already cached?", "can it grow to N tokens?") and gets plain answers; it
never sees block ids it does not own.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from tandem_engine.core.kv.block_pool import BlockPool
from tandem_engine.core.kv.hashing import block_hashes


class CacheableRequest(Protocol):
    """What the manager needs of a request (tandem_engine.core.request.Request has it)."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    salt: bytes
    block_hashes: list[int]
    num_cached_blocks: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        # KV handed off to another engine: blocks kept referenced until the puller says it
        # is done, or until the deadline passes (a dead puller must not strand memory).
        self._pins: dict[str, tuple[list[int], float]] = {}
        # Kept as a plain int so another thread may read it without the owner's lock (a
        # sum over `_pins` would iterate a dict the owner is changing).
        self._num_pinned_blocks = 0
        # Blocks a transfer may still write (its state unknown), by quarantine id: kept out
        # of allocation and the prefix cache until released or `expires_at` passes.
        self._quarantine: dict[int, tuple[list[int], float]] = {}
        self._quarantine_ids = itertools.count(1)
        self._num_quarantined_blocks = 0
        self.queried_tokens = 0
        self.hit_tokens = 0

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

    def hashes(self, request: CacheableRequest) -> list[int]:
        """The request's full-block hashes, extended as its tokens grow."""
        if len(request.block_hashes) < len(request.token_ids) // self.block_size:
            request.block_hashes = block_hashes(request.token_ids, self.block_size,
                                                request.salt, start=request.block_hashes)
        return request.block_hashes

    def acquire_cached_prefix(self, request: CacheableRequest) -> int:
        """Give a request with no blocks the longest chain of cached blocks matching its
        tokens; return how many tokens that covers. At least one token is always left
        to compute, since the next token is sampled from its logits."""
        assert request.request_id not in self._tables, "request already holds blocks"
        if not self.enable_prefix_caching:
            return 0
        self.queried_tokens += len(request.token_ids)
        usable = (len(request.token_ids) - 1) // self.block_size
        hit: list[int] = []
        for h in self.hashes(request)[:usable]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hit.append(block)
        if hit:
            self.pool.touch(hit)
            self._tables[request.request_id] = hit
        request.num_cached_blocks = len(hit)
        self.hit_tokens += len(hit) * self.block_size
        return len(hit) * self.block_size

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

    def reachable_tokens(self, request_id: str) -> int:
        """Slots the request's table would cover if it took every free block."""
        return (len(self._tables.get(request_id, ())) + self.pool.num_free) * self.block_size

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request's table to the blocks that `num_tokens` slots need, freeing
        the rest (tail first). Only for blocks past every cached one: the slots a
        speculative step wrote for proposals that were not accepted."""
        table = self._tables.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if table is not None and len(table) > keep:
            self.pool.free(list(reversed(table[keep:])))
            del table[keep:]

    def cache_computed_blocks(self, request: CacheableRequest) -> None:
        """Register the request's newly completed blocks (prompt or generated tokens)."""
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        if full <= request.num_cached_blocks:
            return
        table = self._tables[request.request_id]
        hashes = self.hashes(request)
        for i in range(request.num_cached_blocks, full):
            self.pool.cache_block(table[i], hashes[i])
        request.num_cached_blocks = full

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            # Tail first: LRU eviction then drops a chain's children before its parents.
            self.pool.free(list(reversed(table)))

    # ---- pins: KV kept for a handoff -------------------------------------------------------

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held by pins. Safe to read from any thread (one int, no iteration)."""
        return self._num_pinned_blocks

    def pin(self, request_id: str, expires_at: float) -> list[int]:
        """Keep a finished request's blocks (its prompt KV) until `unpin` or `expires_at`;
        returns their ids in position order."""
        table = self._tables.pop(request_id, [])
        if table:
            self._pins[request_id] = (table, expires_at)
            self._num_pinned_blocks += len(table)
        return list(table)

    def unpin(self, request_id: str) -> bool:
        pinned = self._pins.pop(request_id, None)
        if pinned is None:
            return False
        self._num_pinned_blocks -= len(pinned[0])
        self.pool.free(list(reversed(pinned[0])))
        return True

    def expire_pins(self, now: float) -> list[str]:
        """Release every pin whose deadline has passed; return their ids."""
        expired = [rid for rid, (_, deadline) in self._pins.items() if deadline <= now]
        for rid in expired:
            self.unpin(rid)
        return expired

    # ---- quarantine: blocks a transfer of unknown state may still write --------------------

    @property
    def num_quarantined_blocks(self) -> int:
        """Blocks in quarantine. Safe to read from any thread (one int)."""
        return self._num_quarantined_blocks

    def quarantine(self, request_id: str, block_ids: list[int], expires_at: float) -> int | None:
        """Take `block_ids` (only the ones the request alone holds) out of the request's
        table into quarantine until `release_quarantine` or `expires_at`; the rest of its
        table stays with it (free it as usual). Returns the quarantine id, None when no
        block qualified."""
        table = self._tables.get(request_id, [])
        wanted = set(block_ids)
        held = [b for b in table if b in wanted and self.pool.ref_count(b) == 1]
        if not held:
            return None
        kept = set(held)
        self._tables[request_id] = [b for b in table if b not in kept]
        self.pool.quarantine(held)
        qid = next(self._quarantine_ids)
        self._quarantine[qid] = (held, expires_at)
        self._num_quarantined_blocks += len(held)
        return qid

    def release_quarantine(self, quarantine_id: int) -> bool:
        held = self._quarantine.pop(quarantine_id, None)
        if held is None:
            return False
        self._num_quarantined_blocks -= len(held[0])
        self.pool.release_quarantined(held[0])
        return True

    def expire_quarantine(self, now: float) -> list[int]:
        """Release every quarantine whose deadline has passed; return their ids."""
        expired = [q for q, (_, deadline) in self._quarantine.items() if deadline <= now]
        for q in expired:
            self.release_quarantine(q)
        return expired

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()
