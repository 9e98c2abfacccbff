"""Engine lifecycle: prefix caching salted by weight epoch, pause/suspend/resume, refit."""

from __future__ import annotations

import gc
import json
import shutil
import weakref
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import random_prompts
from tandem_engine import LLM, CheckpointError, EngineState, EngineStateError, SamplingParams
from tandem_engine.cli.demo_model import write_demo_model
from tandem_engine.core.kv.hashing import block_hashes, block_salt, chain_root, hash_block
from tandem_engine.lifecycle import TRANSITIONS, KVMode, Signal

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and shape as tiny_llama, different weights (seed 1)."""
    return write_demo_model(tmp_path_factory.mktemp("llama-seed1"), arch="llama", seed=1)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _run_all(engine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


# ---- hashing ---------------------------------------------------------------------------------

def test_epoch_zero_without_cache_salt_is_the_unsalted_chain() -> None:
    tokens = list(range(100, 140))
    assert block_salt(0, None) == b""
    unsalted = block_hashes(tokens, 16)
    assert unsalted == block_hashes(tokens, 16, block_salt(0, None))
    assert unsalted[0] == hash_block(chain_root(), tokens[:16])
    assert unsalted[1] == hash_block(unsalted[0], tokens[16:32])
    assert len(unsalted) == 2  # only full blocks
    for salt in (block_salt(1, None), block_salt(0, "tenant-a"), block_salt(1, "tenant-a")):
        assert set(block_hashes(tokens, 16, salt)).isdisjoint(unsalted)
    # Extending known hashes equals hashing from scratch (the router relies on it).
    assert block_hashes(tokens + [1] * 16, 16, start=unsalted) == block_hashes(
        tokens + [1] * 16, 16)


# ---- prefix caching --------------------------------------------------------------------------

def test_cached_and_uncached_runs_agree(tiny_llama: Path) -> None:
    prompts = random_prompts(2048, [70, 33], seed=4)
    shared = prompts[0][:48]
    llm = LLM(tiny_llama)
    first = _tokens(llm.generate(prompts, GREEDY))
    stats = llm.engine.prefix_cache_stats()
    again = _tokens(llm.generate([*prompts, shared + prompts[1]], GREEDY))
    after = llm.engine.prefix_cache_stats()
    # The repeats hit (70-token prompt: 4 full blocks; the 48-token shared prefix: 3).
    assert after["hit_tokens"] - stats["hit_tokens"] == 64 + 32 + 48
    uncached = LLM(tiny_llama, enable_prefix_caching=False)
    assert again[:2] == first
    assert again == _tokens(uncached.generate([*prompts, shared + prompts[1]], GREEDY))
    assert uncached.engine.prefix_cache_stats()["hit_tokens"] == 0


def test_generated_blocks_are_cached_too(tiny_llama: Path) -> None:
    llm = LLM(tiny_llama)
    prompt = random_prompts(2048, [20], seed=8)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0,
                                                ignore_eos=True))[0].outputs[0]
    before = llm.engine.prefix_cache_stats()["hit_tokens"]
    # The continuation of prompt + output matches the generated tokens' blocks too.
    llm.generate([prompt + out.token_ids], GREEDY)
    assert llm.engine.prefix_cache_stats()["hit_tokens"] - before == 48


def test_cache_salt_isolates_tenants(tiny_llama: Path) -> None:
    llm = LLM(tiny_llama)
    engine = llm.engine
    prompt = random_prompts(2048, [40], seed=9)[0]
    for rid, salt in [("a1", "tenant-a"), ("b1", "tenant-b"), ("a2", "tenant-a")]:
        before = engine.prefix_cache_stats()["hit_tokens"]
        engine.add_request(rid, prompt, GREEDY, cache_salt=salt)
        _run_all(engine)
        hits = engine.prefix_cache_stats()["hit_tokens"] - before
        assert hits == (32 if rid == "a2" else 0), rid


def test_reset_prefix_cache_and_lru_eviction(tiny_llama: Path) -> None:
    llm = LLM(tiny_llama, num_blocks=12)
    prompts = random_prompts(2048, [40, 40, 40, 40], seed=10)
    llm.generate(prompts[:1], GREEDY)
    assert llm.engine.prefix_cache_stats()["cached_blocks"] == 3
    llm.reset_prefix_cache()
    assert llm.engine.prefix_cache_stats()["cached_blocks"] == 0
    before = llm.engine.prefix_cache_stats()["hit_tokens"]
    llm.generate(prompts[:1], GREEDY)
    assert llm.engine.prefix_cache_stats()["hit_tokens"] == before
    # Filling the 12-block pool with other prompts evicts the old chain, leaf first.
    llm.generate(prompts[1:], GREEDY)
    assert llm.engine.prefix_cache_stats()["evictions"] > 0
    assert llm.engine.kv.pool.num_free == 12


def test_lru_never_evicts_a_parent_before_its_child() -> None:
    from tandem_engine.core.kv import KVCacheManager
    from tandem_engine.core.request import Request

    kv = KVCacheManager(num_blocks=6, block_size=4)
    req = Request("r", list(range(13)), GREEDY, 0)
    assert kv.acquire_cached_prefix(req) == 0
    kv.allocate_slots("r", 13)
    req.num_computed_tokens = 13
    kv.cache_computed_blocks(req)  # three full blocks cached
    table = kv.block_table("r")
    kv.free("r")
    kv.pool.allocate(3)  # the three never-used blocks go first
    kv.pool.allocate(1)  # then the chain's tail: its leaf block
    assert kv.pool.lookup(req.block_hashes[2]) is None
    assert kv.pool.lookup(req.block_hashes[0]) == table[0]
    assert kv.pool.lookup(req.block_hashes[1]) == table[1]


# ---- refit and prefix caching ------------------------------------------------------------------

def test_refit_never_matches_a_stale_block(tiny_llama: Path, new_weights: Path) -> None:
    prompts = random_prompts(2048, [64, 50], seed=12)
    llm = LLM(tiny_llama)
    old = _tokens(llm.generate(prompts, GREEDY))
    assert _tokens(llm.generate(prompts, GREEDY)) == old  # fully cached now
    llm.pause()
    # Queued before the refit (salted with epoch 0), admitted after it: re-salted.
    llm.engine.add_request("queued", prompts[0], GREEDY)
    assert llm.refit(new_weights, version="v2") == 1
    llm.unpause()
    before = llm.engine.prefix_cache_stats()["hit_tokens"]
    queued = _run_all(llm.engine)["queued"]
    assert llm.engine.prefix_cache_stats()["hit_tokens"] == before  # nothing stale matched
    fresh = _tokens(LLM(new_weights).generate(prompts, GREEDY))
    assert queued == fresh[0]
    refitted = _tokens(llm.generate(prompts[1:], GREEDY))
    assert llm.engine.prefix_cache_stats()["hit_tokens"] == before
    assert refitted == fresh[1:]
    assert fresh != old
    assert llm.engine.weight_version == "v2"
    # Under the new epoch the cache works again.
    assert _tokens(llm.generate(prompts, GREEDY)) == fresh
    assert llm.engine.prefix_cache_stats()["hit_tokens"] > before


# ---- pause / suspend / resume ------------------------------------------------------------------

def _start(llm: LLM, prompts, steps: int) -> None:
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(str(i), prompt, SamplingParams(
            max_tokens=20, temperature=0.0, ignore_eos=True))
    for _ in range(steps):
        llm.engine.step()


@pytest.mark.parametrize("mode", [None, "persist", "offload", "recompute"])
def test_inflight_requests_survive_pause_and_suspend(tiny_qwen3: Path, mode: str | None
                                                     ) -> None:
    prompts = random_prompts(2048, [30, 45, 12], seed=13)
    expected = _tokens(LLM(tiny_qwen3).generate(prompts, SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True)))
    llm = LLM(tiny_qwen3, max_num_batched_tokens=64)
    engine = llm.engine
    _start(llm, prompts[:2], steps=4)
    engine.pause()
    assert engine.step() == []  # paused: no progress
    engine.add_request("2", prompts[2], SamplingParams(max_tokens=20, temperature=0.0,
                                                       ignore_eos=True))  # queues
    if mode is not None:
        released = engine.suspend(mode)
        assert engine.state is EngineState.SUSPENDED
        assert released == (0 if mode == "persist" else engine.runner.kv_bytes)
        if mode == "recompute":
            assert engine.num_running == 0 and engine.num_waiting == 3
            assert engine.kv.pool.num_free == engine.kv.num_blocks
        engine.resume()
        assert engine.state is EngineState.RESUMED
    engine.unpause()
    done = _run_all(engine)
    assert [done[str(i)] for i in range(3)] == expected
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_recompute_across_a_refit_continues_on_the_new_weights(
        tiny_llama: Path, new_weights: Path) -> None:
    prompts = random_prompts(2048, [30, 41], seed=14)
    llm = LLM(tiny_llama)
    engine = llm.engine
    _start(llm, prompts, steps=6)
    so_far = {rid: list(r.output_token_ids) for rid, r in engine.requests.items()}
    assert all(len(t) == 6 for t in so_far.values())
    engine.pause()
    engine.suspend("recompute")
    engine.refit(new_weights, version="v2")
    engine.resume()
    engine.unpause()
    done = {}
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id], outs[out.request_id] = out.outputs[0].token_ids, out
    fresh = LLM(new_weights)
    for i, prompt in enumerate(prompts):
        rid = str(i)
        assert done[rid][:6] == so_far[rid]
        cont = fresh.generate([prompt + so_far[rid]], SamplingParams(
            max_tokens=14, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
        assert done[rid][6:] == cont
        assert outs[rid].epoch_segments == [(0, 0), (1, 6)]


def test_stop_aborts_everything_and_nothing_hangs(tiny_qwen2: Path) -> None:
    llm = LLM(tiny_qwen2)
    engine = llm.engine
    _start(llm, random_prompts(2048, [30, 20], seed=15), steps=2)
    engine.add_request("late", [5, 6, 7], GREEDY)
    engine.pause()
    engine.suspend("offload")
    engine.stop()
    engine.wait_until("STOPPED", timeout=1)
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["0", "1", "late"]
    assert {o.outputs[0].finish_reason for o in outs} == {"abort"}
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    with pytest.raises(EngineStateError, match="STOPPED"):
        engine.add_request("x", [1, 2], GREEDY)
    with pytest.raises(EngineStateError, match="RUNNING engine"):
        llm.generate([[1, 2]], GREEDY)


def test_wait_until_accepts_stable_states_only(tiny_qwen2: Path) -> None:
    llm = LLM(tiny_qwen2)
    llm.engine.wait_until(EngineState.RUNNING, timeout=0.1)
    with pytest.raises(ValueError, match="only stable states"):
        llm.engine.wait_until("PAUSING")
    with pytest.raises(TimeoutError, match="still RUNNING"):
        llm.engine.wait_until("PAUSED", timeout=0.05)
    with pytest.raises(EngineStateError, match="KV management mode 'swap'"):
        llm.pause() or llm.suspend("swap")


# ---- the state table, driven at random ---------------------------------------------------------

@pytest.fixture(scope="module")
def state_llm(tiny_qwen2: Path) -> LLM:
    return LLM(tiny_qwen2, num_blocks=16)


@settings(max_examples=60, deadline=None)
@given(signals=st.lists(st.tuples(st.sampled_from(list(Signal)),
                                  st.sampled_from(list(KVMode))), max_size=12))
def test_random_signal_sequences_follow_the_table(state_llm: LLM, signals) -> None:
    engine = state_llm.engine
    if engine.state is EngineState.STOPPED:
        return  # a stopped engine ends this example's predecessor; nothing left to drive
    engine.add_request(f"req-{id(signals)}", [9, 8, 7, 6, 5], GREEDY)
    for signal, mode in signals:
        before = engine.state
        t = TRANSITIONS[signal]
        if before in t.allowed_from and signal is not Signal.STOP:
            if signal is Signal.SUSPEND:
                engine.suspend(mode)
            else:
                getattr(engine, signal.value.lower())()
            assert engine.state is t.target
        elif before not in t.allowed_from:
            with pytest.raises(EngineStateError, match=f"not allowed in state {before}"):
                getattr(engine, signal.value.lower())()
            assert engine.state is before
        engine.step()
    # Back to RUNNING and drain: every block comes back.
    if engine.state is EngineState.SUSPENDED:
        engine.resume()
    if engine.state is not EngineState.RUNNING:
        engine.unpause()
    _run_all(engine)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


# ---- refit failures leave the old weights serving ------------------------------------------------

def _broken_copy(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    if how == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif how in ("missing", "shape", "dtype"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(weights))
        name = "model.layers.1.mlp.down_proj.weight"
        if how == "missing":
            del tensors[name]
        elif how == "shape":
            tensors[name] = tensors[name][:, :-1].contiguous()
        else:
            tensors[name] = tensors[name].to(dtype=__import__("torch").int32)
        save_file(tensors, str(weights))
    elif how == "architecture":
        config = json.loads((dst / "config.json").read_text())
        config["num_hidden_layers"] = 3
        (dst / "config.json").write_text(json.dumps(config))
    elif how == "unreadable":
        shutil.rmtree(dst)
        dst.mkdir()
    return dst


@pytest.mark.parametrize(("how", "needle"), [
    ("missing", "model.layers.1.mlp.down_proj.weight"),
    ("shape", "model.layers.1.mlp.down_proj.weight"),
    ("dtype", "model.layers.1.mlp.down_proj.weight"),
    ("truncated", "model.safetensors"),
    ("architecture", "num_layers"),
    ("unreadable", "config.json"),
])
def test_failed_refit_keeps_serving_the_old_weights(tiny_llama: Path, new_weights: Path,
                                                    tmp_path: Path, how: str,
                                                    needle: str) -> None:
    prompts = random_prompts(2048, [25], seed=16)
    llm = LLM(tiny_llama)
    before = _tokens(llm.generate(prompts, GREEDY))
    llm.pause()
    broken = _broken_copy(new_weights, tmp_path / "broken", how)
    with pytest.raises(CheckpointError, match=needle.replace(".", r"\.")):
        llm.refit(broken, version="bad")
    assert llm.engine.weight_epoch == 0 and llm.state is EngineState.PAUSED
    llm.unpause()
    assert _tokens(llm.generate(prompts, GREEDY)) == before
    with pytest.raises(EngineStateError, match="refit is not allowed in state RUNNING"):
        llm.refit(new_weights)


@pytest.mark.parametrize("speculation", [None, "ngram", "mtp"])
def test_a_dropped_engine_is_freed_at_once(tiny_llama: Path, tmp_path: Path,
                                           speculation: str | None) -> None:
    """An engine (and its KV pool, 512 MiB by default) is freed when its last user drops
    it, without waiting for a garbage collection: nothing it owns refers back to it. (A
    state machine holding the engine's bound method kept every dropped engine's pool alive
    until a collection; a test worker creating engines grew to 15 GB and was killed.)"""
    model, options = tiny_llama, {}
    if speculation == "mtp":
        model = write_demo_model(tmp_path / "mtp", mtp_heads=2)
        options = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    elif speculation == "ngram":
        options = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
    gc.disable()
    try:
        llm = LLM(model, **options)
        llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0.0))
        llm.engine.pause()
        llm.engine.unpause()
        engine = weakref.ref(llm.engine)
        del llm
        assert engine() is None, "the dropped engine is still alive (a reference cycle)"
    finally:
        gc.enable()
