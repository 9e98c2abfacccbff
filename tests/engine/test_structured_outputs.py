"""Structured outputs inside the engine, on the real model (SmolLM2-135M-Instruct): every
output matches its constraint, and every path that moves a request's tokens around
(chunked prefill, preemption, speculation, a generation resumed from another engine)
keeps the constraint's state right: the tokens are those of the plain path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from tandem_engine import LLM, SamplingParams
from tandem_engine.core.kv import KVCacheManager
from tandem_engine.core.request import Request
from tandem_engine.core.scheduler import Scheduler
from tandem_engine.structured_outputs import StructuredOutputsParams as Structured
from test_handoff_engine import _finish

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "languages": {"type": "array", "maxItems": 3,
                                       "items": {"enum": ["English", "French", "Python"]}}},
          "required": ["name", "age", "languages"]}
PROMPT = ("<|im_start|>user\nDescribe Alice, a 30 year old programmer, as JSON with her "
          "name, age and languages.<|im_end|>\n<|im_start|>assistant\n")


def _greedy(structured: Structured, max_tokens: int = 80, **extra: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0,
                          structured_outputs=structured, **extra)


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> LLM:
    return LLM(smollm2_gguf)


@pytest.fixture(scope="module")
def reference(llm: LLM):
    """The plain path's greedy output under the PERSON schema."""
    out = llm.generate([PROMPT], _greedy(Structured(json=PERSON)))[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    return out


def test_json_schema_output_parses_and_validates(llm: LLM, reference) -> None:
    jsonschema.validate(json.loads(reference.text), PERSON)
    sampled = llm.generate([PROMPT] * 8, SamplingParams(
        max_tokens=120, temperature=1.0, seed=3, structured_outputs=Structured(json=PERSON)))
    for out in sampled:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


@pytest.mark.parametrize(("structured", "pattern"), [
    (Structured(regex=r"\d{3}-\d{4}"), r"\d{3}-\d{4}"),
    (Structured(choice=("yes", "no", "maybe")), r"yes|no|maybe"),
    (Structured(grammar='start: "A=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'),
     r"A=\d{1,3}(,\d{1,3})*"),
    (Structured(grammar='root ::= "B=" [a-z]+'), r"B=[a-z]+"),  # GBNF, as llama.cpp writes it
])
def test_regex_choice_and_grammars_match(llm: LLM, structured: Structured,
                                         pattern: str) -> None:
    outs = llm.generate([PROMPT] * 4, SamplingParams(max_tokens=24, temperature=0.8, seed=1,
                                                     structured_outputs=structured))
    for out in outs:
        text = out.outputs[0].text
        assert re.fullmatch(pattern, text), text


def test_chunked_prefill_and_preemption_keep_the_tokens(smollm2_gguf: Path,
                                                        reference) -> None:
    # 16-token prefill chunks, and a pool of 10 16-token blocks for 4 requests of ~60
    # tokens each: they preempt one another and recompute.
    small = LLM(smollm2_gguf, max_num_batched_tokens=16, num_blocks=10, block_size=16)
    outs = small.generate([PROMPT] * 4, _greedy(Structured(json=PERSON)))
    assert small.engine.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [reference.token_ids] * 4


def test_speculation_verifies_only_allowed_proposals_and_changes_nothing(
        smollm2_gguf: Path, reference) -> None:
    spec = LLM(smollm2_gguf, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3})
    out = spec.generate([PROMPT], _greedy(Structured(json=PERSON)))[0].outputs[0]
    assert out.token_ids == reference.token_ids
    stats = spec.engine.stats.speculative
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def test_resumed_generation_rebuilds_the_matcher_from_its_tokens(llm: LLM,
                                                                 reference) -> None:
    """A disaggregated handoff or a failover resumes on another engine with the tokens
    generated so far: the constraint's state comes from them."""
    prompt_ids = llm.tokenizer.encode(PROMPT)
    for k in (1, 7):
        engine = llm.engine
        engine.add_request(f"resume-{k}", prompt_ids, _greedy(Structured(json=PERSON)),
                           resumed_token_ids=reference.token_ids[:k])
        done = _finish(engine)[f"resume-{k}"]
        assert done.outputs[0].token_ids == reference.token_ids
    # Tokens the constraint forbids cannot be resumed: that request alone fails.
    bad = llm.tokenizer.encode("hello", add_special_tokens=False)
    llm.engine.add_request("resume-bad", prompt_ids, _greedy(Structured(json=PERSON)),
                           resumed_token_ids=bad)
    failed = _finish(llm.engine)["resume-bad"].outputs[0]
    assert failed.finish_reason == "error"
    assert "violate its structured_outputs constraint" in failed.error


def test_limits_and_stops_end_a_constrained_output_honestly(llm: LLM, reference) -> None:
    cut = llm.generate([PROMPT], _greedy(Structured(json=PERSON), max_tokens=5))[0].outputs[0]
    assert cut.finish_reason == "length"
    assert cut.token_ids == reference.token_ids[:5]
    with pytest.raises(ValueError):
        json.loads(cut.text)  # partial JSON is not pretended complete
    stop = llm.generate([PROMPT], _greedy(Structured(json=PERSON), stop=['"age"']))[0]
    assert stop.outputs[0].finish_reason == "stop"
    assert reference.text.startswith(stop.outputs[0].text)


def test_a_grammar_that_does_not_compile_fails_only_its_request(llm: LLM) -> None:
    outs = llm.generate([PROMPT, PROMPT], [
        _greedy(Structured(regex="(unclosed")), _greedy(Structured(choice=("ok",)))])
    assert outs[0].outputs[0].finish_reason == "error"
    assert "does not compile" in outs[0].outputs[0].error
    assert "unclosed group" in outs[0].outputs[0].error
    assert outs[1].outputs[0].text == "ok"


def test_mask_time_shows_in_the_step_timings(llm: LLM) -> None:
    llm.engine.drain_step_timings()
    llm.generate([PROMPT], _greedy(Structured(json=PERSON), max_tokens=8))
    constrained = llm.engine.drain_step_timings()
    llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))
    plain = llm.engine.drain_step_timings()
    assert all(t.grammar_s > 0 for t in constrained)
    assert all(t.grammar_s == 0 for t in plain)


def test_a_compiling_grammar_holds_back_only_its_own_request() -> None:
    kv = KVCacheManager(64, 16)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=256)
    compiling = Request("compiling", [1, 2, 3], SamplingParams(), 0, grammar_pending=True)
    ready = Request("ready", [4, 5, 6], SamplingParams(), 1)
    scheduler.add(compiling)
    scheduler.add(ready)
    first = scheduler.schedule()
    assert [c.request.request_id for c in first.chunks] == ["ready"]
    compiling.grammar_pending = False
    second = scheduler.schedule()
    assert "compiling" in [c.request.request_id for c in second.chunks]

