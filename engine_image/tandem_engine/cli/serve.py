"""`tandem serve`: the whole local stack — N engine processes and a router — on loopback.

The same processes a Kubernetes pool runs, started as children of this one. It shows
each engine's phase while models load (from its `GET /v1/state`: the first start's kernel
build, bytes and files loaded; one block redrawn in place on a terminal, a line per phase
change otherwise), prints the URL once the router is ready,
and on Ctrl-C / SIGTERM stops everything: children get SIGTERM (engines drain), then
SIGKILL after a grace period. Children also get SIGTERM from the kernel if this
process dies (PR_SET_PDEATHSIG), so no orphan survives. Torch-free.

While it serves it supervises (cli/supervision.py): a child that dies is restarted with
back-off and the same arguments, and only a child that crash-loops stops the stack.
Nothing a client sends can make an engine exit and spend its restart budget: the admin
API checks its token and bounds every body before any route reads one
(server/admin_guard.py).

While it serves, `<log dir>/stack.json` describes the stack (router URL, each engine's
name, role and admin URL; the engines' admin token; the weights roots; the start-up
`--lora-modules`, folders resolved; per child its pid, restarts and last exit cause), so
other commands (`tandem refit`) find it by its port. It holds a secret, so only the user
can read it (mode 0600).

A stack never touches another. Before it starts anything it claims its router port and
its log dir (cli/stack_claim.py: a port in use, or a folder a live stack holds, is
refused at once, naming the port and `--port`), and its engines' ports are picked
together, all free and distinct. Its router gets a fresh id in its
environment ($TANDEM_ROUTER_ID), and the stack is ready only when the router on its
port reports that id, so another router that answers there is never taken for its own.
Its router's `/metrics` also serves the engines' series (`--engine-metrics-url`).

The stack is authenticated by default: each `tandem serve` makes fresh CURVE keypairs
for the engines' ZMQ sockets (only its router can connect to them) and a fresh admin
token, and hands them to its children in their environment, never in argv (the router
gets the admin token too: it opens vLLM's LoRA adapter calls, `POST
/v1/load_lora_adapter`, which the router does on every engine). `--lora-modules` goes to
every engine, prefill and decode alike, so both halves of a pair serve the same adapters. Refits may
load checkpoints from the folder holding `--model` (`tandem serve --demo`: the demo
folder itself) and from each `--weights-root`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from tandem_engine.admin_wire import decode_status
from tandem_engine.cli.progress import Status, StatusBlock, render
from tandem_engine.cli.stack_claim import (
    LOCK_FILE,
    STACK_FILE,
    check_port_free,
    claim_log_dir,
    default_log_dir,
    free_port,
    free_ports,
    read_stack,
)
from tandem_engine.cli.supervision import (
    Child,
    die_with_parent,
    start_process,
    supervise_round,
)
from tandem_engine.lifecycle import EngineRole, EngineState
from tandem_engine.lora_request import parse_lora_module
from tandem_engine.router.admission import KeyPolicy
from tandem_engine.router.auth import API_KEY_ENV, policy_lines
from tandem_engine.weights import WeightsURIError, checkpoint_path, format_bytes
from tandem_engine.zmq_auth import ALL_VARIABLES, stack_environments

# Where tests and the other commands import them from (their owners: stack_claim.py and
# supervision.py).
__all__ = ["LOCK_FILE", "STACK_FILE", "Child", "LocalStack", "check_port_free",
           "default_log_dir", "die_with_parent", "engine_status", "free_port",
           "phase_block", "read_stack", "run"]


def engine_status(state: dict | None) -> Status:
    """What an engine that is not ready yet is doing, from its `GET /v1/state` (None: no
    answer yet, the process is still starting)."""
    if state is None:
        return Status("starting")
    loading = state.get("loading")
    if not isinstance(loading, dict):
        return Status(f"{str(state.get('state', 'starting')).lower()}, not ready yet")
    seconds = f"{loading.get('seconds', 0):.0f} s"
    done, total = loading.get("bytes_done", 0), loading.get("bytes_total", 0)
    if total and done < total:
        files = f"{loading.get('files_done', 0)} of {loading.get('files_total', 0)} files"
        return Status(loading.get("phase", "loading the model"),
                      f"{format_bytes(done)} of {format_bytes(total)}, "
                      f"{100 * done / total:.0f}%, {files}, {seconds}")
    return Status(loading.get("phase", "loading the model"), seconds)


def phase_block(states: dict[str, dict | None]) -> list[str]:
    """The lines `tandem serve` shows for engines loading, from each one's `/v1/state`."""
    return render({name: engine_status(state) for name, state in states.items()})


def _drop_flags(args: list[str], flags: Sequence[str]) -> list[str]:
    """`args` without each of `flags` and its value."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            out.append(arg)
    return out


def _lora_modules(engine_args: list[str]) -> list[str]:
    """The `--lora-modules` every engine starts with, as NAME@VERSION=PATH with each folder
    resolved here (where the engines start): `tandem refit --adapter` puts one of them
    back from there when a change of its version fails. ValueError naming a bad one."""
    values: list[str] = []
    taking = False
    for arg in engine_args:
        if arg.startswith("--"):
            taking = arg == "--lora-modules"
        elif taking:
            values.append(arg)
    loras = [parse_lora_module(spec) for spec in values]
    return [f"{lora.identity}={Path(lora.lora_path).resolve()}" for lora in loras]


class LocalStack:
    def __init__(self, model: Path, *, engines: int = 1, prefill: int = 0, decode: int = 0,
                 host: str = "127.0.0.1",
                 port: int = 8000, served_model_name: str | None = None,
                 engine_args: list[str] | None = None, log_dir: Path | None = None,
                 out=sys.stdout, restart_limit: int = 5, restart_window: float = 60.0,
                 backoff_base: float = 1.0, backoff_cap: float = 30.0,
                 weights_roots: list[Path] | None = None,
                 model_root: Path | None = None,
                 api_keys: Sequence[str] | Mapping[str, KeyPolicy] = (),
                 router_args: Sequence[str] = ()) -> None:
        """`model_root`: the folder refits may load from besides each of `weights_roots`
        (default: the one holding `model`; `tandem serve --demo` gives the demo folder, not
        the directory it was started in). `router_args`: extra `tandem-router` flags
        (router/flags.py)."""
        if prefill or decode:
            if prefill < 1 or decode < 1:
                raise ValueError(f"--prefill {prefill} --decode {decode}: a disaggregated "
                                 "stack needs at least one of each")
            self.roles = [EngineRole.PREFILL] * prefill + [EngineRole.DECODE] * decode
        else:
            if engines < 1:
                raise ValueError(f"--engines {engines}: at least one engine is needed")
            self.roles = [EngineRole.MIXED] * engines
        self.model = model
        self.num_engines = len(self.roles)
        self.host = host
        self.port = port
        self.name = served_model_name or (model.stem if model.suffix == ".gguf" else model.name)
        self.engine_args = engine_args or []
        self.router_args = list(router_args)
        self.lora_modules = _lora_modules(self.engine_args)
        self.log_dir = log_dir or default_log_dir(port)
        self.out = out
        self.children: list[Child] = []
        self.engines: list[dict[str, str]] = []  # name, role, admin_url, metrics_url of each
        self.restart_limit = restart_limit
        self.restart_window = restart_window
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        # Refits may load from beside --model (or from `model_root`) and from each
        # --weights-root given.
        root = (model_root or model.resolve().parent).resolve()
        self.weights_roots = [root, *(weights_roots or [])]
        # Per stack: the engines' admin token and the ZMQ CURVE keys of engines and router.
        self.admin_token = secrets.token_urlsafe(32)
        engine_keys, router_keys = stack_environments()
        inherited = {k: v for k, v in os.environ.items()
                     if k not in (*ALL_VARIABLES, "TANDEM_ADMIN_TOKEN")}
        self.engine_env = {**inherited, **engine_keys, "TANDEM_ADMIN_TOKEN": self.admin_token}
        # The router takes the admin token too: it opens the LoRA adapter calls, which it
        # does on every engine (router/adapters.py).
        self.router_env = {**inherited, **router_keys, "TANDEM_ADMIN_TOKEN": self.admin_token}
        # The router's API keys travel in its environment, never in argv (`ps`); these
        # are all it accepts (an inherited $TANDEM_API_KEY is not passed on).
        # Keys with what each may do (a Mapping: rate limits, tenants, models) travel as
        # key lines (auth.policy_lines).
        self.api_keys = tuple(api_keys)
        self.router_env.pop(API_KEY_ENV, None)
        lines = policy_lines(api_keys) if isinstance(api_keys, Mapping) else ""
        if " " in lines:  # some key says what it may do
            self.router_env[API_KEY_ENV] = lines
        elif self.api_keys:
            self.router_env[API_KEY_ENV] = ",".join(self.api_keys)
        # The id the router reports in /v1/engines: readiness counts only from it.
        self.router_id = f"router-{secrets.token_hex(6)}"
        self._lock_fd: int | None = None  # the log dir's lock, held from `claim` to `stop`

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def _spawn(self, name: str, args: list[str], ready_url: str,
               env: dict[str, str] | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        child = Child(name, start_process(args, log, "wb", env), ready_url, log,
                      args=list(args), env=env)
        self.children.append(child)
        return child

    def supervise(self) -> str | None:
        """One round of supervision (`supervise_round`): notice dead children, restart
        those whose back-off is over (an engine on the weights its peers serve now), note
        restarted ones that are ready again. Returns why the stack must stop (a child
        crash-looping), else None."""

        def before_restart(child: Child) -> None:
            if child.name in {e["name"] for e in self.engines}:
                self._follow_refits(child)

        reason, changed = supervise_round(
            self.children, restart_limit=self.restart_limit,
            restart_window=self.restart_window, backoff_base=self.backoff_base,
            backoff_cap=self.backoff_cap, out=self.out, before_restart=before_restart)
        if reason is not None:
            return reason
        if changed:
            with contextlib.suppress(OSError):
                self._describe()
        return None

    def claim(self) -> None:
        """Make sure this stack can start without touching another: its router port is
        free and its log dir is held by no live stack; then hold the log dir until `stop`.
        TandemError (naming the port and `--port`) otherwise, with nothing changed."""
        if self._lock_fd is None:
            self._lock_fd = claim_log_dir(self.host, self.port, self.log_dir)

    def start(self, timeout: float = 300.0) -> None:
        """Start engines and router; return once the router is ready. Raises on failure
        (after stopping whatever was started)."""
        self.claim()  # raises before anything starts
        try:
            self._start(timeout)
            self._describe()
        except BaseException:
            self.stop()
            raise

    def _describe(self) -> None:
        """Write stack.json (atomically: a reader never sees half of it; only the user
        can read it: it holds the admin token)."""
        description = {"router": self.url, "port": self.port, "pid": os.getpid(),
                       "router_id": self.router_id, "engines": self.engines,
                       "admin_token": self.admin_token,
                       "weights_roots": [str(r.resolve()) for r in self.weights_roots],
                       "lora_modules": self.lora_modules,
                       "children": {c.name: c.describe() for c in self.children}}
        tmp = self.log_dir / f".{STACK_FILE}.tmp"
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(description, indent=2))
        tmp.replace(self.log_dir / STACK_FILE)

    def serving_weights(self, besides: str) -> tuple[str, str, int] | None:
        """(uri, version, epoch) of the weights the other engines serve now — the newest
        epoch among those RUNNING and admitting — or None when none answers. A refit
        (`tandem refit`) may have changed them since the stack started."""
        best: tuple[str, str, int] | None = None
        for engine in self.engines:
            if engine["name"] == besides:
                continue
            state = self._engine_state(engine["admin_url"], timeout=2)
            if state is None or "weight_uri" not in state:  # no answer, or no weights named
                continue
            try:
                status = decode_status(state)
            except ValueError:  # msgspec.ValidationError: not an engine's state
                continue
            weights = (status.weight_uri, status.weight_version, status.weight_epoch)
            if status.state is not EngineState.RUNNING or status.draining:
                continue
            if best is None or weights[2] > best[2]:
                best = weights
        return best

    def _follow_refits(self, child: Child) -> None:
        """A restarted engine starts on the weights its peers serve now, under their
        epoch, not on the stack's start-up `--model`: else routers, which prefer the newest
        epoch, would keep it out of traffic (or, with no peer, it serves what it had). And
        with the LoRA adapters the stack serves now (`tandem refit --adapter`'s record over
        the start-up `--lora-modules`)."""
        self._follow_adapters(child)
        weights = self.serving_weights(besides=child.name)
        if weights is None or not weights[0].startswith("file://"):
            return
        uri, version, epoch = weights
        try:
            path = checkpoint_path(uri)
        except WeightsURIError:
            return
        args = _drop_flags(child.args, ("--model", "--weight-version", "--weight-epoch"))
        child.args = [*args, "--model", path, "--weight-version", version,
                      "--weight-epoch", str(epoch)]

    def _follow_adapters(self, child: Child) -> None:
        from tandem_engine.cli.adapter_refit import AdapterLedger

        try:
            modules = AdapterLedger(self.log_dir, {"lora_modules": self.lora_modules}).modules()
        except ValueError as exc:  # an unreadable record: the start-up adapters, said why
            print(f"engine {child.name} restarts with its start-up adapters: {exc}",
                  file=self.out)
            return
        args, taking = [], False
        for arg in child.args:  # without --lora-modules and its values
            if arg.startswith("--"):
                taking = arg == "--lora-modules"
            if not taking:
                args.append(arg)
        child.args = [*args, "--lora-modules", *modules] if modules else args

    def _start(self, timeout: float) -> None:
        engines = []
        self.engines = []
        ports = iter(free_ports(self.host, 3 * self.num_engines, besides=[self.port]))
        for i, role in enumerate(self.roles):
            zmq_port, admin_port = next(ports), next(ports)
            metrics_port = next(ports)  # read-only /metrics: scrapers need no token
            name = f"engine-{i}" if role is EngineRole.MIXED else f"{role}-{i}"
            self.engines.append({"name": name, "role": role,
                                 "admin_url": f"http://{self.host}:{admin_port}",
                                 "metrics_url": f"http://{self.host}:{metrics_port}/metrics"})
            engines.append((zmq_port, self._spawn(
                name,
                ["tandem_engine.server.main", "--model", str(self.model), "--host", self.host,
                 "--port", str(zmq_port), "--admin-port", str(admin_port),
                 "--metrics-port", str(metrics_port), "--engine-id", name,
                 "--served-model-name", self.name, "--role", role,
                 *(a for root in self.weights_roots for a in ("--weights-root", str(root))),
                 *self.engine_args],
                f"http://{self.host}:{admin_port}/readyz", self.engine_env)))
        self._wait([c for _, c in engines], timeout, "loading the model")
        router_args = ["tandem_engine.router.main", "--model", str(self.model),
                       "--served-model-name", self.name, "--host", self.host,
                       "--port", str(self.port), *self.router_args]
        for zmq_port, _ in engines:
            router_args += ["--engine", f"{self.host}:{zmq_port}"]
        for engine in self.engines:  # one /metrics for the stack (docs/metrics.md)
            router_args += ["--engine-metrics-url", engine["metrics_url"]]
        # router.main brings the HTTP stack: imported only once the ports are ours, so a
        # refused `tandem serve` answers at once.
        from tandem_engine.router.main import ROUTER_ID_ENV

        router = self._spawn("router", router_args, f"http://{self.host}:{self.port}/readyz",
                             {**self.router_env, ROUTER_ID_ENV: self.router_id})
        self._wait([router], timeout, "connecting to the engines")
        self._wait_router_sees_all(timeout)

    def _wait_router_sees_all(self, timeout: float) -> None:
        """The router is ready with one engine; the stack is ready when it has them all.
        Only its own router counts: one reporting another id (or refusing our API key)
        is another stack's, and starting fails at once."""
        deadline = time.monotonic() + timeout
        request = urllib.request.Request(f"http://{self.host}:{self.port}/v1/engines")
        if self.api_keys:
            request.add_header("Authorization", f"Bearer {self.api_keys[0]}")
        while True:
            try:
                with urllib.request.urlopen(request, timeout=1) as r:
                    seen = json.loads(r.read())
                if seen.get("router_id") != self.router_id:
                    raise RuntimeError(self._foreign_router(f"router {seen.get('router_id')}"))
                engines = seen["engines"]
                if len(engines) == self.num_engines and all(
                        e.get("alive") and e.get("state") == EngineState.RUNNING for e in engines):
                    return
            except urllib.error.HTTPError as exc:
                if exc.code in (401, 403):
                    raise RuntimeError(self._foreign_router(
                        f"a server that refuses this stack's API key ({exc.code})")) from None
            except (urllib.error.URLError, OSError, ValueError, KeyError, AttributeError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router does not see all {self.num_engines} engines "
                                   f"running after {timeout:.0f} s; logs in {self.log_dir}")
            time.sleep(0.1)

    def _foreign_router(self, what: str) -> str:
        return (f"port {self.port} is answered by {what}, not this stack's router "
                f"({self.router_id}): another server took the port; give this stack "
                f"another with `tandem serve --port N`. Logs in {self.log_dir}")

    def _wait(self, children: list[Child], timeout: float, what: str) -> None:
        """Until every child answers /readyz, showing what each is doing (an engine: its
        phase from /v1/state; another child: `what`) in one `StatusBlock`."""
        deadline = time.monotonic() + timeout
        started = time.monotonic()
        ready_after: dict[str, float] = {}
        admin_urls = {e["name"]: e["admin_url"] for e in self.engines}
        states: dict[str, dict] = {}  # each engine's last /v1/state (a busy one may not answer)
        block = StatusBlock(self.out)
        try:
            while True:
                rows: dict[str, Status] = {}
                for child in children:
                    if child.name not in ready_after:
                        code = child.process.poll()
                        if code is not None:
                            raise RuntimeError(f"{child.name} exited with code {code} while "
                                               f"{what}; its log ({child.log}) ends with:\n"
                                               f"{child.tail()}")
                        if child.ready():
                            ready_after[child.name] = time.monotonic() - started
                        elif child.name in admin_urls and (
                                state := self._engine_state(admin_urls[child.name])):
                            states[child.name] = state
                    if child.name in ready_after:
                        rows[child.name] = Status("ready", f"{ready_after[child.name]:.1f} s")
                    elif child.name in admin_urls:
                        rows[child.name] = engine_status(states.get(child.name))
                    else:
                        rows[child.name] = Status(what)
                block.show(rows)
                if len(ready_after) == len(children):
                    return
                if time.monotonic() > deadline:
                    names = ", ".join(c.name for c in children if c.name not in ready_after)
                    raise TimeoutError(f"{names} not ready after {timeout:.0f} s ({what}); "
                                       f"logs in {self.log_dir}")
                time.sleep(0.2)
        finally:
            block.release()

    def _engine_state(self, admin_url: str, timeout: float = 1.0) -> dict | None:
        """An engine's GET /v1/state, or None when it does not answer (yet)."""
        request = urllib.request.Request(f"{admin_url}/v1/state",
                                         headers={"Authorization": f"Bearer {self.admin_token}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                state = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None
        return state if isinstance(state, dict) else None

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.process.poll() is not None), None)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every child (router first), SIGKILL whatever outlives the grace; then
        let go of the log dir (its stack.json removed) if this stack holds it."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                (self.log_dir / STACK_FILE).unlink(missing_ok=True)
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.terminate()
        deadline = time.monotonic() + grace
        for child in self.children:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                child.process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        self.children.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock; the file stays (no unlink race)
            self._lock_fd = None


def run(stack: LocalStack) -> int:
    """Start the stack, serve (restarting children that die) until Ctrl-C / SIGTERM or
    a child crash-loops, stop everything."""
    stop_requested = False

    def request_stop(signum, _frame) -> None:
        nonlocal stop_requested
        stop_requested = True

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT,
                                                                   signal.SIGTERM)}
    try:
        stack.claim()  # a busy port or a live stack's folder: refused before any output
        roles = ", ".join(stack.roles)
        print(f"starting {stack.num_engines} engine(s) ({roles}) for {stack.model} "
              f"(logs in {stack.log_dir})", file=stack.out, flush=True)
        stack.start()
        keys = "an API key required" if stack.api_keys else "no API key: open to anyone"
        print(f"Tandem is serving '{stack.name}' at {stack.url} "
              f"(OpenAI API, {keys}; Ctrl-C to stop)", file=stack.out, flush=True)
        while not stop_requested:
            reason = stack.supervise()
            if reason is not None:
                print(reason, file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
        print("stopping...", file=stack.out, flush=True)
        return 0
    finally:
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
