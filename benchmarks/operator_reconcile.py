"""Operator reconcile throughput and memory on the test cluster.

Run alone (2 cores: the API server, kubectl and the operator share them):

    .venv/bin/python benchmarks/operator_reconcile.py

It starts the test API server (tests/kcluster, test-only code imported from the tests
folder: this is a dev tool, never shipped), installs crds/, starts `tandem-operator
--standalone --namespace default` as a subprocess with KUBECONFIG, exactly as
tests/operator_tests/test_operator_cluster.py runs it, and waits for its /healthz. No pod
runner runs: pods only exist in the API. Each pool gets its own weights folder holding a
config.json, so the operator's weights check passes. Then one `kubectl apply -f -` of a
multi-document YAML creates every pool at once (client-side apply: kubectl sends the pools
one by one, over HTTP, as a user's apply would), and the clock runs from just before
kubectl starts until every pool has all its pods in the API AND a status whose
observedGeneration equals its generation and whose replica counts show those pods.

Goals (issue 6): 50 pools x (2 prefill + 2 decode + 1 router) done in <= 20 s; the operator's
RSS <= 150 MB, both at its peak during the run (sampled every 50 ms with psutil) and after
settling (--settle seconds after the end, when only resyncs run). Exit status 1 when the
pools do not get there within --timeout or the operator exits; a MISS alone is not an error.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test cluster lives in tests/kcluster

from kcluster.cluster import TestCluster  # noqa: E402

OPERATOR = Path(sys.executable).parent / "tandem-operator"
EXAMPLE = ROOT / "examples" / "inferencepool.yaml"
TIME_GOAL_S = 20.0
RSS_GOAL_MB = 150.0
GROUPS = ("prefill", "decode", "router")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pool_documents(names: list[str], weights: Path, replicas: dict[str, int]) -> str:
    """One YAML stream with a pool per name, each on its own weights folder."""
    docs = []
    for name in names:
        doc = yaml.safe_load(EXAMPLE.read_text())
        doc["metadata"] = {"name": name, "namespace": "default"}
        doc["spec"]["model"]["weights"]["uri"] = f"file://{weights / name}"
        for group in GROUPS:
            doc["spec"][group]["replicas"] = replicas[group]
        docs.append(doc)
    return yaml.safe_dump_all(docs)


class RssSampler(threading.Thread):
    """The operator process's resident set size, every `every` seconds, until stopped."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.process = psutil.Process(pid)
        self.every = every
        self.peak = 0
        self.samples = 0
        self.halt = threading.Event()

    def sample(self) -> int:
        rss = self.process.memory_info().rss
        self.peak = max(self.peak, rss)
        self.samples += 1
        return rss

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.sample()
            except psutil.Error:
                return  # the operator exited; main() notices and reports it
            self.halt.wait(self.every)


class Progress:
    """What the API says about the pools and their pods, polled over HTTP."""

    def __init__(self, cluster: TestCluster, names: list[str], replicas: dict[str, int]):
        self.api = cluster.api()
        self.names = set(names)
        self.replicas = replicas
        self.pods: Counter[tuple[str, str]] = Counter()
        self.statuses_ok = 0
        self.status_written = 0

    def _get(self, path: str) -> dict[str, Any]:
        rsp = self.api.call_api(*self.api.param_serialize(
            "GET", path, header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"]), _request_timeout=30)
        return json.loads(rsp.read())

    def poll(self) -> tuple[bool, bool]:
        """(every pod exists, every status is written and shows them)."""
        pods = self._get("/api/v1/namespaces/default/pods"
                         "?labelSelector=app.kubernetes.io%2Fmanaged-by%3Dtandem-operator")
        self.pods = Counter(
            (p["metadata"]["labels"]["tandem.dev/pool"],
             p["metadata"]["labels"]["app.kubernetes.io/component"])
            for p in pods["items"] if not p["metadata"].get("deletionTimestamp"))
        pools = self._get("/apis/tandem.dev/v1alpha1/namespaces/default/inferencepools")
        self.statuses_ok = self.status_written = 0
        for pool in pools["items"]:
            if pool["metadata"]["name"] not in self.names:
                continue
            status = pool.get("status") or {}
            if status.get("observedGeneration") != pool["metadata"]["generation"]:
                continue
            self.status_written += 1
            if all((status.get(g) or {}).get("replicas") == self.replicas[g] for g in GROUPS):
                self.statuses_ok += 1
        pods_ok = all(self.pods[(name, g)] == self.replicas[g]
                      for name in self.names for g in GROUPS)
        return pods_ok, self.statuses_ok == len(self.names)

    def describe(self) -> str:
        complete = sum(all(self.pods[(n, g)] == self.replicas[g] for g in GROUPS)
                       for n in self.names)
        total = sum(self.pods.values())
        want = len(self.names) * sum(self.replicas.values())
        return (f"pools with all pods {complete}/{len(self.names)} (pods {total}/{want}); "
                f"status at the current generation {self.status_written}/{len(self.names)}, "
                f"showing every pod {self.statuses_ok}/{len(self.names)}")


def wait_healthy(process: subprocess.Popen[bytes], port: int, timeout: float) -> float:
    """Seconds until the operator's /healthz answers 200."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the operator exited with {process.returncode} while starting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as rsp:
                if rsp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the operator's /healthz did not answer within {timeout} s")


def scrape(port: int) -> dict[str, float]:
    """The operator's own counters, from its /metrics (unlabelled series only)."""
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as rsp:
            text = rsp.read().decode()
    except (urllib.error.URLError, OSError):
        return out
    for line in text.splitlines():
        if line.startswith("tandem_operator_") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def run(args: argparse.Namespace, work: Path) -> int:
    replicas = {"prefill": args.prefill, "decode": args.decode, "router": args.routers}
    names = [f"bench-{i:03d}" for i in range(args.pools)]
    weights = work / "models"
    for name in names:
        (weights / name).mkdir(parents=True)
        (weights / name / "config.json").write_text("{}")
    manifest = pool_documents(names, weights, replicas)
    log_path = work / "operator.log"

    with TestCluster() as cluster:
        cluster.install_crds(ROOT / "crds")
        liveness, metrics_port = free_port(), free_port()
        command = [str(OPERATOR), "--standalone", "--namespace", "default",
                   "--metrics-port", str(metrics_port), "--liveness-port", str(liveness),
                   "--resync-seconds", str(args.resync_seconds)]
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONUNBUFFERED": "1"}
        with log_path.open("w") as log:
            operator = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        try:
            return measure(args, cluster, operator, command, names, replicas, manifest,
                           liveness, metrics_port, log_path)
        finally:
            if operator.poll() is None:
                operator.send_signal(signal.SIGTERM)
                try:
                    operator.wait(15)
                except subprocess.TimeoutExpired:
                    operator.kill()
                    operator.wait(5)


def measure(args: argparse.Namespace, cluster: TestCluster, operator: subprocess.Popen[bytes],
            command: list[str], names: list[str], replicas: dict[str, int], manifest: str,
            liveness: int, metrics_port: int, log_path: Path) -> int:
    def fail(message: str) -> int:
        tail = log_path.read_text().splitlines()[-30:] if log_path.exists() else []
        sys.stdout.flush()
        print(f"error: {message}", file=sys.stderr)
        print("---- operator log (last 30 lines) ----", *tail, sep="\n", file=sys.stderr)
        return 1

    try:
        startup = wait_healthy(operator, liveness, 60)
    except RuntimeError as exc:
        return fail(str(exc))
    sampler = RssSampler(operator.pid)
    idle_rss = sampler.sample()
    sampler.start()
    print(f"operator: {shlex.join(command)}")
    print(f"operator up (/healthz 200) in {startup:.2f} s; idle RSS {idle_rss / 1e6:.1f} MB")

    progress = Progress(cluster, names, replicas)
    pods_at: float | None = None
    start = time.monotonic()
    applied = cluster.kubectl("apply", "-f", "-", input=manifest, check=False, timeout=120)
    apply_s = time.monotonic() - start
    if applied.returncode != 0:
        return fail(f"kubectl apply failed ({applied.returncode}): {applied.stderr.strip()}")
    while True:
        pods_ok, status_ok = progress.poll()
        elapsed = time.monotonic() - start
        if pods_ok and pods_at is None:
            pods_at = elapsed
        if pods_ok and status_ok:
            break
        if operator.poll() is not None:
            sampler.halt.set()
            return fail(f"the operator exited with {operator.returncode} after {elapsed:.1f} s; "
                        f"{progress.describe()}")
        if elapsed > args.timeout:
            sampler.halt.set()
            return fail(f"timed out after {args.timeout:g} s: {progress.describe()}")
        time.sleep(args.poll)
    done_s = time.monotonic() - start
    peak_run = sampler.peak

    time.sleep(args.settle)
    settled_rss = sampler.sample()
    sampler.halt.set()
    sampler.join(5)
    counters = scrape(metrics_port)

    pods_total = len(names) * sum(replicas.values())
    print(f"pools: {len(names)} x ({replicas['prefill']} prefill + {replicas['decode']} decode "
          f"+ {replicas['router']} router) = {pods_total} pods, applied with one "
          f"`kubectl apply -f -` (client-side apply, {len(names)} documents)")
    print(f"kubectl apply returned after {apply_s:.2f} s")
    print(f"every pod created after {pods_at:.2f} s")
    print(f"all pods created and status written: {done_s:.2f} s   goal <= {TIME_GOAL_S:.0f} s   "
          f"{verdict(done_s <= TIME_GOAL_S)}")
    print(f"operator RSS peak during the run: {peak_run / 1e6:.1f} MB   goal <= "
          f"{RSS_GOAL_MB:.0f} MB   {verdict(peak_run / 1e6 <= RSS_GOAL_MB)}   "
          f"({sampler.samples} samples)")
    print(f"operator RSS {args.settle:.0f} s after settling: {settled_rss / 1e6:.1f} MB   goal <= "
          f"{RSS_GOAL_MB:.0f} MB   {verdict(settled_rss / 1e6 <= RSS_GOAL_MB)}")
    if counters:
        print("operator counters: " + ", ".join(
            f"{key.removeprefix('tandem_operator_')}={value:g}"
            for key, value in sorted(counters.items())
            if key.endswith("_total") or key.endswith("_count")))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pools", type=int, default=50, help="InferencePools applied at once")
    p.add_argument("--prefill", type=int, default=2, help="prefill replicas per pool")
    p.add_argument("--decode", type=int, default=2, help="decode replicas per pool")
    p.add_argument("--routers", type=int, default=1, help="router replicas per pool")
    p.add_argument("--resync-seconds", type=float, default=5.0,
                   help="the operator's --resync-seconds (its default)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="give up (exit 1) after this many seconds")
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds to wait after the end before the settled RSS sample")
    p.add_argument("--poll", type=float, default=0.1,
                   help="seconds between two looks at the API")
    args = p.parse_args(argv)
    if args.pools < 1:
        p.error("--pools must be at least 1")
    # The CRD's own bounds and CEL rules; kubectl would refuse the pools otherwise.
    if not (0 <= args.prefill <= 64 and 0 <= args.decode <= 64 and 1 <= args.routers <= 16):
        p.error("replicas out of the CRD's bounds: --prefill and --decode 0..64, "
                "--routers 1..16")
    if args.prefill + args.decode < 1 or (args.prefill > 0 and args.decode < 1):
        p.error("a pool needs at least one engine, and a decode engine when it has prefill")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("command:", shlex.join(sys.orig_argv))
    print(f"parameters: pools={args.pools} prefill={args.prefill} decode={args.decode} "
          f"routers={args.routers} resync={args.resync_seconds:g}s timeout={args.timeout:g}s "
          f"settle={args.settle:g}s poll={args.poll:g}s cpus={os.cpu_count()}")
    if not OPERATOR.exists():
        print(f"error: {OPERATOR} not found; install the project with the operator extra "
              "(make dev)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="tandem-bench-operator-") as work:
        return run(args, Path(work))


if __name__ == "__main__":
    sys.exit(main())
