"""The engine's admin HTTP API: what the operator (and `tandem serve`) calls.

State, lifecycle signals, refit, LoRA adapters (vLLM's `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter`), health, readiness and Prometheus metrics. Every
mutating call goes through `EngineControl` (server/control.py); reads come from the
engine's published snapshot. Lifecycle calls block on the engine lock, so they are
plain (threadpool) handlers. `AdminGuard` (server/admin_guard.py) stands in front of
the whole app: with an admin token configured, every request but a read (GET, HEAD)
needs `Authorization: Bearer <token>`, checked before any route reads a body; every body
is bounded. Reads (`/v1/state`, the probes, `/metrics`) stay open; the OpenAPI
description and docs are off.

`build_metrics_app` is the read-only subset for Prometheus and probes (GET /metrics,
/healthz, /readyz and nothing else), served on its own port (`--metrics-port`) so the
mutating API need not be reachable from wherever metrics are scraped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.concurrency import run_in_threadpool

from tandem_engine.admin_wire import (
    AdminBodyError,
    AdminRequest,
    CanaryReply,
    CanaryRequest,
    EngineStatus,
    LoadLoRAAdapterRequest,
    RefitRequest,
    SuspendRequest,
    UnloadLoRAAdapterRequest,
    decode_body,
    encode_status,
)
from tandem_engine.engine.stats import LoRAStats, SpecDecodeStats
from tandem_engine.errors import CheckpointError, RequestRejected
from tandem_engine.lifecycle import EngineStateError
from tandem_engine.server.adapters import AdapterCallError
from tandem_engine.server.admin_guard import guard_admin_app
from tandem_engine.server.control import EngineControl, ShuttingDown
from tandem_engine.server.handoff import HandoffStats
from tandem_engine.server.metric_families import (
    HANDOFF_BUCKETS,
    STEP_BUCKETS,
    LatencyHistogram,
    engine_state_family,
    weights_info_family,
)

# The finish reasons vLLM's request_success counter knows (a handover is no finish there).
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error")


def engine_registry(control: EngineControl) -> CollectorRegistry:
    """The engine's Prometheus registry. One per process: a scrape drains the step and
    pull samples recorded since the last one, so the admin and metrics ports share it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(control))
    return registry


def build_admin_app(control: EngineControl, admin_token: str | None = None,
                    registry: CollectorRegistry | None = None) -> FastAPI:
    """The admin API: every mutating call goes through `control` (and needs the bearer
    token when one is configured: `AdminGuard`); reads come from published snapshots."""
    app = FastAPI(title="tandem-engine admin", docs_url=None, redoc_url=None,
                  openapi_url=None)
    guard_admin_app(app, admin_token)

    @app.exception_handler(HTTPException)
    async def _error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": {"message": exc.detail, "code": exc.status_code}},
                            status_code=exc.status_code)

    _add_lifecycle_routes(app, control)
    _add_serving_routes(app, control)
    _add_lora_routes(app, control)
    _add_read_routes(app, control)
    _add_probe_routes(app, control, registry or engine_registry(control))
    return app


def build_metrics_app(control: EngineControl, registry: CollectorRegistry) -> FastAPI:
    """Read-only: GET /metrics, /healthz and /readyz, no other route at all."""
    app = FastAPI(title="tandem-engine metrics", docs_url=None, redoc_url=None,
                  openapi_url=None)
    guard_admin_app(app, None)  # no token (nothing mutates), bodies bounded all the same
    _add_probe_routes(app, control, registry)
    return app


def _status(status: EngineStatus) -> JSONResponse:
    return JSONResponse(encode_status(status))


async def _body(request: Request, kind: type[AdminRequest], *, optional: bool = False
                ) -> Any:
    """The route's body as the struct `kind` (admin_wire.py), or 422 naming the field."""
    call = f"{request.method} {request.url.path}"
    try:
        return decode_body(call, await request.body(), kind, optional=optional)
    except AdminBodyError as exc:
        raise HTTPException(422, str(exc)) from exc


def _add_lifecycle_routes(app: FastAPI, control: EngineControl) -> None:
    """The state machine: 409 for a signal the state does not allow. A call that takes a
    body reads it here and runs the signal on the threadpool (it waits for the engine
    lock)."""

    def signal(fn: Callable[..., Any], *args: Any) -> JSONResponse:
        try:
            fn(*args)
        except EngineStateError as exc:
            raise HTTPException(409, str(exc)) from exc
        return _status(control.status())

    @app.post("/v1/pause")
    def pause() -> JSONResponse:
        return signal(control.pause)

    @app.post("/v1/unpause")
    def unpause() -> JSONResponse:
        return signal(control.unpause)

    @app.post("/v1/suspend")
    async def suspend(request: Request) -> JSONResponse:
        body: SuspendRequest = await _body(request, SuspendRequest, optional=True)
        return await run_in_threadpool(signal, control.suspend, body.mode)

    @app.post("/v1/resume")
    def resume() -> JSONResponse:
        return signal(control.resume)

    def refit(body: RefitRequest) -> JSONResponse:
        try:
            control.refit(body)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        except CheckpointError as exc:
            raise HTTPException(422, f"refit to {body.uri} refused, old weights still "
                                     f"serving: {exc}") from exc
        except EngineStateError as exc:
            raise HTTPException(409, str(exc)) from exc
        return _status(control.status())

    @app.post("/v1/refit")
    async def refit_route(request: Request) -> JSONResponse:
        return await run_in_threadpool(refit, await _body(request, RefitRequest))


def _add_serving_routes(app: FastAPI, control: EngineControl) -> None:
    """Admission (drain, undrain) and a refit's verification (canary)."""

    @app.post("/v1/drain")
    def drain() -> JSONResponse:
        """Stop admitting new requests (they get 503 and the router places them on another
        engine); running ones finish. The operator polls /v1/state until none is left,
        then deletes the pod. Not readiness-ready from now on."""
        control.drain()
        return _status(control.status())

    @app.post("/v1/undrain")
    def undrain() -> JSONResponse:
        """Admit new requests again (after a refit's verification, or a cancelled
        scale-down). An engine shutting down (SIGTERM) stays draining: 409."""
        try:
            control.undrain()
        except ShuttingDown as exc:
            raise HTTPException(409, str(exc)) from exc
        return _status(control.status())

    def canary(body: CanaryRequest) -> JSONResponse:
        try:
            result = control.canary(body.prompt or body.prompt_token_ids, body.max_tokens,
                                    body.timeout, body.lora_name, body.lora_version)
        except RuntimeError as exc:
            raise HTTPException(409, str(exc)) from exc
        except TimeoutError as exc:
            raise HTTPException(504, str(exc)) from exc
        except RequestRejected as exc:
            raise HTTPException(400, str(exc)) from exc
        weights = control.engine.stats.weights
        return JSONResponse(msgspec.to_builtins(CanaryReply(
            token_ids=result.token_ids, mean_nll=result.mean_nll, top1_mass=result.top1_mass,
            weight_version=weights.version, weight_epoch=weights.epoch,
            lora=result.lora)))

    @app.post("/v1/canary")
    async def canary_route(request: Request) -> JSONResponse:
        """A short greedy generation that no router sees, its prompt scored (mean_nll, and
        top1_mass: the mean probability of the most likely next token): a refit's
        verification. Needs a RUNNING engine (unpause it while it still drains, so routers
        send nothing). 409 when it cannot run or the weights give non-finite logits."""
        return await run_in_threadpool(
            canary, await _body(request, CanaryRequest, optional=True))


def _add_lora_routes(app: FastAPI, control: EngineControl) -> None:
    """LoRA adapters, with vLLM's paths and bodies: 200 with the engine's state (which
    lists the adapters it serves), 400 naming the problem (a bad adapter, name or path,
    LoRA off), 404 unloading a name not served, 422 a body that does not decode. The
    engine reads the adapter under its lock: on the threadpool."""

    def call(fn: Callable[..., str], *args: Any) -> JSONResponse:
        try:
            message = fn(*args)
        except AdapterCallError as exc:
            raise HTTPException(exc.status, exc.message) from exc
        return JSONResponse({**encode_status(control.status()), "message": message})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body: LoadLoRAAdapterRequest = await _body(request, LoadLoRAAdapterRequest)
        return await run_in_threadpool(call, control.load_lora, body)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        body: UnloadLoRAAdapterRequest = await _body(request, UnloadLoRAAdapterRequest)
        return await run_in_threadpool(call, control.unload_lora, body.lora_name)


def _add_read_routes(app: FastAPI, control: EngineControl) -> None:
    """State: open, and never waiting for a step."""

    @app.get("/v1/state")
    def state() -> JSONResponse:
        return _status(control.status())


def _add_probe_routes(app: FastAPI, control: EngineControl,
                      registry: CollectorRegistry) -> None:
    """Health, readiness and metrics: open, read-only, never waiting for a step."""

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        """Liveness: 503 once the stepping thread stopped or its steps keep failing with
        no request to blame (the cause is in the body), so the pod is restarted."""
        w = control.worker
        if not w.alive:
            return JSONResponse({"status": "engine thread stopped"}, status_code=503)
        if w.unhealthy:
            return JSONResponse({"status": "unhealthy", "cause": w.unhealthy},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        ready = control.ready
        return JSONResponse({"ready": ready, "state": str(control.engine.stats.state)},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode(),
                                 media_type="text/plain; version=0.0.4")


class _EngineCollector:
    """Reads the engine's numbers at scrape time (no bookkeeping in the step path). Every
    series carries the engine's `engine_id`, `model_name` and `role` (docs/metrics.md)."""

    def __init__(self, control: EngineControl) -> None:
        self.control = control
        self.worker = control.worker
        self._steps = LatencyHistogram(STEP_BUCKETS)
        self._pulls = LatencyHistogram(HANDOFF_BUCKETS)
        self._lock = threading.Lock()  # two ports' scrapes fold the same samples

    def collect(self):
        with self._lock:
            families = list(self._families())
        yield from families

    def _families(self):
        w, s = self.worker, self.worker.engine.stats
        labels = ["engine_id", "model_name", "role"]
        v = [w.engine_id, w.model_name, str(w.role)]
        gauge, counter = _family_builders(labels, v)
        yield from self._vllm_families(labels, v)
        yield engine_state_family(labels, v, s.state)
        yield weights_info_family(labels, v, s.weights)
        yield gauge("tandem_weight_epoch", "Weight epoch (bumped by each refit)",
                    s.weights.epoch)
        yield counter("tandem_refits", "Refits asked of this engine by outcome: succeeded, "
                      "refused (bad URI or checkpoint: old weights still serving), conflict "
                      "(the engine's state allows no refit)", "outcome",
                      dict(self.control.refits))
        yield counter("tandem_requests_finished", "Finished requests by reason, a prefill "
                      "engine's handovers included", "reason",
                      dict(w.stats.requests_finished))
        yield gauge("tandem_routers", "Routers heard from within the router timeout",
                    w.num_routers)
        yield counter("tandem_prefix_cache_evictions", "Cached blocks evicted",
                      values=s.prefix_cache.evictions)
        yield counter("tandem_step_failures", "Engine steps that raised with no request "
                      "to blame (a few in a row make the engine unhealthy)",
                      values=w.stats.step_failures)
        yield counter("tandem_structured_output_steps", "Engine steps that sampled some "
                      "request under a structured-outputs constraint (token masks)",
                      values=w.stats.grammar_steps)
        yield counter("tandem_structured_output_mask_seconds", "Time those steps spent "
                      "computing the constraints' token masks", values=w.stats.grammar_seconds)
        seconds, w.stats.step_seconds = w.stats.step_seconds, []
        self._steps.observe_all(seconds)
        yield self._steps.family("tandem_step_seconds", "Engine step time", labels, v)
        yield from self._handoff_families(labels, v)
        yield from self._device_families(labels, v)
        if s.speculative is not None:  # only with speculative decoding on
            yield from self._spec_families(labels, v, s.speculative)
        if s.lora is not None:  # only with --enable-lora
            yield from self._lora_families(labels, v, s.lora)

    def _vllm_families(self, labels: list[str], v: list[str]):
        """The names vLLM v1 exports, meaning the same here (docs/metrics.md)."""
        w, s = self.worker, self.worker.engine.stats
        gauge, counter = _family_builders(labels, v)
        yield gauge("vllm:num_requests_running", "Requests in the running batch",
                    s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting for the running batch",
                    s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Share of KV blocks in use (0..1)",
                    s.kv_usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache", values=s.prefix_cache.queried_tokens)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                      values=s.prefix_cache.hit_tokens)
        yield counter("vllm:prompt_tokens", "Prompt tokens of admitted requests",
                      values=w.stats.prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated",
                      values=w.stats.generation_tokens)
        yield counter("vllm:num_preemptions", "Running requests preempted (recomputed "
                      "later) for KV room or for a better priority", values=s.num_preemptions)
        finished = w.stats.requests_finished
        yield counter("vllm:request_success", "Finished requests by reason (handovers are "
                      "in tandem_requests_finished_total)", "finished_reason",
                      {reason: finished.get(reason, 0) for reason in VLLM_FINISH_REASONS})
        yield w.stats.time_to_first_token.family(
            "vllm:time_to_first_token_seconds", "From the request's arrival at the engine to "
            "its first generated token", labels, v)
        yield w.stats.token_gap.family(
            "vllm:inter_token_latency_seconds", "Gap between consecutive outputs of one "
            "request, per token", labels, v)
        yield w.stats.e2e_latency.family(
            "vllm:e2e_request_latency_seconds", "From the request's arrival at the engine to "
            "its finish there", labels, v)

    def _spec_families(self, labels: list[str], v: list[str], spec: SpecDecodeStats):
        """Speculative decoding: vLLM v1's spec_decode counters, meaning the same here,
        and what verifying costs (docs/metrics.md)."""
        w = self.worker
        _, counter = _family_builders(labels, v)
        yield counter("vllm:spec_decode_num_drafts", "Drafts verified: decode steps of a "
                      "request that verified proposed tokens", values=spec.num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified",
                      values=spec.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                      values=spec.num_accepted_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Proposed tokens "
                      "accepted, by their position in the draft (0 = the first proposed)",
                      "position", {str(i): n for i, n in enumerate(spec.accepted_per_position)})
        yield counter("tandem_spec_decode_num_draft_tokens_per_pos", "Proposed tokens "
                      "verified, by their position in the draft: the exact acceptance rate at "
                      "position i is accepted_per_pos / this (drafts may be shorter than k)",
                      "position", {str(i): n for i, n in enumerate(spec.proposed_per_position)})
        yield counter("tandem_spec_decode_steps", "Engine steps with decode tokens: kind "
                      "verify (some request verified proposals) or plain (none did)", "kind",
                      dict(w.stats.spec_steps))
        yield counter("tandem_spec_decode_step_seconds", "Time in engine steps with decode "
                      "tokens, by kind (verify, plain)", "kind", dict(w.stats.spec_step_seconds))

    def _lora_families(self, labels: list[str], v: list[str], lora: LoRAStats):
        """LoRA adapters: vLLM's info gauge (its labels say which adapters the running and
        waiting requests use, comma-joined; its value is the time of the scrape, as
        vLLM's is), and the device slots' loads, evictions and hits."""
        _, counter = _family_builders(labels, v)
        info = GaugeMetricFamily(
            "vllm:lora_requests_info", "LoRA adapters of the running and waiting requests "
            "(value: the time it was read)",
            labels=[*labels, "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([*v, ",".join(lora.running), ",".join(lora.waiting),
                         str(lora.max_loras)], time.time())
        yield info
        yield counter("tandem_lora_loads", "LoRA adapters copied into a device slot",
                      values=lora.loads)
        yield counter("tandem_lora_evictions", "LoRA adapters whose device slot another "
                      "adapter took (least recently used first)", values=lora.evictions)
        yield counter("tandem_lora_hits", "Requests whose LoRA adapter was already in a "
                      "device slot", values=lora.hits)

    def _handoff_families(self, labels: list[str], v: list[str]):
        """KV handoff: pins on a prefill engine, pulls on a decode engine."""
        w, s = self.worker, self.worker.engine.stats
        gauge, counter = _family_builders(labels, v)
        h = w.handoff.stats if w.handoff is not None else HandoffStats()
        yield gauge("tandem_kv_pinned_blocks", "KV blocks pinned for a decode engine's pull",
                    s.num_pinned_blocks)
        yield gauge("tandem_kv_quarantined_blocks", "KV blocks kept out of use because a "
                    "failed pull's transfer may still write them", s.num_quarantined_blocks)
        yield counter("tandem_kv_handoff_bytes", "KV bytes pulled from prefill engines",
                      values=h.bytes)
        yield counter("tandem_kv_handoff_blocks", "Prompt blocks of handed-over requests: "
                      "pulled, or reused from this engine's prefix cache", "kind",
                      {"pulled": h.pulled_blocks, "reused": h.reused_blocks})
        yield counter("tandem_kv_handoff_failures", "Pulls that failed, by cause", "cause",
                      {"geometry": 0, "peer": 0, "timeout": 0, **h.failures})
        yield counter("tandem_kv_handoff_recomputes", "Handed-over requests whose prompt "
                      "was recomputed here (failed pull, or a suspend during the pull)",
                      values=s.num_pull_fallbacks)
        seconds, h.seconds = h.seconds, []
        self._pulls.observe_all(seconds)
        yield self._pulls.family("tandem_kv_handoff_seconds", "KV handoff pull time on the "
                                 "decode engine (add peer, READ, wait), successful pulls",
                                 labels, v)

    def _device_families(self, labels: list[str], v: list[str]):
        """The device's memory, labelled with its type: device-wide on CUDA (and what this
        process's torch holds), the process RSS and host total on the CPU."""
        d = self.control.device_probe()
        info = GaugeMetricFamily("tandem_device_info", "The engine's device (value 1)",
                                 labels=[*labels, "type", "index", "name"])
        info.add_metric([*v, d.type, "" if d.index is None else str(d.index), d.name], 1)
        yield info
        memory = GaugeMetricFamily(
            "tandem_device_memory_bytes", "Device memory by kind: total, used (CUDA: "
            "device-wide; CPU: this process's RSS), torch_allocated, torch_reserved, "
            "torch_peak (CUDA only)", labels=[*labels, "type", "kind"])
        for kind, value in (("total", d.memory_total_bytes), ("used", d.memory_used_bytes),
                            ("torch_allocated", d.torch_allocated_bytes),
                            ("torch_reserved", d.torch_reserved_bytes),
                            ("torch_peak", d.torch_peak_bytes)):
            if value is not None:
                memory.add_metric([*v, d.type, kind], value)
        yield memory


def _family_builders(labels: list[str], v: list[str]):
    """A gauge and a counter builder for series labelled `labels` = `v` (plus one `by`
    label for a counter of several series). Counters are named without `_total`:
    prometheus_client appends it."""

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=labels)
        g.add_metric(v, value)
        return g

    def counter(name: str, doc: str, by: str | None = None,
                values: dict[str, float] | float = 0) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=labels if by is None else [*labels, by])
        if isinstance(values, dict):
            for key, n in sorted(values.items()):
                c.add_metric([*v, key], n)
        else:
            c.add_metric(v, values)
        return c

    return gauge, counter
