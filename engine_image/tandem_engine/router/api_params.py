"""OpenAI request bodies -> validated generation jobs, with errors a client can act on.

Pure functions over the decoded JSON body: every problem is an `InvalidRequest` that
names the parameter, the value and the limit (HTTP 400 in the OpenAI error shape).
Parameters the engine cannot honour (penalties, logit bias, tools, echo) are refused
rather than silently ignored. vLLM-style extensions are accepted too (`top_k`,
`min_tokens`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`,
`include_stop_str_in_output`, `cache_salt`, and `return_token_ids`, which adds each
choice's generated token ids to the response), e.g. through the openai client's
`extra_body`.

Completions accept batches (a list of prompts): choice `i * n + j` is prompt `i`'s
`j`-th sample. With a seed, sample `j` of every prompt uses `seed + j`.

The raw body goes through `decode_body` first, so nothing downstream meets what would
crash it: JSON nested deeper than MAX_JSON_DEPTH, and strings holding lone surrogates
(valid JSON escapes that no tokenizer or UTF-8 encoder accepts). Token ids outside
[0, MAX_TOKEN_ID] are refused here; the vocabulary bound is the engine's (only it knows
the model). `RequestLimits` bounds the body (checked before parsing) and the prompt's
characters (`check_prompt_chars`, before tokenizing).
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass
from typing import Any

from tandem_engine.errors import RequestRejected
from tandem_engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID,
    SamplingParams,
)

MAX_N = 16  # samples per prompt
MAX_PROMPTS = 32  # prompts per completions batch
MAX_CHOICES = 64  # prompts x n
MAX_SEED = 2**63 - 1
MAX_CACHE_SALT_CHARS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default; chat defaults to the context left
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_JSON_DEPTH = 32  # an OpenAI body needs 5 (messages[i].content[j].text)
# A 128k-token context is about 512k characters of English (4 per token); twice that
# leaves room for text that tokenizes densely. The body limit fits such a prompt with
# JSON escaping, or a 128k-token id list.
DEFAULT_MAX_PROMPT_CHARS = 1_000_000
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class InvalidRequest(Exception):
    """A request the router answers with an OpenAI error instead of running it."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.type = type


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
    # The other SamplingParams fields the body set, by name (the rest keep SamplingParams'
    # defaults); `engine_sampling` turns them into each choice's SamplingParams.
    sampling_args: dict[str, Any]
    return_token_ids: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    options: Options
    prompts: list[str | list[int]]


@dataclass(frozen=True)
class ChatRequest:
    options: Options
    messages: list[dict[str, str]]


# ---- the raw body ----------------------------------------------------------------------------


def decode_body(raw: bytes) -> Any:
    """The request's JSON, refused (InvalidRequest) when it is not JSON, nests deeper than
    MAX_JSON_DEPTH, or holds a string no UTF-8 encoder accepts (a lone surrogate)."""
    try:
        body = json.loads(raw)
    except RecursionError:  # deeper than the parser's own recursion limit
        raise _too_deep(None) from None
    except ValueError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    _check_json(body)
    return body


def _check_json(body: Any) -> None:
    # Iterative, so a deep body cannot exhaust the stack here either.
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(path)
        if isinstance(value, dict):
            items = ((f"{path}.{k}" if path else str(k), k, v) for k, v in value.items())
        elif isinstance(value, list):
            items = ((f"{path}[{i}]", None, v) for i, v in enumerate(value)
                     if isinstance(v, dict | list | str))
        else:
            continue
        for where, key, item in items:
            if isinstance(key, str) and not _is_utf8(key):
                raise _surrogate(where)
            if isinstance(item, str):
                if not _is_utf8(item):
                    raise _surrogate(where)
            elif isinstance(item, dict | list):
                stack.append((item, where, depth + 1))


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


def _surrogate(path: str) -> InvalidRequest:
    return InvalidRequest(f"{path} holds a lone UTF-16 surrogate (an unpaired \\ud800-"
                          "\\udfff escape), which is not text: send valid Unicode", path)


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
    _refuse(body, echo=False, suffix="", best_of=None)
    options = _options(body, logprobs=_int(body, "logprobs", 0, MAX_LOGPROBS))
    prompts = _prompts(body.get("prompt"))
    if len(prompts) * options.n > MAX_CHOICES:
        raise InvalidRequest(f"{len(prompts)} prompts x n={options.n} is "
                             f"{len(prompts) * options.n} choices, over the limit of "
                             f"{MAX_CHOICES}: send fewer prompts or a smaller n", "n")
    return CompletionRequest(options, prompts)


def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    _refuse(body, tools=None, functions=None)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise InvalidRequest("response_format other than {'type': 'text'} is not supported",
                             "response_format")
    want = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise InvalidRequest("top_logprobs needs logprobs=true", "top_logprobs")
    max_completion = _int(body, "max_completion_tokens", 1, None)
    options = _options(body, logprobs=(top or 0) if want else None,
                       max_tokens=max_completion)
    return ChatRequest(options, _messages(body.get("messages")))


# ---- from a parsed request to the engine's parameters -----------------------------------------


def resolve_max_tokens(options: Options, prompt_len: int, max_model_len: int, *,
                       default: int | None, prompt_param: str = "prompt") -> int:
    """How many tokens to generate: the request's max_tokens, or `default` (None: all the
    context left), checked against the context limit."""
    if prompt_len == 0:
        raise InvalidRequest("the prompt is empty: give at least one token", prompt_param)
    if prompt_len > max_model_len:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens, over the model's context limit of "
            f"{max_model_len} tokens (max_model_len): shorten it", prompt_param,
            code="context_length_exceeded")
    room = max(1, max_model_len - prompt_len)
    if options.max_tokens is None:
        return room if default is None else min(default, room)
    if options.max_tokens > room:
        raise InvalidRequest(
            f"max_tokens={options.max_tokens} is too large: the prompt has {prompt_len} "
            f"tokens and the context limit (max_model_len) is {max_model_len}, so at most "
            f"{room} tokens can be generated", "max_tokens", code="context_length_exceeded")
    return options.max_tokens


def engine_sampling(options: Options, max_tokens: int, sample_index: int) -> SamplingParams:
    """The SamplingParams of one choice (its `Submit.sampling`, for its whole generation),
    validated here, at the edge: a problem is an InvalidRequest naming the parameter."""
    seed = options.seed + sample_index if options.seed is not None else None
    try:
        return SamplingParams(**options.sampling_args, max_tokens=max_tokens,
                              logprobs=options.logprobs, seed=seed)
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


def _options(body: dict[str, Any], *, logprobs: int | None,
             max_tokens: int | None = None) -> Options:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required: the served model's name (GET /v1/models)",
                             "model")
    _refuse(body, presence_penalty=0, frequency_penalty=0, logit_bias=None)
    n = _int(body, "n", 1, MAX_N)
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise InvalidRequest("stream_options must be an object", "stream_options")
        include_usage = _bool(stream_options, "include_usage", False, "stream_options.")
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, None)
    seed = _int(body, "seed", 0, MAX_SEED)
    n_value = n or 1
    if seed is not None and seed + n_value - 1 > MAX_SEED:
        raise InvalidRequest(f"seed={seed} is too large for n={n_value}: choice i uses "
                             f"seed + i, which must stay <= {MAX_SEED}", "seed")
    sampling: dict[str, Any] = {}  # Options.sampling_args
    temperature = _number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        sampling["temperature"] = temperature
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    if top_p is not None:
        sampling["top_p"] = top_p
    top_k = _int(body, "top_k", -1, None)
    if top_k is not None:
        sampling["top_k"] = top_k
    min_tokens = _int(body, "min_tokens", 0, None)
    if min_tokens is not None:
        sampling["min_tokens"] = min_tokens
    stop = _stop(body.get("stop"))
    if stop:
        sampling["stop"] = stop
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) \
                or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in stop_ids):
            raise InvalidRequest("stop_token_ids must be a list of token ids in "
                                 f"[0, {MAX_TOKEN_ID}]", "stop_token_ids")
        sampling["stop_token_ids"] = list(stop_ids)
    for flag in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        value = _bool(body, flag, None)
        if value is not None:
            sampling[flag] = value
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt
                                   or len(cache_salt) > MAX_CACHE_SALT_CHARS):
        raise InvalidRequest(f"cache_salt must be a string of 1..{MAX_CACHE_SALT_CHARS} "
                             "characters", "cache_salt")
    return Options(model=model, n=n_value, stream=stream, include_usage=include_usage,
                   max_tokens=max_tokens, seed=seed, logprobs=logprobs,
                   cache_salt=cache_salt, sampling_args=sampling,
                   return_token_ids=bool(_bool(body, "return_token_ids", False)))


def _prompts(prompt: Any) -> list[str | list[int]]:
    hint = "a string, a list of token ids, or a list of those (a batch)"
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest(f"prompt is required: {hint}", "prompt")
    if all(_is_int(t) for t in prompt):
        return [_token_ids(prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequest(f"a batch of {len(prompt)} prompts is over the limit of "
                             f"{MAX_PROMPTS}: split it", "prompt")
    out: list[str | list[int]] = []
    for item in prompt:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            out.append(_token_ids(item))
        else:
            raise InvalidRequest(f"prompt must be {hint}; got a list holding "
                                 f"{type(item).__name__}", "prompt")
    return out


def _token_ids(ids: list[int]) -> list[int]:
    bad = next((t for t in ids if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise InvalidRequest(f"prompt token id {_show(bad)} is outside [0, {MAX_TOKEN_ID}] "
                             "(and must be inside the model's vocabulary)", "prompt")
    return list(ids)


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
            raise InvalidRequest(f"{where}.role={_show(role)} is not one of "
                                 f"{', '.join(CHAT_ROLES)}", f"{where}.role")
        message = {"role": role, "content": _content(m.get("content"), role, where)}
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
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
                                     f"{_show(kind)}", f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequest(f"{where}.content must be a string or a list of text parts",
                         f"{where}.content")


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidRequest("stop must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop has {len(items)} strings, over the limit of "
                             f"{MAX_STOP_STRINGS}", "stop")
    for s in items:
        if not s or len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"stop string {_show(s)} must have 1..{MAX_STOP_STRING_CHARS} "
                                 "characters", "stop")
    return items


# ---- typed field readers ---------------------------------------------------------------------

_reprs = reprlib.Repr()
_reprs.maxstring = _reprs.maxother = 80
_reprs.maxlong = 40


def _show(value: Any) -> str:
    """A value as an error message quotes it: repr, shortened (a body may be megabytes)."""
    return _reprs.repr(value)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict[str, Any], name: str, low: int, high: int | None,
         prefix: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value) or value < low or (high is not None and value > high):
        limit = f"between {low} and {high}" if high is not None else f">= {low}"
        raise InvalidRequest(f"{prefix}{name}={_show(value)} is invalid: it must be an integer "
                             f"{limit}", prefix + name)
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float, *,
            low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool) \
        and (low < value if low_open else low <= value) and value <= high
    if not ok:
        lo = "(" if low_open else "["
        raise InvalidRequest(f"{name}={_show(value)} is invalid: it must be a number in "
                             f"{lo}{low:g}, {high:g}]", name)
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool | None,
          prefix: str = "") -> bool | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{prefix}{name}={_show(value)} must be true or false", prefix + name)
    return value


def _refuse(body: dict[str, Any], **neutral: Any) -> None:
    """Refuse unsupported parameters unless absent or at their neutral value."""
    for name, ok in neutral.items():
        value = body.get(name)
        if value is None or value == ok or (name in ("logit_bias", "tools", "functions")
                                            and not value):
            continue
        if name == "best_of" and value == body.get("n", 1):
            continue
        raise InvalidRequest(f"{name}={_show(value)} is not supported by this server", name)
