"""The fault matrix's rows (benchmarks/fault_matrix.py): each starts its stack, drives the
load, injects one fault and returns what the clients counted, with the promise it checks.

Engines and routers (kill -9 or SIGSTOP of one, and a prefill engine frozen mid-pull);
`tandem serve`'s children (killed, and killed during each phase of a Rolling refit); its
log folder on a full disk; the operator (killed or frozen while its pool serves).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml
from fault_stacks import (
    ENV,
    FREEZE_S,
    MODEL,
    PULL_TIMEOUT_S,
    ROOT,
    Load,
    Row,
    Serve,
    Stack,
    drive,
    errors_note,
    free_port,
    freeze,
    join_notes,
    metric,
    spawn,
    stop_processes,
    wait_for,
    warm_up,
)

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
# The refit's own progress line for a phase (None: only the engines' state shows it). A
# drain lasts only as long as the drained engine's in-flight requests, which can pass
# between two polls of its state; the wave's line is printed once its drain has begun.
REFIT_PHASE_LINES = {"drain": "RefitWave: wave 1:", "refit": None, "last": "RefitWave: wave 2:"}
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
        lines: list[str] = []
        marker, seen = REFIT_PHASE_LINES[phase], threading.Event()

        def read() -> None:
            for line in refit.stdout:
                lines.append(line)
                if marker is not None and marker in line:
                    seen.set()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        def phase_or_end() -> bool:
            if refit.poll() is not None and not seen.is_set():
                reader.join(10)
                raise RuntimeError(f"`tandem refit` exited ({refit.returncode}) before its "
                                   f"{phase} phase:\n{''.join(lines)[-3000:]}")
            return seen.is_set() or due(state(e0), state(e1), version)

        try:
            try:
                wait_for(f"the refit's {phase} phase", phase_or_end, timeout=90, every=0.01)
            except TimeoutError as exc:  # say what the refit printed, and where it was
                raise TimeoutError(f"{exc}; `tandem refit` printed:\n"
                                   f"{''.join(lines)[-3000:]}") from None
            os.kill(pid, signal.SIGKILL)
            refit.wait(timeout=240)
        finally:
            if refit.poll() is None:
                refit.kill()
                refit.wait(10)
            reader.join(10)
        out = "".join(lines)

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
