"""The router's HTTP API: OpenAI completions and chat completions over the engine pool.

`RouterApi` holds the handlers: read the body within `RequestLimits` and parse and
validate it (`api_params`), tokenize (and render the chat template) on a worker thread,
so a long prompt never stalls the event loop (`/healthz` stays instant), run every
choice through `Dispatcher.generate` concurrently (`Choices`), and answer in the OpenAI
shapes (`openai_format`), as one JSON body or as server-sent events; `build_app` mounts
them on a FastAPI app. A streamed response starts only when the first choice has
produced something, so errors found before any token (no engine, an engine's 400) still
get a real HTTP status; later errors arrive as an `error` event before `[DONE]`.

A request's `model` names the served model or a LoRA adapter an engine serves (its
heartbeat lists it; `routing.served_adapters`); the choice then runs under it
(`Dispatcher.generate(adapter=)`), and any other name is a 404 naming the served ones.
A client that disconnects has its choices cancelled, which aborts them on the engines.
Also served: `GET /v1/models` (the model, then each adapter with its `parent`, as vLLM
lists them), vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (admin
calls done on every engine: `adapters.py`, `auth.py`), `/v1/engines` (the router's view
of each engine),
`/healthz`, `/readyz` (200 once an engine is RUNNING) and `/metrics`, and as vLLM serves
them `/health` (200, empty, while an engine serves), `/version`, `/tokenize` and
`/detokenize` (`tokenize_params`), and the OpenAPI description `/openapi.json`
(`openapi_schema`). With API keys configured (`auth`), every path but the probes and
`/metrics` needs one.

Every error is in the OpenAI shape: an unknown path (404), a wrong method (405) and a
validation error (422) too. An unexpected exception answers 500 with `Connection: close`
(the server closes the connection after it, so a pooling client must not reuse it),
whether a handler raised it or a choice's task met it (`_failure`).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from tandem_engine.generation_config import GenerationDefaults
from tandem_engine.router import adapters
from tandem_engine.router import openai_format as fmt
from tandem_engine.router import openapi_schema as docs
from tandem_engine.router.admission import (
    TENANT_HEADER,
    Admission,
    KeyPolicy,
    Refused,
    Ticket,
    default_tenant_name,
)
from tandem_engine.router.api_params import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    InvalidRequest,
    Options,
    RequestLimits,
    check_prompt_chars,
    decode_body,
    engine_sampling,
    parse_chat,
    parse_completion,
    rejected_param,
    resolve_max_tokens,
)
from tandem_engine.router.attempts import (
    Delta,
    EngineRejected,
    EnginesBusy,
    GenerationFailed,
    NoEngineAvailable,
    RequestFailed,
)
from tandem_engine.router.auth import OPEN_PATHS, SCOPE_KEY, ApiKeyMiddleware
from tandem_engine.router.chat import ChatEncoder, ChatPrompt, ChatTemplate
from tandem_engine.router.dispatch import Dispatcher
from tandem_engine.router.engines import EnginePool
from tandem_engine.router.metrics import RouterMetrics
from tandem_engine.router.picker import no_engine_message
from tandem_engine.router.routing import served_adapters
from tandem_engine.router.structured_request import GrammarCheck
from tandem_engine.router.tokenize_params import parse_detokenize, parse_tokenize
from tandem_engine.router.tools import ToolRequest, render_for_template
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

try:
    VERSION = importlib.metadata.version("tandem")
except importlib.metadata.PackageNotFoundError:  # run from a source tree
    VERSION = "0+unknown"


@dataclass(frozen=True)
class Job:
    """One choice to generate."""

    index: int  # the choice index in the response
    prompt_index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    echo_text: str = ""  # completions echo: the prompt as the choice's text starts


class ClientGone(Exception):
    """The HTTP client disconnected."""


class Choices:
    """Runs every choice of a request concurrently; `next()` yields (index, Delta) or
    (index, exception) in arrival order, None when all are done."""

    def __init__(self, dispatcher: Dispatcher, request_id: str, jobs: list[Job],
                 cache_salt: str | None, arrival: float, adapter: str | None = None,
                 cache_key: str | None = None, priority: int = 0,
                 ticket: Ticket | None = None) -> None:
        """`ticket`: admission's, given back when the last choice's task ends (however the
        response ends, or if it is never sent)."""
        self._queue: asyncio.Queue[tuple[int, Delta | BaseException]] = asyncio.Queue()
        self._pending = len(jobs)
        self.generated = 0  # tokens generated so far, every choice together
        self._ticket = ticket
        self._running = len(jobs)
        self._tasks = [asyncio.create_task(self._run(dispatcher, f"{request_id}-{j.index}",
                                                     j, cache_salt, arrival, adapter,
                                                     cache_key, priority))
                       for j in jobs]
        for task in self._tasks:
            task.add_done_callback(self._ended)

    def _ended(self, _: asyncio.Task) -> None:
        self._running -= 1
        if self._running == 0 and self._ticket is not None:
            self._ticket.done(self.generated)

    async def _run(self, dispatcher: Dispatcher, request_id: str, job: Job,
                   cache_salt: str | None, arrival: float, adapter: str | None,
                   cache_key: str | None, priority: int) -> None:
        finished = False
        try:
            async for delta in dispatcher.generate(request_id, job.prompt_ids, job.sampling,
                                                   cache_salt, arrival, adapter, cache_key,
                                                   priority):
                finished = delta.finished
                self.generated += len(delta.token_ids)
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


class RouterApi:
    """The router's HTTP handlers over one dispatcher; `build_app` mounts them."""

    def __init__(self, pool: EnginePool, tokenizer: Tokenizer, served_model_name: str,
                 dispatcher: Dispatcher, metrics: RouterMetrics,
                 limits: RequestLimits | None = None,
                 allow_special_tokens_in_content: bool = False,
                 generation_defaults: GenerationDefaults | None = None,
                 admission: Admission | None = None) -> None:
        self.pool = pool
        self.admission = admission or Admission()
        # The model's sampling defaults: what a request leaves out (`--generation-config`).
        self.generation_defaults = generation_defaults or GenerationDefaults()
        self.limits = limits or RequestLimits()
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.chat_template = ChatTemplate.from_tokenizer(tokenizer)
        self.chat_encoder = ChatEncoder(
            tokenizer, allow_special_tokens_in_content=allow_special_tokens_in_content)
        self.strings = fmt.TokenStrings(tokenizer)
        self.grammar_check = GrammarCheck(tokenizer)

    # ---- generation endpoints -----------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req = parse_completion(await self._body(request))
        check_prompt_chars(req, self.limits)
        options = req.options
        adapter = await self._adapter(options.model)
        await self._check_structured(options)
        limit = await self._context_limit()
        jobs: list[Job] = []
        prompt_tokens = 0
        for i, prompt in enumerate(req.prompts):
            ids = await asyncio.to_thread(self.tokenizer.encode_releasing_gil, prompt,
                                          req.add_special_tokens) \
                if isinstance(prompt, str) else prompt
            max_tokens = resolve_max_tokens(options, len(ids), limit,
                                            default=DEFAULT_COMPLETION_MAX_TOKENS)
            prompt_tokens += len(ids)
            echo = "" if not options.echo else prompt if isinstance(prompt, str) \
                else await asyncio.to_thread(self.tokenizer.decode, prompt, False)
            jobs += [Job(i * options.n + j, i, ids,
                         engine_sampling(options, max_tokens, j, self.generation_defaults),
                         echo) for j in range(options.n)]
        return await self._serve(request, "cmpl", jobs, options, prompt_tokens, arrival,
                                 adapter=adapter)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req = parse_chat(await self._body(request))
        check_prompt_chars(req, self.limits)
        options = req.options
        adapter = await self._adapter(options.model)
        if self.chat_template is None:
            raise self._no_chat_template()
        await self._check_structured(options)
        limit = await self._context_limit()
        ids = await asyncio.to_thread(
            self._chat_prompt_ids, self.chat_template, req.messages,
            req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs,
            req.tools)
        max_tokens = resolve_max_tokens(options, len(ids), limit, default=None,
                                        prompt_param="messages")
        jobs = [Job(j, 0, ids, engine_sampling(options, max_tokens, j,
                                                self.generation_defaults))
                for j in range(options.n)]
        return await self._serve(request, "chatcmpl", jobs, options, len(ids), arrival,
                                 req.tools, adapter)

    async def _check_structured(self, options: Options) -> None:
        """A 400 for a constraint the grammar library refuses (before any engine sees it)."""
        if options.structured is not None:
            assert options.structured_param is not None
            await self.grammar_check.check(options.structured, options.structured_param)

    def _chat_prompt_ids(self, template: ChatTemplate, messages: list[dict[str, Any]],
                         add_generation_prompt: bool = True,
                         continue_final_message: bool = False,
                         template_kwargs: dict[str, Any] | None = None,
                         tools: ToolRequest | None = None) -> list[int]:
        """The rendered conversation's token ids (on a worker thread), message content
        tokenized as text (`chat.ChatEncoder`); /tokenize counts a chat with this too, so
        both always agree. With `tools`, the template renders them, or (a template
        without tool support) the router writes them into the conversation
        (`tools.render_for_template`)."""
        messages, template_tools = render_for_template(messages, tools, template.takes_tools)
        prompt = ChatPrompt(messages, add_generation_prompt, continue_final_message,
                            template_kwargs, template_tools)
        return self.chat_encoder.encode(template, prompt)

    def _no_chat_template(self) -> InvalidRequest:
        return InvalidRequest(f"the model {self.served_model_name!r} has no chat template "
                              "(tokenizer_config.json chat_template): use /v1/completions",
                              "messages")

    async def _body(self, request: Request) -> Any:
        """The request's JSON: read up to `max_body_bytes` (413 beyond, without parsing
        the rest: the HTTP layer discards it before closing, so the client reads the 413;
        http_guard.py) and decoded on a worker thread."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise self.limits.body_too_large(int(declared))
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise self.limits.body_too_large()
                chunks.append(chunk)
        except ClientDisconnect:  # gone mid-body, or cut at --body-timeout (answered 408)
            raise InvalidRequest("the connection closed before the request body arrived "
                                 "(tandem-router --body-timeout)", None, 408) from None
        return await asyncio.to_thread(decode_body, b"".join(chunks))

    async def _adapter(self, model: str) -> str | None:
        """`_resolve_model`, for a generation: a router that has not heard from its
        engines yet (just started) waits for them (`wait_until_serving`) before it calls
        an adapter's name unknown."""
        try:
            return self._resolve_model(model)
        except InvalidRequest:
            picker = self.dispatcher.picker
            if picker.ready() or not await picker.wait_until_serving():
                raise
            return self._resolve_model(model)

    def _resolve_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, None for the served model (or no
        name: /tokenize's default); 404 for any other name, naming the served ones."""
        if model is None or model == self.served_model_name:
            return None
        served = served_adapters(self.pool.views())
        if model in served:
            return model
        also = f" and the LoRA adapters {', '.join(map(repr, served))}" if served else ""
        raise InvalidRequest(f"the model {model!r} does not exist: this server serves "
                             f"{self.served_model_name!r}{also} (GET /v1/models)", "model",
                             404, "model_not_found")

    async def _context_limit(self) -> int:
        await self.dispatcher.picker.wait_until_serving()
        limit = self.dispatcher.picker.max_model_len()
        if limit is None:
            raise InvalidRequest(no_engine_message(self.pool), None, 503,
                                 "no_engine_available", "service_unavailable")
        return limit

    # ---- answering: one JSON body or server-sent events ---------------------------------------

    async def _serve(self, request: Request, kind: str, jobs: list[Job], options: Options,
                     prompt_tokens: int, arrival: float,
                     tools: ToolRequest | None = None, adapter: str | None = None
                     ) -> Response:
        """Run the jobs (under LoRA adapter `adapter`, a name, when given); answer once
        the first choice produced something (or failed)."""
        request_id = f"{kind}-{uuid.uuid4().hex}"
        ticket = self.admission.admit(request.scope.get(SCOPE_KEY),
                                      request.headers.get(TENANT_HEADER), options.model,
                                      options.priority, prompt_tokens,
                                      sum(j.sampling.max_tokens or 0 for j in jobs))
        choices = Choices(self.dispatcher, request_id, jobs, options.cache_salt, arrival,
                          adapter, options.cache_key, ticket.engine_priority, ticket)
        choices.watch(request)
        try:
            first = await choices.next()
        except BaseException:
            choices.cancel()
            ticket.done(choices.generated)
            raise
        assert first is not None
        if isinstance(first[1], BaseException):
            choices.cancel()
            ticket.done(choices.generated)
            if isinstance(first[1], EnginesBusy):
                self.admission.refused_for(ticket.tenant, "engines_full")
            return self._failure(first[1])
        # The response names the model asked for: the adapter, as vLLM's does.
        render = fmt.Renderer(kind, request_id, adapter or self.served_model_name, options,
                              len(jobs),
                              self.strings,
                              [fmt.ChoicePrompt(j.prompt_ids, j.echo_text) for j in jobs],
                              tools=tools)
        if options.stream:
            return StreamingResponse(self._stream(choices, first, render, prompt_tokens,
                                                  ticket),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            return await self._respond(choices, first, render, prompt_tokens)
        finally:
            ticket.done(choices.generated)

    async def _respond(self, choices: Choices, first: tuple[int, Delta | BaseException],
                       render: fmt.Renderer, prompt_tokens: int) -> Response:
        """The non-streamed answer: every choice's output in one body."""
        try:
            results = [fmt.ChoiceResult() for _ in range(render.num_choices)]
            item: tuple[int, Delta | BaseException] | None = first
            while item is not None:
                index, delta = item
                if isinstance(delta, BaseException):
                    return self._failure(delta)
                render.accumulate(results[index], delta, index)
                last = delta
                item = await choices.next()
        finally:
            choices.cancel()
        self.metrics.requests.labels("success").inc()
        response = JSONResponse(render.response(results, prompt_tokens))
        if last.received_at is not None:  # the last output's way out
            self.metrics.egress_latency.observe(time.monotonic() - last.received_at)
        return response

    async def _stream(self, choices: Choices, first: tuple[int, Delta | BaseException],
                      render: fmt.Renderer, prompt_tokens: int, ticket: Ticket
                      ) -> AsyncIterator[str]:
        """The streamed answer: a chunk per delta, an error event if a choice fails."""
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
                        self.metrics.egress_latency.observe(
                            time.monotonic() - delta.received_at)
                    yield data
                item = await choices.next()
            else:
                outcome = "success"
                if render.options.include_usage:
                    yield _sse(render.usage_chunk(prompt_tokens))
            yield "data: [DONE]\n\n"
        finally:
            choices.cancel()
            ticket.done(choices.generated)
            self.metrics.requests.labels(outcome).inc()

    def _failure(self, exc: BaseException) -> Response:
        if isinstance(exc, ClientGone):
            self.metrics.requests.labels("cancelled").inc()
            return Response(status_code=499)
        status, body = _failure_body(exc)
        self.metrics.requests.labels(_outcome(status, exc)).inc()
        response = JSONResponse(body, status_code=status)
        if isinstance(exc, EnginesBusy):
            response.headers["Retry-After"] = str(math.ceil(exc.retry_after))
        if status == 500:  # as `unexpected` answers: every 500 closes its connection
            response.headers["Connection"] = "close"
        return response

    # ---- errors raised by a handler -----------------------------------------------------------

    async def refused(self, _: Request, exc: Refused) -> JSONResponse:
        """Admission's refusal (admission.py): a model the key may not use, a limit."""
        self.metrics.requests.labels(_outcome(exc.status)).inc()
        response = _error(exc.status, exc.message,
                          "rate_limit_error" if exc.status == 429 else "invalid_request_error",
                          "model" if exc.status == 404 else None, exc.code)
        if exc.retry_after is not None:
            response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
        return response

    async def invalid(self, _: Request, exc: InvalidRequest) -> JSONResponse:
        self.metrics.requests.labels(_outcome(exc.status)).inc()
        response = _error(exc.status, exc.message, exc.type, exc.param, exc.code)
        if exc.status == 413:  # the rest of the body is discarded, never read
            response.headers["Connection"] = "close"
        return response

    async def unexpected(self, _: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        self.metrics.requests.labels("failed").inc()
        response = _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
        # Starlette re-raises after this answer and uvicorn then drops the connection:
        # say so, or a pooling client's next request on it fails (ECONNRESET).
        response.headers["Connection"] = "close"
        return response

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own errors (no such path, a wrong method) in the OpenAI shape."""
        where = f"{request.method} {request.url.path}"
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            message = (f"Invalid URL ({where}): no such endpoint. The router serves "
                       "/v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                       "/detokenize, /version, /health (see /openapi.json)")
        elif exc.status_code == 405:
            allowed = headers.get("allow") or headers.get("Allow") or "?"
            message = (f"Invalid method for URL ({where}): {request.url.path} takes "
                       f"{allowed}")
        else:
            message = f"{exc.detail} ({where})"
        self.metrics.requests.labels(_outcome(exc.status_code)).inc()
        response = _error(exc.status_code, message,
                          "server_error" if exc.status_code >= 500 else "invalid_request_error")
        response.headers.update(headers)
        return response

    async def validation_error(self, request: Request, exc: RequestValidationError
                               ) -> JSONResponse:
        """FastAPI's request validation (422) in the OpenAI shape, naming each field."""
        problems, first = [], None
        for error in exc.errors():
            field = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
            first = first or field
            problems.append(f"{field}: {error.get('msg', 'invalid')}")
        self.metrics.requests.labels("invalid").inc()
        return _error(422, f"invalid request to {request.method} {request.url.path}: "
                      + "; ".join(problems), "invalid_request_error", first)

    # ---- vLLM's utility endpoints -------------------------------------------------------------

    async def tokenize(self, request: Request) -> dict[str, Any]:
        req = parse_tokenize(await self._body(request))
        self._resolve_model(req.model)  # an adapter tokenizes as its base model
        model = self.served_model_name
        if req.messages is not None:
            chat = parse_chat({"model": model, "messages": req.messages})
            check_prompt_chars(chat, self.limits)
            if self.chat_template is None:
                raise self._no_chat_template()
            ids = await asyncio.to_thread(self._chat_prompt_ids, self.chat_template,
                                          chat.messages, req.add_generation_prompt)
        else:
            check_prompt_chars(parse_completion({"model": model, "prompt": req.prompt}),
                               self.limits)
            ids = await asyncio.to_thread(self.tokenizer.encode_releasing_gil, req.prompt,
                                          req.add_special_tokens)
        answer: dict[str, Any] = {"count": len(ids),
                                  "max_model_len": self.dispatcher.picker.max_model_len(),
                                  "tokens": ids}
        if req.return_token_strs:
            answer["token_strs"] = [self.strings.text(t) for t in ids]
        return answer

    async def detokenize(self, request: Request) -> dict[str, str]:
        req = parse_detokenize(await self._body(request), self.tokenizer.vocab_size)
        self._resolve_model(req.model)
        text = await asyncio.to_thread(self.tokenizer.decode, req.tokens, False)
        return {"prompt": text}

    async def health(self) -> Response:
        """vLLM's /health: 200 with an empty body while an engine serves, else 503."""
        return Response(status_code=200 if self.dispatcher.picker.ready() else 503)

    async def version(self) -> dict[str, str]:
        return {"version": VERSION}

    # ---- the router's own endpoints -----------------------------------------------------------

    async def models(self) -> dict[str, Any]:
        """The served model, then each LoRA adapter an engine serves, as vLLM lists them:
        its `parent` is the served model, its `root` its identity "name@version" (the
        version most engines serve). `default_sampling_params` are what a request that
        leaves a sampling parameter out gets, and `generation_config` says where they
        came from."""
        created, max_model_len = int(time.time()), self.dispatcher.picker.max_model_len()
        base = {"id": self.served_model_name, "object": "model", "created": created,
                "owned_by": "tandem", "root": self.served_model_name, "parent": None,
                "max_model_len": max_model_len,
                "default_sampling_params": self.generation_defaults.sampling_kwargs(),
                "generation_config": self.generation_defaults.source}
        loras = [{"id": name, "object": "model", "created": created, "owned_by": "tandem",
                  "root": identities[0], "parent": self.served_model_name,
                  "max_model_len": max_model_len}
                 for name, identities in served_adapters(self.pool.views()).items()]
        return {"object": "list", "data": [base, *loras]}

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's: serve an adapter on every engine (an admin call: `auth.ADMIN_PATHS`)."""
        req = adapters.parse_load(await self._body(request), self.served_model_name)
        return self._adapter_answer(await adapters.load_everywhere(self.pool, req))

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's: stop serving an adapter on every engine (an admin call)."""
        req = adapters.parse_unload(await self._body(request))
        return self._adapter_answer(await adapters.unload_everywhere(self.pool, req))

    @staticmethod
    def _adapter_answer(result: adapters.CallResult) -> Response:
        """vLLM's answers: its success text, or the error in the OpenAI shape."""
        if result.status == 200:
            return PlainTextResponse(result.message)
        if result.status == 404:
            return _error(404, result.message, "invalid_request_error", "lora_name",
                          "lora_adapter_not_found")
        if result.status >= 500:
            return _error(result.status, result.message, "service_unavailable", None,
                          "engine_unavailable")
        return _error(result.status, result.message, "invalid_request_error", "lora_path")

    async def engines(self) -> dict[str, Any]:
        return {"router_id": self.pool.router_id,
                "engines": [c.describe() for c in self.pool.clients]}

    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    async def readyz(self) -> JSONResponse:
        ready = self.dispatcher.picker.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    async def render_metrics(self) -> Response:
        """The router's series, and its engines' with `--engine-metrics-url` (metrics.py)."""
        return Response(await self.metrics.scrape(), media_type=CONTENT_TYPE_LATEST)


def build_app(pool: EnginePool, tokenizer: Tokenizer, served_model_name: str,
              dispatcher: Dispatcher | None = None,
              limits: RequestLimits | None = None,
              api_keys: Sequence[str] = (),
              allow_special_tokens_in_content: bool = False,
              generation_defaults: GenerationDefaults | None = None,
              admin_token: str | None = None,
              admission: Admission | None = None) -> FastAPI:
    """The router app; its lifespan starts and closes the pool's connections. With
    `api_keys`, every path but `auth.OPEN_PATHS` and `auth.ADMIN_PATHS` needs one of
    them; the admin paths need `admin_token` (none: they answer 403)."""
    if dispatcher is None:
        dispatcher = Dispatcher(pool)
    if dispatcher.metrics is None:
        dispatcher.metrics = RouterMetrics()
    metrics = dispatcher.metrics
    metrics.watch_engines(pool.views)
    if admission is None:
        admission = Admission({key: KeyPolicy(default_tenant_name(key)) for key in api_keys})
    metrics.watch_admission(admission)
    api = RouterApi(pool, tokenizer, served_model_name, dispatcher, metrics, limits,
                    allow_special_tokens_in_content, generation_defaults, admission)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:
            await pool.close()

    app = RouterApp(title="tandem-router", version=VERSION, lifespan=lifespan, docs_url=None,
                    redoc_url=None, openapi_url="/openapi.json")
    app.state.dispatcher = dispatcher
    app.state.metrics = metrics
    app.add_exception_handler(InvalidRequest, api.invalid)
    app.add_exception_handler(Refused, api.refused)
    app.add_exception_handler(HTTPException, api.http_error)
    app.add_exception_handler(RequestValidationError, api.validation_error)
    app.add_exception_handler(Exception, api.unexpected)
    _mount(app, api)
    app.front = ApiKeyMiddleware(AdmissionGate(app.inner, admission), keys=api_keys,
                                 admin_token=admin_token)
    if api_keys:

        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                app.openapi_schema = docs.secure(
                    get_openapi(title=app.title, version=app.version, routes=app.routes),
                    OPEN_PATHS)
            return app.openapi_schema

        app.openapi = openapi  # type: ignore[method-assign]
    return app


GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
TENANT_HEADER_BYTES = TENANT_HEADER.encode()


class RouterApp(FastAPI):
    """The router's FastAPI app with its front door before FastAPI's own per-request work
    (its telemetry check, middleware stack, routing): the API key check, then the
    admission gate. What they refuse (401, and the 429s of a full router) is answered in
    a few tens of microseconds, so a burst's excess costs the router little."""

    front: Any = None  # ApiKeyMiddleware(AdmissionGate(inner)), set by build_app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await (self.front or self.inner)(scope, receive, send)

    async def inner(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await super().__call__(scope, receive, send)


class AdmissionGate:
    """ASGI middleware, in the router's front door (`RouterApp`): a generation request takes
    its seat here when its headers arrive (`Admission.enter`) and gives it back when its
    answer is done. One that arrives while the router is full gets its 429 here, before
    the framework sees it or its body is read: a burst's excess is answered at once."""

    def __init__(self, app: Any, admission: Admission) -> None:
        self.app, self.admission = app, admission

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            tenant = next((v.decode(errors="replace") for k, v in scope["headers"]
                           if k == TENANT_HEADER_BYTES), None)
            self.admission.enter(scope.get(SCOPE_KEY), tenant)
        except Refused as exc:
            body = json.dumps(fmt.error_body(exc.message, "rate_limit_error", None,
                                             exc.code)).encode()
            await send({"type": "http.response.start", "status": exc.status, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(max(1, math.ceil(exc.retry_after or 1))).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave()


def _mount(app: FastAPI, api: RouterApi) -> None:
    """The routes, each with its documented body and answers (`openapi_schema`)."""
    model = api.served_model_name
    app.post("/v1/completions", **docs.route_docs(
        docs.completion_request(model), docs.COMPLETION, stream=True))(api.completions)
    app.post("/v1/chat/completions", **docs.route_docs(
        docs.chat_request(model), docs.COMPLETION, stream=True))(api.chat_completions)
    app.get("/v1/models", **docs.route_docs(None, docs.MODELS))(api.models)
    app.post("/tokenize", **docs.route_docs(
        docs.tokenize_request(model), docs.TOKENIZE))(api.tokenize)
    app.post("/detokenize", **docs.route_docs(
        docs.detokenize_request(model), docs.DETOKENIZE))(api.detokenize)
    app.get("/version", **docs.route_docs(None, docs.VERSION))(api.version)
    app.get("/health")(api.health)
    app.get("/v1/engines")(api.engines)
    # Admin calls (auth.ADMIN_PATHS), left out of the API description clients read.
    app.post("/v1/load_lora_adapter", include_in_schema=False)(api.load_lora_adapter)
    app.post("/v1/unload_lora_adapter", include_in_schema=False)(api.unload_lora_adapter)
    app.get("/healthz")(api.healthz)
    app.get("/readyz")(api.readyz)
    app.get("/metrics")(api.render_metrics)


# ---- helpers ------------------------------------------------------------------------------------


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _error(status: int, message: str, type: str, param: str | None = None,
           code: str | int | None = None) -> JSONResponse:
    return JSONResponse(fmt.error_body(message, type, param, code), status_code=status)


def _failure_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """HTTP status and OpenAI error body for a choice's failure."""
    if isinstance(exc, EnginesBusy):
        return 429, fmt.error_body(str(exc), "rate_limit_error", None, "engines_busy")
    if isinstance(exc, InvalidRequest):
        return exc.status, fmt.error_body(exc.message, exc.type, exc.param, exc.code)
    if isinstance(exc, EngineRejected):
        if exc.status < 500:
            return exc.status, fmt.error_body(str(exc), "invalid_request_error",
                                              rejected_param(str(exc)))
        return 503, fmt.error_body(str(exc), "service_unavailable", None, "engine_rejected")
    if isinstance(exc, NoEngineAvailable):
        return 503, fmt.error_body(str(exc), "service_unavailable", None,
                                   "no_engine_available")
    if isinstance(exc, GenerationFailed):
        return 503, fmt.error_body(str(exc), "server_error", None, "generation_failed")
    if isinstance(exc, RequestFailed):  # this request alone: never failed over
        return 500, fmt.error_body(str(exc), "server_error", None, "request_failed")
    log.error("choice failed: %r", exc, exc_info=exc)
    return 500, fmt.error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _outcome(status: int, exc: BaseException | None = None) -> str:
    if status == 429:
        return "shed"
    if isinstance(exc, GenerationFailed) or (status >= 500 and status != 503):
        return "failed"
    return "unavailable" if status == 503 else "invalid"

