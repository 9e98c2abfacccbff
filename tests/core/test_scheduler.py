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


def _request(i: int, prompt_len: int, max_tokens: int, shared: bool = False,
             priority: int = 0) -> Request:
    """Shared prompts (0, 1, 2, ...) share prefixes, so prefix caching shares their blocks;
    the others start at 1000 * i and never match each other."""
    first = 0 if shared else 1000 * i
    return Request(f"r{i}", list(range(first, first + prompt_len)),
                   SamplingParams(max_tokens=max_tokens), i, priority=priority)


def _run_step(sched: Scheduler, reserve_seats: bool = False) -> list[Request]:
    """What the engine does with a schedule, minus the model: advance, append, finish."""
    out = sched.schedule()
    done = []
    for chunk in out.chunks:
        assert chunk.start == chunk.request.num_computed_tokens  # no stale chunk left
        assert chunk.request.status is RequestStatus.RUNNING
    assert sum(c.num_tokens for c in out.chunks) <= sched.max_num_batched_tokens
    assert out.num_prefill_tokens + out.num_decode_tokens == sum(
        c.num_tokens for c in out.chunks)
    sched.advance(out)
    for chunk in out.chunks:
        if chunk.samples:
            chunk.request.token_ids.append(7)
            if chunk.request.num_output_tokens >= chunk.request.params.max_tokens:
                done.append(chunk.request)
    for r in done:
        sched.finish(r, reserve_seat=reserve_seats)
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
       max_seqs=st.integers(1, 8), reserve=st.booleans())
def test_every_block_is_free_after_any_mix_of_finish_abort_and_preempt(
        ops, num_blocks: int, budget: int, max_seqs: int, reserve: bool) -> None:
    """With priorities -1, 0 and 1 mixed in (from the sizes: `ops` is shared with the
    speculative decoding test), so admissions preempt too. With `reserve`, completed
    requests reserve their seats for a time that never passes: progress must come from
    the rule that a reservation lapses once nothing runs."""
    kv = KVCacheManager(num_blocks, BLOCK)
    sched = Scheduler(kv, max_seqs, budget, seat_reserve_s=1e9 if reserve else 0.0,
                      clock=lambda: 0.0)
    live: dict[int, Request] = {}
    n = 0
    for op, a, b in ops:
        if op == "add":
            # Like the engine: a request must fit in the cache on its own.
            prompt_len = min(a, kv.capacity_tokens - b)
            live[n] = _request(n, prompt_len, b, shared=True, priority=(a + b) % 3 - 1)
            sched.add(live[n])
            n += 1
        elif op == "step":
            for _ in range(a):
                for r in _run_step(sched, reserve):
                    live.pop(r.arrival_index)
        elif live:
            victim = live.pop(sorted(live)[a % len(live)])
            sched.finish(victim)
        _check_invariants(sched)
    # Drain: everything still queued runs to completion; progress is guaranteed.
    for _ in range(10_000):
        if not sched.num_unfinished:
            break
        _run_step(sched, reserve)
        _check_invariants(sched)
        assert len(sched.reserved) <= max_seqs - len(sched.running)
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
    assert next(iter(sched.waiting)) is b and b.num_preemptions == 1
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


# ---- priority (vLLM's: lower first, equal priorities by arrival) ----------------------------

def _ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    kv = KVCacheManager(64, BLOCK)
    sched = Scheduler(kv, max_num_seqs=3, max_num_batched_tokens=64)
    for i, priority in enumerate([0, 1, -1, 0, -1]):
        sched.add(_request(i, 4, 2, priority=priority))
    assert _ids(sched.waiting) == ["r2", "r4", "r0", "r3", "r1"]
    out = sched.schedule()
    assert _ids(c.request for c in out.chunks) == ["r2", "r4", "r0"]
    assert _ids(sched.waiting) == ["r3", "r1"]


def test_equal_priorities_are_first_come_first_served() -> None:
    kv = KVCacheManager(64, BLOCK)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        sched.add(_request(i, 4, 2, priority=3))
    assert _ids(c.request for c in sched.schedule().chunks) == ["r0", "r1"]
    assert _ids(sched.waiting) == ["r2", "r3"]


def test_a_better_priority_preempts_the_worst_running_request_for_a_seat() -> None:
    kv = KVCacheManager(64, BLOCK)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    worst, better = _request(0, 6, 10, priority=1), _request(1, 6, 10, priority=0)
    sched.add(worst)
    sched.add(better)
    _run_step(sched)  # both prefilled, the batch is full
    urgent = _request(2, 6, 10, priority=-1)
    sched.add(urgent)
    out = sched.schedule()
    # The worst priority goes, though it arrived first; its decode this step is taken back.
    assert out.preempted == [worst] and worst.num_computed_tokens == 0
    assert _ids(c.request for c in out.chunks) == ["r1", "r2"]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 6
    assert sched.running == [better, urgent] and list(sched.waiting) == [worst]


def test_a_better_priority_preempts_for_kv_room_as_few_as_it_needs() -> None:
    kv = KVCacheManager(6, BLOCK)  # 24 slots
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    low = [_request(i, 7, 10, priority=2) for i in range(3)]  # 2 blocks each: all 6
    for r in low:
        sched.add(r)
    _run_step(sched)
    assert kv.pool.num_free == 0
    urgent = _request(3, 5, 10, priority=0)  # needs 2 blocks: one victim's
    sched.add(urgent)
    out = sched.schedule()
    # The running requests' next tokens fit their blocks; for the 2 blocks the arrival
    # needs, the last in queue order (the latest arrival of the worst priority) goes, and
    # only it.
    assert out.preempted == [low[2]]
    assert urgent in sched.running and _ids(c.request for c in out.chunks) == [
        "r0", "r1", "r3"]
    _check_invariants(sched)


def test_equal_or_better_priorities_are_never_preempted_for_an_arrival() -> None:
    kv = KVCacheManager(64, BLOCK)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    running = [_request(0, 6, 10, priority=0), _request(1, 6, 10, priority=-1)]
    for r in running:
        sched.add(r)
    _run_step(sched)
    for i, priority in ((2, 0), (3, 5)):  # equal to the worst running one, and worse
        sched.add(_request(i, 6, 10, priority=priority))
    out = sched.schedule()
    assert not out.preempted and sorted(_ids(sched.running)) == ["r0", "r1"]
    assert _ids(sched.waiting) == ["r2", "r3"]


def test_no_preemption_when_the_victims_could_not_make_room() -> None:
    kv = KVCacheManager(6, BLOCK)  # 24 slots
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    keep, low = _request(0, 13, 10, priority=-1), _request(1, 6, 10, priority=1)
    sched.add(keep)
    sched.add(low)
    _run_step(sched)  # 4 + 2 blocks, room for their next tokens: the pool is full
    big = _request(2, 15, 10, priority=-1)  # 4 blocks; preempting `low` frees only 2
    sched.add(big)
    out = sched.schedule()
    assert not out.preempted and big in sched.waiting
    assert sched.running == [keep, low] and kv.block_table("r2") == []
    assert _ids(c.request for c in out.chunks) == ["r0", "r1"]


def test_kv_growth_preempts_the_worst_priority_before_the_latest_arrival() -> None:
    kv = KVCacheManager(4, BLOCK)  # 16 slots
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    worse, better = _request(0, 7, 10, priority=1), _request(1, 7, 10, priority=0)
    sched.add(worse)
    sched.add(better)
    _run_step(sched)
    _run_step(sched)  # 9 tokens each, the pool full: the next step needs a block each
    out = sched.schedule()
    assert out.preempted == [worse]  # though `better` arrived later
    assert _ids(c.request for c in out.chunks) == ["r1"]


# ---- reserved seats: a completed request's seat waits for its priority's next one -----------

class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _scheduled(out) -> list[Request]:
    return [c.request for c in out.chunks]


def _light_beside_heavy(reserve_s: float = 0.02) -> tuple[Scheduler, _Clock, Request, Request]:
    """Two seats: a light request (priority 0) and a heavy one (5) running, another heavy
    one waiting. Returns the scheduler, its clock, the light request and the waiting one."""
    clock = _Clock()
    sched = Scheduler(KVCacheManager(64, BLOCK), max_num_seqs=2, max_num_batched_tokens=64,
                      seat_reserve_s=reserve_s, clock=clock)
    light, heavy, queued = (_request(0, 6, 10, priority=0), _request(1, 6, 10, priority=5),
                            _request(2, 6, 10, priority=5))
    for r in (light, heavy, queued):
        sched.add(r)
    _run_step(sched)
    assert sched.running == [light, heavy] and list(sched.waiting) == [queued]
    return sched, clock, light, queued


def test_a_completed_requests_seat_waits_for_its_prioritys_next_request() -> None:
    sched, clock, light, queued = _light_beside_heavy()
    sched.finish(light, reserve_seat=True)
    clock.now += 0.005
    out = sched.schedule()  # the heavy one decodes; the waiting one keeps waiting
    assert _ids(c.request for c in out.chunks) == ["r1"] and queued in sched.waiting
    sched.advance(out)
    again = _request(3, 6, 10, priority=0)  # the light client's next request
    sched.add(again)
    clock.now += 0.005
    out = sched.schedule()
    # It takes the seat without preempting anyone (no heavy prefill wasted).
    assert not out.preempted and again in sched.running and queued in sched.waiting
    assert not sched.reserved
    _check_invariants(sched)


def test_a_reserved_seat_goes_to_the_queue_when_its_time_is_up() -> None:
    sched, clock, light, queued = _light_beside_heavy(reserve_s=0.02)
    sched.finish(light, reserve_seat=True)
    clock.now += 0.019
    assert queued not in _scheduled(sched.schedule())
    clock.now += 0.002
    out = sched.schedule()
    assert queued in sched.running and queued in _scheduled(out)
    assert not sched.reserved


def test_a_seat_is_never_reserved_while_the_engine_would_idle_or_nobody_worse_waits() -> None:
    # Nothing else runs: the engine would idle for it, so the queue gets the seat at once.
    clock = _Clock()
    sched = Scheduler(KVCacheManager(64, BLOCK), max_num_seqs=1, max_num_batched_tokens=64,
                      seat_reserve_s=1.0, clock=clock)
    light, queued = _request(0, 6, 10, priority=0), _request(1, 6, 10, priority=5)
    sched.add(light)
    sched.add(queued)
    _run_step(sched)
    sched.finish(light, reserve_seat=True)
    assert not sched.reserved
    assert queued in _scheduled(sched.schedule())
    # Aborted (its client is gone), off (0 s), or only equal priorities waiting: no hold.
    for reserve_s, reserve_seat, waiting_priority in ((1.0, False, 5), (0.0, True, 5),
                                                      (1.0, True, 0)):
        sched, clock, light, queued = _light_beside_heavy(reserve_s)
        queued.priority = waiting_priority
        sched.finish(light, reserve_seat=reserve_seat)
        assert not sched.reserved
        assert queued in _scheduled(sched.schedule())


def test_a_reserved_seat_is_taken_by_a_better_priority_and_never_by_a_worse_one() -> None:
    sched, _, light, _ = _light_beside_heavy()
    heavy = sched.running[1]
    sched.finish(light, reserve_seat=True)
    worse = _request(3, 6, 10, priority=1)  # better than the heavy ones, worse than the seat's
    sched.add(worse)
    out = sched.schedule()
    # The reserved seat is not its own: to it the batch is full, so it preempts the heavy
    # one by the usual rule, and the seat stays reserved.
    assert out.preempted == [heavy] and worse in sched.running and len(sched.reserved) == 1
    urgent = _request(4, 6, 10, priority=-3)  # better than the seat's: it takes it
    sched.add(urgent)
    out = sched.schedule()
    assert urgent in sched.running and not out.preempted and not sched.reserved


def test_reservations_lapse_when_nothing_runs() -> None:
    sched, _, light, queued = _light_beside_heavy(reserve_s=10.0)
    sched.finish(light, reserve_seat=True)
    assert len(sched.reserved) == 1
    heavy = sched.running[0]
    sched.finish(heavy)  # aborted: the engine would idle for the reservation
    out = sched.schedule()
    assert queued in sched.running and queued in _scheduled(out)
    assert not sched.reserved


def test_a_held_request_is_passed_over_whatever_its_priority() -> None:
    kv = KVCacheManager(64, BLOCK)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64)
    running = _request(0, 6, 10, priority=1)
    sched.add(running)
    _run_step(sched)
    held = _request(1, 6, 10, priority=-5)
    held.grammar_pending = True  # its grammar compiles
    urgent = _request(2, 6, 10, priority=0)
    sched.add(held)
    sched.add(urgent)
    out = sched.schedule()
    assert out.preempted == [running] and sched.running == [urgent]
    assert _ids(sched.waiting) == ["r1", "r0"]


def test_a_handed_over_request_is_admitted_first() -> None:
    kv = KVCacheManager(64, BLOCK)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64)
    urgent = _request(0, 6, 10, priority=-1)
    handed_over = _request(1, 6, 10, priority=3)
    sched.add(urgent)
    sched.admit_pulled(handed_over)
    assert list(sched.waiting) == [handed_over, urgent]
    out = sched.schedule()  # and the better priority behind it does not preempt it
    assert [c.request for c in out.chunks] == [handed_over] and not out.preempted
    assert list(sched.waiting) == [urgent]
