"""OpenAI tool calling for chat completions: the request's tools, the grammar that keeps
the model's calls valid, the prompt that shows it the tools, and the parser that turns
its output back into `tool_calls`.

The wire format is Hermes': the model answers a call as
`<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, several calls one per
line. A checkpoint whose chat template renders tools itself gets the OpenAI tool list
and messages; one without tool support (SmolLM2) gets the tools as a system prompt, its
past calls and their results written into plain messages (`render_for_template`).

Every call the model emits is valid, whatever `tool_choice` says: `required` and a named
tool force calls from the first token; `auto` lets the model write text, but once the
text `<tool_call>` appears, what follows must be a call to one of the tools whose
arguments satisfy that tool's `parameters` schema. After its calls the model can only
end (no text after a call), so a call is never followed by text a client would not see.
`tool_choice: none` shows the model no tools and parses nothing.

The grammar is llguidance Lark text: `<tool_call>` is plain text in the vocabularies we
serve, not a special token, so `auto` uses a lazy lexeme that ends at the first
`<tool_call>` (the trigger of llguidance's `StructTag`, written out here so calls can
be separated by newlines and nothing can follow them).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import llguidance as llg

from tandem_engine.router.request_errors import InvalidRequest, show

MAX_TOOLS = 128
MAX_FUNCTION_BYTES = 32 * 1024  # one function's JSON, its schema included
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
OPEN, CLOSE, NEWLINE = "<tool_call>", "</tool_call>", "\n"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# Calls in one turn at most (with parallel_tool_calls): a small model otherwise repeats
# the same call until max_tokens cuts it off.
MAX_PARALLEL_CALLS = 8
# A call's arguments as JSON in the Hermes style (`{"city": "Tokyo"}`), no other
# whitespace: a model cannot pad a call with whitespace until max_tokens either.
_ARGUMENTS_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools. `tools` holds each function as `{"name", "description"?,
    "parameters"}` (parameters defaulted); `choice` is none | auto | required | named,
    `name` the named tool's; `parallel`: one or more calls (else at most one)."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the model is shown the tools and its output parsed for calls."""
        return self.choice != "none"

    def grammar(self) -> str | None:
        """The Lark grammar (llguidance's dialect) the output must follow; None for none.

        required/named: `<tool_call>` blocks only, from the first token. auto: any text
        without a call, or text up to the first `<tool_call>` and then calls. Each call
        is `{"name": "NAME", "arguments": ARGS}` with ARGS that tool's schema (`%json`)."""
        if not self.active:
            return None
        tools = [t for t in self.tools if self.choice != "named" or t["name"] == self.name]
        # further calls, one per line
        more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if self.parallel else ""
        if self.choice == "auto":
            # Once `<tool_call>` is complete the lazy `head` matches and the parser commits
            # to it, so TEXT never holds one: what follows it must be a call.
            start = [f"start: TEXT | head call_body{more}",
                     f"head[lazy]: TEXT {_lark(OPEN)}", "TEXT: /(?s:.*)/"]
        else:
            start = [f"start: call{more}"]
        alternatives = " | ".join(f"tool_{i}" for i in range(len(tools)))
        lines = ["%llguidance {}", *start, f"call: {_lark(OPEN)} call_body",
                 f"call_body: {_lark(NEWLINE)} ({alternatives}) {_lark(NEWLINE + CLOSE)}"]
        for i, tool in enumerate(tools):
            head = _lark(f'{{"name": "{tool["name"]}", "arguments": ')
            schema = json.dumps(_object_schema(tool))
            lines.append(f"tool_{i}: {head} %json {schema} {_lark('}')}")
        return "\n".join(lines) + "\n"


def _lark(text: str) -> str:
    return json.dumps(text)  # a JSON string is a Lark string literal


def _object_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool's arguments are an object even where its schema leaves the type open,
    written as `_ARGUMENTS_JSON` says (llguidance reads `x-guidance`)."""
    return {"type": "object", **tool["parameters"], "x-guidance": _ARGUMENTS_JSON}


# ---- the request ------------------------------------------------------------------------------


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`, validated; None when
    it has no tools. Unknown keys in a tool are ignored, as OpenAI clients add their own."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest(f"parallel_tool_calls={show(parallel_tool_calls)} must be true "
                             "or false", "parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    if tools is None:
        if tool_choice not in (None, "none"):
            raise InvalidRequest(f"tool_choice={show(tool_choice)} needs tools: send the "
                                 "tools the model may call, or leave tool_choice out",
                                 "tool_choice")
        return None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        got = f"{len(tools)} tools" if isinstance(tools, list) else show(tools)
        raise InvalidRequest(f"tools must be a list of 1..{MAX_TOOLS} "
                             f'{{"type": "function", "function": {{...}}}} objects, not {got}',
                             "tools")
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        function = _function(tool, f"tools[{i}]")
        for j, seen in enumerate(functions):
            if seen["name"] == function["name"]:
                raise InvalidRequest(f"tools[{i}].function.name={show(function['name'])} "
                                     f"is also tools[{j}]'s: give each tool its own name",
                                     f"tools[{i}].function.name")
        functions.append(function)
    choice, name = _choice(tool_choice, [f["name"] for f in functions])
    return ToolRequest(tuple(functions), choice, name, parallel)


def _function(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InvalidRequest(f'{where} must be {{"type": "function", "function": {{"name": '
                             f'..., "parameters": ...}}}}, not {show(tool)}', where)
    function = tool.get("function")
    where = f"{where}.function"
    if not isinstance(function, dict):
        raise InvalidRequest(f'{where} must be an object with a "name" (and optionally '
                             f'"description" and "parameters"), not {show(function)}', where)
    size = len(json.dumps(function, ensure_ascii=False).encode())
    if size > MAX_FUNCTION_BYTES:
        raise InvalidRequest(f"{where} is {size} bytes of JSON, over the limit of "
                             f"{MAX_FUNCTION_BYTES}: shorten its description or schema", where)
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise InvalidRequest(f"{where}.name={show(name)} must be 1..64 letters, digits, "
                             "'_' or '-'", f"{where}.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"{where}.description must be a string, not "
                             f"{show(description)}", f"{where}.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{where}.strict={show(strict)} must be true or false",
                             f"{where}.strict")
    parameters = function.get("parameters")
    parameters = EMPTY_PARAMETERS if parameters is None else parameters
    _check_schema(parameters, name, f"{where}.parameters")
    described = {"description": description} if description is not None else {}
    return {"name": name, **described, "parameters": parameters}


def _check_schema(schema: Any, name: str, where: str) -> None:
    """The schema must describe the arguments object, and llguidance must compile it:
    the grammar enforces it on every call (`strict` or not)."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise InvalidRequest(f"{where} of tool {name!r} must be a JSON schema of an object "
                             f'({{"type": "object", "properties": {{...}}}}), not '
                             f"{show(schema)}", where)
    try:
        error = llg.LLMatcher.validate_grammar(llg.grammar_from("json", json.dumps(schema)))
    except (ValueError, TypeError) as exc:  # not JSON-encodable, or refused outright
        error = str(exc)
    if error:
        raise InvalidRequest(f"{where} of tool {name!r} is not a JSON schema this server can "
                             f"enforce: {error}; simplify the schema (see llguidance's "
                             "supported keywords)", where)


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in CHOICES:
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(function, dict) or tool_choice.get("type", "function") != "function":
        raise InvalidRequest(f"tool_choice={show(tool_choice)} must be none, auto, required "
                             'or {"type": "function", "function": {"name": ...}}',
                             "tool_choice")
    name = function.get("name")
    if name not in names:
        raise InvalidRequest(f"tool_choice.function.name={show(name)} is not one of the "
                             f"tools ({', '.join(names)})", "tool_choice.function.name")
    return "named", name


def parse_assistant_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` (`where` is the message, `messages[3]`),
    validated and normalized to `{"id", "type": "function", "function": {"name",
    "arguments"}}`; `arguments` must hold JSON, as a template or the tool prompt needs it
    parsed."""
    where = f"{where}.tool_calls"
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise InvalidRequest(f"{where} must be a list of at most {MAX_TOOLS} calls", where)
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise InvalidRequest(f'{at} must be {{"id": ..., "type": "function", "function": '
                                 f'{{"name": ..., "arguments": ...}}}}, not {show(call)}', at)
        call_id = call.get("id")
        if not isinstance(call_id, str) or not 1 <= len(call_id) <= 256:
            raise InvalidRequest(f"{at}.id={show(call_id)} must be a string of 1..256 "
                                 "characters (the id the tool's answer names)", f"{at}.id")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidRequest(f"{at}.function.name={show(name)} must be 1..64 letters, "
                                 "digits, '_' or '-'", f"{at}.function.name")
        arguments = function.get("arguments")
        try:
            _json_value(arguments if isinstance(arguments, str) else "")
        except ValueError:
            raise InvalidRequest(f"{at}.function.arguments must be a string holding JSON, "
                                 f"not {show(arguments)}", f"{at}.function.arguments") from None
        calls.append({"id": call_id, "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    return calls


_DECODER = json.JSONDecoder(parse_constant=lambda name: _refuse(f"{name} is not JSON"))


def _json_value(text: str) -> Any:
    """JSON held in a request's string or written by the model; not a request body (that
    is `api_params.decode_body`'s), but refused alike (ValueError): not JSON, nested too
    deep, NaN or Infinity (a client's parser refuses them), a lone surrogate (UTF-8 has
    none)."""
    try:
        value = _DECODER.decode(text)
        json.dumps(value, ensure_ascii=False).encode()
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    return value


def _refuse(reason: str) -> Any:
    raise ValueError(reason)


# ---- the prompt -------------------------------------------------------------------------------


def render_for_template(messages: list[dict[str, Any]], request: ToolRequest | None,
                        template_takes_tools: bool
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages to give the chat template and its `tools` argument.

    A template that renders tools gets the OpenAI tool list and the messages as they are,
    except that a past call's `arguments` become an object, as HuggingFace templates
    expect. Any other template gets Hermes' format as plain messages: the tools prompt
    opens the system message, a past call is written into its assistant message's
    content, and tool results become a user message of `<tool_response>` blocks. The
    conversation's past calls are written even when the request's tools are off."""
    active = request is not None and request.active
    if template_takes_tools:
        tools = [{"type": "function", "function": f} for f in request.tools] if active \
            else None
        return [_with_object_arguments(m) for m in messages], tools
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":  # consecutive results share one user turn
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif m.get("tool_calls"):
            blocks = "\n".join(_call_block(c["function"]["name"],
                                           _json_value(c["function"]["arguments"]))
                               for c in m["tool_calls"])
            content = f"{m['content']}\n{blocks}" if m["content"] else blocks
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": content})
        else:
            out.append(dict(m))
    if active:
        prompt = hermes_system_prompt(request)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{prompt}\n\n{out[0]['content']}"
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"],
                                "arguments": _json_value(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _call_block(name: str, arguments: Any) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{call}\n{CLOSE}"


def hermes_system_prompt(request: ToolRequest) -> str:
    """The tools as Hermes-format models (Qwen2.5, Hermes 2 Pro) are shown them."""
    signatures = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                           for f in request.tools)
    how_many = "one or more functions" if request.parallel else "one function"
    return ("# Tools\n\n"
            f"You may call {how_many} to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


# ---- the output -------------------------------------------------------------------------------


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output's content (None when empty) and its calls as OpenAI `tool_calls`.

    The content is the text outside the calls: a `<tool_call>` block that is not a JSON
    `{"name": ..., "arguments": {...}}` stays content, and so does an unfinished one;
    whitespace-only text next to a call (the newline between calls, say) is dropped. It
    is exactly what `ToolCallStream` streams, being computed by one."""
    stream = ToolCallStream()
    deltas = stream.push(text) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    return content or None, stream.calls


class ToolCallStream:
    """One choice's output, streamed: text deltas in, chat `delta` dicts out.

    Text goes out as content as soon as it cannot be the start of a call (a suffix that
    could begin `<tool_call>` is held back); a call goes out whole once its
    `</tool_call>` arrived and it parsed, as its header (`index`, `id`, `type`, `name`)
    and then its `arguments`. Whitespace is held back while it could turn out to border
    a call, so the content streamed adds up to `parse_tool_calls`'."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet classified: a possible call, or its start
        self._in_call = False  # _pending starts with `<tool_call>`
        self._scanned = 0  # how far into _pending no `</tool_call>` starts
        self._held = ""  # the whitespace-only start of the current text run
        self._run_has_text = False  # the current run went out (it is not all whitespace)
        self._calls: list[dict[str, Any]] = []

    @property
    def made_calls(self) -> bool:
        return bool(self._calls)

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The calls so far, as OpenAI `tool_calls` entries."""
        return list(self._calls)

    def push(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._pending += text
        while True:
            if self._in_call:
                end = self._pending.find(CLOSE, max(self._scanned, len(OPEN)))
                if end < 0:
                    self._scanned = max(len(OPEN), len(self._pending) - len(CLOSE) + 1)
                    break
                end += len(CLOSE)
                block, self._pending = self._pending[:end], self._pending[end:]
                self._in_call, self._scanned = False, 0
                call = _parse_call(block[len(OPEN):-len(CLOSE)])
                if call is None:
                    self._text(block, out)
                else:
                    self._call(*call, out)
                continue
            start = self._pending.find(OPEN)
            if start < 0:
                keep = _open_prefix_length(self._pending)
                cut = len(self._pending) - keep
                self._text(self._pending[:cut], out)
                self._pending = self._pending[cut:]
                break
            self._text(self._pending[:start], out)
            self._pending, self._in_call = self._pending[start:], True
        return out

    def finish(self) -> list[dict[str, Any]]:
        """What was held back: an unfinished call or a partial `<tool_call>` is text, and
        whitespace goes out unless a call came before it."""
        out: list[dict[str, Any]] = []
        self._text(self._pending, out)
        self._pending, self._in_call, self._scanned = "", False, 0
        if self._held and not self._calls:
            _say(out, self._held)
        self._held = ""
        return out

    def _text(self, text: str, out: list[dict[str, Any]]) -> None:
        if not text:
            return
        if self._run_has_text:
            _say(out, text)
            return
        self._held += text
        if self._held.strip():
            _say(out, self._held)
            self._held, self._run_has_text = "", True

    def _call(self, name: str, arguments: str, out: list[dict[str, Any]]) -> None:
        self._held, self._run_has_text = "", False  # whitespace bordering a call is dropped
        index, call_id = len(self._calls), f"call_{secrets.token_hex(12)}"
        self._calls.append({"id": call_id, "type": "function",
                            "function": {"name": name, "arguments": arguments}})
        out.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})


def _open_prefix_length(text: str) -> int:
    """The length of the longest end of `text` that could begin `<tool_call>`."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


def _parse_call(body: str) -> tuple[str, str] | None:
    """A call's name and arguments (as JSON text), or None when `body` is not one."""
    try:
        value = _json_value(body)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("arguments")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name) \
            or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def _say(out: list[dict[str, Any]], text: str) -> None:
    """Content onto the deltas, adjacent content as one delta."""
    if out and "content" in out[-1]:
        out[-1] = {"content": out[-1]["content"] + text}
    else:
        out.append({"content": text})


def merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Several chat deltas as the one a stream chunk carries: the content joined, each
    call's entries merged into one (its arguments joined)."""
    merged: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if "content" in d:
            merged["content"] = merged.get("content", "") + d["content"]
        for entry in d.get("tool_calls", ()):
            call = calls.setdefault(entry["index"], {"function": {"arguments": ""}})
            arguments = call["function"]["arguments"] + entry["function"]["arguments"]
            call.update(entry, function={**call["function"], **entry["function"],
                                         "arguments": arguments})
    if calls:
        merged["tool_calls"] = list(calls.values())
    return merged
