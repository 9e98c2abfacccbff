"""Fault injection under streaming load: what Tandem survives, counted by its clients.

Run alone (2 cores: every engine, router, operator and the load share them):

    .venv/bin/python benchmarks/fault_matrix.py [--only ROW[,ROW...]] [--duration S]

Each row starts a real stack on the tiny demo model (written fresh to a temporary
folder): `tandem-engine` and `tandem-router` processes on loopback, real NIXL between
prefill and decode engines, `tandem serve` for the rows about its children, and the
operator with the test kubelet against the test API server (tests/kcluster, test-only code
imported from the tests folder) for the operator rows. It drives `--streams` concurrent
streaming completions with the `openai` client for `--duration` seconds, injects one fault
a third of the way in, and prints one markdown table row per fault:

    fault | topology | sent | ok | failed | resumed | promise held? | notes

* sent / ok / failed are counted by the clients. A request is ok when its stream ended
  with finish reason `length` (every request asks for `--max-tokens` with `ignore_eos`);
  failed when it raised or ended otherwise. A connection refused before anything reached
  a router (nobody listening: a router restarting) is not sent; the client retries it
  after 0.2 s and the notes count those refusals.
* resumed comes from the routers' `tandem_router_resumed_choices_total` (the delta over
  the row): requests that failed over mid-stream (tokens already streamed) and completed
  on another engine. A killed router's own counter dies with it; its rows read the others.
* kill = SIGKILL. stop = SIGSTOP held `--freeze` s (longer than the routers'
  `--heartbeat-deadline` of 1 s), then SIGCONT.
* The promise: 0 failed requests wherever another engine of the needed role exists. The
  only allowed losses are requests in flight on (or sent to) a router that was killed;
  they are counted per router.

Rows (`--only` takes these names): mixed-kill, mixed-stop (2 mixed engines); prefill-kill,
prefill-stop (2 prefill + 1 decode); decode-kill, decode-stop (1 prefill + 2 decode);
router-kill, router-stop (2 routers over 2 mixed engines, clients spread over both; a
client whose router failed moves to the other); serve-engine-kill, serve-router-kill
(`tandem serve --engines 2`: it restarts the child; stack.json must record the restart);
operator-kill, operator-stop (1 mixed engine + router pods run by the test kubelet; after
the fault the operator reconciles with no action taken and no pod replaced); refit-kill-drain,
refit-kill-refit, refit-kill-last (`tandem serve --engines 2` under a Rolling `tandem refit`:
kill -9 of engine-1 while wave 1 drains engine-0, while engine-0 loads the new weights, or
while wave 2 drains engine-1, the old version's last engine); nixl-frozen-read
(1 prefill + 1 decode: SIGSTOP the prefill engine as a stream's first token arrives, i.e.
while the decode engine pulls its KV; the pull's deadline fires and the request completes by
recompute); log-disk-full (`tandem serve` whose log folder is a 1 MiB tmpfs filled up
while it serves; falls back to logs that are symlinks to /dev/full where mount is refused).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

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


# ---- rows: engines and routers ----------------------------------------------------------------

TOPOLOGIES = {"mixed": ["mixed", "mixed"], "prefill": ["prefill", "prefill", "decode"],
              "decode": ["prefill", "decode", "decode"]}
TOPOLOGY_NAMES = {"mixed": "2 mixed + 1 router", "prefill": "2 prefill + 1 decode + 1 router",
                  "decode": "1 prefill + 2 decode + 1 router"}


def engine_fault(model: Path, folder: Path, role: str, kill: bool, duration: float,
                 streams: int) -> Row:
    """kill -9 or SIGSTOP one engine of `role` where another of that role serves on."""
    with Stack(model, folder, TOPOLOGIES[role]) as stack:
        warm_up(stack.urls())
        victim = stack.engine(role)
        resumed0, failovers0, fallbacks0 = stack.resumed(), stack.failovers(), stack.fallbacks()

        def inject() -> None:
            if kill:
                victim.popen.kill()
            else:
                freeze(victim.popen.pid)
        load = drive(stack.urls(), duration, streams, inject)
        tally = load.total()
        resumed = stack.resumed() - resumed0
        failovers = stack.failovers() - failovers0
        fallbacks = stack.fallbacks() - fallbacks0
    return Row(f"{role} engine {'kill -9' if kill else 'SIGSTOP'}", TOPOLOGY_NAMES[role],
               tally.sent, tally.ok, tally.failed, resumed, "0 failed", tally.failed == 0,
               join_notes(f"{failovers} failovers",
                          f"{fallbacks} failed prefills served colocated" if role != "mixed"
                          else "", errors_note(tally)))


def router_fault(model: Path, folder: Path, kill: bool, duration: float,
                 streams: int, engines: int = 2) -> Row:
    """Two routers over the same mixed engines, clients spread over both; kill -9 or
    SIGSTOP the first router."""
    with Stack(model, folder, ["mixed"] * engines, routers=2) as stack:
        warm_up(stack.urls())
        victim, survivor = stack.routers
        resumed0 = stack.resumed([survivor])

        def inject() -> None:
            if kill:
                victim.popen.kill()
            else:
                freeze(victim.popen.pid)
        load = drive(stack.urls(), duration, streams, inject)
        tally = load.total()
        lost = load.tallies[f"{victim.url}/v1"]
        kept = load.tallies[f"{survivor.url}/v1"]
        resumed = stack.resumed([survivor]) - resumed0
        engines_alive = all(e.popen.poll() is None for e in stack.engines)
    if kill:
        promise = "losses only on the killed router"
        held = kept.failed == 0 and engines_alive
    else:
        promise = "0 failed"
        held = tally.failed == 0
    return Row(f"router {'kill -9' if kill else 'SIGSTOP'}", f"2 routers over {engines} mixed",
               tally.sent, tally.ok, tally.failed, resumed, promise, held, detail={
                   "victim": lost, "survivor": kept, "engines_alive": engines_alive},
               notes=join_notes(
                   f"{'killed' if kill else 'frozen'} router: {lost.sent} sent, {lost.failed} "
                   f"failed; other router: {kept.sent} sent, {kept.failed} failed",
                   f"{tally.refused} refused connections retried" if tally.refused else "",
                   "" if kill or not tally.errors else errors_note(tally)))


def nixl_frozen_read(model: Path, folder: Path, duration: float, streams: int) -> Row:
    """SIGSTOP the prefill engine as a stream's first token arrives: the decode engine is
    pulling that request's KV then; its pull deadline fires and it recomputes."""
    with Stack(model, folder, ["prefill", "decode"]) as stack:
        warm_up(stack.urls())
        prefill, decode = stack.engines
        pulls0 = httpx.get(f"{decode.url}/v1/state", timeout=5).json()["kv_pulls"]
        resumed0 = stack.resumed()
        probe: dict[str, Any] = {}

        def inject() -> None:
            client = openai.OpenAI(base_url=stack.urls()[0], api_key="x", max_retries=0,
                                   timeout=60)
            frozen = threading.Event()

            def on_first_token() -> None:
                os.kill(prefill.popen.pid, signal.SIGSTOP)
                frozen.set()
            try:
                probe["ok"] = Load([]).one(client, "The frozen peer", on_first_token)
            except Exception as exc:
                probe["ok"], probe["error"] = False, f"{type(exc).__name__}: {exc}"
            finally:
                if frozen.is_set():
                    time.sleep(max(0.0, FREEZE_S - PULL_TIMEOUT_S))
                os.kill(prefill.popen.pid, signal.SIGCONT)
        load = drive(stack.urls(), duration, streams, inject)
        tally = load.total()
        pulls = httpx.get(f"{decode.url}/v1/state", timeout=5).json()["kv_pulls"]
        resumed = stack.resumed() - resumed0
    timeouts = pulls.get("failed_timeout", 0) - pulls0.get("failed_timeout", 0)
    recomputed = pulls["recomputed"] - pulls0["recomputed"]
    sent, ok = tally.sent + 1, tally.ok + bool(probe.get("ok"))
    return Row("NIXL peer frozen mid-READ", "1 prefill + 1 decode + 1 router", sent, ok,
               sent - ok, resumed, "0 failed (recompute)", sent == ok,
               join_notes(f"decode engine: {timeouts} pulls timed out, {recomputed} "
                          "recomputed", probe.get("error", ""), errors_note(tally)))


# ---- rows: `tandem serve` ---------------------------------------------------------------------


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


def serve_child_kill(model: Path, folder: Path, child: str, duration: float,
                     streams: int) -> Row:
    """kill -9 one child of `tandem serve` (an engine or the router) under load; serve
    restarts it and stack.json records the restart."""
    serve = Serve(model, folder).start()
    try:
        warm_up([serve.url])
        name = "router" if child == "router" else serve.stack()["engines"][0]["name"]
        pid = serve.stack()["children"][name]["pid"]
        resumed0 = serve.resumed()
        load = drive([serve.url], duration, streams, lambda: os.kill(pid, signal.SIGKILL))
        tally = load.total()

        def restarted() -> dict | None:
            c = serve.stack()["children"][name]
            return c if c["restarts"] >= 1 and c["pid"] != pid else None
        record = wait_for(f"stack.json to record the restart of {name}", restarted, timeout=60)
        wait_for("the router to serve again", lambda: httpx.get(
            f"http://127.0.0.1:{serve.port}/readyz", timeout=1).status_code == 200)
        # A router restarted counts from zero: its delta is its own count.
        resumed = serve.resumed() - (0 if child == "router" else resumed0)
        serving = serve.proc is not None and serve.proc.poll() is None
    finally:
        serve.stop()
    recorded = record["last_exit"] == "SIGKILL"
    note = (f"stack.json: {name} restarts {record['restarts']}, last_exit "
            f"{record['last_exit']}")
    if child == "router":
        promise = "losses only on the killed router; restarted"
        # Every loss broke on the killed router's connections: none is the new one's.
        held = serving and recorded and tally.failed == len(tally.errors) and all(
            ": APIConnectionError:" in e for e in tally.errors)
        note = join_notes(note, f"{tally.refused} refused connections retried while it "
                          "restarted", errors_note(tally))
    else:
        promise = "0 failed; restarted"
        held = serving and recorded and tally.failed == 0
        note = join_notes(note, errors_note(tally))
    return Row(f"`tandem serve` {child} child kill -9", "serve --engines 2", tally.sent,
               tally.ok, tally.failed, resumed, promise, held, note)


REFIT_TOKENS = 128  # per request: long enough that a drain lasts a while
REFIT_PHASES = {  # when engine-1 is killed, by engine-0's (and engine-1's) admin state
    # wave 1 took engine-0: it drains (engine-1 is the other engine of the old version)
    "drain": lambda s0, s1, v: s0["state"] == "RUNNING" and s0["draining"]
    and s0["weight_version"] != v,
    # engine-0 is out of RUNNING: paused, suspended, loading the new weights
    "refit": lambda s0, s1, v: s0["state"] != "RUNNING",
    # engine-0 serves the target; wave 2 drains engine-1, the old version's last engine
    "last": lambda s0, s1, v: s0["weight_version"] == v and not s0["draining"]
    and s1["draining"],
}


def refit_engine_kill(serve: Serve, target: Path, version: str, phase: str,
                      streams: int) -> Row:
    """kill -9 of engine-1 of a running `tandem serve --engines 2` during a Rolling
    `tandem refit` to `target` (as `version`), at `phase` (`REFIT_PHASES`), under load.
    serve restarts engine-1; the refit either waits for it (re-planning a wave that would
    strand the old version's requests) and ends with every engine on `version`, or refuses
    honestly; the load runs until both are over."""
    stack = serve.stack()
    token = stack.get("admin_token")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    e0, e1 = stack["engines"][:2]
    pid = stack["children"][e1["name"]]["pid"]

    def state(e: dict) -> dict:
        return httpx.get(f"{e['admin_url']}/v1/state", headers=headers, timeout=2).json()

    due = REFIT_PHASES[phase]
    cmd = [sys.executable, "-m", "tandem_engine.cli.main", "refit", "--port", str(serve.port),
           "--uri", target.resolve().as_uri(), "--weights-version", version]
    resumed0 = serve.resumed()
    load = Load([serve.url], streams, max_tokens=REFIT_TOKENS)
    with load:
        time.sleep(0.5)  # streams in flight on both engines
        refit = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env={**os.environ, **ENV, "TMPDIR": str(serve.folder)})
        try:
            wait_for(f"the refit's {phase} phase", lambda: due(state(e0), state(e1), version),
                     timeout=90, every=0.01)
            os.kill(pid, signal.SIGKILL)
            out, _ = refit.communicate(timeout=240)
        finally:
            if refit.poll() is None:
                refit.kill()
                refit.wait(10)

        def back() -> bool:
            child = serve.stack()["children"][e1["name"]]
            return child["pid"] != pid and httpx.get(f"{e1['admin_url']}/readyz",
                                                     timeout=1).status_code == 200
        wait_for(f"{e1['name']} restarted and ready", back, timeout=90)
        time.sleep(0.5)  # requests after it
    tally = load.total()
    versions = [state(e)["weight_version"] for e in (e0, e1)]
    serving = serve.proc is not None and serve.proc.poll() is None
    resumed = serve.resumed() - resumed0
    replanned = "RefitWaveReplanned" in out
    waited = "RefitWaiting" in out
    succeeded = refit.returncode == 0 and versions == [version, version]
    # Honest refusal: exit 1 with the reason, never a success that stranded requests.
    refused = refit.returncode == 1 and "failed and was" in out
    held = serving and tally.failed == 0 and (succeeded or refused)
    return Row(f"engine kill -9 during a Rolling refit ({phase})", "serve --engines 2",
               tally.sent, tally.ok, tally.failed, resumed,
               "0 failed; the refit succeeds after the engine is back, or refuses", held,
               join_notes(f"refit exit {refit.returncode}", f"engines on {versions}",
                          "wave re-planned" if replanned else "",
                          "waited for the engine" if waited else "", errors_note(tally)),
               {"refit_rc": refit.returncode, "refit_out": out, "versions": versions,
                "errors": tally.errors, "serving": serving})


def serve_refit_kill(model: Path, folder: Path, phase: str, duration: float,
                     streams: int) -> Row:
    """`refit_engine_kill` on a fresh `tandem serve --engines 2`, refitting to a second
    demo checkpoint (`duration` unused: the row lasts as long as the refit)."""
    from tandem_engine.cli.demo_model import write_demo_model

    target = write_demo_model(folder / "weights" / "v2", arch="llama", size="tiny", seed=1)
    serve = Serve(model, folder)
    serve.cmd += ["--weights-root", str(target.parent)]
    serve.start()
    try:
        warm_up([serve.url])
        return refit_engine_kill(serve, target, "v2", phase, streams)
    finally:
        serve.stop()


@contextlib.contextmanager
def full_log_folder(log_dir: Path, names: list[str]) -> Iterator[Callable[[], str]]:
    """The log folder on a 1 MiB tmpfs (mounted before `serve` starts); yields `fill()`,
    which fills it and says how. Where mount is refused: each log a symlink to /dev/full
    (every write fails with ENOSPC from the start), and fill() says so."""
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs",
                                  str(log_dir)], capture_output=True).returncode == 0
    except OSError:  # no mount command
        mounted = False
    if not mounted:
        for name in names:
            (log_dir / f"{name}.log").symlink_to("/dev/full")

    def fill() -> str:
        if not mounted:
            return "logs are symlinks to /dev/full (mount refused)"
        with (log_dir / "filler").open("wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        free = os.statvfs(log_dir).f_bavail
        return f"1 MiB tmpfs filled ({free} blocks free)"
    try:
        yield fill
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(log_dir)], capture_output=True)


def log_disk_full(model: Path, folder: Path, duration: float, streams: int,
                  engines: int = 2) -> Row:
    """The log folder of `tandem serve` full while it serves, and an engine killed then, so
    that every process has something to log (the router its failovers, `serve` the restart
    and stack.json, the new engine its start-up): serving goes on with 0 failed requests,
    no child dies of a write error, and the killed engine comes back."""
    serve = Serve(model, folder, engines)
    names = [f"engine-{i}" for i in range(engines)]
    with full_log_folder(serve.log_dir, [*names, "router"]) as fill:
        serve.start()
        try:
            warm_up([serve.url])
            how = fill()
            sizes0 = sum(p.stat().st_size for p in serve.log_dir.glob("*.log"))
            victim = serve.stack()["children"]["engine-0"]["pid"]
            resumed0 = serve.resumed()
            load = drive([serve.url], duration, streams,
                         lambda: os.kill(victim, signal.SIGKILL))
            tally = load.total()
            admin = serve.stack()["engines"][0]["admin_url"]
            # stack.json cannot be rewritten on a full disk: serve's own output says it.
            wait_for("engine-0 restarted", lambda: "engine-0: restarted" in serve.output(),
                     timeout=60)
            wait_for("engine-0 ready again", lambda: httpx.get(
                f"{admin}/readyz", timeout=1).status_code == 200, timeout=60)
            resumed = serve.resumed() - resumed0
            out = serve.output()
            others_died = sum(f"{n} exited unexpectedly" in out
                              for n in [*names[1:], "router"])
            serving = serve.proc is not None and serve.proc.poll() is None
            grew = sum(p.stat().st_size for p in serve.log_dir.glob("*.log")) - sizes0
        finally:
            serve.stop()
    return Row("log folder full (ENOSPC) + engine kill -9", f"serve --engines {engines}",
               tally.sent, tally.ok, tally.failed, resumed,
               "0 failed; no child dies of it; the killed engine restarts",
               tally.failed == 0 and serving and others_died == 0,
               join_notes(how, f"logs grew {grew} B", "engine-0 restarted and ready",
                          f"{others_died} other children died", errors_note(tally)),
               {"serving": serving, "others_died": others_died, "errors": tally.errors})


# ---- rows: the operator -----------------------------------------------------------------------


def operator_fault(model: Path, folder: Path, kill: bool, duration: float,
                   streams: int) -> Row:
    """kill -9 or SIGSTOP `tandem-operator` while its pool (1 mixed engine + 1 router, real
    processes run by the test kubelet) serves; then the operator (restarted after a kill)
    reconciles and takes no action: no pod replaced."""
    from kcluster.cluster import TestCluster
    from kcluster.podrunner import PodRunner

    folder.mkdir(parents=True, exist_ok=True)
    with TestCluster() as cluster:
        cluster.install_crds(ROOT / "crds")
        runner = PodRunner(cluster).start()
        operators: list[subprocess.Popen] = []

        def start_operator() -> tuple[subprocess.Popen, str]:
            port = free_port()
            proc = spawn([str(Path(sys.executable).parent / "tandem-operator"), "--namespace",
                          "default", "--resync-seconds", "0.5", "--standalone",
                          "--metrics-port", str(port), "--liveness-port", "0"],
                         folder / f"operator-{len(operators)}.log",
                         env={"KUBECONFIG": str(cluster.kubeconfig)})
            operators.append(proc)
            return proc, f"http://127.0.0.1:{port}/metrics"

        def kubectl_json(*args: str) -> Any:
            return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)

        def pods() -> dict[str, str]:
            items = kubectl_json("pods", "-l", "tandem.dev/pool=demo")["items"]
            return {p["metadata"]["name"]: p["metadata"]["uid"] for p in items
                    if not p["metadata"].get("deletionTimestamp")}

        try:
            operator, metrics_url = start_operator()
            doc = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
            spec = doc["spec"]
            spec["model"] = {"name": MODEL, "weights": {"uri": model.as_uri(), "version": "v1"}}
            spec.update(prefill={"replicas": 0}, decode={"replicas": 1},
                        router={"replicas": 1})
            spec["engine"].update(kvCache={"numBlocks": 256})
            for key in ("initContainers", "volumes", "volumeMounts"):
                spec["engine"].pop(key, None)
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

            def ready() -> bool:
                conditions = kubectl_json("ipool", "demo").get("status", {}).get(
                    "conditions", [])
                return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
            wait_for("the pool to be Ready", ready, timeout=180, every=0.3)
            router = next(p for p in kubectl_json("pods", "-l", "tandem.dev/pool=demo,"
                                                  "tandem.dev/role=router")["items"])
            url = f"http://{router['status']['podIP']}:8000/v1"
            wait_for("the router to see its engine", lambda: [e["state"] for e in httpx.get(
                f"{url}/engines", timeout=2).json()["engines"]] == ["RUNNING"], timeout=60)
            warm_up([url])
            before = pods()
            resumed0 = metric(f"{url[:-3]}/metrics", "tandem_router_resumed_choices_total")
            actions0 = metric(metrics_url, "tandem_operator_actions_total")

            def inject() -> None:
                if kill:
                    operator.kill()
                    operator.wait(10)
                else:
                    freeze(operator.pid)
            load = drive([url], duration, streams, inject)
            tally = load.total()
            if kill:  # a new process counts from zero
                operator, metrics_url = start_operator()
                actions0 = 0
            # The operator reconciles on resync every 0.5 s: two reconciles after the
            # fault show its view of the pool; no action means no pod created or deleted.
            base = 0 if kill else metric(metrics_url, "tandem_operator_reconciles_total")
            wait_for("two reconciles after the fault", lambda: metric(
                metrics_url, "tandem_operator_reconciles_total") >= base + 2, timeout=60)
            actions = int(metric(metrics_url, "tandem_operator_actions_total") - actions0)
            after = pods()
            resumed = int(metric(f"{url[:-3]}/metrics", "tandem_router_resumed_choices_total")
                          - resumed0)
        finally:
            stop_processes(operators)
            runner.stop()
    churn = len(set(before.values()) ^ set(after.values()))
    note = (f"after the {'restart' if kill else 'thaw'}: operator actions {actions}, "
            f"pods replaced {churn // 2} ({len(after)} pods, same uids: {before == after})")
    return Row(f"operator {'kill -9' if kill else 'SIGSTOP'}",
               "operator + 1 mixed engine pod + 1 router pod (test cluster)", tally.sent,
               tally.ok, tally.failed, resumed, "0 failed; no pod churn",
               tally.failed == 0 and before == after and actions == 0,
               join_notes(note, errors_note(tally)),
               {"actions": actions, "pods_before": before, "pods_after": after})


# ---- the matrix -------------------------------------------------------------------------------

RowFn = Callable[[Path, Path, float, int], Row]
ROWS: dict[str, RowFn] = {
    "mixed-kill": lambda m, f, d, s: engine_fault(m, f, "mixed", True, d, s),
    "mixed-stop": lambda m, f, d, s: engine_fault(m, f, "mixed", False, d, s),
    "prefill-kill": lambda m, f, d, s: engine_fault(m, f, "prefill", True, d, s),
    "prefill-stop": lambda m, f, d, s: engine_fault(m, f, "prefill", False, d, s),
    "decode-kill": lambda m, f, d, s: engine_fault(m, f, "decode", True, d, s),
    "decode-stop": lambda m, f, d, s: engine_fault(m, f, "decode", False, d, s),
    "router-kill": lambda m, f, d, s: router_fault(m, f, True, d, s),
    "router-stop": lambda m, f, d, s: router_fault(m, f, False, d, s),
    "serve-engine-kill": lambda m, f, d, s: serve_child_kill(m, f, "engine", d, s),
    "serve-router-kill": lambda m, f, d, s: serve_child_kill(m, f, "router", d, s),
    **{f"refit-kill-{phase}": lambda m, f, d, s, phase=phase: serve_refit_kill(m, f, phase, d, s)
       for phase in REFIT_PHASES},
    "operator-kill": lambda m, f, d, s: operator_fault(m, f, True, d, s),
    "operator-stop": lambda m, f, d, s: operator_fault(m, f, False, d, s),
    "nixl-frozen-read": nixl_frozen_read,
    "log-disk-full": log_disk_full,
}


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def write_model(folder: Path) -> Path:
    import torch
    from tandem_engine.cli.demo_model import write_demo_model

    torch.set_num_threads(1)
    return write_demo_model(folder / "tiny-llama", arch="llama", size="tiny")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="rows: " + ", ".join(ROWS))
    ap.add_argument("--only", default=None, metavar="ROW[,ROW...]",
                    help="run these rows only (default: all)")
    ap.add_argument("--duration", type=float, default=12.0,
                    help="seconds of load per row (default 12)")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams (default 8)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep every process log under this folder")
    args = ap.parse_args(argv)
    names = list(ROWS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown row(s) {', '.join(unknown)}; rows: {', '.join(ROWS)}")

    print("command:", " ".join(sys.orig_argv))
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); {args.streams} streams x "
          f"{args.duration:g} s per row, 32 tokens each; SIGSTOP held {FREEZE_S:g} s "
          f"(router heartbeat deadline {HEARTBEAT_DEADLINE_S:g} s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as tmp:
        root = args.keep or Path(tmp)
        model = write_model(root)
        rows = []
        for name in names:
            started = time.monotonic()
            try:
                row = ROWS[name](model, root / name, args.duration, args.streams)
            except Exception as exc:
                row = Row(name, "-", 0, 0, 0, 0, "row did not run", False,
                          f"{type(exc).__name__}: {exc}"[:300])
            rows.append(row)
            print(f"  {name}: {time.monotonic() - started:.0f} s; {row.markdown()}",
                  flush=True)
    print()
    print(TABLE_HEADER)
    for row in rows:
        print(row.markdown())
    return 0 if all(r.held for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
