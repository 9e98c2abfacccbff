"""One engine's prefix cache as this router knows it from the engine's own KV events.

The engine publishes every change of its prefix cache (`protocol.KVEvents`: numbered
batches of block hashes stored and removed, or the whole cache cleared) and a snapshot on
request (`protocol.KVSnapshot`: every hash it holds, as of one batch). The index starts
empty and unsynced; a snapshot syncs it, and each following batch applies in order. A
batch that does not follow the last one (a gap: a dropped frame, a reconnect) unsyncs it
and its owner asks for a snapshot again. So the index is exactly the engine's cache,
for every router (one that started later included), after restarts (a new incarnation
starts over) and refits (hashes carry the weight epoch: `core/kv/hashing.block_salt`).

Bounded: an engine holds at most its KV pool's blocks (WELCOME's `num_kv_blocks`); an
index that grows past that (a misbehaving engine) is dropped and resynced. Pure: no
sockets (`engines.EngineClient` owns one per engine and does the asking).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tandem_engine import protocol as p


class KVIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.hashes: set[int] = set()
        self.seq: int | None = None  # the last batch applied; None: not synced
        self.resyncs: dict[str, int] = {}  # why it lost sync, counted
        self.last_lag = 0.0  # seconds from the engine's batch to its arrival here

    @property
    def synced(self) -> bool:
        return self.seq is not None

    def __len__(self) -> int:
        return len(self.hashes)

    def unsync(self, reason: str) -> None:
        """Forget everything until the next snapshot."""
        self.hashes.clear()
        self.seq = None
        self.resyncs[reason] = self.resyncs.get(reason, 0) + 1

    def load(self, snapshot: p.KVSnapshot, now: float) -> None:
        self.hashes = set(snapshot.hashes)
        self.seq = snapshot.seq
        self.last_lag = max(0.0, now - snapshot.sent_at)
        if len(self.hashes) > self.capacity:
            self.unsync("oversized")

    def apply(self, batch: p.KVEvents, now: float) -> bool:
        """Apply a batch; False when it shows a gap (the index is then unsynced, and a
        snapshot is needed). Batches before the snapshot's are already in it."""
        if self.seq is None or batch.seq <= self.seq:
            return self.seq is not None
        if batch.seq != self.seq + 1:
            self.unsync("gap")
            return False
        if batch.cleared:
            self.hashes.clear()
        self.hashes.difference_update(batch.removed)
        self.hashes.update(batch.stored)
        self.seq = batch.seq
        self.last_lag = max(0.0, now - batch.sent_at)
        if len(self.hashes) > self.capacity:
            self.unsync("oversized")
            return False
        return True

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading `hashes` the engine holds (chained hashes: a block's hash
        stands for its whole prefix, so the leading run is the cached prefix)."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def holds(self, hashes: Iterable[int]) -> bool:
        return all(h in self.hashes for h in hashes)
