"""Structured outputs and tool calls through the router, with the openai SDK, on the real
model (SmolLM2-135M-Instruct): every output parses and validates, 20 of 20 per case, on a
disaggregated stack (each choice is prefilled on one engine and decoded on the other, so
the decode engine rebuilds every constraint from the prompt's first token); streaming
equals non-streaming; bad constraints are 400s naming the problem; and a constrained
generation survives its engine being killed (failover resumes it elsewhere, token for
token)."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from tandem_engine import LLM, SamplingParams
from tandem_engine.structured_outputs import MAX_GRAMMAR_CHARS, StructuredOutputsParams
from test_router_e2e import MODEL, Cluster, _metric, _streams_through, run_cluster

pytestmark = pytest.mark.slow

N = 20  # samples per case, all of which must parse and validate (two requests of n=10)

SCHEMAS = {
    "nested objects": {
        "type": "object", "additionalProperties": False, "required": ["person"],
        "properties": {"person": {
            "type": "object", "additionalProperties": False, "required": ["name", "address"],
            "properties": {
                "name": {"type": "string", "maxLength": 30},
                "address": {"type": "object", "additionalProperties": False,
                            "required": ["city", "zip"],
                            "properties": {"city": {"type": "string", "maxLength": 30},
                                           "zip": {"type": "string",
                                                   "pattern": "^[0-9]{5}$"}}}}}}},
    "arrays": {
        "type": "object", "additionalProperties": False, "required": ["colors"],
        "properties": {"colors": {"type": "array", "minItems": 2, "maxItems": 4,
                                  "items": {"type": "string", "maxLength": 20}}}},
    "enums": {
        "type": "object", "additionalProperties": False,
        "required": ["sentiment", "confidence"],
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"enum": ["low", "medium", "high"]}}},
    "required and optional fields": {
        "type": "object", "additionalProperties": False, "required": ["title", "year"],
        "properties": {"title": {"type": "string", "maxLength": 40},
                       "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                       "director": {"type": "string", "maxLength": 40}}},
    "numbers with bounds": {
        "type": "object", "additionalProperties": False,
        "required": ["temperature", "humidity"],
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                       "humidity": {"type": "integer", "minimum": 0, "maximum": 100}}},
}
ASKS = {
    "nested objects": "Give the name and address of a person living in Paris.",
    "arrays": "List a few colors of the rainbow.",
    "enums": "How does this review feel: 'I loved the film, it was wonderful!'",
    "required and optional fields": "Describe a famous film.",
    "numbers with bounds": "What is the weather like in Madrid in summer?",
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "maxLength": 40}}}}}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
CONVERSATION = [
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "user", "content": "What's the weather in Tokyo?"}]


@pytest.fixture(scope="module")
def disagg(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    pytest.importorskip("nixl_cu12")
    yield from run_cluster(smollm2_gguf, tmp_path_factory.mktemp("structured-disagg"),
                           ("prefill", "decode"))


def _chat(cluster: Cluster, content: str, **kw):
    return cluster.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def _twenty(create, **kw) -> list:
    """N choices: two requests of n = N / 2 (the router's n limit is 16), other seeds."""
    seed = kw.pop("seed")
    return [c for s in (seed, seed + 1000)
            for c in create(n=N // 2, seed=s, **kw).choices]


def _chat_twenty(cluster: Cluster, content: str, **kw) -> list:
    return _twenty(cluster.client().chat.completions.create, model=MODEL,
                   messages=[{"role": "user", "content": content}], **kw)


def _completions_twenty(cluster: Cluster, prompt: str, **kw) -> list:
    return _twenty(cluster.client().completions.create, model=MODEL, prompt=prompt, **kw)


def _all_choices_valid(choices: list, schema: dict) -> None:
    assert len(choices) == N
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("shape", SCHEMAS)
def test_json_schema_outputs_always_validate(disagg: Cluster, shape: str) -> None:
    schema = SCHEMAS[shape]
    choices = _chat_twenty(disagg, ASKS[shape] + " Answer in JSON.", temperature=0.8, seed=7,
                           max_tokens=150, response_format={
                               "type": "json_schema",
                               "json_schema": {"name": "answer", "schema": schema,
                                               "strict": True}})
    _all_choices_valid(choices, schema)


def test_json_object_regex_choice_and_grammar(disagg: Cluster) -> None:
    obj = _chat_twenty(disagg, "Reply with a JSON object with two keys, name and age, for "
                       "a cat.",  # any object: at 0.7 one sample in 40 nests forever
                       temperature=0.3, seed=1, max_tokens=300,
                       response_format={"type": "json_object"})
    assert len(obj) == N
    for choice in obj:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)
    phone = _completions_twenty(disagg, "Call us at ", temperature=1.0, seed=2,
                                max_tokens=20,
                                extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
    assert all(re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", c.text) for c in phone)
    labels = ["positive", "negative", "neutral"]
    picked = _chat_twenty(disagg, "Is 'what a great day' positive, negative or neutral?",
                          temperature=1.0, seed=3, extra_body={"guided_choice": labels})
    assert {c.message.content for c in picked} <= set(labels)
    assert all(c.finish_reason == "stop" for c in picked)
    sums = _completions_twenty(disagg, "Write a sum: ", temperature=1.0, seed=4,
                               max_tokens=20, extra_body={"structured_outputs": {
                                   "grammar": 'start: NUM " + " NUM " = " NUM\n'
                                              'NUM: /[0-9]{1,3}/'}})
    assert all(re.fullmatch(r"\d{1,3} \+ \d{1,3} = \d{1,3}", c.text) for c in sums)


def test_streaming_equals_non_streaming(disagg: Cluster) -> None:
    schema = SCHEMAS["nested objects"]
    kw = dict(temperature=0, max_tokens=150, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    whole = _chat(disagg, ASKS["nested objects"], **kw).choices[0]
    chunks = list(_chat(disagg, ASKS["nested objects"], stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "stop"
    jsonschema.validate(json.loads(streamed), schema)
    # The decode engine's metrics show the masks' cost.
    text = httpx.get(f"{disagg.admin_urls[1]}/metrics", timeout=5).text
    assert _metric(text, "tandem_structured_output_steps_total", {}) > 0
    assert _metric(text, "tandem_structured_output_mask_seconds_total", {}) > 0


def _calls_validate(choices: list) -> int:
    """Every tool call of every choice names a tool and its arguments validate; returns
    how many choices called."""
    called = 0
    for choice in choices:
        calls = choice.message.tool_calls or []
        if calls:
            called += 1
            assert choice.finish_reason == "tool_calls"
        for call in calls:
            assert call.id and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments),
                                SCHEMA_OF[call.function.name])
    return called


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}, "auto"])
def test_tool_calls_always_validate(disagg: Cluster, tool_choice) -> None:
    # A conversation with one call already made: a 135M model untrained for tools follows
    # it (with no call before, it rarely calls on its own under auto).
    choices = _twenty(disagg.client().chat.completions.create, model=MODEL,
                      messages=CONVERSATION, temperature=0.8, seed=5, max_tokens=500,
                      tools=[WEATHER, TIME], tool_choice=tool_choice)
    called = _calls_validate(choices)
    assert called == N if tool_choice != "auto" else called > 0
    if isinstance(tool_choice, dict):
        assert {call.function.name for c in choices for call in c.message.tool_calls} \
            == {"get_time"}


def test_streamed_tool_calls_equal_non_streamed_and_results_feed_back(
        disagg: Cluster) -> None:
    kw = dict(temperature=0, max_tokens=500, tools=[WEATHER, TIME], tool_choice="required")
    ask = "What's the weather in Oslo?"
    whole = _chat(disagg, ask, **kw).choices[0]
    stream = _chat(disagg, ask, stream=True, **kw)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    # The call's result goes back as a `tool` message; the model answers in text.
    call = whole.message.tool_calls[0]
    answer = disagg.client().chat.completions.create(model=MODEL, max_tokens=40, messages=[
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 12}'}],
        tools=[WEATHER, TIME])
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed group"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format", "strin"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"guided_json": {"type": "object", "properties": {
        f"field_{i:05d}": {"type": "string"} for i in range(3000)}}},
     "guided_json", str(MAX_GRAMMAR_CHARS)),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "both constrain"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"},
     "guided_decoding_backend", "llguidance"),
])
def test_bad_constraints_are_400s_naming_the_problem(disagg: Cluster, extra, param,
                                                     words) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        disagg.client().completions.create(model=MODEL, prompt="x", max_tokens=4,
                                           extra_body=extra)
    error = info.value.body
    assert error["param"] == param, error
    assert words in error["message"], error


def test_a_bad_tool_schema_is_a_400_naming_the_tool(disagg: Cluster) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        _chat(disagg, "hi", tools=[bad], tool_choice="required")
    assert "tools[0]" in info.value.body["param"]


# ---- failover ------------------------------------------------------------------------------------

LONG = StructuredOutputsParams(json={"type": "array", "minItems": 60, "maxItems": 60,
                                     "items": {"type": "integer", "minimum": 0,
                                               "maximum": 999}})


@pytest.fixture(scope="module")
def mixed(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_cluster(smollm2_gguf, tmp_path_factory.mktemp("structured-mixed"),
                           ("mixed", "mixed"))


def test_a_killed_engine_s_constrained_streams_resume_token_for_token(
        mixed: Cluster, smollm2_gguf: Path) -> None:
    llm = LLM(smollm2_gguf)
    prompts = [llm.tokenizer.encode(f"Numbers from list {i}: ") for i in range(4)]
    refs = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(
        max_tokens=400, temperature=0.0, structured_outputs=LONG))]
    assert all(r.finish_reason == "stop" for r in refs)

    def kill() -> None:
        assert mixed.engine_view()[mixed.engine_keys[0]]["inflight"] > 0
        mixed.engines[0].send_signal(signal.SIGKILL)

    results = _streams_through(mixed, prompts, 400, kill,
                               extra_body={"guided_json": json.loads(LONG.json)})
    assert [ids for ids, _, _ in results] == [r.token_ids for r in refs]
    assert [text for _, text, _ in results] == [r.text for r in refs]
    assert mixed.metric("tandem_router_failovers_total", reason="engine_lost") > 0
