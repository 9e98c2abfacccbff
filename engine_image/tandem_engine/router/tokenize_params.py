"""vLLM's /tokenize and /detokenize request bodies -> validated requests.

The shapes are vLLM's: /tokenize takes {"model"?, "prompt", "add_special_tokens"?} (a
completions prompt) or {"model"?, "messages", "add_generation_prompt"?, ...} (a chat,
rendered with the checkpoint's template exactly as /v1/chat/completions renders it) and
answers {"count", "max_model_len", "tokens"} (plus "token_strs" on request);
/detokenize takes {"model"?, "tokens"} and answers {"prompt"}. Every field is checked
and an unknown one is refused, never ignored; a problem is an `InvalidRequest` (400 in
the OpenAI error shape) naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem_engine.router.api_params import _bool, _child, _object
from tandem_engine.router.param_table import (
    DETOKENIZE,
    INT_PARAMS,
    TOKENIZE,
    TOKENIZE_CHAT,
    names,
)
from tandem_engine.router.request_errors import InvalidRequest, show

# The fields of each body, from the parameter table.
PROMPT_FIELDS = names(TOKENIZE)
CHAT_FIELDS = names(TOKENIZE_CHAT)
DETOKENIZE_FIELDS = names(DETOKENIZE)


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None  # None: the served model
    prompt: str | None  # exactly one of prompt and messages is set
    messages: Any  # the raw messages, validated as /v1/chat/completions validates them
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str | None
    tokens: list[int]


def parse_tokenize(body: Any) -> TokenizeRequest:
    body = _object(body)
    chat = "messages" in body
    if chat and "prompt" in body:
        raise InvalidRequest("give either prompt (text) or messages (a chat), not both",
                             "prompt")
    _refuse_unknown(body, CHAT_FIELDS if chat else PROMPT_FIELDS)
    return_token_strs = bool(_bool(body, "return_token_strs", False))
    if chat:
        # The chat template writes the special tokens it wants (a BOS, say); adding the
        # tokenizer's on top would double them, and the chat endpoint never does.
        if _bool(body, "add_special_tokens", False):
            raise InvalidRequest("add_special_tokens=true is not supported with messages: the "
                                 "chat template already writes its special tokens",
                                 "add_special_tokens")
        if _bool(body, "continue_final_message", False):
            raise InvalidRequest("continue_final_message=true is not supported by this server",
                                 "continue_final_message")
        return TokenizeRequest(_model(body), None, body["messages"], False,
                               bool(_bool(body, "add_generation_prompt", True)),
                               return_token_strs)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequest(f"prompt is required: a string, got {show(prompt)} (or send "
                             "messages, a chat)", "prompt")
    return TokenizeRequest(_model(body), prompt, None,
                           bool(_bool(body, "add_special_tokens", True)), True,
                           return_token_strs)


def parse_detokenize(body: Any, vocab_size: int) -> DetokenizeRequest:
    body = _object(body)
    _refuse_unknown(body, DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise InvalidRequest(f"tokens is required: a list of token ids, got {show(tokens)}",
                             "tokens")
    ids = INT_PARAMS["tokens"].check_each("tokens", tokens)
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise InvalidRequest(f"tokens[{i}]={t} is not a token id of this model: "
                                 f"ids lie in [0, {vocab_size - 1}]", "tokens")
    return DetokenizeRequest(_model(body), ids)


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"model={show(model)} must be a string: the served model's "
                             "name (GET /v1/models)", "model")
    return model


def _refuse_unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(str(k) for k in body if k not in known)
    if unknown:
        raise InvalidRequest(f"unknown field {show(unknown[0])}: this endpoint takes "
                             f"{', '.join(sorted(known))}", _child("", unknown[0]))
