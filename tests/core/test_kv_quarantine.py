"""KV quarantine in core/kv: the destination blocks of a pull whose transfer state is
unknown are neither allocated nor matched until released or their TTL passes."""

from __future__ import annotations

import pytest
from tandem_engine.core.kv import KVCacheManager
from tandem_engine.core.request import Request
from tandem_engine.sampling_params import SamplingParams

BLOCK = 4


def _request(rid: str, first: int, prompt_len: int) -> Request:
    return Request(rid, list(range(first, first + prompt_len)),
                   SamplingParams(max_tokens=1), 0)


def test_quarantined_blocks_are_never_allocated_until_released() -> None:
    kv = KVCacheManager(8, BLOCK)
    assert kv.allocate_slots("pulled", 5 * BLOCK)
    table = kv.block_table("pulled")
    # The pull into the last 3 blocks timed out: those go to quarantine, the rest is freed.
    qid = kv.quarantine("pulled", table[2:], expires_at=100.0)
    assert qid is not None
    quarantined = set(table[2:])
    assert kv.num_quarantined_blocks == 3 == kv.pool.num_quarantined
    assert kv.block_table("pulled") == table[:2]
    kv.free("pulled")
    assert kv.pool.num_free == 5
    # Every block allocation can get is one that was never quarantined.
    assert kv.allocate_slots("other", 5 * BLOCK)
    assert not set(kv.block_table("other")) & quarantined
    assert not kv.allocate_slots("more", BLOCK)  # the quarantined 3 are not free
    kv.free("other")
    assert kv.release_quarantine(qid) and not kv.release_quarantine(qid)
    assert kv.num_quarantined_blocks == 0 and kv.pool.num_free == 8
    assert kv.allocate_slots("all", 8 * BLOCK)


def test_quarantined_blocks_are_not_matchable_by_the_prefix_cache() -> None:
    kv = KVCacheManager(8, BLOCK)
    a = _request("a", 0, 3 * BLOCK)
    assert kv.acquire_cached_prefix(a) == 0 and kv.allocate_slots("a", 3 * BLOCK)
    a.num_computed_tokens = 3 * BLOCK
    kv.cache_computed_blocks(a)  # cached, e.g. by an earlier request with this prompt
    assert kv.pool.num_cached == 3
    kv.quarantine("a", kv.block_table("a"), expires_at=100.0)
    kv.free("a")
    assert kv.pool.num_cached == 0
    again = _request("b", 0, 3 * BLOCK + 1)
    assert kv.acquire_cached_prefix(again) == 0


def test_shared_blocks_are_not_quarantined() -> None:
    kv = KVCacheManager(8, BLOCK)
    a = _request("a", 0, 2 * BLOCK + 1)
    kv.acquire_cached_prefix(a)
    kv.allocate_slots("a", 2 * BLOCK + 1)
    a.num_computed_tokens = 2 * BLOCK + 1
    kv.cache_computed_blocks(a)
    b = _request("b", 0, 2 * BLOCK + 1)
    assert kv.acquire_cached_prefix(b) == 2 * BLOCK  # shares a's two full blocks
    kv.allocate_slots("b", 2 * BLOCK + 1)
    table = kv.block_table("b")
    kv.quarantine("b", table, expires_at=100.0)  # only b's own last block qualifies
    assert kv.num_quarantined_blocks == 1 and kv.block_table("b") == table[:2]
    with pytest.raises(RuntimeError):
        kv.pool.quarantine(table[:1])  # shared: refused


def test_the_ttl_releases_a_quarantine() -> None:
    kv = KVCacheManager(4, BLOCK)
    kv.allocate_slots("x", 2 * BLOCK)
    kv.allocate_slots("y", 2 * BLOCK)
    qx = kv.quarantine("x", kv.block_table("x"), expires_at=10.0)
    qy = kv.quarantine("y", kv.block_table("y"), expires_at=20.0)
    kv.free("x")
    kv.free("y")
    assert kv.pool.num_free == 0 and kv.num_quarantined_blocks == 4
    assert kv.expire_quarantine(now=5.0) == []
    assert kv.expire_quarantine(now=15.0) == [qx]
    assert kv.pool.num_free == 2 and kv.num_quarantined_blocks == 2
    assert kv.expire_quarantine(now=25.0) == [qy]
    assert kv.pool.num_free == 4 and kv.num_quarantined_blocks == 0
    assert kv.pool.num_used == 0
