"""The engine process before its engine exists: probes, state and progress while it loads.

Kubernetes probes a pod from the moment it starts, and a multi-GB checkpoint takes
minutes to load. So the admin (and metrics) HTTP servers start first, serving the apps
built here: `/healthz` 200, `/readyz` 503, `GET /v1/state` in state LOADING with the
load's progress, `/metrics` with the bytes loaded; every mutating admin call gets 503
(nothing to signal yet). Once the engine is built, `SwappableApp` switches each server
to the full app (server/admin.py) without restarting it. A failed load ends the process
(non-zero exit), so `/healthz` never stays 200 for an engine that will not come.

`ModelLoad` is the load's progress: written by the loading thread through the loader's
callback, read by the HTTP threads, and logged at most every few seconds and per file.
Its `phase` names the step in words (`tandem serve` shows it): preparing, the first
start's build of the native CPU kernel, reading the checkpoint, building the engine.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from tandem_engine.admin_wire import EngineStatus, LoadingProgress, encode_status
from tandem_engine.lifecycle import EngineRole, EngineState
from tandem_engine.server.metric_families import engine_state_family, weights_info_family
from tandem_engine.weights import WeightIdentity, format_bytes

if TYPE_CHECKING:
    from tandem_engine.model.checkpoint import LoadProgress

log = logging.getLogger("tandem_engine.server.loading")

# A test knob, nothing else: seconds the load waits once the checkpoint is validated
# (its totals known) and before any tensor data is read, to simulate a slow load.
TEST_LOAD_DELAY_ENV = "TANDEM_TEST_LOAD_DELAY_S"
MAX_TEST_LOAD_DELAY_S = 3600.0
LOG_EVERY_S = 5.0
# The phases `GET /v1/state` reports in `loading.phase`, in order.
KERNEL_BUILD_PHASE = "compiling the native CPU kernel (first start on this machine, about 30 s)"
PREPARING_PHASE = "preparing to load the model"
READING_PHASE = "loading the model"
BUILDING_PHASE = "building the engine"


def test_load_delay() -> float:
    """`$TANDEM_TEST_LOAD_DELAY_S` in seconds (0 when unset); ValueError when malformed."""
    raw = os.environ.get(TEST_LOAD_DELAY_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        delay = float(raw)
    except ValueError:
        delay = -1.0
    if not 0.0 <= delay <= MAX_TEST_LOAD_DELAY_S:
        raise ValueError(f"${TEST_LOAD_DELAY_ENV}={raw!r}: give seconds from 0 to "
                         f"{MAX_TEST_LOAD_DELAY_S:.0f} (a test knob; unset it in production)")
    return delay


class ModelLoad:
    """Progress of the checkpoint load at startup. `report` is the loader's callback."""

    def __init__(self, source: str, test_delay_s: float = 0.0) -> None:
        self.source = source
        self.test_delay_s = test_delay_s
        self.started = time.monotonic()
        self._progress: LoadProgress | None = None
        self._lock = threading.Lock()
        self._last_log, self._files_logged = 0.0, -1  # a line per file, else every few s
        self._step: str | None = None  # a phase before the checkpoint's own (set_step)
        self._stepped = False  # a step came and went: preparing is over

    def set_step(self, phase: str | None) -> None:
        """Report `phase` instead of the checkpoint's own until `set_step(None)`."""
        with self._lock:
            self._step, self._stepped = phase, True

    @property
    def phase(self) -> str:
        with self._lock:
            step, p, stepped = self._step, self._progress, self._stepped
        if step is not None:
            return step
        if p is None:
            return READING_PHASE if stepped else PREPARING_PHASE
        if p.bytes_done < p.bytes_total or p.files_done < p.files_total:
            return READING_PHASE
        return BUILDING_PHASE

    def report(self, progress: LoadProgress) -> None:
        with self._lock:
            first, self._progress = self._progress is None, progress
        now = time.monotonic()
        if progress.files_done != self._files_logged or now - self._last_log >= LOG_EVERY_S:
            self._files_logged, self._last_log = progress.files_done, now
            log.info("loading %s: %s after %.1f s", self.source, describe(progress),
                     now - self.started)
        if first and self.test_delay_s > 0:
            log.warning("test knob %s: waiting %.1f s before reading tensor data",
                        TEST_LOAD_DELAY_ENV, self.test_delay_s)
            time.sleep(self.test_delay_s)

    def progress(self) -> LoadingProgress:
        """The `loading` object of `GET /v1/state` (totals 0 until the checkpoint is
        validated)."""
        with self._lock:
            p = self._progress
        done = (p.bytes_done, p.bytes_total, p.files_done, p.files_total) if p else (0,) * 4
        return LoadingProgress(phase=self.phase, bytes_done=done[0], bytes_total=done[1],
                               files_done=done[2], files_total=done[3],
                               seconds=round(time.monotonic() - self.started, 1))

    def as_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.progress())


def describe(p: LoadProgress) -> str:
    share = f" ({100 * p.bytes_done / p.bytes_total:.0f}%)" if p.bytes_total else ""
    return (f"{format_bytes(p.bytes_done)} of {format_bytes(p.bytes_total)}{share}, "
            f"{p.files_done} of {p.files_total} files")


@dataclass(frozen=True)
class LoadingEngine:
    """What the process already knows about the engine it is loading."""

    engine_id: str
    role: str
    model_name: str
    weights: WeightIdentity

    def status(self, load: ModelLoad) -> EngineStatus:
        """`GET /v1/state` while loading: what every reader of the full status relies on
        (state, weights, counts, draining), plus `loading`; no KV numbers yet."""
        w = self.weights
        return EngineStatus(
            engine_id=self.engine_id, role=EngineRole(self.role), model=self.model_name,
            state=EngineState.LOADING, weight_version=w.version, weight_epoch=w.epoch,
            weight_uri=w.uri, num_running=0, num_waiting=0, kv_usage=0.0, draining=False,
            unhealthy=None, loading=load.progress())


class SwappableApp:
    """An ASGI app whose target is replaced once the engine is loaded (a running uvicorn
    server keeps its socket; each request goes to the app current when it arrives)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


def build_loading_app(engine: LoadingEngine, load: ModelLoad, *, admin: bool) -> FastAPI:
    """The probes and metrics while loading; with `admin`, also `GET /v1/state` and a 503
    for every mutating call (all of them are POSTs)."""
    app = FastAPI(title="tandem-engine (loading)", docs_url=None, redoc_url=None,
                  openapi_url=None)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_LoadCollector(engine, load))

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        return JSONResponse({"status": "loading", "loading": load.as_dict()})

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        return JSONResponse({"ready": False, "state": str(EngineState.LOADING)},
                            status_code=503)

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    if not admin:
        return app

    @app.get("/v1/state")
    def state() -> JSONResponse:
        return JSONResponse(encode_status(engine.status(load)))

    @app.post("/{path:path}")
    def not_yet(path: str) -> JSONResponse:
        loading = load.as_dict()
        done = (f"{format_bytes(loading['bytes_done'])} of "
                f"{format_bytes(loading['bytes_total'])}")
        message = (f"engine {engine.engine_id} is still loading its model ({done} after "
                   f"{loading['seconds']:.0f} s): POST /{path} is possible once GET /readyz "
                   "answers 200; GET /v1/state shows the progress")
        return JSONResponse({"error": {"message": message, "code": 503}}, status_code=503,
                            headers={"Retry-After": "5"})

    return app


class _LoadCollector:
    """The load's bytes, the LOADING state and the weights being loaded, labelled like every
    engine series (engine_id, model_name, role)."""

    def __init__(self, engine: LoadingEngine, load: ModelLoad) -> None:
        self.engine, self.load = engine, load

    def collect(self):
        e = self.engine
        labels, values = ["engine_id", "model_name", "role"], [e.engine_id, e.model_name,
                                                                str(e.role)]
        loading = self.load.as_dict()
        for name, doc, key in (
                ("tandem_model_load_done_bytes", "Checkpoint bytes loaded so far", "bytes_done"),
                ("tandem_model_load_size_bytes", "Checkpoint bytes to load", "bytes_total")):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, loading[key])
            yield g
        yield engine_state_family(labels, values, EngineState.LOADING)
        yield weights_info_family(labels, values, e.weights)
