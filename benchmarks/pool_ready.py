"""Time from `kubectl apply` to a Ready pool: pods from the built images vs local processes.

Run alone (2 cores: the operator, three engines and the router share them), after
`make images`:

    .venv/bin/python benchmarks/pool_ready.py [--runs N]

Each run starts a fresh test API server (tests/kcluster, test-only code imported from the
tests folder), `helm install`s the chart and starts the operator pod from its Deployment,
then `kubectl apply`s a pool of 1 prefill + 1 decode engine + 1 router on the tiny demo
model (written once to a host folder that every pod mounts as a hostPath volume at the same
path), and measures until the pool's Ready condition is True. Two modes of the test
kubelet: `process` runs each container as a local process from this venv; `image` runs it
from its image (podman image mount, chroot, own mount and pid namespaces), the operator
from the operator image and the engines and router from the engine image. Prints the
CPU model and a markdown table: mode | runs | median s | min s | max s | image / process.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "operator_tests")]  # kcluster, helpers

from kcluster.cluster import TestCluster  # noqa: E402
from kcluster.podrunner import PodRunner  # noqa: E402
from tandem_engine.cli.demo_model import write_demo_model  # noqa: E402
from test_operator_cluster import wait_for  # noqa: E402
from test_operator_e2e import condition, get, helm, run_deployment  # noqa: E402


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def pool_manifest(model: Path) -> str:
    volume = {"name": "models", "hostPath": {"path": str(model.parent)}}
    return yaml.safe_dump({
        "apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool",
        "metadata": {"name": "bench"},
        "spec": {"model": {"name": "demo", "weights": {"uri": model.as_uri(),
                                                        "version": "v1"}},
                 "engine": {"kvCache": {"numBlocks": 128}, "volumes": [volume],
                            "volumeMounts": [{"name": "models",
                                              "mountPath": str(model.parent)}]},
                 "prefill": {"replicas": 1}, "decode": {"replicas": 1},
                 "router": {"replicas": 1}}})


def one_run(images: bool, model: Path) -> float:
    with TestCluster() as cluster, PodRunner(cluster, images=images) as kubelet:
        helm(cluster, "install", "tandem", str(ROOT / "charts" / "tandem"),
             "--set", "replicaCount=1")
        operator_pod = run_deployment(cluster, "tandem-operator")
        wait_for("the operator pod", lambda: any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in get(cluster, "pod", operator_pod).get("status", {}).get(
                "conditions", [])), timeout=120)
        started = time.monotonic()
        cluster.kubectl("apply", "-f", "-", input=pool_manifest(model))
        try:
            wait_for("the pool to be Ready", lambda: condition(
                get(cluster, "ipool", "bench"), "Ready") == "True", timeout=300, every=0.2)
        except AssertionError:
            for p in get(cluster, "pods")["items"]:
                print(kubelet.logs(p["metadata"]["name"])[-2000:], file=sys.stderr)
            raise
        return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per mode (default 3)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: give at least 1")
    print(f"CPU: {cpu_model()}, {len(os.sched_getaffinity(0))} cores")
    # Not under /tmp: engine pods mount an emptyDir there, which would hide the hostPath.
    with tempfile.TemporaryDirectory(prefix="tandem-pool-ready-", dir="/var/tmp") as tmp:
        os.chmod(tmp, 0o755)  # image-mode pods run as uid 65532
        model = write_demo_model(Path(tmp) / "demo")
        for file in model.iterdir():  # readable by the pods' uid (written 0600)
            file.chmod(0o644)
        times = {mode: [one_run(mode == "image", model) for _ in range(args.runs)]
                 for mode in ("process", "image")}
    base = statistics.median(times["process"])
    print("\n| mode | runs | median s | min s | max s | image / process |")
    print("|---|---|---|---|---|---|")
    for mode, ts in times.items():
        print(f"| {mode} | {len(ts)} | {statistics.median(ts):.1f} | {min(ts):.1f} | "
              f"{max(ts):.1f} | {statistics.median(ts) / base:.2f}x |")


if __name__ == "__main__":
    main()
