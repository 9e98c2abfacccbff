"""The one table of the router's request parameters: each declared once, here.

Every parameter of the OpenAI completions and chat-completions bodies, of vLLM's
extensions to them, and of vLLM's /tokenize and /detokenize, is one `Param`: its name,
the endpoints that take it, its JSON type, its bounds, its status, and the
`SamplingParams` field it sets. Its status is one of

* implemented: read by the parsers (`api_params`, `tokenize_params`);
* informational: accepted with no effect on the output, by its definition (`user`,
  `metadata`, a client's own request id);
* refused: a 400 naming it unless absent or at one of its neutral values, which ask
  for nothing (`logit_bias={}`).

A name the table does not know for an endpoint is refused as unrecognized, as OpenAI
does: nothing is silently ignored. What the router derives from the table: which names a
body may hold and which are refused (`api_params`), each integer's range (`INT_PARAMS`,
checked before a value reaches SamplingParams or the engine's msgpack wire, which
encodes nothing past 2**64 - 1), the sampling fields copied as sent, and the OpenAPI
description (`openapi_schema`). Token ids lie in [0, MAX_TOKEN_ID] here; the vocabulary
bound is the engine's (only it knows the model).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

from tandem_engine.router.admission import MAX_PRIORITY
from tandem_engine.router.request_errors import InvalidRequest, show
from tandem_engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from tandem_engine.structured_outputs import MAX_GRAMMAR_CHARS

MAX_N = 16  # samples per prompt
MAX_PROMPTS = 32  # prompts per completions batch
MAX_CHOICES = 64  # prompts x n
MAX_SEED = 2**63 - 1
MAX_CACHE_SALT_CHARS = 256
MAX_MESSAGE_FIELD_CHARS = 256  # a message's name or tool_call_id
# No context is longer than this (and it fits every integer field of the wire); the
# model's own limit is checked once the prompt is tokenized (`resolve_max_tokens`).
MAX_TOKEN_COUNT = 2**31 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# What a chat message may hold (`audio` and the like are refused).
MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id", "tool_calls")


@dataclass(frozen=True)
class IntRange:
    """The integers one parameter takes, both ends included, and what the range means.

    JSON integers have no size, and Python's neither: without a bound a 2**64 reaches
    the engine's msgpack encoder (a 500) and 10**30 an error message. A float with an
    integral value inside the range (`2.0`, `-0.0`) counts as that integer, as vLLM's
    pydantic models read it. A list parameter's range is each element's."""

    low: int
    high: int
    hint: str = ""  # what the bound is, said after the range in the error

    def check(self, name: str, value: Any) -> int:
        """`value` as an int, or an InvalidRequest naming `name` and the range."""
        number = self._integral(value)
        if number is None:
            raise InvalidRequest(f"{name}={show(value)} is invalid: it must be an integer "
                                 f"between {self.low} and {self.high}{self._hint()}", name)
        return number

    def check_each(self, name: str, values: list[Any], at: str = "") -> list[int]:
        """Each element of a list parameter (token ids; `at`: which list of a batch): the
        error names the element."""
        out = []
        for i, value in enumerate(values):
            number = self._integral(value)
            if number is None:
                raise InvalidRequest(f"{name}{at}[{i}]={show(value)} is invalid: each must be "
                                     f"an integer between {self.low} and {self.high}"
                                     f"{self._hint()}", name)
            out.append(number)
        return out

    def _integral(self, value: Any) -> int | None:
        if isinstance(value, float) and value.is_integer() and self.low <= value <= self.high:
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool) \
                and self.low <= value <= self.high:
            return value
        return None

    def _hint(self) -> str:
        return f" ({self.hint})" if self.hint else ""


@dataclass(frozen=True)
class NumberRange:
    """The real numbers one parameter takes: [low, high], or (low, high]."""

    low: float
    high: float
    low_open: bool = False
    # The range is SamplingParams' own check (its message, through `engine_sampling`);
    # the router checks only that the value is a finite number.
    sampling_checks: bool = False

    def check(self, name: str, value: Any) -> float:
        if self.sampling_checks:
            number = finite(value)
            if number is None:
                raise InvalidRequest(f"{name}={show(value)} is invalid: it must be a number",
                                     name)
            return number
        ok = isinstance(value, int | float) and not isinstance(value, bool) \
            and (self.low < value if self.low_open else self.low <= value) \
            and value <= self.high
        if not ok:
            lo = "(" if self.low_open else "["
            raise InvalidRequest(f"{name}={show(value)} is invalid: it must be a number in "
                                 f"{lo}{self.low:g}, {self.high:g}]", name)
        return float(value)


def finite(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else (NaN, Infinity, an integer
    too large for a float, a string, a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # 10**400: an int no float holds
        return None
    return number if math.isfinite(number) else None


@dataclass(frozen=True)
class Length:
    """A string's characters, both ends included (each string's, for a list of them), and
    how many strings a list holds."""

    low: int
    high: int
    max_items: int | None = None


@dataclass(frozen=True)
class Choice:
    """The only values a parameter takes (besides null, which is its absence)."""

    values: tuple[Any, ...]


Bound = IntRange | NumberRange | Length | Choice


class Status(enum.Enum):
    IMPLEMENTED = "implemented"
    INFORMATIONAL = "informational"
    REFUSED = "refused"


# The endpoints, by the body they read (/tokenize takes a prompt or a chat).
COMPLETIONS = "completions"
CHAT = "chat"
TOKENIZE = "tokenize"
TOKENIZE_CHAT = "tokenize_chat"
DETOKENIZE = "detokenize"
ENDPOINTS = (COMPLETIONS, CHAT, TOKENIZE, TOKENIZE_CHAT, DETOKENIZE)
GENERATION = (COMPLETIONS, CHAT)

# A parameter's JSON type, with the bound each takes: a JSON Schema type, or one of the
# shapes the parsers read (a stop string or a list of them, token ids, a completions
# prompt, a chat's messages, `json`: any JSON value whose shape its parser checks, such
# as a schema given as an object or as its text); `any` is an informational or refused
# parameter's.
TYPES: dict[str, tuple[type, ...]] = {
    "string": (Length,), "integer": (IntRange,), "number": (NumberRange,),
    "boolean": (Choice,), "object": (), "stop": (Length,), "token_ids": (IntRange,),
    "prompt": (IntRange,), "messages": (), "json": (), "any": ()}
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(frozen=True)
class Param:
    """One request parameter of one or more endpoints."""

    name: str
    type: str  # one of TYPES
    endpoints: tuple[str, ...] = GENERATION
    status: Status = Status.IMPLEMENTED
    bound: Bound | None = None
    # The SamplingParams field the value sets, as sent (through Options.sampling_args)
    # unless `mapping` says how the parser derives the field from it.
    sampling: str | None = None
    mapping: str = ""
    required: bool = False
    neutral: tuple[Any, ...] = ()  # refused: the values that ask for nothing
    members: tuple[Param, ...] = ()  # an object's own fields
    doc: str = ""  # what it is, for the OpenAPI description

    def __post_init__(self) -> None:
        where = f"parameter {self.name!r}"
        if self.type not in TYPES:
            raise ValueError(f"{where}: unknown type {self.type!r}")
        if self.bound is not None and not isinstance(self.bound, TYPES[self.type]):
            raise ValueError(f"{where}: a {self.type} takes no {type(self.bound).__name__}")
        if (self.status is Status.IMPLEMENTED) == (self.type == "any"):
            raise ValueError(f"{where}: only an informational or refused parameter is `any`")
        if self.neutral and self.status is not Status.REFUSED:
            raise ValueError(f"{where}: only a refused parameter has neutral values")
        if self.sampling is not None and self.sampling not in _SAMPLING_FIELDS:
            raise ValueError(f"{where}: SamplingParams has no field {self.sampling!r}")
        if self.mapping and self.sampling is None:
            raise ValueError(f"{where}: a mapping needs the SamplingParams field it sets")
        if not set(self.endpoints) <= set(ENDPOINTS):
            raise ValueError(f"{where}: unknown endpoint in {self.endpoints}")

    @property
    def sampled_as_sent(self) -> bool:
        """Whether the value goes into its SamplingParams field as sent."""
        return self.sampling is not None and not self.mapping


def _refused(name: str, *neutral: Any) -> Param:
    return Param(name, "any", status=Status.REFUSED, neutral=neutral)


def _informational(name: str, doc: str) -> Param:
    return Param(name, "any", status=Status.INFORMATIONAL, doc=doc)


_TOKEN_COUNT = "the model's context limit (max_model_len) bounds it further"
TOKEN_ID = IntRange(0, MAX_TOKEN_ID, "a token id, also checked against the model's "
                    "vocabulary")
_OFF = Choice((False,))
_MAX_TOKENS = IntRange(1, MAX_TOKEN_COUNT, _TOKEN_COUNT)
_ALTERNATIVES = IntRange(0, MAX_LOGPROBS, "alternatives per token")
_TOKENIZE = (TOKENIZE, TOKENIZE_CHAT)

# In the order the parsers read them (an error names the first bad one). `logprobs` is an
# integer in completions, a boolean in chat.
PARAMS: tuple[Param, ...] = (
    # ---- implemented: what completions and chat share
    Param("model", "string", required=True, doc="the served model's name (GET /v1/models)"),
    Param("n", "integer", bound=IntRange(1, MAX_N, "samples per prompt"),
          doc="samples per prompt"),
    Param("stream", "boolean", doc="answer as server-sent events"),
    Param("stream_options", "object", members=(Param("include_usage", "boolean"),),
          doc="include_usage: a last chunk with the usage"),
    Param("prompt_logprobs", "integer",
          bound=IntRange(0, MAX_LOGPROBS, "alternatives per prompt token"),
          sampling="prompt_logprobs", mapping="the larger of it and logprobs with echo",
          doc="vLLM's: each prompt token's logprob and this many alternatives; not with "
              "stream"),
    Param("max_tokens", "integer", bound=_MAX_TOKENS, sampling="max_tokens",
          mapping="absent: 16 in completions, the context left in chat; prompt tokens + "
                  "max_tokens must fit in max_model_len",
          doc="tokens to generate at most"),
    Param("seed", "integer", bound=IntRange(0, MAX_SEED, "choice i of n uses seed + i"),
          sampling="seed", mapping="seed + i for choice i", doc="reproducible sampling"),
    Param("temperature", "number", bound=NumberRange(0.0, 2.0), sampling="temperature"),
    Param("top_p", "number", bound=NumberRange(0.0, 1.0, low_open=True), sampling="top_p"),
    Param("top_k", "integer", bound=IntRange(
        -1, MAX_TOKEN_COUNT, "-1 or 0: off; past the vocabulary it is off too"),
        sampling="top_k", doc="vLLM's; -1 or 0: off"),
    Param("min_p", "number", bound=NumberRange(0.0, 1.0, sampling_checks=True),
          sampling="min_p", doc="vLLM's; 0: off"),
    Param("repetition_penalty", "number", bound=NumberRange(
        MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, sampling_checks=True),
        sampling="repetition_penalty", doc="vLLM's; 1: off"),
    Param("presence_penalty", "number",
          bound=NumberRange(-MAX_PENALTY, MAX_PENALTY, sampling_checks=True),
          sampling="presence_penalty", doc="0: off"),
    Param("frequency_penalty", "number",
          bound=NumberRange(-MAX_PENALTY, MAX_PENALTY, sampling_checks=True),
          sampling="frequency_penalty", doc="0: off"),
    Param("min_tokens", "integer", bound=IntRange(0, MAX_TOKEN_COUNT, "and at most max_tokens"),
          sampling="min_tokens", doc="vLLM's: tokens before a stop may end the choice"),
    Param("stop", "stop", bound=Length(1, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS),
          sampling="stop", doc="a string or a list of strings that end the choice"),
    Param("stop_token_ids", "token_ids", bound=TOKEN_ID, sampling="stop_token_ids",
          doc="vLLM's: token ids that end the choice"),
    Param("ignore_eos", "boolean", sampling="ignore_eos", doc="vLLM's"),
    Param("skip_special_tokens", "boolean", sampling="skip_special_tokens", doc="vLLM's"),
    Param("include_stop_str_in_output", "boolean", sampling="include_stop_str_in_output",
          doc="vLLM's"),
    Param("cache_salt", "string", bound=Length(1, MAX_CACHE_SALT_CHARS),
          doc="vLLM's: isolates this request's prefix cache"),
    Param("return_token_ids", "boolean", doc="vLLM's: each choice's generated token ids"),
    # ---- implemented: completions
    Param("prompt", "prompt", (COMPLETIONS,), bound=TOKEN_ID, required=True,
          doc="a string, a list of token ids, or a list of those (a batch)"),
    Param("logprobs", "integer", (COMPLETIONS,), bound=_ALTERNATIVES, sampling="logprobs",
          mapping="as sent, through Options.logprobs", doc="alternatives per token"),
    Param("echo", "boolean", (COMPLETIONS,), doc="the prompt before the text"),
    Param("add_special_tokens", "boolean", (COMPLETIONS,),
          doc="vLLM's: a text prompt's BOS, as the tokenizer adds it"),
    # ---- implemented: chat
    Param("messages", "messages", (CHAT,), required=True),
    Param("logprobs", "boolean", (CHAT,), sampling="logprobs",
          mapping="top_logprobs (0 without it) when true"),
    Param("top_logprobs", "integer", (CHAT,), bound=_ALTERNATIVES,
          doc="alternatives per token, with logprobs"),
    Param("max_completion_tokens", "integer", (CHAT,), bound=_MAX_TOKENS,
          sampling="max_tokens", mapping="max_tokens' newer name: wins over it",
          doc="tokens to generate at most"),
    Param("echo", "boolean", (CHAT,), bound=_OFF, doc="vLLM's chat echo: not here"),
    Param("add_special_tokens", "boolean", (CHAT,), bound=_OFF,
          doc="the chat template writes the special tokens"),
    Param("add_generation_prompt", "boolean", (CHAT,), doc="vLLM's; default true"),
    Param("continue_final_message", "boolean", (CHAT,),
          doc="vLLM's: go on with the last (assistant) message"),
    Param("chat_template_kwargs", "object", (CHAT,), doc="vLLM's: template variables"),
    Param("tools", "json", (CHAT,), doc="functions the model may call: [{type: function, "
          "function: {name, description, parameters}}]"),
    Param("tool_choice", "json", (CHAT,), doc="none, auto (the default with tools), "
          "required, or {type: function, function: {name}}"),
    Param("parallel_tool_calls", "boolean", (CHAT,), doc="more than one call per turn "
          "(default true)"),
    # ---- implemented: structured outputs (at most one of them per request)
    Param("response_format", "json", doc="OpenAI's: {type: text | json_object | "
          "json_schema, json_schema: {name, schema, strict}}"),
    Param("structured_outputs", "json", sampling="structured_outputs",
          mapping="from whichever of response_format, structured_outputs, guided_json, "
                  "guided_regex, guided_choice, guided_grammar, structural_tag and tools "
                  "(a call's grammar) the request gives",
          doc="vLLM's: {json | json_object | regex | choice | grammar | structural_tag, "
              "whitespace_pattern}"),
    Param("guided_json", "json", doc="vLLM's (older): a JSON schema, as an object or text"),
    Param("guided_regex", "string", bound=Length(1, MAX_GRAMMAR_CHARS),
          doc="vLLM's (older): a regular expression the output matches"),
    Param("guided_choice", "json", doc="vLLM's (older): the output is one of these strings"),
    Param("guided_grammar", "string", bound=Length(1, MAX_GRAMMAR_CHARS),
          doc="vLLM's (older): a Lark or GBNF grammar"),
    Param("structural_tag", "json", doc="vLLM's: structures (begin, schema, end) started by "
          "trigger strings within free text"),
    Param("guided_whitespace_pattern", "string", bound=Length(1, MAX_GRAMMAR_CHARS),
          doc="vLLM's: the whitespace JSON output may hold between tokens (a regex)"),
    Param("guided_decoding_backend", "string", bound=Length(1, 64),
          doc="vLLM's: auto or llguidance (the only backend here)"),
    # ---- informational: no effect on the output, by their definition
    _informational("user", "an end-user id"),
    _informational("metadata", "the client's own tags"),
    _informational("safety_identifier", "an end-user id"),
    Param("priority", "integer", bound=IntRange(-MAX_PRIORITY, MAX_PRIORITY, "lower first"),
          doc="vLLM's: the engines schedule lower values first, preempting running "
          "requests of a higher value by recompute; default 0"),
    Param("prompt_cache_key", "string", bound=Length(1, MAX_CACHE_SALT_CHARS),
          doc="OpenAI's cache-routing hint: requests with one key prefer the engine that "
          "served the key last (weighed against its load, as a cached prompt is)"),
    _informational("prompt_cache_retention", "a cache-routing hint"),
    _informational("request_id", "the client's own request id"),
    # ---- refused unless absent or neutral: OpenAI's
    _refused("logit_bias", {}), _refused("best_of"), _refused("suffix", ""),
    _refused("functions", []), _refused("function_call", "none"), _refused("audio"),
    _refused("modalities", ["text"]),
    _refused("prediction"), _refused("reasoning_effort"), _refused("verbosity"),
    _refused("web_search_options"), _refused("store", False),
    _refused("service_tier", "auto", "default"),
    # ---- refused unless absent or neutral: vLLM's
    _refused("use_beam_search", False), _refused("length_penalty", 1, 1.0),
    _refused("spaces_between_special_tokens", True), _refused("truncate_prompt_tokens"),
    _refused("allowed_token_ids"), _refused("bad_words", []), _refused("logits_processors"),
    _refused("return_tokens_as_token_ids", False), _refused("kv_transfer_params"),
    _refused("vllm_xargs"), _refused("prompt_embeds"), _refused("documents"),
    _refused("chat_template"), _refused("mm_processor_kwargs"), _refused("media_io_kwargs"),
    _refused("thinking_token_budget"), _refused("include_reasoning"),
    _refused("prompt_embeds_list"),
    # ---- vLLM's /tokenize (a prompt or a chat) and /detokenize: every field implemented
    Param("model", "string", (*_TOKENIZE, DETOKENIZE), doc="the served model's name"),
    Param("prompt", "string", (TOKENIZE,), required=True),
    Param("add_special_tokens", "boolean", (TOKENIZE,), doc="default true"),
    Param("messages", "messages", (TOKENIZE_CHAT,), required=True,
          doc="rendered as /v1/chat/completions renders them"),
    Param("add_generation_prompt", "boolean", (TOKENIZE_CHAT,), doc="default true"),
    Param("add_special_tokens", "boolean", (TOKENIZE_CHAT,), bound=_OFF,
          doc="the chat template writes the special tokens"),
    Param("continue_final_message", "boolean", (TOKENIZE_CHAT,), bound=_OFF),
    Param("return_token_strs", "boolean", _TOKENIZE, doc="each token's string too"),
    Param("tokens", "token_ids", (DETOKENIZE,), bound=TOKEN_ID, required=True),
)


def params(endpoint: str, *statuses: Status) -> tuple[Param, ...]:
    """The endpoint's parameters (of the given statuses: all when none is given)."""
    return tuple(p for p in PARAMS if endpoint in p.endpoints
                 and (not statuses or p.status in statuses))


def names(endpoint: str, *statuses: Status) -> frozenset[str]:
    return frozenset(p.name for p in params(endpoint, *statuses))


def _check_table() -> None:
    for endpoint in ENDPOINTS:
        seen = [p.name for p in params(endpoint)]
        twice = {name for name in seen if seen.count(name) > 1}
        if twice:
            raise ValueError(f"the {endpoint} endpoint declares {sorted(twice)} twice")
    integers = [p.name for p in PARAMS if isinstance(p.bound, IntRange)]
    if len(integers) != len(set(integers)):  # INT_PARAMS has one range per name
        raise ValueError(f"integer parameters with two ranges: {sorted(integers)}")


_check_table()

# Views of the table, each for the code that reads it.
KNOWN: dict[str, frozenset[str]] = {e: names(e) for e in ENDPOINTS}  # the rest: refused
COMPLETION_PARAMS = names(COMPLETIONS, Status.IMPLEMENTED)
CHAT_PARAMS = names(CHAT, Status.IMPLEMENTED)
INFORMATIONAL_PARAMS = frozenset(p.name for p in PARAMS if p.status is Status.INFORMATIONAL)
REFUSED: dict[str, tuple[Any, ...]] = {
    p.name: p.neutral for p in PARAMS if p.status is Status.REFUSED}
# Every integer a request can carry, by parameter, in every endpoint: a list
# parameter's range is each element's (a token-id prompt's, or each of a batch's).
INT_PARAMS: dict[str, IntRange] = {
    p.name: p.bound for p in PARAMS if isinstance(p.bound, IntRange)}
# What completions and chat copy as sent into SamplingParams, in the order read.
SAMPLED_AS_SENT: tuple[Param, ...] = tuple(
    p for p in PARAMS if p.sampled_as_sent and p.endpoints == GENERATION)


def entry(endpoint: str, name: str) -> Param:
    """The entry of `name` in `endpoint`."""
    for p in params(endpoint):
        if p.name == name:
            return p
    raise KeyError(f"{endpoint} has no parameter {name!r}")
