"""The OpenAI response shapes: completions, chat completions, stream chunks, logprobs,
usage and errors.

Builders of JSON-ready dicts with no I/O, so every shape is tested without a server;
`Renderer` turns one request's choice deltas into its endpoint's chunks or final body.
Token strings in logprobs are each token decoded on its own (special tokens included);
a logprob of -inf, which JSON cannot carry, is reported as -9999.0.

Prompt logprobs have vLLM's shape (`prompt_logprobs`: None for the first prompt token,
then token id -> {logprob, rank, decoded_token} for the token itself and the top
alternatives), on each completions choice and on the chat response. `echo` prepends
the prompt to a completions choice's text and, with `logprobs`, the prompt tokens'
entries (the first one's logprob null) to its logprobs, as OpenAI does.
`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens an engine found in
its prefix cache (for each prompt, the most any of its choices found).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem_engine import protocol as p
from tandem_engine.router.api_params import Options
from tandem_engine.router.attempts import Delta
from tandem_engine.router.tools import (
    ToolCallStream,
    ToolRequest,
    merge_deltas,
    parse_tool_calls,
)
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


def _ranked(lp: p.TokenLogprobs, token_id: int, top: int) -> list[tuple[int, float, int]]:
    """A prompt token's entries as (token id, logprob, rank): the top `top` alternatives
    and the token itself, whatever its rank. `lp.top` is sorted by rank, so an entry's
    rank is its position, except the token's own when it lies beyond the top."""
    out = []
    for k, (tid, value) in enumerate(lp.top):
        rank = lp.rank if tid == token_id and lp.rank is not None else k + 1
        if rank <= top or tid == token_id:
            out.append((tid, value, rank))
    if all(tid != token_id for tid, _, _ in out):
        out.append((token_id, lp.logprob, lp.rank or len(lp.top) + 1))
    return out


def prompt_logprobs(token_ids: Sequence[int], logprobs: Sequence[p.TokenLogprobs],
                    strings: TokenStrings, top: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then for each next one its
    entry and the top `top` alternatives, keyed by token id."""
    out: list[dict[str, Any] | None] = [None]
    for tid, lp in zip(token_ids[1:], logprobs, strict=True):
        out.append({str(t): {"logprob": _lp(v), "rank": rank, "decoded_token": strings.text(t)}
                    for t, v, rank in _ranked(lp, tid, top)})
    return out


def echo_logprobs(token_ids: Sequence[int], logprobs: Sequence[p.TokenLogprobs] | None,
                  strings: TokenStrings, top: int) -> dict[str, Any]:
    """The completions `logprobs` of an echoed prompt: the first token has none (null),
    the others their teacher-forced logprob and top alternatives."""
    tokens = [strings.text(t) for t in token_ids]
    token_lps: list[float | None] = [None] * len(token_ids)
    tops: list[dict[str, float] | None] = [None] * len(token_ids)
    if logprobs is not None:
        for k, (tid, lp) in enumerate(zip(token_ids[1:], logprobs, strict=True), start=1):
            token_lps[k] = _lp(lp.logprob)
            tops[k] = {strings.text(t): _lp(v) for t, v, rank in _ranked(lp, tid, top)
                       if rank <= top}
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(reason: str | None) -> str | None:
    # The engine's "abort" never reaches a client that is still listening.
    return reason if reason in (None, "stop", "length") else "stop"


def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None,
                      reason: str | None, stop_reason: str | int | None = None
                      ) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason(reason), "stop_reason": stop_reason}


def chat_choice(index: int, content: str | None, logprobs: list[dict[str, Any]] | None,
                reason: str | None, stop_reason: str | int | None = None,
                tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message,
            "logprobs": {"content": logprobs} if logprobs is not None else None,
            "finish_reason": chat_finish_reason(reason, bool(tool_calls)),
            "stop_reason": stop_reason}


def chat_finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for a choice that ended after its calls."""
    return "tool_calls" if made_calls and reason == "stop" else finish_reason(reason)


def completion_response(request_id: str, created: int, model: str,
                        choices: list[dict[str, Any]], usage_: dict[str, Any]
                        ) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage_}


def chat_response(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
                  usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


# ---- stream chunks ----------------------------------------------------------------------------


def completion_chunk(request_id: str, created: int, model: str,
                     choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    chunk = {"id": request_id, "object": "text_completion", "created": created,
             "model": model, "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_chunk(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
               usage_: dict[str, Any] | None = None) -> dict[str, Any]:
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


MAX_ERROR_MESSAGE_CHARS = 4096
MAX_ERROR_PARAM_CHARS = 256


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """The OpenAI error object. It must always encode: message and param can quote the
    request (a key, a value, an exception's text), so they are cut to a readable length
    and any character UTF-8 cannot carry (a lone surrogate) is written as its escape;
    an error body that failed to encode would turn the answer into a 500."""
    return {"error": {"message": _error_text(message, MAX_ERROR_MESSAGE_CHARS),
                      "type": type,
                      "param": None if param is None else _error_text(param,
                                                                      MAX_ERROR_PARAM_CHARS),
                      "code": code}}


def _error_text(text: str, limit: int) -> str:
    text = str(text)
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


# ---- one request's choices ----------------------------------------------------------------------


@dataclass(frozen=True)
class ChoicePrompt:
    """The prompt behind one choice: its ids, and the text `echo` shows."""

    token_ids: list[int]
    text: str = ""


@dataclass
class ChoiceResult:
    """A choice's output accumulated for a non-streamed response."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Delta] = field(default_factory=list)  # the deltas that carry logprobs
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[p.TokenLogprobs] | None = None


class Renderer:
    """Turns one request's deltas into its endpoint's chunks and final body (`kind`:
    cmpl for completions, chatcmpl for chat completions). `prompts` holds each choice's
    prompt (choice i is prompt i // n's)."""

    def __init__(self, kind: str, request_id: str, model: str, options: Options,
                 num_choices: int, strings: TokenStrings,
                 prompts: Sequence[ChoicePrompt] = (), *, tools: ToolRequest | None = None
                 ) -> None:
        self.chat = kind == "chatcmpl"
        self.request_id = request_id
        self.model = model
        self.options = options
        self.created = int(time.time())
        self.strings = strings
        self.num_choices = num_choices
        self.prompts = list(prompts) or [ChoicePrompt([])] * num_choices
        self.echo = options.echo and not self.chat
        # Completions logprobs text_offset: generated text starts after an echoed prompt.
        self._text_offsets = [len(c.text) if self.echo else 0 for c in self.prompts]
        self._tokens = [0] * num_choices
        self._cached = [0] * num_choices  # prompt tokens found in a prefix cache
        self._echoed = [False] * num_choices  # streaming: the prompt went out
        # Chat with tools: each choice's text is parsed for calls (streaming: as it comes).
        self.tools = tools if self.chat and tools is not None and tools.active else None
        self._tool_streams = [ToolCallStream() for _ in range(num_choices)] \
            if self.tools is not None else None

    def _logprobs(self, index: int, delta: Delta) -> Any:
        if self.options.logprobs is None or delta.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(delta.token_ids, delta.logprobs, self.strings)
        lp = completion_logprobs(delta.token_ids, delta.logprobs, self.strings,
                                 self._text_offsets[index])
        self._text_offsets[index] += sum(len(s) for s in lp["tokens"])
        return lp

    def _echo_logprobs(self, index: int, prompt_lps: list[p.TokenLogprobs] | None
                       ) -> dict[str, Any] | None:
        if self.options.logprobs is None:
            return None
        return echo_logprobs(self.prompts[index].token_ids, prompt_lps, self.strings,
                             self.options.logprobs)

    def _prompt_logprobs(self, index: int, prompt_lps: list[p.TokenLogprobs] | None
                         ) -> list[dict[str, Any] | None] | None:
        if self.options.prompt_logprobs is None or prompt_lps is None:
            return None
        return prompt_logprobs(self.prompts[index].token_ids, prompt_lps, self.strings,
                               self.options.prompt_logprobs)

    def _note(self, index: int, delta: Delta) -> None:
        self._tokens[index] += len(delta.token_ids)
        self._cached[index] = max(self._cached[index], delta.num_cached_tokens)

    def _usage(self, prompt_tokens: int) -> dict[str, Any]:
        per_prompt: dict[int, int] = {}
        for index, cached in enumerate(self._cached):
            prompt = index // self.options.n
            per_prompt[prompt] = max(per_prompt.get(prompt, 0), cached)
        return usage(prompt_tokens, sum(self._tokens), sum(per_prompt.values()))

    def accumulate(self, result: ChoiceResult, delta: Delta, index: int) -> None:
        self._note(index, delta)
        result.text.append(delta.text)
        result.token_ids += delta.token_ids
        if delta.logprobs is not None and self.options.logprobs is not None:
            result.logprobs.append(delta)
        if delta.prompt_logprobs is not None and result.prompt_logprobs is None:
            result.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            result.finish_reason, result.stop_reason = delta.finish_reason, delta.stop_reason

    def response(self, results: list[ChoiceResult], prompt_tokens: int) -> dict[str, Any]:
        choices = []
        for i, r in enumerate(results):
            text = "".join(r.text)
            want = self.options.logprobs is not None
            if self.chat:
                entries = [e for d in r.logprobs for e in self._logprobs(i, d)] if want \
                    else None
                content, calls = parse_tool_calls(text) if self.tools is not None \
                    else (text, [])
                choice = chat_choice(i, content, entries, r.finish_reason, r.stop_reason,
                                     calls)
            else:
                parts = [self._logprobs(i, d) for d in r.logprobs]
                if self.echo:
                    text = self.prompts[i].text + text
                    parts.insert(0, self._echo_logprobs(i, r.prompt_logprobs))
                lp = merge_completion_logprobs(parts) if want else None
                choice = completion_choice(i, text, lp, r.finish_reason, r.stop_reason)
                if self.options.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(i, r.prompt_logprobs)
            if self.options.return_token_ids:
                choice["token_ids"] = r.token_ids
            choices.append(choice)
        build = chat_response if self.chat else completion_response
        body = build(self.request_id, self.created, self.model, choices,
                     self._usage(prompt_tokens))
        if self.chat and self.options.prompt_logprobs is not None:  # vLLM: on the response
            body["prompt_logprobs"] = self._prompt_logprobs(0, results[0].prompt_logprobs)
        return body

    def opening_chunks(self) -> list[dict[str, Any]]:
        if not self.chat:
            return []
        return [chat_chunk(self.request_id, self.created, self.model, [
            chat_chunk_choice(i, {"role": "assistant", "content": ""})])
            for i in range(self.num_choices)]

    def chunk(self, index: int, delta: Delta) -> dict[str, Any] | None:
        self._note(index, delta)
        echo = self.echo and not self._echoed[index]
        self._echoed[index] = True
        logprobs = self._logprobs(index, delta) if delta.token_ids else None
        text = delta.text
        if echo:  # the prompt opens the choice's first chunk
            text = self.prompts[index].text + text
            echoed = self._echo_logprobs(index, delta.prompt_logprobs)
            if echoed is not None:
                logprobs = merge_completion_logprobs([echoed, *([logprobs] if logprobs
                                                                 else [])])
        want_ids = self.options.return_token_ids and delta.token_ids
        message: dict[str, Any] = {"content": text} if text else {}
        if self._tool_streams is not None:  # text held back may turn out to be a call
            stream = self._tool_streams[index]
            message = merge_deltas(stream.push(text)
                                   + (stream.finish() if delta.finished else []))
        if not (message or delta.finished or logprobs or want_ids):
            return None
        if self.chat:
            choice = chat_chunk_choice(index, message, logprobs, delta.finish_reason,
                                       delta.stop_reason)
            if self._tool_streams is not None and delta.finished:
                choice["finish_reason"] = chat_finish_reason(
                    delta.finish_reason, self._tool_streams[index].made_calls)
        else:
            choice = completion_choice(index, text, logprobs, delta.finish_reason,
                                       delta.stop_reason)
        if self.options.return_token_ids:
            choice["token_ids"] = delta.token_ids
        build = chat_chunk if self.chat else completion_chunk
        return build(self.request_id, self.created, self.model, [choice])

    def usage_chunk(self, prompt_tokens: int) -> dict[str, Any]:
        build = chat_chunk if self.chat else completion_chunk
        return build(self.request_id, self.created, self.model, [], self._usage(prompt_tokens))
