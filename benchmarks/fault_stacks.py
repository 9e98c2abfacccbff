"""The fault matrix's harness (benchmarks/fault_matrix.py): the stacks it starts, the load
it drives, and the rows it counts.

A `Stack` is engines of given roles and routers over all of them, as raw processes on
loopback; a `Serve` is `tandem serve` with its logs in a given folder. `Load` streams
completions through routers from client threads, counting per router what was sent, ok,
failed and refused; `drive` runs it with one fault injected a third of the way in. Every
process dies with this one (`die_with_parent`). A `Row` is one line of the matrix.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "engine_image"))
sys.path.insert(0, str(ROOT / "tests"))  # the test cluster lives in tests/kcluster

from tandem_engine.cli.serve import die_with_parent, free_port  # noqa: E402

MODEL = "tiny"  # served model name
FREEZE_S = 3.0  # SIGSTOP held this long: longer than the routers' heartbeat deadline
HEARTBEAT_DEADLINE_S = 1.0
PULL_TIMEOUT_S = 1.5
ENGINE_ARGS = ["--threads", "1", "--heartbeat-interval", "0.2", "--num-blocks", "512",
               "--max-num-seqs", "16", "--shutdown-grace", "1",
               "--pull-timeout", str(PULL_TIMEOUT_S)]
ROUTER_ARGS = ["--heartbeat-deadline", str(HEARTBEAT_DEADLINE_S), "--shutdown-grace", "2"]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# ---- results ----------------------------------------------------------------------------------


@dataclass
class Row:
    fault: str
    topology: str
    sent: int
    ok: int
    failed: int
    resumed: int
    promise: str
    held: bool
    notes: str = ""
    detail: dict[str, Any] = field(default_factory=dict)  # for tests: what the notes say

    def markdown(self) -> str:
        return (f"| {self.fault} | {self.topology} | {self.sent} | {self.ok} | {self.failed} "
                f"| {self.resumed} | {'yes' if self.held else 'NO'}: {self.promise} "
                f"| {self.notes} |")


TABLE_HEADER = ("| fault | topology | sent | ok | failed | resumed | promise held? | notes |\n"
                "|---|---|---|---|---|---|---|---|")


# ---- client-side load -------------------------------------------------------------------------


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    refused: int = 0
    errors: list[str] = field(default_factory=list)


class Load:
    """`streams` threads, each streaming completions back to back through one of `urls`
    (thread i starts on urls[i % len(urls)]) until stopped; counts per router URL. A thread
    whose request failed on a connection error moves to the next URL, as a client behind a
    load balancer would."""

    def __init__(self, urls: list[str], streams: int = 8, max_tokens: int = 32) -> None:
        self.urls = urls
        self.max_tokens = max_tokens
        self.tallies = {u: Tally() for u in urls}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(streams)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def total(self) -> Tally:
        out = Tally()
        for t in self.tallies.values():
            out.sent, out.ok, out.failed = out.sent + t.sent, out.ok + t.ok, out.failed + t.failed
            out.refused += t.refused
            out.errors += t.errors
        return out

    def one(self, client: openai.OpenAI, prompt: str,
            on_first_token: Callable[[], None] | None = None) -> bool:
        """One streamed completion; True when it ran to its length. Raises what the client
        raised."""
        finish, text = None, []
        for chunk in client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=self.max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True}):
            if not chunk.choices:
                continue
            if chunk.choices[0].text:
                if not text and on_first_token is not None:
                    on_first_token()
                text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return finish == "length" and bool(text)

    def _run(self, i: int) -> None:
        at = i % len(self.urls)
        clients = [openai.OpenAI(base_url=u, api_key="x", max_retries=0, timeout=60)
                   for u in self.urls]
        n = 0
        while not self._stop.is_set():
            url = self.urls[at]
            tally = self.tallies[url]
            try:
                ok = self.one(clients[at], f"Request {i}.{n}: once upon a time")
            except openai.APIConnectionError as exc:
                # Nobody listening (the client's own httpx raises ConnectError).
                if type(exc.__cause__).__name__ == "ConnectError":
                    with self._lock:
                        tally.refused += 1
                    at = (at + 1) % len(self.urls)
                    time.sleep(0.2)
                    continue
                ok = False
                with self._lock:
                    tally.errors.append(f"{url}: {type(exc).__name__}: {exc}")
                at = (at + 1) % len(self.urls)
            except Exception as exc:  # every failure is counted and reported
                ok = False
                with self._lock:
                    tally.errors.append(f"{url}: {type(exc).__name__}: {exc}")
            with self._lock:
                tally.sent += 1
                tally.ok += ok
                tally.failed += not ok
            n += 1


# ---- processes --------------------------------------------------------------------------------


def spawn(cmd: list[str], log: Path, **kw: Any) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **ENV, **kw.pop("env", {})},
                                preexec_fn=die_with_parent, **kw)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0,
             every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError, KeyError):
            result = check()
            if result:
                return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def stop_processes(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def freeze(pid: int, seconds: float = FREEZE_S) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus series at `url` (the /metrics endpoint) over matching labels."""
    text = httpx.get(url, timeout=5).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    url: str  # engine: admin URL; router: base URL (no /v1)
    zmq: str = ""  # engine: HOST:PORT routers connect to


class Stack:
    """Engines of `roles` and `routers` routers over all of them, as raw processes."""

    def __init__(self, model: Path, folder: Path, roles: list[str], routers: int = 1) -> None:
        self.model, self.folder, self.roles, self.num_routers = model, folder, roles, routers
        self.engines: list[Proc] = []
        self.routers: list[Proc] = []

    def __enter__(self) -> Stack:
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        for i, role in enumerate(self.roles):
            zp, ap = free_port(), free_port()
            name = f"{role}-{i}"
            self.engines.append(Proc(name, spawn(
                [sys.executable, "-m", "tandem_engine.server.main", "--model", str(self.model),
                 "--served-model-name", MODEL, "--port", str(zp), "--admin-port", str(ap),
                 "--engine-id", name, "--role", role, *ENGINE_ARGS],
                self.folder / f"{name}.log"), f"http://127.0.0.1:{ap}", f"127.0.0.1:{zp}"))
        for e in self.engines:
            wait_for(f"{e.name} ready", lambda e=e: self._alive(e) and httpx.get(
                f"{e.url}/readyz", timeout=1).status_code == 200, timeout=120)
        for i in range(self.num_routers):
            port = free_port()
            cmd = [sys.executable, "-m", "tandem_engine.router.main", "--model",
                   str(self.model), "--served-model-name", MODEL, "--port", str(port),
                   *ROUTER_ARGS]
            for e in self.engines:
                cmd += ["--engine", e.zmq]
            self.routers.append(Proc(f"router-{i}", spawn(cmd, self.folder / f"router-{i}.log"),
                                     f"http://127.0.0.1:{port}"))
        for r in self.routers:
            wait_for(f"{r.name} sees every engine RUNNING", lambda r=r: self._alive(r) and sum(
                e["alive"] and e["state"] == "RUNNING" for e in httpx.get(
                    f"{r.url}/v1/engines", timeout=1).json()["engines"]) == len(self.engines),
                timeout=60)

    @staticmethod
    def _alive(p: Proc) -> bool:
        if p.popen.poll() is not None:
            raise RuntimeError(f"{p.name} exited with {p.popen.returncode}")
        return True

    def stop(self) -> None:
        stop_processes([p.popen for p in self.routers + self.engines])

    def engine(self, role: str) -> Proc:
        return next(e for e in self.engines if e.name.startswith(role))

    def urls(self) -> list[str]:
        return [f"{r.url}/v1" for r in self.routers]

    def resumed(self, routers: list[Proc] | None = None) -> int:
        return int(sum(metric(f"{r.url}/metrics", "tandem_router_resumed_choices_total")
                       for r in (routers or self.routers)))

    def failovers(self, routers: list[Proc] | None = None) -> int:
        return int(sum(metric(f"{r.url}/metrics", "tandem_router_failovers_total")
                       for r in (routers or self.routers)))

    def fallbacks(self) -> int:
        """Disaggregated choices whose prefill failed and that were served colocated."""
        return int(sum(metric(f"{r.url}/metrics", "tandem_router_disaggregated_requests_total",
                              outcome="fallback") for r in self.routers))


def warm_up(urls: list[str]) -> None:
    """One request per router, so that no row counts first-request costs."""
    for url in urls:
        Load([url]).one(openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60),
                        "warm up")


def drive(urls: list[str], duration: float, streams: int,
          inject: Callable[[], None]) -> Load:
    """Run the load for `duration` s with `inject()` called a third of the way in (the
    load keeps running while inject blocks, e.g. holding a SIGSTOP)."""
    load = Load(urls, streams)
    with load:
        started = time.monotonic()
        time.sleep(duration / 3)
        inject()
        time.sleep(max(0.0, duration - (time.monotonic() - started)))
    return load


def errors_note(tally: Tally) -> str:
    """The client errors by kind (exception and its first words), most frequent first."""
    kinds: dict[str, int] = {}
    for error in tally.errors:
        kind = error.split(": ", 1)[1][:90]
        kinds[kind] = kinds.get(kind, 0) + 1
    return "errors: " + ", ".join(f"{n} x {k}" for k, n in sorted(
        kinds.items(), key=lambda kv: -kv[1])) if kinds else ""


def join_notes(*notes: str) -> str:
    return "; ".join(n for n in notes if n)

# ---- `tandem serve` ----------------------------------------------------------------------------


class Serve:
    """`tandem serve --model MODEL --engines N` with TMPDIR=folder (its logs and stack.json
    in folder/tandem-PORT)."""

    def __init__(self, model: Path, folder: Path, engines: int = 2) -> None:
        self.port = free_port()
        self.folder = folder
        self.log_dir = folder / f"tandem-{self.port}"
        self.cmd = [sys.executable, "-m", "tandem_engine.cli.main", "serve", "--model",
                    str(model), "--served-model-name", MODEL, "--engines", str(engines),
                    "--port", str(self.port), "--threads", "1"]
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> Serve:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = spawn(self.cmd, self.folder / f"serve-{self.port}.out",
                          env={"TMPDIR": str(self.folder)})
        try:
            wait_for("`tandem serve` to serve", lambda: self._alive() and "Tandem is serving"
                     in self.output(), timeout=180)
        except BaseException:
            self.stop()
            raise
        return self

    def _alive(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"`tandem serve` exited with {self.proc.returncode}:\n"
                               f"{self.output()[-3000:]}")
        return True

    def output(self) -> str:
        return (self.folder / f"serve-{self.port}.out").read_text(errors="replace")

    def stack(self) -> dict:
        return json.loads((self.log_dir / "stack.json").read_text())

    def stop(self) -> None:
        if self.proc is not None:
            stop_processes([self.proc])

    def resumed(self) -> int:
        return int(metric(f"http://127.0.0.1:{self.port}/metrics",
                          "tandem_router_resumed_choices_total"))
