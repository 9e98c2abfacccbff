"""What a steady pool costs the API server: the operator's calls per reconcile, and the rule
that makes reading from watches safe (a watch must show the operator's own writes).

The operator learns about its pools' pods and objects from kopf's watches (indexes), so a
reconcile of a pool that needs nothing reads nothing: no LIST of pods, no GET per object.
Counted with the test API server's request log while `tandem-operator` resyncs an idle pool.

Measured on the earlier operator, which read everything in every pass (a GET of the pool, a
LIST of its pods, GETs of the admin Secret and the seven support objects): 10.0 calls per
steady-state reconcile.
"""

from __future__ import annotations

import asyncio
import collections
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kcluster.cluster import TestCluster
from kcluster.fixtures import test_cluster  # noqa: F401
from tandem_operator.kube import POOL_OBJECT_KINDS, Kube, Writes
from tandem_operator.reconcile import Context, Watched, reconcile
from test_operator_cluster import (  # noqa: F401  (fixtures)
    Operator,
    cluster,
    free_port,
    operators,
    pool_manifest,
    wait_serving,
    weights,
)

BEFORE = 10.0  # calls per steady-state reconcile before kopf's indexes fed the operator


def reconciles(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as rsp:
        for line in rsp.read().decode().splitlines():
            if line.startswith("tandem_operator_reconciles_total "):
                return float(line.split()[1])
    raise AssertionError("no tandem_operator_reconciles_total in /metrics")


def test_a_steady_pool_costs_almost_no_api_calls(
        cluster: TestCluster, operators: Callable[..., Operator],  # noqa: F811
        weights: Path) -> None:  # noqa: F811
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


# ---- the operator's own writes against what a watch shows ---------------------------------------


def _pod(name: str, version: str | None, *, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": {"tandem.dev/pool": "p"}}
    if version is not None:
        meta["resourceVersion"] = version
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"kind": "Pod", "metadata": meta}


def test_a_watch_is_trusted_once_it_shows_every_write() -> None:
    writes = Writes(ttl=60)
    writes.record("Pod", "ns", "a", _pod("a", "10"))  # created
    writes.record("Pod", "ns", "b", _pod("b", "11"))  # annotated
    writes.record("Pod", "ns", "c", _pod("c", "12", deleting=True), deleted=True)
    writes.record("Secret", "other", "s", {"metadata": {"resourceVersion": "5"}})
    kinds = ("Pod", "Secret")
    stale = {("Pod", "b"): _pod("b", "9"), ("Pod", "c"): _pod("c", "8")}
    assert writes.missing("ns", "p", kinds, stale) == ["Pod/a", "Pod/b", "Pod/c"]
    # Later versions count too (the kubelet wrote after us); a deleted pod may be gone.
    caught_up = {("Pod", "a"): _pod("a", "10"), ("Pod", "b"): _pod("b", "14")}
    assert writes.missing("ns", "p", kinds, caught_up) == []
    assert len(writes) == 1  # shown writes are forgotten; another namespace's stays
    # A write the watch never shows (its object deleted since by someone else) stops
    # counting once a direct read finds the object gone, or after the TTL.
    writes.record("Pod", "ns", "d", _pod("d", "20"))
    writes.forget_gone("ns", "p", kinds, fresh={})
    assert writes.missing("ns", "p", kinds, {}) == []
    writes.record("Pod", "ns", "e", _pod("e", "21"))
    writes.ttl = 0.0
    assert writes.missing("ns", "p", kinds, {}) == []
    # The pool's own body: a status write is shown by the version it produced, or a later one.
    writes.record("InferencePool", "ns", "p", {"metadata": {"resourceVersion": "30"}})
    writes.ttl = 60.0
    assert not writes.shown("InferencePool", "ns", "p", {"metadata": {"resourceVersion": "29"}})
    assert writes.shown("InferencePool", "ns", "p", {"metadata": {"resourceVersion": "31"}})


def test_a_watch_behind_the_operators_writes_is_not_acted_on(
        cluster: TestCluster, weights: Path) -> None:  # noqa: F811
    """A pass whose watched view misses the pods the last pass created reads the cluster
    instead (and creates nothing twice); once the view shows them, it reads nothing."""
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(weights))

    def pod_lists(since: float) -> int:
        return sum(1 for r in cluster.requests(since) if r.user_agent == "tandem-operator"
                   and r.method == "GET" and r.path.endswith("/pods") and not r.watch)

    async def scenario() -> None:
        kube = await Kube.connect(cluster.kubeconfig)
        ctx = Context(kube=kube)
        try:
            pool = await kube.get_pool("default", "demo")
            first = await reconcile(pool, ctx, Watched())  # nothing written yet: trusted
            assert len(first.actions) == 13  # 8 objects, 2 NetworkPolicies, 3 pods
            since = time.monotonic()
            stale = await reconcile(await kube.get_pool("default", "demo"), ctx, Watched())
            assert stale.actions == () and pod_lists(since) == 1
            pods = await kube.list("Pod", "default", {"tandem.dev/pool": "demo"})
            objects = {}
            for kind in POOL_OBJECT_KINDS:
                for body in await kube.list(kind, "default", {"tandem.dev/pool": "demo"}):
                    objects[(kind, body["metadata"]["name"])] = body
            since = time.monotonic()
            fresh = await reconcile(await kube.get_pool("default", "demo"), ctx,
                                    Watched(pods=tuple(pods), objects=objects))
            assert fresh.actions == () and pod_lists(since) == 0
            assert len(kube.writes) <= 1  # at most the pool's own status write
        finally:
            await ctx.fleet.close()
            await kube.close()

    asyncio.run(scenario())
