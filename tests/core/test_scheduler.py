"""Scheduler and KV block accounting, without a model: every block comes back.

The property test drives the real Scheduler and KVCacheManager through random
arrivals, steps, aborts and finishes (with a cache small enough to force
preemption) and checks the invariants after every step and at the end.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tandem_engine.core.kv import BlockPool, KVCacheManager, OutOfBlocks
from tandem_engine.core.request import Request, RequestStatus
from tandem_engine.core.scheduler import Scheduler
from tandem_engine.sampling_params import SamplingParams

BLOCK = 4


def _request(i: int, prompt_len: int, max_tokens: int, shared: bool = False) -> Request:
    """Shared prompts (0, 1, 2, ...) share prefixes, so prefix caching shares their blocks;
    the others start at 1000 * i and never match each other."""
    first = 0 if shared else 1000 * i
    return Request(f"r{i}", list(range(first, first + prompt_len)),
                   SamplingParams(max_tokens=max_tokens), i)


def _run_step(sched: Scheduler) -> list[Request]:
    """What the engine does with a schedule, minus the model: advance, append, finish."""
    out = sched.schedule()
    done = []
    for chunk in out.chunks:
        assert chunk.start == chunk.request.num_computed_tokens
    sched.advance(out)
    for chunk in out.chunks:
        if chunk.samples:
            chunk.request.token_ids.append(7)
            if chunk.request.num_output_tokens >= chunk.request.params.max_tokens:
                done.append(chunk.request)
    for r in done:
        sched.finish(r)
    return done


def _check_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    tables = [kv.block_table(r.request_id) for r in sched.running + list(sched.waiting)]
    owned = [b for t in tables for b in t]
    # Prefix caching shares blocks: each block is referenced once per table holding it.
    assert len(set(owned)) == kv.pool.num_used
    for b in range(kv.num_blocks):
        assert kv.pool.ref_count(b) == owned.count(b)
    for t in tables:
        assert len(t) == len(set(t)), "a block twice in one table"
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert len(kv.block_table(r.request_id)) * BLOCK >= r.num_computed_tokens
    assert len(sched.running) <= sched.max_num_seqs


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12)),
        st.tuples(st.just("step"), st.integers(1, 4), st.integers(0, 0)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.integers(0, 0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(12, 40), budget=st.integers(1, 64),
       max_seqs=st.integers(1, 8))
def test_every_block_is_free_after_any_mix_of_finish_abort_and_preempt(
        ops, num_blocks: int, budget: int, max_seqs: int) -> None:
    kv = KVCacheManager(num_blocks, BLOCK)
    sched = Scheduler(kv, max_seqs, budget)
    live: dict[int, Request] = {}
    n = 0
    for op, a, b in ops:
        if op == "add":
            # Like the engine: a request must fit in the cache on its own.
            prompt_len = min(a, kv.capacity_tokens - b)
            live[n] = _request(n, prompt_len, b, shared=True)
            sched.add(live[n])
            n += 1
        elif op == "step":
            for _ in range(a):
                for r in _run_step(sched):
                    live.pop(r.arrival_index)
        elif live:
            victim = live.pop(sorted(live)[a % len(live)])
            sched.finish(victim)
        _check_invariants(sched)
    # Drain: everything still queued runs to completion; progress is guaranteed.
    for _ in range(10_000):
        if not sched.num_unfinished:
            break
        _run_step(sched)
        _check_invariants(sched)
    assert sched.num_unfinished == 0
    assert kv.pool.num_free == num_blocks


def test_decodes_go_before_prefills_and_the_budget_holds() -> None:
    kv = KVCacheManager(64, BLOCK)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    first = _request(0, 6, 5)
    sched.add(first)
    _run_step(sched)  # first prefills fully (6 tokens) and samples
    late = _request(1, 30, 5)
    sched.add(late)
    out = sched.schedule()
    assert [c.request for c in out.chunks] == [first, late]
    assert out.num_decode_tokens == 1
    assert out.chunks[1].num_tokens == 9  # the rest of the budget: a chunk of the prompt
    assert not out.chunks[1].samples


def test_head_of_queue_is_never_overtaken() -> None:
    kv = KVCacheManager(8, BLOCK)  # 32 slots
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    big, small = _request(0, 20, 2), _request(1, 4, 2)
    sched.add(_request(9, 12, 50))
    _run_step(sched)  # 3 blocks taken by a long-running request
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    # r9 grows to 4 blocks; the 4 left cannot hold r0's 20 tokens, and r1 waits behind it.
    assert [c.request.request_id for c in out.chunks] == ["r9"]
    assert list(sched.waiting) == [big, small]


def test_preemption_takes_the_latest_arrival_and_requeues_it_first() -> None:
    kv = KVCacheManager(4, BLOCK)  # 16 slots
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _request(0, 7, 10), _request(1, 7, 10)
    sched.add(a)
    sched.add(b)
    _run_step(sched)  # both prefilled: 2 blocks each, cache full
    _run_step(sched)  # 9 tokens each now
    out = sched.schedule()  # a needs a third block: b is preempted
    assert b in out.preempted and b.num_computed_tokens == 0
    assert sched.waiting[0] is b and b.num_preemptions == 1
    assert [c.request for c in out.chunks] == [a]


def test_block_pool_refuses_overallocation_and_double_free() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    with pytest.raises(OutOfBlocks, match="asked for 1 KV blocks, only 0 free"):
        pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks[:1])
    assert pool.num_free == 3


def test_pins_keep_blocks_until_unpinned_or_expired() -> None:
    kv = KVCacheManager(16, BLOCK)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _request(0, 10, 1), _request(1, 6, 1)
    sched.add(a)
    sched.add(b)
    sched.advance(sched.schedule())  # both prompts computed
    # A handoff pins a finished request's prompt KV before the scheduler lets go of it.
    assert len(kv.pin("r0", expires_at=10.0)) == 3
    pinned_b = kv.pin("r1", expires_at=20.0)
    sched.finish(a)
    sched.finish(b)
    assert len(pinned_b) == 2 and kv.num_pinned_blocks == 5 and kv.pool.num_used == 5
    assert kv.expire_pins(now=15.0) == ["r0"]
    assert kv.pool.num_used == 2
    assert kv.unpin("r1") and not kv.unpin("r1")
    assert kv.pool.num_used == 0 and kv.num_pinned_blocks == 0
