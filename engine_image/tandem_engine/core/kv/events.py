"""What an engine's prefix cache gained and lost: the KV events routers index exactly.

The block pool (`block_pool.BlockPool`) reports each change of its hash -> block map: a
block hash becoming matchable (`stored`), one no longer matchable (`removed`: an
eviction, a quarantine), or every hash forgotten (`cleared`). The log nets them per hash
between two drains (a hash stored and evicted within one step is simply gone), so a
batch is a set difference: apply `cleared` first, then `removed`, then `stored`. Batches
are numbered from 1 (`seq`); a router that sees a gap asks for a snapshot (every hash
held now, with the seq of the last batch it covers) and applies only later batches.

Bounded: past `limit` pending hashes (an engine whose events nobody drains, as offline
`LLM` use), the log keeps only the fact that it overflowed, and its next batch is a
`cleared` one carrying every hash the pool holds: the same state, in O(pool) memory.
Thread-safe (the stepping thread writes; the socket thread asks for snapshots through
the stepping thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KVEventBatch:
    seq: int
    cleared: bool
    stored: list[int]
    removed: list[int]
    at: float  # wall clock when drained (a router's lag metric)


class KVEventLog:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"KV event log limit {limit} must be >= 1")
        self.limit = limit
        self.seq = 0  # the last batch drained
        self._pending: dict[int, bool] = {}  # hash -> held after the changes so far
        self._cleared = False
        self._overflowed = False
        self._lock = threading.Lock()

    def stored(self, block_hash: int) -> None:
        self._set(block_hash, True)

    def removed(self, block_hash: int) -> None:
        self._set(block_hash, False)

    def cleared(self) -> None:
        with self._lock:
            self._pending.clear()
            self._cleared = True

    def _set(self, block_hash: int, held: bool) -> None:
        with self._lock:
            if self._overflowed:
                return
            self._pending[block_hash] = held
            if len(self._pending) > self.limit:
                self._pending.clear()
                self._overflowed = True

    def drain(self, held: Callable[[], Iterable[int]]) -> KVEventBatch | None:
        """The changes since the last drain as the next batch (None: none). `held`: every
        hash the pool holds now, read only after an overflow."""
        with self._lock:
            if self._overflowed:
                batch = KVEventBatch(self.seq + 1, True, list(held()), [], time.time())
            elif self._pending or self._cleared:
                batch = KVEventBatch(self.seq + 1, self._cleared,
                                     [h for h, v in self._pending.items() if v],
                                     [h for h, v in self._pending.items() if not v],
                                     time.time())
            else:
                return None
            self.seq = batch.seq
            self._pending, self._cleared, self._overflowed = {}, False, False
            return batch
