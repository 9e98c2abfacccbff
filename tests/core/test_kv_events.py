"""KV events: the block pool's log of its prefix cache's changes (core/kv/events.py), and a
router's exact index built from them (router/kv_index.py). Pure: the real pool, no
processes (tests/router/test_kv_routing.py runs engines and routers)."""

from __future__ import annotations

from tandem_engine import protocol as p
from tandem_engine.core.kv.block_pool import BlockPool
from tandem_engine.core.kv.events import KVEventLog
from tandem_engine.router.kv_index import KVIndex


def events(batch) -> p.KVEvents:
    return p.KVEvents("e", "i", batch.seq, batch.cleared, batch.stored, batch.removed,
                      batch.at)


def snapshot(pool: BlockPool, seq: int) -> p.KVSnapshot:
    return p.KVSnapshot("e", "i", seq, pool.cached_hashes(), 0.0)


def test_the_pool_reports_what_becomes_matchable_and_what_stops_being() -> None:
    pool = BlockPool(4)
    assert pool.drain_events() is None  # nothing happened
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], 11)
    pool.cache_block(blocks[1], 12)
    first = pool.drain_events()
    assert (first.seq, first.cleared, sorted(first.stored), first.removed) == (
        1, False, [11, 12], [])
    pool.free(list(reversed(blocks)))
    pool.allocate(4)  # takes every block: the two cached hashes are evicted
    second = pool.drain_events()
    assert (second.seq, sorted(second.removed), second.stored) == (2, [11, 12], [])
    assert pool.drain_events() is None


def test_changes_within_a_batch_are_netted_and_a_reset_clears() -> None:
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache_block(b, 7)
    pool.free([b])
    pool.allocate(2)  # 7 stored and evicted before anyone drained: it never was, to them
    batch = pool.drain_events()
    assert batch.stored == [] and batch.removed == [7]
    pool.reset_cache()
    assert pool.drain_events().cleared


def test_a_quarantined_block_is_removed_from_the_cache() -> None:
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache_block(b, 5)
    pool.drain_events()
    pool.quarantine([b])
    assert pool.drain_events().removed == [5]


def test_an_undrained_log_stays_bounded_and_resyncs_with_the_whole_cache() -> None:
    log = KVEventLog(limit=3)
    for h in range(10):
        log.stored(h)
    batch = log.drain(lambda: [8, 9])
    assert batch.cleared and batch.stored == [8, 9] and batch.seq == 1
    assert len(log._pending) == 0


def test_the_index_is_exact_from_a_snapshot_and_the_batches_after_it() -> None:
    pool = BlockPool(8)
    index = KVIndex(capacity=8)
    a = pool.allocate(3)
    for block, h in zip(a, (1, 2, 3), strict=True):
        pool.cache_block(block, h)
    early = pool.drain_events()
    index.apply(events(early), 0.0)  # before any snapshot: ignored
    assert not index.synced and len(index) == 0
    index.load(snapshot(pool, pool.events.seq), 0.0)
    assert index.synced and index.match([1, 2, 3, 4]) == 3
    assert index.apply(events(early), 0.0)  # already in the snapshot: nothing changes
    pool.free(list(reversed(a)))
    b = pool.allocate(8)  # evicts all three
    pool.cache_block(b[0], 9)
    assert index.apply(events(pool.drain_events()), 0.0)
    assert index.hashes == set(pool.cached_hashes()) == {9}
    assert index.match([1, 2]) == 0 and index.holds([9])


def test_a_gap_unsyncs_the_index_until_the_next_snapshot() -> None:
    pool = BlockPool(4)
    index = KVIndex(capacity=4)
    index.load(snapshot(pool, 0), 0.0)
    [b, c] = pool.allocate(2)
    pool.cache_block(b, 1)
    pool.drain_events()  # batch 1: lost on the way
    pool.cache_block(c, 2)
    assert not index.apply(events(pool.drain_events()), 0.0)  # batch 2: a gap
    assert not index.synced and index.resyncs == {"gap": 1} and len(index) == 0
    index.load(snapshot(pool, pool.events.seq), 0.0)
    assert index.hashes == {1, 2}


def test_an_index_larger_than_the_engine_s_pool_is_dropped() -> None:
    index = KVIndex(capacity=2)
    index.load(p.KVSnapshot("e", "i", 0, [], 0.0), 0.0)
    assert not index.apply(p.KVEvents("e", "i", 1, False, [1, 2, 3], [], 0.0), 0.0)
    assert not index.synced and index.resyncs == {"oversized": 1}


def test_the_events_cross_the_wire_with_64_bit_hashes() -> None:
    msg = p.KVEvents("e", "i", 3, True, [2**64 - 1, 0], [2**63], 1.5)
    assert p.decode(p.encode(msg)) == msg
    snap = p.KVSnapshot("e", "i", 3, [2**64 - 1], 1.5)
    assert p.decode(p.encode(snap)) == snap
