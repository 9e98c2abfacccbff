"""OpenAI request bodies -> validated generation jobs, with errors a client can act on.

Pure functions over the decoded JSON body: every problem is an `InvalidRequest` that
names the parameter, the value and the limit (HTTP 400 in the OpenAI error shape). Which
parameters a body may hold, which are refused unless neutral, each one's type and bounds
and the SamplingParams fields copied as sent all come from the one parameter table,
`param_table.PARAMS`; this module reads a body by it.

Implemented vLLM-style extensions (through the openai client's `extra_body`): `top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
`skip_special_tokens`, `include_stop_str_in_output`, `cache_salt`, `prompt_logprobs`
(each prompt token's logprob, vLLM's shape; not with stream), `add_special_tokens`
(completions), `add_generation_prompt`, `continue_final_message` and
`chat_template_kwargs` (chat), and `return_token_ids`, which adds each choice's
generated token ids to the response.

A sampling parameter the request leaves out takes the served model's default
(`generation_config`, vLLM's `--generation-config auto`: e.g. its temperature), applied
in `engine_sampling`; one the request sets always wins.

Completions accept batches (a list of prompts): choice `i * n + j` is prompt `i`'s
`j`-th sample. With a seed, sample `j` of every prompt uses `seed + j`.

The raw body goes through `decode_body` first (every endpoint's one JSON loader), so
nothing downstream meets what would crash it: JSON nested deeper than MAX_JSON_DEPTH, and
strings, values or keys, holding lone surrogates (valid JSON escapes that no tokenizer or
UTF-8 encoder accepts, the error body's included). `RequestLimits` bounds the body
(checked before parsing) and the prompt's characters (`check_prompt_chars`, before
tokenizing).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem_engine.config import context_room
from tandem_engine.errors import RequestRejected
from tandem_engine.generation_config import GenerationDefaults
from tandem_engine.router.param_table import (
    CHAT,
    CHAT_ROLES,
    COMPLETIONS,
    INT_PARAMS,
    KNOWN,
    MAX_CHOICES,
    MAX_MESSAGE_FIELD_CHARS,
    MAX_PROMPTS,
    MAX_SEED,
    MESSAGE_FIELDS,
    REFUSED,
    SAMPLED_AS_SENT,
    Param,
    entry,
)
from tandem_engine.router.request_errors import InvalidRequest, show
from tandem_engine.router.structured_request import read_structured
from tandem_engine.router.tools import ToolRequest, parse_assistant_tool_calls, parse_tools
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.structured_outputs import StructuredOutputsParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default; chat defaults to the context left
MAX_JSON_DEPTH = 32  # an OpenAI body needs 5 (messages[i].content[j].text)
# A 128k-token context is about 512k characters of English (4 per token); twice that
# leaves room for text that tokenizes densely. The body limit fits such a prompt with
# JSON escaping, or a 128k-token id list.
DEFAULT_MAX_PROMPT_CHARS = 1_000_000
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# chat_template_kwargs may not set what the router passes to the template itself.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
    "bos_token", "eos_token"})


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request, checked before it costs anything (`tandem-router` flags)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # --max-body-bytes
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS  # --max-prompt-chars

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    def body_too_large(self, size: int | None = None) -> InvalidRequest:
        got = f" ({size} bytes)" if size is not None else ""
        return InvalidRequest(
            f"the request body{got} is over the limit of {self.max_body_bytes} bytes "
            "(tandem-router --max-body-bytes): send a shorter prompt", None, 413,
            "request_too_large")


@dataclass(frozen=True)
class Options:
    """What completions and chat requests share."""

    model: str
    n: int
    stream: bool
    include_usage: bool  # stream_options.include_usage
    max_tokens: int | None  # None: the endpoint's default
    seed: int | None
    logprobs: int | None  # top alternatives per token; None: no logprobs
    cache_salt: str | None
    # OpenAI's prompt_cache_key: routing's affinity hint (picker.py)
    cache_key: str | None
    priority: int  # vLLM's: the engines schedule lower first (admission.py)
    # The other SamplingParams fields the body set, by name (the rest take the model's
    # defaults, else SamplingParams'); `engine_sampling` turns them into each choice's
    # SamplingParams.
    sampling_args: dict[str, Any]
    return_token_ids: bool = False
    prompt_logprobs: int | None = None  # top alternatives per prompt token, vLLM's shape
    echo: bool = False  # completions: the prompt (and its logprobs) before the text
    # What the output must match (structured outputs, or the tools' calls), and the
    # parameter that said so (named by a 400 when it does not compile).
    structured: StructuredOutputsParams | None = None
    structured_param: str | None = None


@dataclass(frozen=True)
class CompletionRequest:
    options: Options
    prompts: list[str | list[int]]
    add_special_tokens: bool = True  # a text prompt's BOS, as the tokenizer adds it


@dataclass(frozen=True)
class ChatRequest:
    options: Options
    messages: list[dict[str, str]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: ToolRequest | None = None  # None: no tools, or tool_choice none


# ---- the raw body ----------------------------------------------------------------------------


def decode_body(raw: bytes) -> Any:
    """The request's JSON, refused (InvalidRequest) when it is not JSON, nests deeper than
    MAX_JSON_DEPTH, or holds a string, a value or an object's key, that no UTF-8 encoder
    accepts (a lone surrogate). Every endpoint reads its body through this one loader."""
    try:
        body = json.loads(raw)
    except RecursionError:  # deeper than the parser's own recursion limit
        raise _too_deep(None) from None
    except ValueError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    _check_json(body)
    return body


def _check_json(body: Any) -> None:
    # Iterative, so a deep body cannot exhaust the stack here either. A key is checked
    # before it names anything: the path to it (in an error) must be text itself.
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(path)
        if isinstance(value, dict):
            if not all(_is_utf8(k) for k in value):
                raise _surrogate_key(path)
            items = ((_child(path, k), v) for k, v in value.items())
        elif isinstance(value, list):
            items = ((f"{path}[{i}]", v) for i, v in enumerate(value)
                     if isinstance(v, dict | list | str))
        else:
            continue
        for where, item in items:
            if isinstance(item, str):
                if not _is_utf8(item):
                    raise _surrogate(where)
            elif isinstance(item, dict | list):
                stack.append((item, where, depth + 1))


MAX_KEY_CHARS = 64  # of an object's key, where an error's path names it


def _child(path: str, key: str) -> str:
    """The path to `path`'s member `key` (`messages[0].content`), a long key shortened:
    a path is for reading in an error, and a body may hold a megabyte-long key."""
    if len(key) > MAX_KEY_CHARS:
        key = f"{key[:MAX_KEY_CHARS]}...({len(key)} characters)"
    return f"{path}.{key}" if path else key


def _is_utf8(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _too_deep(path: str | None) -> InvalidRequest:
    return InvalidRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
                          + (f" at {path}" if path else "")
                          + ": no OpenAI parameter needs that", path or None)


_LONE_SURROGATE = ("a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is "
                   "not text: send valid Unicode")


def _surrogate(path: str) -> InvalidRequest:
    return InvalidRequest(f"{path} holds {_LONE_SURROGATE}", path)


def _surrogate_key(path: str) -> InvalidRequest:
    return InvalidRequest(f"{path or 'the request body'} holds a key with {_LONE_SURROGATE}",
                          path or None)


def check_prompt_chars(request: CompletionRequest | ChatRequest, limits: RequestLimits
                       ) -> None:
    """Refuse a prompt longer than `limits.max_prompt_chars` before it is tokenized."""
    if isinstance(request, ChatRequest):
        sizes = [("messages", sum(len(m["content"]) for m in request.messages))]
    else:
        sizes = [("prompt", len(p)) for p in request.prompts if isinstance(p, str)]
    for param, size in sizes:
        if size > limits.max_prompt_chars:
            raise InvalidRequest(
                f"the {param} has {size} characters, over the limit of "
                f"{limits.max_prompt_chars} (tandem-router --max-prompt-chars): shorten it",
                param, code="context_length_exceeded")


# ---- the two endpoints ------------------------------------------------------------------------


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    _check_names(body, COMPLETIONS)
    n = body.get("n") if body.get("n") is not None else 1
    if body.get("best_of") is not None and body["best_of"] == n:
        body = {k: v for k, v in body.items() if k != "best_of"}  # best_of == n: neutral
    _refuse(body)
    echo = bool(_bool(body, "echo", False))
    options = _options(body, logprobs=_int(body, "logprobs"), echo=echo)
    prompts = _prompts(body.get("prompt"))
    if len(prompts) * options.n > MAX_CHOICES:
        raise InvalidRequest(f"{len(prompts)} prompts x n={options.n} is "
                             f"{len(prompts) * options.n} choices, over the limit of "
                             f"{MAX_CHOICES}: send fewer prompts or a smaller n", "n")
    return CompletionRequest(options, prompts,
                             bool(_bool(body, "add_special_tokens", True)))


def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    _check_names(body, CHAT)
    _refuse(body)
    if _bool(body, "echo", False):  # vLLM's chat echo (prepend the last message): not here
        raise InvalidRequest("echo=True is not supported for chat completions by this "
                             "server: drop it", "echo")
    if _bool(body, "add_special_tokens", False):
        raise InvalidRequest("add_special_tokens=True is not supported for chat "
                             "completions: the chat template writes the special tokens",
                             "add_special_tokens")
    want = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs")
    if top is not None and not want:
        raise InvalidRequest("top_logprobs needs logprobs=true", "top_logprobs")
    max_completion = _int(body, "max_completion_tokens")
    options = _options(body, logprobs=(top or 0) if want else None,
                       max_tokens=max_completion)
    messages = _messages(body.get("messages"))
    add_generation_prompt = bool(_bool(body, "add_generation_prompt", True))
    continue_final = bool(_bool(body, "continue_final_message", False))
    if continue_final and add_generation_prompt:
        raise InvalidRequest("continue_final_message=true cannot be used with "
                             "add_generation_prompt=true (the default): set "
                             "add_generation_prompt to false", "continue_final_message")
    tools = parse_tools(body.get("tools"), body.get("tool_choice"),
                        body.get("parallel_tool_calls"))
    if tools is not None and not tools.active:
        tools = None
    if tools is not None:
        if options.structured is not None:
            raise InvalidRequest(f"tools and {options.structured_param} both constrain the "
                                 f"output: drop {options.structured_param}, or set "
                                 "tool_choice to none", options.structured_param)
        grammar = tools.grammar()
        if grammar is not None:
            options = dataclasses.replace(
                options, structured=StructuredOutputsParams(grammar=grammar),
                structured_param="tools")
    return ChatRequest(options, messages, add_generation_prompt, continue_final,
                       _template_kwargs(body.get("chat_template_kwargs")), tools)


def _template_kwargs(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("chat_template_kwargs must be an object of template "
                             "variables", "chat_template_kwargs")
    for key in value:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS:
            where = _child("chat_template_kwargs", key)
            raise InvalidRequest(
                f"{where} cannot be set: template variables are identifiers other than the "
                f"router's own ({', '.join(sorted(RESERVED_TEMPLATE_KWARGS))})", where)
    return dict(value)


# ---- from a parsed request to the engine's parameters -----------------------------------------


def resolve_max_tokens(options: Options, prompt_len: int, max_model_len: int, *,
                       default: int | None, prompt_param: str = "prompt") -> int:
    """How many tokens to generate: the request's max_tokens, or `default` (None: all the
    context left). The one place the context limit is decided, by vLLM's rule: the
    prompt's tokens plus max_tokens must fit in max_model_len (so a prompt must leave
    room for at least one token)."""
    if prompt_len == 0:
        raise InvalidRequest("the prompt is empty: give at least one token", prompt_param)
    room = context_room(prompt_len, max_model_len)
    if room < 1:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens, which leaves no room to generate within "
            f"the model's context limit of {max_model_len} tokens (max_model_len; prompt "
            f"tokens + max_tokens must be at most {max_model_len}): shorten it to at most "
            f"{max_model_len - 1} tokens", prompt_param, code="context_length_exceeded")
    if options.max_tokens is None:
        return room if default is None else min(default, room)
    if options.max_tokens > room:
        raise InvalidRequest(
            f"max_tokens={options.max_tokens} is too large: the prompt has {prompt_len} "
            f"tokens and the context limit (max_model_len) is {max_model_len}, so at most "
            f"{room} tokens can be generated (prompt tokens + max_tokens must be at most "
            f"{max_model_len})", "max_tokens", code="context_length_exceeded")
    return options.max_tokens


def engine_sampling(options: Options, max_tokens: int, sample_index: int,
                    defaults: GenerationDefaults | None = None) -> SamplingParams:
    """The SamplingParams of one choice (its `Submit.sampling`, for its whole generation),
    validated here, at the edge: a problem is an InvalidRequest naming the parameter.
    `defaults` (the model's, `--generation-config`) fill the sampling fields the request
    left out; a field the request set, even to its neutral value, keeps the request's.
    The prompt's logprobs are computed for `prompt_logprobs`, and for `echo` with
    `logprobs` (as many alternatives as the larger of the two asks)."""
    seed = options.seed + sample_index if options.seed is not None else None
    asked = [n for n in (options.prompt_logprobs,
                         options.logprobs if options.echo else None) if n is not None]
    sampling = {**defaults.sampling_kwargs(), **options.sampling_args} if defaults \
        else options.sampling_args
    try:
        return SamplingParams(**sampling, max_tokens=max_tokens,
                              logprobs=options.logprobs, seed=seed,
                              prompt_logprobs=max(asked) if asked else None,
                              structured_outputs=options.structured)
    except RequestRejected as exc:
        raise InvalidRequest(str(exc), rejected_param(str(exc))) from None


def rejected_param(message: str) -> str | None:
    """The parameter a RequestRejected message names (here, or in an engine's REJECT):
    "sampling parameter NAME=...", or the prompt (a token id outside the vocabulary)."""
    if message.startswith("sampling parameter "):
        param = message.removeprefix("sampling parameter ").split("=", 1)[0]
        return param if param.isidentifier() else None
    return "prompt" if "prompt" in message else None


# ---- shared options ----------------------------------------------------------------------------

# What the parameters read by code of their own take, from their table entries.
_STREAM_OPTIONS = tuple(m.name for m in entry(COMPLETIONS, "stream_options").members)
_CACHE_SALT = entry(COMPLETIONS, "cache_salt").bound
_CACHE_KEY = entry(COMPLETIONS, "prompt_cache_key").bound
_STOP = entry(COMPLETIONS, "stop").bound


def _short_string(body: dict[str, Any], name: str, bound: Any) -> str | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, str)
                              or not bound.low <= len(value) <= bound.high):
        raise InvalidRequest(f"{name} must be a string of {bound.low}..{bound.high} "
                             "characters", name)
    return value


def _options(body: dict[str, Any], *, logprobs: int | None,
             max_tokens: int | None = None, echo: bool = False) -> Options:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required: the served model's name (GET /v1/models)",
                             "model")
    n = _int(body, "n")
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise InvalidRequest("stream_options must be an object", "stream_options")
        include_usage = _bool(stream_options, "include_usage", False, "stream_options.")
        for key, value in stream_options.items():
            if key not in _STREAM_OPTIONS and value not in (None, False):
                where = _child("stream_options", key)
                raise InvalidRequest(f"{where}={show(value)} is not supported by this "
                                     f"server (only {', '.join(_STREAM_OPTIONS)} is)", where)
    prompt_logprobs = _int(body, "prompt_logprobs")
    if prompt_logprobs is not None and stream:
        raise InvalidRequest("prompt_logprobs is not available with stream=true (as in "
                             "vLLM): ask without streaming", "prompt_logprobs")
    legacy_max = _int(body, "max_tokens")  # checked even when not used
    if max_tokens is None:
        max_tokens = legacy_max
    seed = _int(body, "seed")
    n_value = n or 1
    if seed is not None and seed + n_value - 1 > MAX_SEED:
        raise InvalidRequest(f"seed={seed} is too large for n={n_value}: choice i uses "
                             f"seed + i, which must stay <= {MAX_SEED}", "seed")
    sampling: dict[str, Any] = {}  # Options.sampling_args
    for p in SAMPLED_AS_SENT:
        value = body.get(p.name)
        if value is not None:
            value = _READERS[p.type](p, value)
        if value is not None:
            sampling[p.sampling] = value
    cache_salt = _short_string(body, "cache_salt", _CACHE_SALT)
    cache_key = _short_string(body, "prompt_cache_key", _CACHE_KEY)
    structured, structured_param = read_structured(body)
    return Options(model=model, n=n_value, stream=stream, include_usage=include_usage,
                   max_tokens=max_tokens, seed=seed, logprobs=logprobs,
                   cache_salt=cache_salt, cache_key=cache_key,
                   priority=_int(body, "priority") or 0, sampling_args=sampling,
                   return_token_ids=bool(_bool(body, "return_token_ids", False)),
                   prompt_logprobs=prompt_logprobs, echo=echo, structured=structured,
                   structured_param=structured_param)


def _prompts(prompt: Any) -> list[str | list[int]]:
    hint = "a string, a list of token ids, or a list of those (a batch)"
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest(f"prompt is required: {hint}", "prompt")
    # A list of numbers is token ids (its range names any that is no id: 1e308, 0.5).
    if all(_is_number(t) for t in prompt):
        return [INT_PARAMS["prompt"].check_each("prompt", prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequest(f"a batch of {len(prompt)} prompts is over the limit of "
                             f"{MAX_PROMPTS}: split it", "prompt")
    out: list[str | list[int]] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list) and item and all(_is_number(t) for t in item):
            out.append(INT_PARAMS["prompt"].check_each("prompt", item, f"[{i}]"))
        else:
            raise InvalidRequest(f"prompt must be {hint}; got a list holding "
                                 f"{type(item).__name__}", "prompt")
    return out


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages is required: a non-empty list of "
                             "{'role': ..., 'content': ...} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{where} must be an object with role and content", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"{where}.role={show(role)} is not one of "
                                 f"{', '.join(CHAT_ROLES)}", f"{where}.role")
        for key, value in m.items():
            if key not in MESSAGE_FIELDS and value not in (None, [], ""):
                field = _child(where, key)
                raise InvalidRequest(f"{field} is not supported by this server (a message "
                                     f"has {', '.join(MESSAGE_FIELDS)})", field)
        message: dict[str, Any] = {"role": role,
                                   "content": _content(m.get("content"), role, where)}
        if m.get("tool_calls") not in (None, []):
            if role != "assistant":
                raise InvalidRequest(f"{where}.tool_calls: only an assistant message makes "
                                     "tool calls", f"{where}.tool_calls")
            message["tool_calls"] = parse_assistant_tool_calls(m["tool_calls"], where)
        for key in ("name", "tool_call_id"):  # for templates that show them
            value = m.get(key)
            if value is None:
                continue
            if not isinstance(value, str) or len(value) > MAX_MESSAGE_FIELD_CHARS:
                raise InvalidRequest(f"{where}.{key} must be a string of at most "
                                     f"{MAX_MESSAGE_FIELD_CHARS} characters, not "
                                     f"{show(value)}", f"{where}.{key}")
            message[key] = value
        out.append(message)
    return out


def _content(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"{where}.content: only text parts are supported, got "
                                     f"{show(kind)}", f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequest(f"{where}.content must be a string or a list of text parts",
                         f"{where}.content")


# ---- typed field readers ---------------------------------------------------------------------


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int(body: dict[str, Any], name: str) -> int | None:
    """An integer parameter, within its `INT_PARAMS` range; None when absent."""
    value = body.get(name)
    return None if value is None else INT_PARAMS[name].check(name, value)


def _bool(body: dict[str, Any], name: str, default: bool | None,
          prefix: str = "") -> bool | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{prefix}{name}={show(value)} must be true or false", prefix + name)
    return value


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    bound = _STOP
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidRequest("stop must be a string or a list of strings", "stop")
    if len(items) > bound.max_items:
        raise InvalidRequest(f"stop has {len(items)} strings, over the limit of "
                             f"{bound.max_items}", "stop")
    for s in items:
        if not bound.low <= len(s) <= bound.high:
            raise InvalidRequest(f"stop string {show(s)} must have {bound.low}..{bound.high} "
                                 "characters", "stop")
    return items


def _token_ids(p: Param, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise InvalidRequest(f"{p.name} must be a list of token ids in "
                             f"[{p.bound.low}, {p.bound.high}]", p.name)
    return p.bound.check_each(p.name, value)


# A sampling parameter's reader by its type (its value present): the value to set, or
# None for one that asks for nothing (an empty stop list).
_READERS: dict[str, Callable[[Param, Any], Any]] = {
    "integer": lambda p, value: p.bound.check(p.name, value),
    "number": lambda p, value: p.bound.check(p.name, value),
    "boolean": lambda p, value: _bool({p.name: value}, p.name, None),
    "stop": lambda p, value: _stop(value) or None,
    "token_ids": _token_ids,
}


def _check_names(body: dict[str, Any], endpoint: str) -> None:
    """Refuse a parameter the table does not know for the endpoint (OpenAI's
    "unrecognized request argument")."""
    known = KNOWN[endpoint]
    for name in body:
        if name not in known:
            raise InvalidRequest(f"{show(name)} is an unrecognized request argument: this "
                                 "server does not know it, so it is refused rather than "
                                 "ignored", _child("", name))


def _refuse(body: dict[str, Any]) -> None:
    """Refuse the REFUSED parameters unless absent or at a neutral value."""
    for name, neutral in REFUSED.items():
        value = body.get(name)
        if value is None or any(value == ok and type(value) is type(ok) for ok in neutral):
            continue
        raise InvalidRequest(f"{name}={show(value)} is not supported by this server", name)
