"""The one HTTP client of `tandem bench`: streamed /v1/completions, timed per chunk.

Each request asks for `stream_options.include_usage`, so its token counts (prompt,
completion, and `prompt_tokens_details.cached_tokens` where the server reports prefix
cache hits) are the server's own. Chunk arrival times are taken as each SSE event is
parsed; a chunk with text is a token arrival (Tandem and vLLM send one token per chunk
when streaming; a server that batches tokens into a chunk shows larger gaps).

Every call has a timeout; a failure is recorded on the request (`error`), never raised,
so one bad request does not end a run. Server probes (`probe`) fail fast with an error
that names the URL and the deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

DEFAULT_CONNECT_TIMEOUT_S = 10.0
API_KEY_VARIABLES = ("TANDEM_API_KEY", "OPENAI_API_KEY")


def resolve_api_key(given: str | None) -> str | None:
    """The API key a client sends: `given` (a flag), else $TANDEM_API_KEY, else
    $OPENAI_API_KEY, else none (`tandem bench`, `tandem refit --adapter`)."""
    return given or next((os.environ[v] for v in API_KEY_VARIABLES if os.environ.get(v)),
                         None)


class EndpointError(RuntimeError):
    """The endpoint cannot be benchmarked: the message names the URL and what to check."""


@dataclass
class RequestRecord:
    """One request as the client saw it; times are seconds on the run's clock."""
    index: int
    output_len: int  # max_tokens asked for
    model: str | None = None  # the served name asked for; None: the client's model
    sent_s: float = 0.0
    first_token_s: float | None = None
    done_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None and bool(self.chunk_times)


def normalize_base_url(url: str) -> str:
    """`http://host:port` whether given with or without `/v1` (and trailing slashes)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise EndpointError(f"--base-url {url!r}: needs http:// or https:// "
                            "(e.g. http://127.0.0.1:8000)")
    return url[:-3].rstrip("/") if url.endswith("/v1") else url


class BenchClient:
    """An `httpx.AsyncClient` pointed at one server, with its key and timeouts."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 request_timeout_s: float = 600.0, ignore_eos: bool = True,
                 temperature: float = 0.0, max_connections: int = 1024) -> None:
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers,
            timeout=httpx.Timeout(request_timeout_s, connect=DEFAULT_CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def get_json(self, path: str, timeout_s: float = 5.0) -> Any | None:
        """GET `path` as JSON; None when the server has no such endpoint or answers badly."""
        try:
            r = await self.http.get(path, timeout=timeout_s)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def probe(self, deadline_s: float, adapters: Sequence[str] = ()) -> None:
        """Wait until GET /v1/models answers 200 and lists `model` (and each of
        `adapters`, the names of `--lora-modules`), up to `deadline_s`."""
        end = time.monotonic() + deadline_s
        last = "no answer"
        while True:
            try:
                r = await self.http.get("/v1/models", timeout=min(5.0, deadline_s))
                if r.status_code in (401, 403):
                    raise EndpointError(f"{self.base_url}/v1/models answered {r.status_code}: "
                                        "pass the server's key with --api-key (or "
                                        "$TANDEM_API_KEY / $OPENAI_API_KEY)")
                if r.status_code == 200:
                    ids = [m.get("id") for m in r.json().get("data", [])]
                    served = ", ".join(map(str, ids))
                    if self.model not in ids:
                        raise EndpointError(f"--model {self.model!r} is not served at "
                                            f"{self.base_url} (it serves: {served})")
                    missing = [name for name in dict.fromkeys(adapters) if name not in ids]
                    if missing:
                        raise EndpointError(
                            f"--lora-modules {', '.join(map(repr, missing))}: not served at "
                            f"{self.base_url} (it serves: {served}); load the adapters "
                            "first (vLLM's POST /v1/load_lora_adapter, `tandem refit "
                            "--adapter`) or name only served ones")
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            except ValueError as exc:
                last = f"not JSON ({exc})"
            if time.monotonic() >= end:
                raise EndpointError(f"--base-url {self.base_url}: no OpenAI API answered "
                                    f"within {deadline_s:g} s ({last}); check the URL and "
                                    "that the server is up, or raise --connect-deadline")
            await asyncio.sleep(0.5)

    async def tokens_per_word(self, text: str) -> float | None:
        """The server's tokens per whitespace word on `text`, from its /tokenize."""
        try:
            r = await self.http.post("/tokenize", json={"model": self.model, "prompt": text,
                                                        "add_special_tokens": False},
                                     timeout=10.0)
            count = r.json().get("count") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        words = len(text.split())
        return count / words if isinstance(count, int) and count > 0 and words else None

    async def complete(self, record: RequestRecord, prompt: str,
                       clock: Callable[[], float]) -> RequestRecord:
        """Send one streamed completion under `record.model` (default: the client's
        model); fill `record` (times from `clock()`)."""
        body: dict[str, Any] = {"model": record.model or self.model, "prompt": prompt,
                                "max_tokens": record.output_len,
                                "temperature": self.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        record.sent_s = clock()
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")[:300]
                    record.error = f"HTTP {r.status_code}: {text}"
                    return record
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    self._on_chunk(record, json.loads(data), clock())
            record.done_s = clock()
            if not record.chunk_times:
                record.error = "the stream ended with no text"
        except (httpx.HTTPError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        return record

    @staticmethod
    def _on_chunk(record: RequestRecord, chunk: dict, now: float) -> None:
        if "error" in chunk:
            raise ValueError(f"the server sent an error: {chunk['error']}")
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            if record.first_token_s is None:
                record.first_token_s = now
            record.chunk_times.append(now)
        if choices and choices[0].get("finish_reason"):
            record.finish_reason = choices[0]["finish_reason"]
        usage = chunk.get("usage")
        if usage:
            record.prompt_tokens = usage.get("prompt_tokens")
            record.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens")

