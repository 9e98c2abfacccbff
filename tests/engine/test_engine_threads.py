"""Other threads read the engine only through its public, thread-safe surface.

Regression: the KV-progress thread of a prefill engine polled the pinned-block count
while the stepping thread pinned and unpinned. The count was a sum over a dict being
changed, so it raised `RuntimeError: dictionary changed size during iteration`, which
killed the progress thread (pulls from that engine then timed out) and could make
`/v1/state` answer 500.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from reference import random_prompts
from tandem_engine import SamplingParams
from tandem_engine.core.kv import KVCacheManager
from tandem_engine.lifecycle import EngineState


@pytest.fixture
def fast_thread_switches():
    """Switch threads every microsecond, so a reader lands inside a writer's update."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _poll(read, stop: threading.Event, errors: list[BaseException], seen: list) -> None:
    while not stop.is_set():
        try:
            seen.append(read())
        except BaseException as exc:  # the failure under test: record, do not hide it
            errors.append(exc)
            return


def test_pinned_block_count_can_be_polled_while_pins_change(fast_thread_switches) -> None:
    kv = KVCacheManager(num_blocks=4096, block_size=1)
    ids = [f"r{i}" for i in range(1000)]
    stop, errors, seen = threading.Event(), [], []
    reader = threading.Thread(target=_poll, args=(lambda: kv.num_pinned_blocks, stop,
                                                  errors, seen))
    reader.start()
    try:
        for _ in range(30):
            for rid in ids:
                kv.allocate_slots(rid, 2)
                kv.pin(rid, expires_at=1e18)
            for rid in ids:
                kv.unpin(rid)
            if errors:
                break
    finally:
        stop.set()
        reader.join()
    assert not errors, f"reading the pinned-block count failed: {errors[0]!r}"
    assert kv.num_pinned_blocks == 0 and kv.pool.num_used == 0
    assert seen and all(0 <= n <= 2 * len(ids) for n in seen)


def test_engine_stats_are_consistent_snapshots_under_concurrent_steps(
        tiny_llama: Path, fast_thread_switches) -> None:
    """A prefill engine steps, pins and unpins on one thread while another reads its
    published stats and pin count, as heartbeats, /v1/state and the KV progress thread
    do: every read succeeds and describes a state the engine was really in."""
    from tandem_engine.config import EngineConfig
    from tandem_engine.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_checkpoint(tiny_llama, EngineConfig(num_blocks=256))
    prompts = random_prompts(2048, [20] * 24, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    stop, errors, seen = threading.Event(), [], []
    reader = threading.Thread(target=_poll, args=(
        lambda: (engine.stats, engine.num_pinned_blocks), stop, errors, seen))
    reader.start()
    pinned_outputs = 0
    try:
        for round_ in range(4):
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{round_}-{i}", prompt, params, pin_for_handoff=True)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.pinned_blocks:
                        pinned_outputs += 1
            for i in range(len(prompts)):
                assert engine.unpin(f"{round_}-{i}")
    finally:
        stop.set()
        reader.join()
    assert not errors, f"reading the engine from another thread failed: {errors[0]!r}"
    assert pinned_outputs == 4 * len(prompts)
    assert engine.num_pinned_blocks == 0 == engine.stats.num_pinned_blocks
    for stats, pinned in seen:
        assert stats.state is EngineState.RUNNING
        assert 0 <= stats.num_pinned_blocks <= 256 and 0 <= pinned <= 256
        assert 0.0 <= stats.kv_usage <= 1.0
