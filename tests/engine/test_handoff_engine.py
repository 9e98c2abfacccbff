"""The engine's side of a prefill → decode KV handoff, two real engines in one process.

The bytes move with a tensor copy standing in for the NIXL READ (the transfer backend
has its own two-process tests); what is checked here is the engines' bookkeeping:
the prefill engine pins exactly the prompt's blocks, the decode engine pulls only what
its own prefix cache lacks, decodes straight from the pulled KV to the same tokens as a
colocated run, falls back to recompute on a failed pull, and no block leaks anywhere.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from reference import random_prompts
from tandem_engine import LLM, SamplingParams

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _finish(engine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _prefill(prefill, rid: str, prompt: list[int]):
    prefill.add_request(rid, prompt, GREEDY, pin_for_handoff=True)
    out = _finish(prefill)[rid]
    assert out.pinned_blocks is not None
    return out.outputs[0].token_ids[0], out.pinned_blocks


def _copy_blocks(prefill, decode, remote: list[int], plan) -> None:
    """Stand-in for the NIXL READ: prompt block i of the prefill engine -> local block."""
    src, dst = prefill.runner.kv_cache, decode.runner.kv_cache
    for index, local in zip(plan.block_indices, plan.local_blocks, strict=True):
        dst[:, :, local] = src[:, :, remote[index]]


@pytest.fixture()
def pair(tiny_llama: Path):
    return LLM(tiny_llama).engine, LLM(tiny_llama).engine


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_handoff_decodes_like_a_colocated_run(tiny_llama: Path, kv_cache_dtype: str) -> None:
    """Also with a float16 KV cache under float32 weights (--kv-cache-dtype): the blocks
    move as they are stored."""
    pair = prefill, decode = (LLM(tiny_llama, kv_cache_dtype=kv_cache_dtype).engine,
                              LLM(tiny_llama, kv_cache_dtype=kv_cache_dtype).engine)
    prompts = random_prompts(2048, [5, 16, 37, 64], seed=30)
    expected = LLM(tiny_llama, kv_cache_dtype=kv_cache_dtype).generate(prompts, GREEDY)
    for i, prompt in enumerate(prompts):
        rid = f"h{i}"
        first, remote = _prefill(prefill, rid, prompt)
        assert len(remote) == -(-len(prompt) // 16)
        assert prefill.kv.num_pinned_blocks == len(remote)
        plan = decode.add_pulled_request(rid, prompt, GREEDY, [first])
        assert plan.block_indices == list(range(len(remote))) and plan.reused_blocks == 0
        _copy_blocks(prefill, decode, remote, plan)
        decode.complete_pull(rid, ok=True)
        assert prefill.unpin(rid) and prefill.kv.num_pinned_blocks == 0
        out = _finish(decode)[rid].outputs[0]
        assert out.token_ids == expected[i].outputs[0].token_ids
        assert out.text == expected[i].outputs[0].text
    # Only the first token of each prompt was computed on the decode engine's side.
    assert decode.prefix_cache_stats()["hit_tokens"] == 0
    for engine in pair:
        assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_only_blocks_missing_from_the_decode_cache_are_pulled(pair, tiny_llama: Path) -> None:
    prefill, decode = pair
    shared, tail = random_prompts(2048, [48, 20], seed=31)
    decode.add_request("warm", [*shared, 7], GREEDY)  # caches the shared 48-token prefix
    _finish(decode)
    prompt = shared + tail  # 68 tokens: 5 blocks, the first 3 already on the decode engine
    first, remote = _prefill(prefill, "p", prompt)
    plan = decode.add_pulled_request("p", prompt, GREEDY, [first])
    assert plan.reused_blocks == 3 and plan.block_indices == [3, 4]
    _copy_blocks(prefill, decode, remote, plan)
    decode.complete_pull("p", ok=True)
    prefill.unpin("p")
    out = _finish(decode)["p"].outputs[0]
    expected = LLM(tiny_llama).generate([prompt], GREEDY)[0].outputs[0]
    assert out.token_ids == expected.token_ids
    assert decode.kv.pool.num_used == 0 and prefill.kv.pool.num_used == 0


def test_failed_pull_recomputes_and_pins_expire(tiny_llama: Path) -> None:
    prefill = LLM(tiny_llama, kv_pin_ttl_s=0.2).engine
    decode = LLM(tiny_llama).engine
    prompt = random_prompts(2048, [40], seed=32)[0]
    first, _ = _prefill(prefill, "f", prompt)
    plan = decode.add_pulled_request("f", prompt, GREEDY, [first])
    assert len(plan.local_blocks) == 3
    decode.complete_pull("f", ok=False)  # e.g. the prefill engine died mid-READ
    out = _finish(decode)["f"].outputs[0]
    expected = LLM(tiny_llama).generate([prompt], GREEDY)[0].outputs[0]
    assert out.token_ids == expected.token_ids and decode.num_pull_fallbacks == 1
    assert decode.kv.pool.num_used == 0
    # Nobody unpins: the TTL releases the prefill engine's blocks on a later step.
    assert prefill.kv.num_pinned_blocks == 3
    time.sleep(0.25)
    prefill.step()
    assert prefill.kv.num_pinned_blocks == 0 and prefill.kv.pool.num_used == 0


def test_abort_during_a_pull_frees_the_destination(pair) -> None:
    prefill, decode = pair
    prompt = random_prompts(2048, [33], seed=33)[0]
    first, _ = _prefill(prefill, "a", prompt)
    decode.add_pulled_request("a", prompt, GREEDY, [first])
    assert decode.kv.pool.num_used == 3 and decode.has_unfinished_requests()
    assert decode.abort("a")
    decode.complete_pull("a", ok=True)  # a late completion is ignored
    assert decode.kv.pool.num_used == 0 and not decode.has_unfinished_requests()
    assert [o.outputs[0].finish_reason for o in decode.step()] == ["abort"]


def test_recompute_suspend_fails_pulls_in_progress(pair, tiny_llama: Path) -> None:
    prefill, decode = pair
    prompt = random_prompts(2048, [40], seed=34)[0]
    first, remote = _prefill(prefill, "s", prompt)
    plan = decode.add_pulled_request("s", prompt, GREEDY, [first])
    decode.pause()
    decode.suspend("recompute")  # the pool's storage is dropped: the pull cannot land
    decode.resume()
    decode.unpause()
    _copy_blocks(prefill, decode, remote, plan)
    decode.complete_pull("s", ok=True)  # too late: ignored
    out = _finish(decode)["s"].outputs[0]
    expected = LLM(tiny_llama).generate([prompt], GREEDY)[0].outputs[0]
    assert out.token_ids == expected.token_ids and decode.num_pull_fallbacks == 1
    assert decode.kv.pool.num_used == 0


def test_seeded_sampling_continues_across_the_handoff(pair, tiny_llama: Path) -> None:
    """A seeded request draws the same tokens whether one engine or two produce them:
    the decode engine's generator continues past the draw the prefill engine made."""
    prefill, decode = pair
    seeded = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_k=50, seed=11,
                            ignore_eos=True)
    prompt = random_prompts(2048, [21], seed=32)[0]
    expected = LLM(tiny_llama).generate([prompt], seeded)[0].outputs[0].token_ids
    prefill.add_request("s", prompt, seeded, pin_for_handoff=True)
    out = _finish(prefill)["s"]
    first, remote = out.outputs[0].token_ids[0], out.pinned_blocks
    assert first == expected[0]
    plan = decode.add_pulled_request("s", prompt, seeded, [first])
    _copy_blocks(prefill, decode, remote, plan)
    decode.complete_pull("s", ok=True)
    prefill.unpin("s")
    assert _finish(decode)["s"].outputs[0].token_ids == expected
    # Without the skipped draw the stream would restart: the tokens would differ.
    assert LLM(tiny_llama).generate([[*prompt, first]], SamplingParams(
        max_tokens=MAX_NEW - 1, temperature=1.0, top_k=50, seed=11, ignore_eos=True)
    )[0].outputs[0].token_ids != expected[1:]
