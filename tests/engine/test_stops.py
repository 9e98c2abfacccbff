"""Stop conditions, aborts and rejected requests, as a user of the engine sees them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from reference import random_prompts
from tandem_engine import LLM, RequestRejected, SamplingParams
from tandem_engine.tokenizer import IncrementalDetokenizer

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(tiny_llama, max_num_batched_tokens=64)


def _pieces(llm: LLM, token_ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(llm.tokenizer)
    return [detok.push(t) for t in token_ids]


def _long_output(llm: LLM, prompt: str, n: int = 40):
    return llm.generate([prompt], SamplingParams(max_tokens=n, **GREEDY))[0].outputs[0]


def test_stop_string_spanning_tokens_is_trimmed(llm: LLM) -> None:
    full = _long_output(llm, "Once upon a time")
    pieces = _pieces(llm, full.token_ids)
    # A stop string from the middle of one token's text into the middle of a later one's.
    i = next(k for k in range(3, len(pieces) - 2)
             if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2)
    start = len("".join(pieces[:i])) + 1
    stop = full.text[start:start + len(pieces[i]) - 1 + 1]
    assert full.text.find(stop) == start, "pick a stop string that occurs first here"
    out = llm.generate(["Once upon a time"],
                       SamplingParams(max_tokens=40, stop=[stop], **GREEDY))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == full.text[:start]
    assert len(out.token_ids) == i + 2  # generation ended at the token completing the stop
    kept = llm.generate(["Once upon a time"], SamplingParams(
        max_tokens=40, stop=[stop], include_stop_str_in_output=True, **GREEDY))[0].outputs[0]
    assert kept.text == full.text[:start] + stop


def test_earliest_stop_string_wins(llm: LLM) -> None:
    full = _long_output(llm, "The harbour at dawn")
    a, b = full.text[10:13], full.text[20:23]
    out = llm.generate(["The harbour at dawn"],
                       SamplingParams(max_tokens=40, stop=[b, a], **GREEDY))[0].outputs[0]
    assert out.stop_reason == a and out.text == full.text[:full.text.find(a)]


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    full = _long_output(llm, "A quiet street")
    target = full.token_ids[5]
    first = full.token_ids.index(target)
    out = llm.generate(["A quiet street"], SamplingParams(
        max_tokens=40, stop_token_ids=[target], **GREEDY))[0].outputs[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", target)
    short = llm.generate(["A quiet street"], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert short.outputs[0].token_ids == full.token_ids[:3]
    assert short.outputs[0].finish_reason == "length"


@pytest.fixture(scope="module")
def eos_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    """A copy of the demo model whose EOS is a token that greedy decoding emits early."""
    llm = LLM(tiny_llama)
    prompt = random_prompts(2048, [25], seed=11)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0]
    pos = next(i for i in range(2, 30) if full.token_ids[i] not in full.token_ids[:i])
    eos = full.token_ids[pos]
    folder = tmp_path_factory.mktemp("eos-model")
    shutil.copytree(tiny_llama, folder, dirs_exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return LLM(folder), prompt, full.token_ids, pos, eos


def test_eos_stops_unless_ignored_or_inside_min_tokens(eos_model) -> None:
    llm, prompt, full, pos, eos = eos_model
    out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))[0].outputs[0]
    assert out.token_ids == full[:pos + 1] and out.finish_reason == "stop"
    ignored = llm.generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0]
    assert ignored.token_ids == full and ignored.finish_reason == "length"
    # Inside min_tokens the EOS cannot be sampled at all; generation goes on.
    held = llm.generate([prompt], SamplingParams(max_tokens=30, min_tokens=pos + 3,
                                                 temperature=0.0))[0].outputs[0]
    assert len(held.token_ids) >= pos + 3
    assert eos not in held.token_ids[:pos + 3]
    assert held.token_ids[:pos] == full[:pos]


def test_abort_mid_decode_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    total = engine.kv.num_blocks
    for i, prompt in enumerate(random_prompts(2048, [40, 60, 20], seed=2)):
        engine.add_request(f"abort-{i}", prompt, SamplingParams(max_tokens=50, **GREEDY))
    for _ in range(4):
        engine.step()
    assert engine.num_running == 3
    used = engine.kv.pool.num_used
    held = len(engine.kv.block_table("abort-1"))
    assert held >= 4  # a 60-token prompt and its first tokens
    assert engine.abort("abort-1")
    assert engine.kv.pool.num_used == used - held
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["abort-1"].outputs[0].finish_reason == "abort"
    assert outputs["abort-0"].outputs[0].finish_reason == "length"
    assert engine.kv.pool.num_free == total
    assert not engine.abort("abort-1")  # unknown now: nothing to do


def test_too_long_prompt_is_rejected_and_others_keep_running(tiny_qwen2: Path) -> None:
    llm = LLM(tiny_qwen2, num_blocks=8)  # 128 token slots
    engine = llm.engine
    engine.add_request("ok", random_prompts(2048, [20])[0], SamplingParams(max_tokens=5))
    with pytest.raises(RequestRejected, match=r"prompt has 200 tokens, which leaves no room "
                                              r"to generate within this engine's limit of 128 "
                                              r".*KV cache 128 tokens"):
        engine.add_request("long", random_prompts(2048, [200])[0])
    with pytest.raises(RequestRejected, match="outside the model's vocabulary"):
        engine.add_request("bad", [1, 2, 999_999])
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request("ok", [5, 6])
    with pytest.raises(RequestRejected, match="prompt is empty"):
        engine.add_request("empty", [])
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["ok"]
    assert len(done[0].outputs[0].token_ids) == 5


def test_generation_stops_at_the_context_limit(tiny_qwen2: Path) -> None:
    llm = LLM(tiny_qwen2, max_model_len=40)
    out = llm.generate([random_prompts(2048, [30])[0]],
                       SamplingParams(max_tokens=100, **GREEDY))[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len=5000 exceeds the model's context"):
        LLM(tiny_qwen2, max_model_len=5000)
