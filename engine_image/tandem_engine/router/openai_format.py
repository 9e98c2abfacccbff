"""The OpenAI response shapes: completions, chat completions, stream chunks, logprobs,
usage and errors.

Pure builders of JSON-ready dicts, so every shape is tested without a server. Token
strings in logprobs are each token decoded on its own (special tokens included); a
logprob of -inf, which JSON cannot carry, is reported as -9999.0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

from tandem_engine import protocol as p
from tandem_engine.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0


class TokenStrings:
    """Token id -> the text of that token alone, cached."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 65536) -> None:
        self._tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=cache_size)(self._text)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def _lp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


# ---- logprobs ---------------------------------------------------------------------------------


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[p.TokenLogprobs],
                        strings: TokenStrings, text_offset: int) -> dict[str, Any]:
    """The completions `logprobs` object for some tokens; `text_offset` is where the first
    one starts in the choice's text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in zip(token_ids, logprobs, strict=True):
        s = strings.text(tid)
        tokens.append(s)
        token_lps.append(_lp(lp.logprob))
        tops.append({strings.text(t): _lp(v) for t, v in lp.top})
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def merge_completion_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
    for part in parts:
        for key, values in merged.items():
            values.extend(part[key])
    return merged


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[p.TokenLogprobs],
                  strings: TokenStrings) -> list[dict[str, Any]]:
    """Entries of the chat `logprobs.content` list."""

    def entry(tid: int, value: float) -> dict[str, Any]:
        s = strings.text(tid)
        return {"token": s, "logprob": _lp(value), "bytes": list(s.encode("utf-8"))}

    return [{**entry(tid, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for tid, lp in zip(token_ids, logprobs, strict=True)]


# ---- whole responses --------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str | None:
    # The engine's "abort" never reaches a client that is still listening.
    return reason if reason in (None, "stop", "length") else "stop"


def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None,
                      reason: str | None, stop_reason: str | int | None = None
                      ) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason(reason), "stop_reason": stop_reason}


def chat_choice(index: int, content: str, logprobs: list[dict[str, Any]] | None,
                reason: str | None, stop_reason: str | int | None = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": content},
            "logprobs": {"content": logprobs} if logprobs is not None else None,
            "finish_reason": finish_reason(reason), "stop_reason": stop_reason}


def completion_response(request_id: str, created: int, model: str,
                        choices: list[dict[str, Any]], usage_: dict[str, int]
                        ) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage_}


def chat_response(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
                  usage_: dict[str, int]) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


# ---- stream chunks ----------------------------------------------------------------------------


def completion_chunk(request_id: str, created: int, model: str,
                     choices: list[dict[str, Any]], usage_: dict[str, int] | None = None
                     ) -> dict[str, Any]:
    chunk = {"id": request_id, "object": "text_completion", "created": created,
             "model": model, "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_chunk(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
               usage_: dict[str, int] | None = None) -> dict[str, Any]:
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created,
             "model": model, "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_chunk_choice(index: int, delta: dict[str, Any],
                      logprobs: list[dict[str, Any]] | None = None, reason: str | None = None,
                      stop_reason: str | int | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": delta,
                              "logprobs": {"content": logprobs} if logprobs is not None
                              else None,
                              "finish_reason": finish_reason(reason)}
    if reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


# ---- errors -----------------------------------------------------------------------------------


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
