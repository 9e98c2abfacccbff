"""The router's HTTP API: OpenAI completions and chat completions over the engine pool.

`build_app` wires the parts: parse and validate (`api_params`), tokenize (and render
the chat template), run every choice through `Dispatcher.generate` concurrently, and
answer in the OpenAI shapes (`openai_format`), as one JSON body or as server-sent
events. A streamed response starts only when the first choice has produced something,
so errors found before any token (no engine, an engine's 400) still get a real HTTP
status; later errors arrive as an `error` event before `[DONE]`.

A client that disconnects has its choices cancelled, which aborts them on the engines.
Also served: `GET /v1/models`, `/v1/engines` (the router's view of each engine),
`/healthz`, `/readyz` (200 once an engine is RUNNING) and `/metrics`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tandem_engine.router import openai_format as fmt
from tandem_engine.router.api_params import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    InvalidRequest,
    Options,
    engine_sampling,
    parse_chat,
    parse_completion,
    resolve_max_tokens,
)
from tandem_engine.router.chat import ChatTemplate
from tandem_engine.router.dispatch import (
    Delta,
    Dispatcher,
    EngineRejected,
    GenerationFailed,
    NoEngineAvailable,
    no_engine_message,
)
from tandem_engine.router.engines import EnginePool
from tandem_engine.router.metrics import RouterMetrics
from tandem_engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One choice to generate."""

    index: int  # the choice index in the response
    prompt_index: int
    prompt_ids: list[int]
    sampling: dict[str, Any]


class ClientGone(Exception):
    """The HTTP client disconnected."""


class Choices:
    """Runs every choice of a request concurrently; `next()` yields (index, Delta) or
    (index, exception) in arrival order, None when all are done."""

    def __init__(self, dispatcher: Dispatcher, request_id: str, jobs: list[Job],
                 cache_salt: str | None, arrival: float) -> None:
        self._queue: asyncio.Queue[tuple[int, Delta | BaseException]] = asyncio.Queue()
        self._pending = len(jobs)
        self._tasks = [asyncio.create_task(self._run(dispatcher, f"{request_id}-{j.index}",
                                                     j, cache_salt, arrival))
                       for j in jobs]

    async def _run(self, dispatcher: Dispatcher, request_id: str, job: Job,
                   cache_salt: str | None, arrival: float) -> None:
        finished = False
        try:
            async for delta in dispatcher.generate(request_id, job.prompt_ids, job.sampling,
                                                   cache_salt, arrival):
                finished = delta.finished
                self._queue.put_nowait((job.index, delta))
            if not finished:
                raise GenerationFailed(f"request {request_id} ended without a final output")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._queue.put_nowait((job.index, exc))

    def watch(self, request: Request) -> None:
        """Report the client's disconnect as a ClientGone item."""

        async def wait() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            log.debug("client gone")
            self._queue.put_nowait((-1, ClientGone()))

        self._tasks.append(asyncio.create_task(wait()))

    async def next(self) -> tuple[int, Delta | BaseException] | None:
        if self._pending == 0:
            return None
        index, item = await self._queue.get()
        if isinstance(item, ClientGone):
            return index, item
        if isinstance(item, BaseException) or item.finished:
            self._pending -= 1
        return index, item

    def cancel(self) -> None:
        """Stop every choice (each aborts its engine request) and the disconnect watch."""
        for task in self._tasks:
            task.cancel()


@dataclass
class _ChoiceResult:
    """A choice's output accumulated for a non-streamed response."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


def build_app(pool: EnginePool, tokenizer: Tokenizer, served_model_name: str,
              dispatcher: Dispatcher | None = None) -> FastAPI:
    """The router app; its lifespan starts and closes the pool's connections."""
    if dispatcher is None:
        dispatcher = Dispatcher(pool, tokenizer)
    if dispatcher.metrics is None:
        dispatcher.metrics = RouterMetrics()
    metrics = dispatcher.metrics
    metrics.watch_engines(pool.views)
    chat_template = ChatTemplate.from_tokenizer(tokenizer)
    strings = fmt.TokenStrings(tokenizer)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(title="tandem-router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.dispatcher = dispatcher
    app.state.metrics = metrics

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
        metrics.requests.labels(_outcome(exc.status)).inc()
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        metrics.requests.labels("failed").inc()
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    def check_model(options: Options) -> None:
        if options.model != served_model_name:
            raise InvalidRequest(f"the model {options.model!r} does not exist: this server "
                                 f"serves {served_model_name!r}", "model", 404,
                                 "model_not_found")

    async def context_limit() -> int:
        await dispatcher.wait_until_serving()
        limit = dispatcher.max_model_len()
        if limit is None:
            raise InvalidRequest(no_engine_message(pool), None, 503, "no_engine_available",
                                 "service_unavailable")
        return limit

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = parse_completion(await _body(request))
        options = req.options
        check_model(options)
        limit = await context_limit()
        jobs: list[Job] = []
        prompt_tokens = 0
        for i, prompt in enumerate(req.prompts):
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            max_tokens = resolve_max_tokens(options, len(ids), limit,
                                            default=DEFAULT_COMPLETION_MAX_TOKENS)
            prompt_tokens += len(ids)
            jobs += [Job(i * options.n + j, i, ids, engine_sampling(options, max_tokens, j))
                     for j in range(options.n)]
        return await serve(request, "cmpl", jobs, options, prompt_tokens, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = parse_chat(await _body(request))
        options = req.options
        check_model(options)
        if chat_template is None:
            raise InvalidRequest(f"the model {served_model_name!r} has no chat template "
                                 "(tokenizer_config.json chat_template): use /v1/completions",
                                 "messages")
        limit = await context_limit()
        ids = tokenizer.encode(chat_template.render(req.messages), add_special_tokens=False)
        max_tokens = resolve_max_tokens(options, len(ids), limit, default=None,
                                        prompt_param="messages")
        jobs = [Job(j, 0, ids, engine_sampling(options, max_tokens, j))
                for j in range(options.n)]
        return await serve(request, "chatcmpl", jobs, options, len(ids), arrival)

    async def serve(request: Request, kind: str, jobs: list[Job], options: Options,
                    prompt_tokens: int, arrival: float) -> Response:
        request_id = f"{kind}-{uuid.uuid4().hex}"
        choices = Choices(dispatcher, request_id, jobs, options.cache_salt, arrival)
        choices.watch(request)
        try:
            first = await choices.next()
        except BaseException:
            choices.cancel()
            raise
        assert first is not None
        if isinstance(first[1], BaseException):
            choices.cancel()
            return _failure(first[1])
        render = _Renderer(kind, request_id, served_model_name, options, len(jobs), strings)
        if options.stream:
            return StreamingResponse(stream(choices, first, render, prompt_tokens),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            results = [_ChoiceResult() for _ in jobs]
            item: tuple[int, Delta | BaseException] | None = first
            while item is not None:
                index, delta = item
                if isinstance(delta, BaseException):
                    return _failure(delta)
                render.accumulate(results[index], delta)
                last = delta
                item = await choices.next()
        finally:
            choices.cancel()
        metrics.requests.labels("success").inc()
        response = JSONResponse(render.response(results, prompt_tokens))
        if last.received_at is not None:  # the last output's way out
            metrics.egress_latency.observe(time.monotonic() - last.received_at)
        return response

    async def stream(choices: Choices, first: tuple[int, Delta | BaseException],
                     render: _Renderer, prompt_tokens: int) -> AsyncIterator[str]:
        outcome = "cancelled"
        try:
            for chunk in render.opening_chunks():
                yield _sse(chunk)
            item: tuple[int, Delta | BaseException] | None = first
            while item is not None:
                index, delta = item
                if isinstance(delta, BaseException):
                    if isinstance(delta, ClientGone):
                        return
                    status, body = _failure_body(delta)
                    outcome = _outcome(status, delta)
                    yield _sse(body)
                    break
                chunk = render.chunk(index, delta)
                if chunk is not None:
                    data = _sse(chunk)
                    if delta.received_at is not None:
                        metrics.egress_latency.observe(time.monotonic() - delta.received_at)
                    yield data
                item = await choices.next()
            else:
                outcome = "success"
                if render.options.include_usage:
                    yield _sse(render.usage_chunk(prompt_tokens))
            yield "data: [DONE]\n\n"
        finally:
            choices.cancel()
            metrics.requests.labels(outcome).inc()

    def _failure(exc: BaseException) -> Response:
        if isinstance(exc, ClientGone):
            metrics.requests.labels("cancelled").inc()
            return Response(status_code=499)
        status, body = _failure_body(exc)
        metrics.requests.labels(_outcome(status, exc)).inc()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "tandem", "max_model_len": dispatcher.max_model_len()}]}

    @app.get("/v1/engines")
    async def engines() -> dict[str, Any]:
        return {"router_id": pool.router_id,
                "engines": [c.describe() for c in pool.clients]}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ready = dispatcher.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class _Renderer:
    """Turns deltas into the endpoint's chunks and final body."""

    def __init__(self, kind: str, request_id: str, model: str, options: Options,
                 num_choices: int, strings: fmt.TokenStrings) -> None:
        self.chat = kind == "chatcmpl"
        self.request_id = request_id
        self.model = model
        self.options = options
        self.created = int(time.time())
        self.strings = strings
        self.num_choices = num_choices
        self._text_offsets = [0] * num_choices  # completions logprobs text_offset
        self._tokens = [0] * num_choices

    def _logprobs(self, index: int, delta: Delta) -> Any:
        if self.options.logprobs is None or delta.logprobs is None:
            return None
        if self.chat:
            return fmt.chat_logprobs(delta.token_ids, delta.logprobs, self.strings)
        lp = fmt.completion_logprobs(delta.token_ids, delta.logprobs, self.strings,
                                     self._text_offsets[index])
        self._text_offsets[index] += sum(len(s) for s in lp["tokens"])
        return lp

    def accumulate(self, result: _ChoiceResult, delta: Delta) -> None:
        result.text.append(delta.text)
        result.token_ids += delta.token_ids
        if delta.logprobs is not None and self.options.logprobs is not None:
            result.logprobs.append(delta)
        if delta.finished:
            result.finish_reason, result.stop_reason = delta.finish_reason, delta.stop_reason

    def response(self, results: list[_ChoiceResult], prompt_tokens: int) -> dict[str, Any]:
        choices = []
        for i, r in enumerate(results):
            text = "".join(r.text)
            want = self.options.logprobs is not None
            if self.chat:
                entries = [e for d in r.logprobs for e in self._logprobs(i, d)] if want \
                    else None
                choice = fmt.chat_choice(i, text, entries, r.finish_reason, r.stop_reason)
            else:
                lp = fmt.merge_completion_logprobs([self._logprobs(i, d) for d in r.logprobs]) \
                    if want else None
                choice = fmt.completion_choice(i, text, lp, r.finish_reason, r.stop_reason)
            if self.options.return_token_ids:
                choice["token_ids"] = r.token_ids
            choices.append(choice)
        used = fmt.usage(prompt_tokens, sum(len(r.token_ids) for r in results))
        build = fmt.chat_response if self.chat else fmt.completion_response
        return build(self.request_id, self.created, self.model, choices, used)

    def opening_chunks(self) -> list[dict[str, Any]]:
        if not self.chat:
            return []
        return [fmt.chat_chunk(self.request_id, self.created, self.model, [
            fmt.chat_chunk_choice(i, {"role": "assistant", "content": ""})])
            for i in range(self.num_choices)]

    def chunk(self, index: int, delta: Delta) -> dict[str, Any] | None:
        self._tokens[index] += len(delta.token_ids)
        logprobs = self._logprobs(index, delta) if delta.token_ids else None
        want_ids = self.options.return_token_ids and delta.token_ids
        if not (delta.text or delta.finished or logprobs or want_ids):
            return None
        if self.chat:
            choice = fmt.chat_chunk_choice(index, {"content": delta.text} if delta.text else {},
                                           logprobs, delta.finish_reason, delta.stop_reason)
        else:
            choice = fmt.completion_choice(index, delta.text, logprobs, delta.finish_reason,
                                           delta.stop_reason)
        if self.options.return_token_ids:
            choice["token_ids"] = delta.token_ids
        build = fmt.chat_chunk if self.chat else fmt.completion_chunk
        return build(self.request_id, self.created, self.model, [choice])

    def usage_chunk(self, prompt_tokens: int) -> dict[str, Any]:
        build = fmt.chat_chunk if self.chat else fmt.completion_chunk
        return build(self.request_id, self.created, self.model, [],
                     fmt.usage(prompt_tokens, sum(self._tokens)))


# ---- helpers ------------------------------------------------------------------------------------


async def _body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _error(status: int, message: str, type: str, param: str | None = None,
           code: str | int | None = None) -> JSONResponse:
    return JSONResponse(fmt.error_body(message, type, param, code), status_code=status)


def _failure_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """HTTP status and OpenAI error body for a choice's failure."""
    if isinstance(exc, InvalidRequest):
        return exc.status, fmt.error_body(exc.message, exc.type, exc.param, exc.code)
    if isinstance(exc, EngineRejected):
        if exc.status < 500:
            param = "prompt" if "prompt" in str(exc) else None
            return exc.status, fmt.error_body(str(exc), "invalid_request_error", param)
        return 503, fmt.error_body(str(exc), "service_unavailable", None, "engine_rejected")
    if isinstance(exc, NoEngineAvailable):
        return 503, fmt.error_body(str(exc), "service_unavailable", None,
                                   "no_engine_available")
    if isinstance(exc, GenerationFailed):
        return 503, fmt.error_body(str(exc), "server_error", None, "generation_failed")
    log.error("choice failed: %r", exc)
    return 500, fmt.error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _outcome(status: int, exc: BaseException | None = None) -> str:
    if isinstance(exc, GenerationFailed) or (status >= 500 and status != 503):
        return "failed"
    return "unavailable" if status == 503 else "invalid"

