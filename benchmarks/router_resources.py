"""What a router costs: its memory (RSS) and CPU, idle and under load, for the defaults of
an InferencePool's `spec.router.resources`.

    .venv/bin/python benchmarks/router_resources.py [--requests 600]

Two measurements, read from /proc (VmRSS, VmHWM, utime + stime):

* a pod's router, `tandem-router --discover-pool` (as the operator runs it: the
  Kubernetes client loaded, watching the pool's pods) against the test API server
  (tests/kcluster), idle for 30 s;
* the router of `tandem serve --demo --prefill 1 --decode 1` (the same process, engines
  given on its command line) before and after `tandem bench` runs of random prompts of
  256 tokens and outputs of 64 at 8 and at 32 requests in flight: CPU seconds per
  request and cores used at the rate reached, and the RSS it grows to.

Prints a markdown table. The engines (the tiny demo model) share the machine's cores with
the router and the load generator, so the request rate is the engines'; the router's CPU
per request is what scales.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path[:0] = [str(ROOT / "tests")]  # kcluster, the test API server

from kcluster.cluster import TestCluster  # noqa: E402
from tandem_engine.cli.demo_model import write_demo_model  # noqa: E402
from tandem_engine.cli.serve import free_port  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def sample(pid: int) -> tuple[float, int, int]:
    """(CPU seconds so far, RSS KiB, peak RSS KiB) of a process."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / TICKS  # utime, stime
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    return cpu, int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0])


def pod_router_idle(model: Path, seconds: float = 30.0) -> tuple[int, float]:
    """(RSS KiB, idle cores) of `tandem-router --discover-pool` watching an empty pool."""
    with TestCluster() as cluster:
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        router = subprocess.Popen(
            [str(BIN / "tandem-router"), "--discover-pool", "bench", "--namespace", "default",
             "--model", str(model), "--served-model-name", "demo", "--host", "127.0.0.1",
             "--port", str(free_port())],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(20)  # started and watching
            cpu0, _, _ = sample(router.pid)
            time.sleep(seconds)
            cpu1, rss, _ = sample(router.pid)
        finally:
            router.terminate()
            router.wait(15)
    return rss, (cpu1 - cpu0) / seconds


def serve_router(port: int) -> int:
    """The pid of the router `tandem serve` started (its child running router.main)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"tandem_engine.router.main" in cmdline and str(port).encode() in cmdline:
                return int(entry.name)
    raise RuntimeError("the router of tandem serve is not running")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=600, help="requests per load level")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="router-resources-"))
    model = work / "demo"
    write_demo_model(model)
    rss_pod, idle_pod = pod_router_idle(model)
    rows = [("pod router (`--discover-pool`), idle 30 s", f"{rss_pod / 1024:.0f}", "",
             f"{idle_pod * 1000:.1f}m", "", "")]

    port = free_port()
    serve = subprocess.Popen(
        [str(BIN / "tandem"), "serve", "--model", str(model), "--prefill", "1", "--decode", "1",
         "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(180):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(1)
        router = serve_router(port)
        time.sleep(5)
        cpu0, _, _ = sample(router)
        time.sleep(20)
        cpu1, rss1, _ = sample(router)
        rows.append(("serve router, idle 20 s", f"{rss1 / 1024:.0f}", "",
                     f"{(cpu1 - cpu0) / 20 * 1000:.1f}m", "", ""))
        for concurrency in (8, 32):
            report = work / f"bench-{concurrency}.json"
            before, start = sample(router), time.monotonic()
            subprocess.run([str(BIN / "tandem"), "bench",
                            "--base-url", f"http://127.0.0.1:{port}", "--model", "demo",
                            "--workload", "random", "--input-len", "256", "--output-len", "64",
                            "--num-requests", str(args.requests),
                            "--concurrency", str(concurrency), "--json", str(report)],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            after, elapsed = sample(router), time.monotonic() - start
            rate = json.loads(report.read_text())["runs"][-1]["summary"]["throughput"][
                "requests_per_s"]
            cpu = after[0] - before[0]
            rows.append((f"serve router, {concurrency} in flight", f"{after[1] / 1024:.0f}",
                         f"{after[2] / 1024:.0f}", f"{cpu / elapsed:.2f}", f"{rate:.1f}",
                         f"{cpu / args.requests * 1000:.1f}"))
    finally:
        serve.terminate()
        serve.wait(30)
    print("| router | RSS MiB | peak MiB | cores | requests/s | CPU ms/request |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
