"""Tool calling without a server: the request's tools validated, the prompt a tools-less
template gets, the grammars checked by a real llguidance matcher over the demo tokenizer,
the output parser (whole and streamed in pieces), and the chat responses that carry the
calls."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path
from typing import Any

import llguidance as llg
import pytest
from tandem_engine.router import api_params as ap
from tandem_engine.router import openai_format as fmt
from tandem_engine.router import tools as t
from tandem_engine.router.attempts import Delta
from tandem_engine.router.chat import ChatTemplate
from tandem_engine.router.request_errors import InvalidRequest
from tandem_engine.tokenizer import Tokenizer

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"], "additionalProperties": False}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
TOOLS = [WEATHER, NOOP]


def block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


PARIS = block("get_weather", '{"city": "Paris"}')
PARIS_F = block("get_weather", '{"city": "Paris", "unit": "F"}')
NOOP_CALL = block("noop", "{}")


# ---- validation ---------------------------------------------------------------------------------


def test_defaults_and_normalized_tools() -> None:
    request = t.parse_tools(TOOLS, None, None)
    assert request is not None
    assert (request.choice, request.name, request.parallel, request.active) == \
        ("auto", None, True, True)
    assert request.tools[0] == WEATHER["function"]
    assert request.tools[1] == {"name": "noop", "parameters": t.EMPTY_PARAMETERS}
    named = t.parse_tools([{**NOOP, "function": {"name": "noop", "strict": True}}],
                          {"type": "function", "function": {"name": "noop"}}, False)
    assert (named.choice, named.name, named.parallel) == ("named", "noop", False)
    assert "strict" not in named.tools[0]
    assert t.parse_tools(None, None, None) is None
    assert t.parse_tools(None, "none", True) is None
    off = t.parse_tools(TOOLS, "none", None)
    assert not off.active and off.grammar() is None


BIG = {"type": "function", "function": {"name": "big", "description": "x" * 33_000}}


@pytest.mark.parametrize("tools, choice, parallel, param, message", [
    (None, "auto", None, "tool_choice", "needs tools"),
    ([], None, None, "tools", "1..128"),
    ({"a": 1}, None, None, "tools", "must be a list"),
    ([NOOP] * 129, None, None, "tools", "129 tools"),
    ([NOOP, "x"], None, None, "tools[1]", "must be"),
    ([{"type": "retrieval", "function": {"name": "a"}}], None, None, "tools[0]", "function"),
    ([{"type": "function"}], None, None, "tools[0].function", "name"),
    ([{"type": "function", "function": {"name": "a b"}}], None, None,
     "tools[0].function.name", "letters, digits"),
    ([{"type": "function", "function": {"name": "a" * 65}}], None, None,
     "tools[0].function.name", "1..64"),
    ([NOOP, NOOP], None, None, "tools[1].function.name", "tools\\[0\\]'s"),
    ([{"type": "function", "function": {"name": "a", "description": 3}}], None, None,
     "tools[0].function.description", "string"),
    ([{"type": "function", "function": {"name": "a", "strict": "yes"}}], None, None,
     "tools[0].function.strict", "true or false"),
    ([{"type": "function", "function": {"name": "a", "parameters": []}}], None, None,
     "tools[0].function.parameters", "'a' must be a JSON schema of an object"),
    ([{"type": "function", "function": {"name": "a", "parameters": {"type": "string"}}}],
     None, None, "tools[0].function.parameters", "of an object"),
    ([NOOP, {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}],
     None, None, "tools[1].function.parameters", "tool 'odd' is not a JSON schema .*not"),
    ([{"type": "function", "function": {"name": "r", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}],
     None, None, "tools[0].function.parameters", "missing"),
    ([BIG], None, None, "tools[0].function", "over the limit of 32768"),
    (TOOLS, "sometimes", None, "tool_choice", "none, auto, required"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None,
     "tool_choice.function.name", "not one of the tools \\(get_weather, noop\\)"),
    (TOOLS, {"type": "function"}, None, "tool_choice", "none, auto, required"),
    (TOOLS, None, "yes", "parallel_tool_calls", "true or false"),
])
def test_invalid_tools_name_their_parameter(tools, choice, parallel, param, message) -> None:
    with pytest.raises(InvalidRequest, match=message) as err:
        t.parse_tools(tools, choice, parallel)
    assert err.value.param == param and err.value.status == 400


@pytest.mark.parametrize("calls, param, message", [
    ({"id": "a"}, "messages[2].tool_calls", "list"),
    (["x"], "messages[2].tool_calls[0]", "must be"),
    ([{"id": "a", "type": "code", "function": {"name": "f", "arguments": "{}"}}],
     "messages[2].tool_calls[0]", "function"),
    ([{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
     "messages[2].tool_calls[0].id", "1..256"),
    ([{"id": "a", "type": "function", "function": {"name": "", "arguments": "{}"}}],
     "messages[2].tool_calls[0].function.name", "letters"),
    ([{"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
     "messages[2].tool_calls[0].function.arguments", "string holding JSON"),
    *[([{"id": "a", "type": "function", "function": {"name": "f", "arguments": bad}}],
       "messages[2].tool_calls[0].function.arguments", "string holding JSON")
      for bad in ("{x", '{"x": NaN}', '{"x": "\\ud800"}', "[" * 5000 + "]" * 5000)],
])
def test_invalid_assistant_tool_calls_name_their_path(calls, param, message) -> None:
    with pytest.raises(InvalidRequest, match=message) as err:
        t.parse_assistant_tool_calls(calls, "messages[2]")
    assert err.value.param == param


def test_assistant_tool_calls_are_normalized() -> None:
    calls = [{"id": "call_1", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert t.parse_assistant_tool_calls(calls, "messages[1]") == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert t.parse_assistant_tool_calls(None, "messages[1]") == []


# ---- the prompt -------------------------------------------------------------------------------


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        CALL, {**CALL, "id": "call_2", "function": {"name": "get_weather",
                                                    "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "content": "18C", "tool_call_id": "call_1"},
    {"role": "tool", "content": "25C", "tool_call_id": "call_2"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
    {"role": "tool", "content": "19C", "tool_call_id": "call_1"},
    {"role": "user", "content": "Thanks"},
]


def test_a_tools_less_template_gets_the_hermes_format() -> None:
    request = t.parse_tools(TOOLS, "auto", None)
    messages, tools = t.render_for_template(CONVERSATION, request, False)
    assert tools is None
    text = ChatTemplate(SMOLLM2_TEMPLATE).render(messages)
    signature = json.dumps({"type": "function", "function": WEATHER["function"]})
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert f"<tools>\n{signature}\n" in text and "SmolLM" not in text
    paris, rome = block("get_weather", '{"city": "Paris"}'), block("get_weather",
                                                                  '{"city": "Rome"}')
    assert f"<|im_start|>assistant\n{paris}\n{rome}<|im_end|>\n" in text
    assert ("<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n"
            "<tool_response>\n25C\n</tool_response><|im_end|>\n") in text
    assert f"<|im_start|>assistant\nChecking.\n{paris}<|im_end|>\n" in text
    assert "<|im_start|>user\n<tool_response>\n19C\n</tool_response><|im_end|>\n" \
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n" in text
    assert CONVERSATION[1]["content"] == "" and "tool_calls" in CONVERSATION[1]  # untouched


def test_the_tools_prompt_opens_an_existing_system_message() -> None:
    request = t.parse_tools(TOOLS, "required", False)
    messages, _ = t.render_for_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        request, False)
    assert messages[0]["role"] == "system" and len(messages) == 2
    assert messages[0]["content"].startswith("# Tools\n\nYou may call one function")
    assert messages[0]["content"].endswith("</tool_call>\n\nBe brief.")


def test_tool_choice_none_shows_no_tools_but_keeps_the_conversation() -> None:
    for request in (t.parse_tools(TOOLS, "none", None), None):
        messages, tools = t.render_for_template(CONVERSATION, request, False)
        assert tools is None and messages[0] == CONVERSATION[0]
        assert messages[1]["content"].startswith("<tool_call>\n")
        assert messages[2]["role"] == "user"


def test_a_template_that_renders_tools_gets_them_as_given() -> None:
    request = t.parse_tools(TOOLS, "auto", None)
    messages, tools = t.render_for_template(CONVERSATION, request, True)
    assert tools == [{"type": "function", "function": f} for f in request.tools]
    assert messages[2] == CONVERSATION[2] and messages[0] == CONVERSATION[0]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    template = ChatTemplate("{% for tool in tools %}{{ tool.function.name }};{% endfor %}"
                            "{{ messages[1].tool_calls[0].function.arguments.city }}")
    assert template.render(messages, tools=tools) == \
        "get_weather;noop;Paris"
    assert t.render_for_template(CONVERSATION, t.parse_tools(TOOLS, "none", None),
                                 True)[1] is None


# ---- the grammars, with a real matcher --------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama)


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer: Tokenizer) -> llg.LLTokenizer:
    return llg.LLTokenizer(tokenizer._backend.to_str(), n_vocab=tokenizer.vocab_size,
                           eos_token=list(tokenizer.eos_token_ids))


def follows(request: t.ToolRequest, text: str, tokenizer: Tokenizer,
            ll_tokenizer: llg.LLTokenizer) -> bool:
    """Whether `text` is a whole output the request's grammar allows."""
    grammar = llg.grammar_from("lark", request.grammar())
    assert llg.LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""
    matcher = llg.LLMatcher(ll_tokenizer, grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if matcher.validate_tokens(ids) < len(ids):
        return False
    assert matcher.consume_tokens(ids)
    return matcher.is_accepting()


ALWAYS_WRONG = [
    block("get_weather", '{"town": "Paris"}'),  # a property the schema forbids
    block("get_weather", '{"unit": "C"}'),  # a required one missing
    block("get_weather", '{"city": 7}'),  # of the wrong type
    block("get_time", "{}"),  # no such tool
    block("noop", "[]"),  # arguments not an object
    PARIS + " and more text",  # nothing may follow a call
    PARIS + "\n\n" + NOOP_CALL,  # calls are one per line
    block("get_weather", '{ "city": "Paris"}'),  # arguments written as the prompt shows
    block("get_weather", '{"city":\n\n"Paris"}'),  # no whitespace to pad a call with
]


@pytest.mark.parametrize("choice, parallel, accepted, refused", [
    ("auto", True,
     ["", "It is sunny.", "Let me check.\n" + PARIS, PARIS, PARIS_F + "\n" + NOOP_CALL,
      "a <tool_call", "mentions </tool_call> freely"],
     ALWAYS_WRONG),
    ("auto", False, ["No call.", "Sure " + NOOP_CALL],
     [*ALWAYS_WRONG, PARIS + "\n" + NOOP_CALL]),
    ("required", True, [PARIS, NOOP_CALL + "\n" + PARIS_F + "\n" + PARIS],
     [*ALWAYS_WRONG, "", "It is sunny.", "Let me check.\n" + PARIS]),
    ("required", False, [PARIS, NOOP_CALL],
     [*ALWAYS_WRONG, "It is sunny.", PARIS + "\n" + NOOP_CALL]),
    ({"type": "function", "function": {"name": "get_weather"}}, True,
     [PARIS, PARIS + "\n" + PARIS_F],
     [*ALWAYS_WRONG, "It is sunny.", NOOP_CALL, PARIS + "\n" + NOOP_CALL]),
])
def test_the_grammar_admits_only_valid_calls(choice, parallel, accepted, refused, tokenizer,
                                              ll_tokenizer) -> None:
    request = t.parse_tools(TOOLS, choice, parallel)
    for text in accepted:
        assert follows(request, text, tokenizer, ll_tokenizer), text
    for text in refused:
        assert not follows(request, text, tokenizer, ll_tokenizer), text


def test_parallel_calls_are_bounded(tokenizer, ll_tokenizer) -> None:
    request = t.parse_tools(TOOLS, "required", True)
    calls = [PARIS] * t.MAX_PARALLEL_CALLS
    assert follows(request, "\n".join(calls), tokenizer, ll_tokenizer)
    assert not follows(request, "\n".join([*calls, PARIS]), tokenizer, ll_tokenizer)


def test_after_its_only_call_the_model_can_only_end(tokenizer, ll_tokenizer) -> None:
    for choice in ("auto", "required"):
        grammar = llg.grammar_from("lark", t.parse_tools(TOOLS, choice, False).grammar())
        matcher = llg.LLMatcher(ll_tokenizer, grammar, log_level=0)
        assert matcher.consume_tokens(tokenizer.encode("Ok " * (choice == "auto") + PARIS,
                                                       add_special_tokens=False))
        assert matcher.is_stopped() and matcher.is_accepting()


def test_the_prompts_own_call_format_is_what_the_grammar_admits(tokenizer,
                                                                ll_tokenizer) -> None:
    """A past call as the tools prompt writes it is a call the grammar allows."""
    messages, _ = t.render_for_template(CONVERSATION, t.parse_tools(TOOLS, "auto", None), False)
    assert follows(t.parse_tools(TOOLS, "required", True), messages[2]["content"], tokenizer,
                   ll_tokenizer)


# ---- the output -------------------------------------------------------------------------------


CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def calls_of(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    for call in calls:
        assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


OUTPUTS = [  # text, content, calls
    ("Hello there.", "Hello there.", []),
    ("", None, []),
    ("  \n", "  \n", []),  # no call: the text is the answer, whitespace too
    (PARIS, None, [("get_weather", '{"city": "Paris"}')]),
    ("Let me check.\n" + PARIS_F + "\n" + NOOP_CALL + "\n",
     "Let me check.\n", [("get_weather", '{"city": "Paris", "unit": "F"}'), ("noop", "{}")]),
    ("\n " + PARIS, None, [("get_weather", '{"city": "Paris"}')]),
    (block("f", '{"s": "é\\u00e9", "n": [1, 2.5, null]}'), None,
     [("f", '{"s": "éé", "n": [1, 2.5, null]}')]),
    ("a <tool_call", "a <tool_call", []),  # a start cut short
    ("x " + PARIS[:30], "x " + PARIS[:30], []),  # an unfinished call
    (block("f", "{broken"), block("f", "{broken"), []),
    (block("f", "[1]"), block("f", "[1]"), []),  # arguments not an object
    ('<tool_call>\n{"arguments": {}}\n</tool_call>',
     '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    (block("f", '{"x": NaN}'), block("f", '{"x": NaN}'), []),
    (block("f", '{"x": "\\ud800"}'), block("f", '{"x": "\\ud800"}'), []),  # no UTF-8
    ("<tool_call>" + "[" * 5000 + "</tool_call>", "<tool_call>" + "[" * 5000 + "</tool_call>",
     []),
    (NOOP_CALL + "\nBye", "\nBye", [("noop", "{}")]),  # text after a call (no grammar)
    (block("f", "{bad") + "\n" + NOOP_CALL, block("f", "{bad") + "\n", [("noop", "{}")]),
    ("</tool_call><tool_call><tool_call>", "</tool_call><tool_call><tool_call>", []),
]


@pytest.mark.parametrize("text, content, calls", OUTPUTS)
def test_parse_tool_calls(text, content, calls) -> None:
    got_content, got_calls = t.parse_tool_calls(text)
    assert got_content == content and calls_of(got_calls) == calls


def splits(text: str, seed: int):
    """`text` in pieces: of 1..3 characters (each size at each offset, then at random), and
    in three pieces cut at every two places (a short text)."""
    for size in (1, 2, 3):
        for offset in range(size):
            cuts = [0, *range(offset, len(text), size), len(text)]
            yield [text[a:b] for a, b in itertools.pairwise(cuts) if b > a]
    if len(text) <= 100:
        for a, b in itertools.combinations(range(len(text) + 1), 2):
            yield [text[:a], text[a:b], text[b:]]
    rng = random.Random(seed)
    for _ in range(50):
        pieces, at = [], 0
        while at < len(text):
            step = rng.randint(1, 3)
            pieces.append(text[at:at + step])
            at += step
        yield pieces


def streamed(pieces: list[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and calls a client assembles from the stream's deltas."""
    stream = t.ToolCallStream()
    content, calls = "", {}
    deltas = [d for piece in pieces for d in stream.push(piece)] + stream.finish()
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"})
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", ()):
            call = calls.setdefault(entry["index"], {"function": {"arguments": ""}})
            if "id" in entry:  # the header comes first, once
                assert "id" not in call and entry["function"]["arguments"] == ""
                call.update(id=entry["id"], type=entry["type"])
                call["function"]["name"] = entry["function"]["name"]
            call["function"]["arguments"] += entry["function"]["arguments"]
    assert list(calls) == list(range(len(calls)))
    assert stream.made_calls == bool(calls)
    return content or None, list(calls.values())


@pytest.mark.parametrize("text, content, calls", OUTPUTS)
def test_a_streamed_output_adds_up_to_the_whole(text, content, calls) -> None:
    for pieces in splits(text, seed=len(text)):
        got_content, got_calls = streamed(pieces)
        assert got_content == content, pieces
        assert calls_of(got_calls) == calls


def test_the_stream_holds_back_only_what_could_start_a_call() -> None:
    stream = t.ToolCallStream()
    assert stream.push("Hi <to") == [{"content": "Hi "}]
    assert stream.push("ol") == []
    assert stream.push("s!") == [{"content": "<tools!"}]
    assert stream.push("\n\n") == [{"content": "\n\n"}]  # the run has text: it goes out
    deltas = stream.push(NOOP_CALL)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "noop", "arguments": ""}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert stream.push("\n") == [] and stream.finish() == []  # whitespace after a call
    assert t.merge_deltas(deltas) == {"tool_calls": [{
        "index": 0, "id": deltas[0]["tool_calls"][0]["id"], "type": "function",
        "function": {"name": "noop", "arguments": "{}"}}]}


# ---- the responses ------------------------------------------------------------------------------


def renderer(tokenizer: Tokenizer, tools: t.ToolRequest | None, n: int = 1,
             stream: bool = False) -> fmt.Renderer:
    options = ap.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                             "n": n, "stream": stream}).options
    return fmt.Renderer("chatcmpl", "chatcmpl-1", "m", options, n, fmt.TokenStrings(tokenizer),
                        tools=tools)


def deltas_of(pieces: list[str], reason: str = "stop") -> list[Delta]:
    return [Delta([], piece) for piece in pieces[:-1]] + [
        Delta([], pieces[-1], finished=True, finish_reason=reason)]


def respond(render: fmt.Renderer, pieces: list[str], reason: str = "stop") -> dict[str, Any]:
    result = fmt.ChoiceResult()
    for delta in deltas_of(pieces, reason):
        render.accumulate(result, delta, 0)
    return render.response([result], prompt_tokens=1)["choices"][0]


def stream_out(render: fmt.Renderer, pieces: list[str], reason: str = "stop"
               ) -> list[dict[str, Any]]:
    chunks = [render.chunk(0, d) for d in deltas_of(pieces, reason)]
    return [c["choices"][0] for c in chunks if c is not None]


TEXT = ["Let me", " check.\n<tool", "_call>\n{\"name\": \"noop\", ",
        "\"arguments\": {}}\n</tool_call>", "\n"]


def test_a_response_carries_the_calls(tokenizer) -> None:
    request = t.parse_tools(TOOLS, "auto", None)
    choice = respond(renderer(tokenizer, request), TEXT)
    assert choice["message"]["content"] == "Let me check.\n"
    assert calls_of(choice["message"]["tool_calls"]) == [("noop", "{}")]
    assert choice["finish_reason"] == "tool_calls"
    only_call = respond(renderer(tokenizer, request), [NOOP_CALL])
    assert only_call["message"]["content"] is None
    cut = respond(renderer(tokenizer, request), ["Sure ", PARIS[:20]], reason="length")
    assert cut["message"] == {"role": "assistant", "content": "Sure " + PARIS[:20]}
    assert cut["finish_reason"] == "length"
    plain = respond(renderer(tokenizer, request), ["It is", " sunny."])
    assert plain["message"] == {"role": "assistant", "content": "It is sunny."}
    assert plain["finish_reason"] == "stop"


def test_without_tools_a_response_is_unchanged(tokenizer) -> None:
    for tools in (None, t.parse_tools(TOOLS, "none", None)):
        choice = respond(renderer(tokenizer, tools), TEXT)
        assert choice["message"] == {"role": "assistant", "content": "".join(TEXT)}
        assert choice["finish_reason"] == "stop"
        assert respond(renderer(tokenizer, tools), [""])["message"]["content"] == ""
        chunks = stream_out(renderer(tokenizer, tools, stream=True), TEXT)
        assert [c["delta"] for c in chunks] == [{"content": s} for s in TEXT]


def test_a_stream_carries_the_calls_as_deltas(tokenizer) -> None:
    request = t.parse_tools(TOOLS, "required", None)
    chunks = stream_out(renderer(tokenizer, request, stream=True), TEXT)
    deltas = [c["delta"] for c in chunks]
    assert deltas[:2] == [{"content": "Let me"}, {"content": " check.\n"}]
    assert deltas[2:] == [{"tool_calls": [{
        "index": 0, "id": deltas[2]["tool_calls"][0]["id"], "type": "function",
        "function": {"name": "noop", "arguments": "{}"}}]}, {}]
    assert [c["finish_reason"] for c in chunks] == [None, None, None, "tool_calls"]
    cut = stream_out(renderer(tokenizer, request, stream=True), ["Ok <tool_c"], "length")
    assert [(c["delta"], c["finish_reason"]) for c in cut] == [
        ({"content": "Ok <tool_c"}, "length")]
    held = stream_out(renderer(tokenizer, request, stream=True), ["Hi <tool_c", " no"])
    assert [c["delta"] for c in held] == [{"content": "Hi "}, {"content": "<tool_c no"}]


def test_each_choice_streams_on_its_own(tokenizer) -> None:
    render = renderer(tokenizer, t.parse_tools(TOOLS, "auto", None), n=2, stream=True)
    assert render.chunk(0, Delta([], "<tool_call>\n")) is None
    second = render.chunk(1, Delta([], "Hi", finished=True, finish_reason="stop"))
    assert second["choices"][0]["delta"] == {"content": "Hi"}
    assert second["choices"][0]["finish_reason"] == "stop"
    first = render.chunk(0, Delta([], NOOP_CALL[12:], finished=True, finish_reason="stop"))
    assert first["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "noop"
    assert first["choices"][0]["finish_reason"] == "tool_calls"
