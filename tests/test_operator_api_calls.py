"""What a steady pool costs the API server: the operator's calls per reconcile.

The operator learns about its pools' pods and objects from kopf's watches (indexes), so a
reconcile of a pool that needs nothing reads nothing: no LIST of pods, no GET per object.
Counted with the test API server's request log while `tandem-operator` resyncs an idle pool.

Measured on the earlier operator (a LIST of pods, a GET of the pool, the admin Secret and
six support objects in every pass): 9.0 calls per steady-state reconcile.
"""

from __future__ import annotations

import collections
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kcluster.cluster import TestCluster
from kcluster.fixtures import test_cluster  # noqa: F401
from test_operator_cluster import (  # noqa: F401  (fixtures)
    Operator,
    cluster,
    free_port,
    operators,
    pool_manifest,
    wait_serving,
    weights,
)

BEFORE = 9.0  # calls per steady-state reconcile before kopf's indexes fed the operator


def reconciles(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as rsp:
        for line in rsp.read().decode().splitlines():
            if line.startswith("tandem_operator_reconciles_total "):
                return float(line.split()[1])
    raise AssertionError("no tandem_operator_reconciles_total in /metrics")


def test_a_steady_pool_costs_almost_no_api_calls(
        cluster: TestCluster, operators: Callable[..., Operator], weights: Path) -> None:
    port = free_port()
    operators("--standalone", "--metrics-port", str(port), "--liveness-port", "0")
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(weights))
    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 1})
    time.sleep(1.0)  # the last status write and its watch events settle

    since, first = time.monotonic(), reconciles(port)
    time.sleep(4.0)  # about eight resyncs at --resync-seconds 0.5
    passes = reconciles(port) - first
    calls = [r for r in cluster.requests(since)
             if not r.watch and not r.user_agent.startswith("kubectl")]
    kinds = collections.Counter(f"{r.method} {r.path}" for r in calls)
    per_pass = len(calls) / passes
    print(f"{passes:.0f} reconciles, {len(calls)} API calls ({per_pass:.2f} per reconcile): "
          f"{dict(kinds)}")
    assert passes >= 4, f"the operator resynced only {passes:.0f} times in 4 s"
    assert per_pass < BEFORE
    assert per_pass <= 1.0, f"{per_pass:.2f} calls per steady reconcile: {dict(kinds)}"
