"""`tandem-engine`: one engine process — the model, a ZMQ socket for routers, the admin API.

The admin HTTP API (and `--metrics-port`) answers from the start: while the checkpoint
loads, /healthz is 200, /readyz 503 and /v1/state says LOADING with the load's progress
(server/loading.py); the ZMQ socket binds once the engine exists. A failed load exits 2.

The ZMQ socket authenticates routers with CURVE when the environment holds the pool's
keys (`tandem_engine.zmq_auth`); refits and LoRA adapters loaded at run time read only
inside `--weights-root`; `--metrics-port` serves metrics and probes read-only, apart from
the admin API. `--lora-modules` adapters are loaded before the socket binds: one that
cannot be loaded ends the start (exit 2), so a router never sees an engine without them.

SIGTERM (or SIGINT) stops admitting requests, lets in-flight ones finish within
`--shutdown-grace` seconds, aborts the rest (their routers get final outputs), and
exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import prometheus_client

from tandem_engine.cli_help import ArgumentParser
from tandem_engine.config import (
    ENGINE_CONFIG_FLAGS,
    ENGINE_FLAGS,
    EngineConfig,
    parse_device,
    speculative_from_flags,
)
from tandem_engine.engine_flags import add_flags, namespace_values
from tandem_engine.http_guard import add_deadline_flags, protocol_class
from tandem_engine.lifecycle import EngineRole
from tandem_engine.lora_request import LoRARequest
from tandem_engine.ports import port_problem
from tandem_engine.server.adapters import lora_modules
from tandem_engine.server.loading import (
    KERNEL_BUILD_PHASE,
    TEST_LOAD_DELAY_ENV,
    LoadingEngine,
    ModelLoad,
    test_load_delay,
)
from tandem_engine.server.weights_roots import WeightsRoots
from tandem_engine.weights import WeightIdentity, resolve_checkpoint
from tandem_engine.zmq_auth import CurveServer, engine_curve, unauthenticated_warning

log = logging.getLogger("tandem_engine.server.main")


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated flags: a pod's args mean what they spell (the operator refuses engine
    # args that set a flag it renders, which `--max-model` would otherwise slip past).
    p = ArgumentParser(
        prog="tandem-engine", description=__doc__.split("\n")[0], allow_abbrev=False,
        epilog=f"Test knob, for tests only: ${TEST_LOAD_DELAY_ENV}=SECONDS makes the model "
               "load wait that long once the checkpoint is validated, before any tensor "
               "data is read, to simulate a slow load (e.g. a multi-GB checkpoint).")
    p.add_argument("--model", required=True,
                   help="checkpoint: a HuggingFace-format folder or a GGUF file")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the folder name)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the ZMQ socket and the HTTP ports listen on")
    p.add_argument("--port", type=int, required=True, help="ZMQ port routers connect to")
    p.add_argument("--admin-port", type=int, required=True, help="admin HTTP port")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="also serve GET /metrics, /healthz and /readyz (read-only, nothing "
                        "else) on this port, for Prometheus and probes")
    p.add_argument("--engine-id", default=None, help="default: host:port")
    p.add_argument("--role", choices=[str(r) for r in EngineRole],
                   default=str(EngineRole.MIXED),
                   help="mixed: prefill and decode; prefill or decode: one half of a "
                        "disaggregated pair")
    p.add_argument("--heartbeat-interval", type=float, default=0.5,
                   help="seconds between heartbeats to each connected router")
    p.add_argument("--router-timeout", type=float, default=10.0,
                   help="forget a router silent this long (no PING, HELLO, SUBMIT or "
                        "ABORT) and abort its requests (s)")
    p.add_argument("--max-routers", type=int, default=1024,
                   help="routers remembered at once; a new one beyond this evicts the "
                        "least recently heard (default 1024)")
    p.add_argument("--pull-timeout", type=float, default=10.0,
                   help="decode: deadline of one KV pull from a prefill engine (s)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    add_deadline_flags(p, "an admin or metrics client")
    p.add_argument("--admin-token-file", type=Path, default=None,
                   help="bearer token for mutating admin calls (else $TANDEM_ADMIN_TOKEN)")
    p.add_argument("--weights-root", type=Path, action="append", default=[],
                   metavar="DIR", help="a folder refits may load checkpoints from "
                   "(repeatable; symlinks are resolved first); default: the folder "
                   "holding --model")
    # The engine's own flags (EngineConfig's, and torch's threads): config.ENGINE_FLAGS.
    add_flags(p, ENGINE_FLAGS)
    p.add_argument("--weight-version", default="initial",
                   help="the version name of the weights at --model (the pool's weights.version)")
    p.add_argument("--weight-epoch", type=int, default=0,
                   help="the pool-wide number of the weights at --model (routers prefer the "
                        "highest); refits set it from then on")
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine options, checked before the model loads: a bad value, or a GPU asked for
    where none is visible, fails at start (exit 2)."""
    config = EngineConfig(**namespace_values(ENGINE_CONFIG_FLAGS, args),
                          speculative=speculative_from_flags(args))
    config.validate()
    if parse_device(config.device)[0] == "cuda":  # torch is imported only when a GPU is asked
        from tandem_engine.model.device import resolve_device

        resolve_device(config.device)
    return config


def _read_token(path: Path | None) -> str | None:
    """The admin bearer token: from --admin-token-file, else $TANDEM_ADMIN_TOKEN, else none.

    Kubernetes pods get it from the pool's Secret as an environment variable."""
    if path is None:
        token = os.environ.get("TANDEM_ADMIN_TOKEN", "").strip()
        return token or None
    token = path.read_text().strip()
    if not token:
        raise SystemExit(f"tandem-engine: --admin-token-file {path} is empty")
    return token


def _http_protocol(args: argparse.Namespace) -> type:
    """uvicorn's HTTP protocol for the admin and metrics ports: the header and body
    deadlines and JSON refusals of the router's (http_guard.py), in the admin API's error
    shape (server/admin.py)."""
    return protocol_class(args.header_timeout, args.body_timeout,
                          lambda status, message: {"error": {"message": message,
                                                             "code": status}})


class _HttpServers:
    """The admin (and metrics) HTTP servers: up from the start with the loading apps
    (server/loading.py), switched to the full apps once the engine exists."""

    def __init__(self, ports: dict[str, int], host: str, http: type,
                 loading_apps: dict) -> None:
        import uvicorn

        from tandem_engine.server.loading import SwappableApp

        self.apps = {name: SwappableApp(loading_apps[name]) for name in ports}
        self.servers = [uvicorn.Server(uvicorn.Config(self.apps[name], host=host, port=port,
                                                      http=http, log_level="warning",
                                                      lifespan="off"))
                        for name, port in ports.items()]
        # Each server runs on its own thread and loop: off the main thread uvicorn leaves
        # SIGTERM/SIGINT alone, and a slow admin call never delays socket I/O.
        self.threads = [threading.Thread(target=lambda s=server: asyncio.run(s.serve()),
                                         name=f"{name}-http", daemon=True)
                        for name, server in zip(ports, self.servers, strict=True)]
        for thread in self.threads:
            thread.start()

    def switch(self, full_apps: dict) -> None:
        for name, app in full_apps.items():
            self.apps[name].app = app

    def should_exit(self) -> None:
        for server in self.servers:
            server.should_exit = True

    async def stop(self) -> None:
        self.should_exit()
        for thread in self.threads:
            await asyncio.to_thread(thread.join, 5)


async def _run(args: argparse.Namespace, config: EngineConfig, curve: CurveServer | None,
               roots: WeightsRoots, load_delay_s: float, loras: list[LoRARequest]) -> int:
    from tandem_engine.server.admin_guard import guard_admin_app
    from tandem_engine.server.loading import build_loading_app

    token = _read_token(args.admin_token_file)
    if curve is None:
        log.warning("%s", unauthenticated_warning(args.port))
    loading = LoadingEngine(
        args.engine_id or f"{socket.gethostname()}:{args.port}", args.role,
        args.served_model_name or Path(args.model).name,
        WeightIdentity(Path(args.model).resolve().as_uri(), args.weight_version,
                       args.weight_epoch))
    # Probes, state and load progress are served before the model loads; the ZMQ socket
    # binds only once the engine exists (routers connect when it is there).
    load = ModelLoad(args.model, test_delay_s=load_delay_s)
    ports = {"admin": args.admin_port}
    if args.metrics_port is not None:
        ports["metrics"] = args.metrics_port
    # The admin token (and the body bound) hold from the first request, loading included.
    http = _HttpServers(ports, args.host, _http_protocol(args), {
        name: guard_admin_app(build_loading_app(loading, load, admin=name == "admin"),
                              token if name == "admin" else None) for name in ports})
    log.info("engine %s loading %s: admin http://%s:%d%s", loading.engine_id, args.model,
             args.host, args.admin_port, "" if args.metrics_port is None
             else f", metrics http://{args.host}:{args.metrics_port}")
    try:
        return await _load_and_serve(args, config, curve, roots, token, loading, load, http,
                                     loras)
    finally:  # a failed load ends the process: its probes must not outlive it
        await http.stop()


def _build_native_kernel(config: EngineConfig, load: ModelLoad) -> None:
    """On the first start on a machine, compile the native CPU kernel before the model
    loads, as a phase of its own (`/v1/state`, the log): half a minute that would
    otherwise pass unexplained inside the load. The runner then loads the cached kernel,
    and reports a failed build as it always does (a warning with `auto`, an error with
    `native`)."""
    from tandem_engine.model import native
    from tandem_engine.model.device import resolve_device

    if config.kernels not in ("auto", "native") or resolve_device(config.device).type != "cpu":
        return
    if not native.build_pending():
        return
    load.set_step(KERNEL_BUILD_PHASE)
    try:
        native.paged_decode_kernel()
    except native.NativeKernelUnavailable:
        pass  # remembered by `native`; the runner reports it
    finally:
        load.set_step(None)


async def _load_and_serve(args: argparse.Namespace, config: EngineConfig,
                          curve: CurveServer | None,
                          roots: WeightsRoots, token: str | None, loading: LoadingEngine,
                          load: ModelLoad, http: _HttpServers,
                          loras: list[LoRARequest]) -> int:
    """Load the model and the `--lora-modules` adapters, switch the HTTP servers to the
    full apps, serve until stopped."""
    import torch

    from tandem_engine.engine.llm_engine import LLMEngine
    from tandem_engine.server.adapters import EngineAdapters
    from tandem_engine.server.admin import build_admin_app, build_metrics_app, engine_registry
    from tandem_engine.server.control import EngineControl
    from tandem_engine.server.worker import EngineWorker

    torch.set_num_threads(args.threads)
    await asyncio.to_thread(_build_native_kernel, config, load)
    engine = await asyncio.to_thread(LLMEngine.from_checkpoint, args.model, config,
                                     load.report)
    engine.set_weights(loading.weights)
    log.info("loaded %s in %.1f s", args.model, load.as_dict()["seconds"])
    adapters = EngineAdapters(engine, roots)
    await asyncio.to_thread(adapters.preload, loras)  # ValueError: exit 2 naming it
    if loras:
        log.info("serving LoRA adapters %s", ", ".join(
            f"{lora.lora_name}@{lora.lora_version}" for lora in loras))
    engine_id = loading.engine_id
    transfer = None
    if args.role != "mixed":  # prefill and decode engines hand KV over with NIXL
        from tandem_engine.transfer import NixlBackend

        # The agent is named after the engine: a restarted engine (same id, new process)
        # replaces its stale self in every decode engine's peer table.
        transfer = NixlBackend(engine_id)
    worker = EngineWorker(engine, engine_id=engine_id, model_name=loading.model_name,
                          role=args.role, heartbeat_interval=args.heartbeat_interval,
                          transfer=transfer, pull_timeout=args.pull_timeout,
                          router_timeout=args.router_timeout,
                          max_routers=args.max_routers, adapters=adapters)

    shutdown = asyncio.Event()
    control = EngineControl(worker, roots)
    registry = engine_registry(control)
    full = {"admin": build_admin_app(control, token, registry)}
    if args.metrics_port is not None:
        full["metrics"] = build_metrics_app(control, registry)
    loop = asyncio.get_running_loop()
    stopping = False
    background: set[asyncio.Task] = set()

    def on_signal(signum: int) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        worker.set_draining(True)  # refuse new requests from now on
        log.info("signal %d: draining (grace %.0f s)", signum, args.shutdown_grace)

        async def drain_then_stop() -> None:
            await asyncio.to_thread(worker.drain, args.shutdown_grace)
            http.should_exit()
            shutdown.set()

        task = loop.create_task(drain_then_stop())
        background.add(task)
        task.add_done_callback(background.discard)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    serving = asyncio.create_task(worker.serve(f"tcp://{args.host}:{args.port}", shutdown,
                                               curve))
    # Switch to the full apps once the stepping thread runs: /healthz never sees a
    # worker that has not started yet.
    while not worker.alive and not serving.done():
        await asyncio.sleep(0.01)
    http.switch(full)
    log.info("engine %s ready: zmq tcp://%s:%d (%s), admin http://%s:%d%s", engine_id,
             args.host, args.port, "CURVE" if curve else "unauthenticated", args.host,
             args.admin_port, "" if args.metrics_port is None
             else f", metrics http://{args.host}:{args.metrics_port}")
    await serving
    log.info("engine %s stopped", engine_id)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.model = str(resolve_checkpoint(args.model))  # a model image's /model: its .gguf
    # Before torch loads OpenMP: its workers then sleep between parallel regions instead
    # of spinning for milliseconds after each. The native kernels share the cores out with
    # their own pool, and on a small machine a spinning worker took a core from it (a
    # 17-row fused decode step: 16.6 ms, 11.7 with sleeping workers). The environment's
    # own OMP_WAIT_POLICY wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    prometheus_client.disable_created_metrics()  # no `_created` series (docs/metrics.md)
    try:
        # Keys and roots are checked before the model loads: a bad Secret fails at once.
        curve = engine_curve()
        roots = WeightsRoots.of(args.weights_root, Path(args.model))
        if args.metrics_port in (args.port, args.admin_port):
            raise ValueError(f"--metrics-port {args.metrics_port}: give a port apart from "
                             "--port and --admin-port")
        # The ZMQ port is bound once the model is loaded: a port in use fails at once.
        held = port_problem(args.host, args.port)
        if held is not None:
            raise ValueError(f"--port {args.port}: cannot listen on {args.host}:{args.port} "
                             f"({held}); give another port")
        load_delay_s = test_load_delay()
        config = engine_config(args)
        loras = lora_modules(args.lora_modules, config.enable_lora)
        code = asyncio.run(_run(args, config, curve, roots, load_delay_s, loras))
    except Exception as exc:  # report a startup failure in one line, not a traceback
        from tandem_engine.errors import TandemError

        if isinstance(exc, TandemError | ValueError | OSError):
            print(f"tandem-engine: error: {exc}", file=sys.stderr)
            return 2
        raise
    _exit_now(code)
    return code  # not reached


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown. The engine has stopped cleanly by now
    (requests ended, sockets closed, the log written); what is left is collecting torch's
    and NIXL's objects, whose finalizers took 6 s on the demo model (measured: the main
    thread "Garbage-collecting" after "stopped"), time a rolling restart or `tandem serve`'s
    Ctrl-C would otherwise wait out."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
