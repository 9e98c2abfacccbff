"""The operator against the test API server, driven with real kubectl.

`tandem-operator` runs as a subprocess (as in a pod: KUBECONFIG, --standalone, one namespace)
and no pod runner runs: pods only exist in the API, and the test plays kubelet where it
matters by patching pod status (Running + Ready). So these tests are fast and cover what the
operator does with the API: objects and owners, printer columns, scaling, rollouts within
the budget, replacement, deletion, schema/CEL rejections, Degraded, restarts, peering and its
endpoints. Real engines behind the pods are the end-to-end test's business.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kcluster.cluster import TestCluster
from kcluster.fixtures import test_cluster  # noqa: F401
from tandem_operator.kube import Kube
from tandem_operator.reconcile import Context, reconcile
from tandem_operator.spec import default_engine_image

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / ".venv" / "bin" / "tandem-operator"
EXAMPLE = ROOT / "examples" / "inferencepool.yaml"
T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], timeout: float = 20.0, every: float = 0.1
             ) -> T:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; "
                                 f"last: {result!r}")
        time.sleep(every)


def free_port() -> int:
    from tandem_engine.cli.serve import free_port

    return free_port()


class Operator:
    """One `tandem-operator` process against the test cluster."""

    def __init__(self, cluster: TestCluster, log: Path, *args: str) -> None:
        self.log = log
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [str(OPERATOR), "--namespace", "default", "--resync-seconds", "0.5", *args],
            env=env, stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def cluster(test_cluster: TestCluster) -> TestCluster:  # noqa: F811
    test_cluster.install_crds(ROOT / "crds")
    return test_cluster


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    folder = tmp_path / "models" / "demo"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture
def operators(cluster: TestCluster, tmp_path: Path) -> Iterator[Callable[..., Operator]]:
    started: list[Operator] = []

    def start(*args: str) -> Operator:
        log = tmp_path / f"operator-{len(started)}.log"
        op = Operator(cluster, log, *(args or ("--standalone", "--metrics-port", "0",
                                               "--liveness-port", "0")))
        started.append(op)
        return op

    yield start
    for op in started:
        op.stop()
    for op in started:  # pytest shows these only when the test failed
        print(f"---- {op.log.name} (tail) ----\n{op.log.read_text()[-6000:]}")


# ---- helpers: kubectl and the simulated kubelet -------------------------------------------------


def pool_manifest(weights: Path, name: str = "demo", **spec: Any) -> str:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["model"]["weights"]["uri"] = f"file://{weights}"
    doc["spec"].update(spec)
    return yaml.safe_dump(doc)


def get_json(cluster: TestCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def pods(cluster: TestCluster, pool: str = "demo") -> list[dict[str, Any]]:
    items = get_json(cluster, "pods", "-l", f"tandem.dev/pool={pool}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def by_group(items: list[dict[str, Any]], group: str) -> list[dict[str, Any]]:
    return [p for p in items if p["metadata"]["labels"]["app.kubernetes.io/component"] == group]


def pool(cluster: TestCluster, name: str = "demo") -> dict[str, Any]:
    return get_json(cluster, "inferencepool", name)


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (body.get("status") or {}).get("conditions") or ()
                 if c["type"] == type_), {})


def is_ready(p: dict[str, Any]) -> bool:
    return p["status"].get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", ()))


def set_pod_status(cluster: TestCluster, name: str, phase: str, ready: bool) -> None:
    status = {"phase": phase, "conditions": [{"type": "Ready",
                                              "status": "True" if ready else "False"}]}
    cluster.kubectl("patch", "pod", name, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": status}))


def make_ready(cluster: TestCluster, pool_name: str = "demo") -> list[str]:
    """Play kubelet once: every pod not ready yet becomes Running and Ready."""
    names = [p["metadata"]["name"] for p in pods(cluster, pool_name) if not is_ready(p)]
    for name in names:
        set_pod_status(cluster, name, "Running", True)
    return names


def counts(cluster: TestCluster, pool_name: str = "demo") -> dict[str, int]:
    items = pods(cluster, pool_name)
    return {g: len(by_group(items, g)) for g in ("prefill", "decode", "router")}


def events(cluster: TestCluster, name: str = "demo") -> list[tuple[str, str]]:
    items = get_json(cluster, "events")["items"]
    return [(e["reason"], e["message"]) for e in items
            if e["involvedObject"].get("name") == name
            and e["involvedObject"].get("kind") == "InferencePool"]


def patch_spec(cluster: TestCluster, spec: dict[str, Any], name: str = "demo") -> None:
    cluster.kubectl("patch", "inferencepool", name, "--type=merge",
                    "-p", json.dumps({"spec": spec}))


def wait_serving(cluster: TestCluster, expected: dict[str, int], name: str = "demo") -> None:
    """Play kubelet until the pool has `expected` pods per group, all ready, status Ready."""
    def settled() -> bool:
        make_ready(cluster, name)
        body = pool(cluster, name)
        return (counts(cluster, name) == expected
                and condition(body, "Ready").get("status") == "True"
                and condition(body, "Progressing").get("reason") == "Complete")
    wait_for(f"{name} serving with {expected}", settled)


# ---- tests --------------------------------------------------------------------------------------


def test_apply_creates_the_pool_with_owned_objects_and_printer_columns(
        cluster: TestCluster, operators: Callable[..., Operator], weights: Path) -> None:
    metrics_port, liveness_port = free_port(), free_port()
    operators("--standalone", "--metrics-port", str(metrics_port),
              "--liveness-port", str(liveness_port))
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(weights))
    wait_for("three pods", lambda: counts(cluster) == {"prefill": 1, "decode": 1, "router": 1})
    uid = pool(cluster)["metadata"]["uid"]

    owned = {
        "service": ["demo", "demo-engines"], "poddisruptionbudget": ["demo-prefill",
                                                                    "demo-decode"],
        "secret": ["demo-admin-token"], "serviceaccount": ["demo-router"],
        "role": ["demo-router"], "rolebinding": ["demo-router"]}
    for kind, names in owned.items():
        for name in names:
            body = get_json(cluster, kind, name)
            (ref,) = body["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
                "InferencePool", "demo", uid, True), (kind, name)
            assert body["metadata"]["labels"]["tandem.dev/pool"] == "demo"
    for p in pods(cluster):
        (ref,) = p["metadata"]["ownerReferences"]
        assert ref["uid"] == uid and ref["controller"] is True
        assert p["metadata"]["annotations"]["tandem.dev/weights-version"] == "v1"
    router = by_group(pods(cluster), "router")[0]
    assert router["spec"]["serviceAccountName"] == "demo-router"
    engine_args = by_group(pods(cluster), "decode")[0]["spec"]["containers"][0]["args"]
    assert engine_args[:4] == ["--role", "decode", "--model", str(weights)]

    table = cluster.kubectl("get", "ipool").stdout.splitlines()
    assert table[0].split() == ["NAME", "PREFILL", "PREFILL-READY", "DECODE", "DECODE-READY",
                                "WEIGHTS", "TARGET", "REFIT", "READY", "ADAPTERS", "AGE"]
    # Refit stays blank until the first weights edit.
    assert table[1].split()[:8] == ["demo", "1", "0", "1", "0", "v1", "v1", "False"]

    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 1})
    row = cluster.kubectl("get", "ipool", "demo", "--no-headers").stdout.split()
    assert row[:8] == ["demo", "1", "1", "1", "1", "v1", "v1", "True"]
    wide = cluster.kubectl("get", "ipool", "demo", "-o", "wide").stdout
    assert "http://demo.default.svc:8000/v1" in wide
    status = pool(cluster)["status"]
    assert status["observedGeneration"] == pool(cluster)["metadata"]["generation"]
    assert status["routerEndpoint"] == "http://demo.default.svc:8000/v1"
    assert status["selector"] == "tandem.dev/pool=demo,app.kubernetes.io/component=decode"
    assert {c["type"] for c in status["conditions"]} == {"Ready", "Progressing", "Degraded",
                                                         "Refitting"}
    described = cluster.kubectl("describe", "ipool", "demo").stdout
    assert "created Secret demo-admin-token" in described
    assert "created prefill pod demo-prefill-" in described

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as rsp:
        text = rsp.read().decode()
    assert "tandem_operator_reconciles_total" in text
    assert 'tandem_operator_actions_total{kind="CreatePod"} 3.0' in text
    assert "tandem_operator_pools 1.0" in text
    with urllib.request.urlopen(f"http://127.0.0.1:{liveness_port}/healthz", timeout=5) as rsp:
        assert rsp.status == 200


def test_scale_up_then_down_drains_the_extra_pods(
        cluster: TestCluster, operators: Callable[..., Operator], weights: Path) -> None:
    operators()
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(weights))
    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 1})
    patch_spec(cluster, {"decode": {"replicas": 3}, "router": {"replicas": 2}})
    wait_serving(cluster, {"prefill": 1, "decode": 3, "router": 2})
    keep = {p["metadata"]["name"] for p in by_group(pods(cluster), "decode")}
    patch_spec(cluster, {"decode": {"replicas": 1}})
    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 2})
    assert {p["metadata"]["name"] for p in by_group(pods(cluster), "decode")} < keep
    reasons = [r for r, _ in events(cluster)]
    assert reasons.count("Draining") >= 2 and reasons.count("Deleted") >= 2


def test_a_template_change_rolls_within_max_surge_and_max_unavailable(
        cluster: TestCluster, operators: Callable[..., Operator], weights: Path) -> None:
    operators()
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(
        weights, prefill={"replicas": 2}, decode={"replicas": 2},
        rollout={"maxSurge": 1, "maxUnavailable": 0}))
    wait_serving(cluster, {"prefill": 2, "decode": 2, "router": 1})
    old = {p["metadata"]["annotations"]["tandem.dev/template-hash"] for p in pods(cluster)
           if p["metadata"]["labels"]["app.kubernetes.io/component"] != "router"}
    patch_spec(cluster, {"engine": {"args": ["--seed", "7"]}})

    seen_max = {"prefill": 0, "decode": 0}

    def rolled() -> bool:
        items = pods(cluster)
        for g in ("prefill", "decode"):
            group = by_group(items, g)
            available = [p for p in group if is_ready(p) and "tandem.dev/draining-since"
                         not in p["metadata"].get("annotations", {})]
            assert len(available) >= 2, f"{g} fell below maxUnavailable 0: {len(available)}"
            assert len(group) <= 3, f"{g} went beyond maxSurge 1: {len(group)}"
            seen_max[g] = max(seen_max[g], len(group))
        hashes = {p["metadata"]["annotations"]["tandem.dev/template-hash"]
                  for p in items if p["metadata"]["labels"]["app.kubernetes.io/component"]
                  != "router"}
        done = len(items) == 5 and not hashes & old and all(is_ready(p) for p in items)
        for p in items:  # the kubelet starts one new pod per look
            if not is_ready(p):
                set_pod_status(cluster, p["metadata"]["name"], "Running", True)
                break
        return done

    wait_for("the rollout", rolled, timeout=40, every=0.2)
    assert seen_max == {"prefill": 3, "decode": 3}  # it did surge, one pod at a time
    assert any(r == "RollingUpdate" for r, _ in events(cluster))


def test_a_deleted_or_failed_pod_is_replaced(
        cluster: TestCluster, operators: Callable[..., Operator], weights: Path) -> None:
    operators()
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(weights))
    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 1})
    victim = by_group(pods(cluster), "decode")[0]["metadata"]["name"]
    cluster.kubectl("delete", "pod", victim)
    wait_for("a new decode pod", lambda: [p for p in by_group(pods(cluster), "decode")
                                          if p["metadata"]["name"] != victim])
    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 1})
    assert any(r == "Replaced" for r, _ in events(cluster))

    broken = by_group(pods(cluster), "prefill")[0]["metadata"]["name"]
    set_pod_status(cluster, broken, "Failed", False)
    wait_for("the failed pod replaced", lambda: [
        p["metadata"]["name"] for p in by_group(pods(cluster), "prefill")] not in ([broken], []))
    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 1})
    assert broken not in [p["metadata"]["name"] for p in pods(cluster)]


def test_deleting_the_pool_removes_everything(
        cluster: TestCluster, operators: Callable[..., Operator], weights: Path) -> None:
    operators()
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(weights))
    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 1})
    assert "tandem.dev/drain-engines" in pool(cluster)["metadata"]["finalizers"]
    cluster.kubectl("delete", "ipool", "demo", "--wait=true", timeout=60)
    kinds = "pods,services,poddisruptionbudgets,secrets,serviceaccounts,roles,rolebindings"

    def nothing_left() -> bool:
        items = get_json(cluster, kinds, "-l", "tandem.dev/pool=demo")["items"]
        return not items
    wait_for("garbage collection", nothing_left)
    assert cluster.kubectl("get", "ipool", "demo", check=False).returncode != 0


@pytest.mark.parametrize(("change", "reason"), [
    ({"prefill": {"replicas": 1}, "decode": {"replicas": 0}},
     "decode.replicas must be at least 1 when prefill.replicas > 0"),
    ({"rollout": {"maxSurge": 0, "maxUnavailable": 0}},
     "rollout.maxSurge and rollout.maxUnavailable must not both be 0"),
    ({"engine": {"kvCache": {"numBlocks": 64, "memoryMiB": 64}}},
     "set at most one of kvCache.numBlocks, kvCache.memory and kvCache.memoryMiB"),
    ({"engine": {"kvCache": {"numBlocks": 64, "memory": "1Gi"}}},
     "set at most one of kvCache.numBlocks, kvCache.memory and kvCache.memoryMiB"),
    ({"engine": {"kvCache": {"memory": "12Q"}}}, "spec.engine.kvCache.memory"),
    ({"engine": {"gpuMemoryUtilization": "1.5"}}, "spec.engine.gpuMemoryUtilization"),
    ({"engine": {"device": "CPU", "gpuMemoryUtilization": "0.9"}},
     "engine.gpuMemoryUtilization sizes a CUDA engine's memory; remove it for device CPU"),
    ({"engine": {"args": ["--max-model-len=4096"]}},
     "engine.args must not set a flag the operator renders"),
    ({"pod": {"overrides": {"containers": [{"name": "engine", "command": ["sh"]}]}}},
     "pod.overrides must not change the engine or router container's command, args, image, "
     "ports or probes"),
    ({"model": {"name": "demo", "weights": {"uri": "s3://bucket/demo", "version": "v1"}}},
     "weights.uri must be a file://, pvc:// or oci:// URI"),
    ({"decode": {"replicas": 100}}, "spec.decode.replicas"),
    ({"engine": {"imagePullPolicy": "Sometimes"}}, "spec.engine.imagePullPolicy"),
])
def test_an_invalid_manifest_is_rejected_with_the_reason(
        cluster: TestCluster, weights: Path, change: dict[str, Any], reason: str) -> None:
    done = cluster.kubectl("apply", "-f", "-", input=pool_manifest(weights, **change),
                           check=False)
    assert done.returncode != 0
    assert reason in done.stderr, done.stderr
    assert cluster.kubectl("get", "ipool", "demo", check=False).returncode != 0


def test_the_pod_fields_of_a_pool_reach_its_pods(
        cluster: TestCluster, operators: Callable[..., Operator], weights: Path) -> None:
    """kvCache.memory, maxModelLen, dtype, router.resources and pod.overrides, applied with
    kubectl: the API server keeps them (defaulting what is left out) and the pods carry
    them."""
    operators()
    example = yaml.safe_load(EXAMPLE.read_text())["spec"]
    engine = {**example["engine"], "kvCache": {"memory": "1Gi"}, "maxModelLen": 2048,
              "dtype": "Float32"}
    overrides = {"dnsConfig": {"options": [{"name": "ndots", "value": "2"}]},
                 "containers": [{"name": "engine", "env": [{"name": "NCCL_DEBUG",
                                                            "value": "INFO"}]},
                                {"name": "shipper", "image": "busybox:1",
                                 "command": ["sleep", "infinity"]}]}
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(
        weights, engine=engine, router={"resources": {"requests": {"cpu": "250m"}}},
        pod={"overrides": overrides}))
    wait_for("three pods", lambda: counts(cluster) == {"prefill": 1, "decode": 1, "router": 1})
    stored = pool(cluster)["spec"]
    assert stored["pod"]["overrides"] == overrides  # kept whole: it preserves unknown fields
    assert stored["router"]["resources"] == {"requests": {"cpu": "250m"},
                                             "limits": {"cpu": "2", "memory": "1Gi"}}
    for p in pods(cluster):
        main, shipper = p["spec"]["containers"]
        assert shipper["name"] == "shipper" and p["spec"]["dnsConfig"] == overrides["dnsConfig"]
        env = {e["name"]: e.get("value") for e in main["env"]}
        if main["name"] == "router":
            assert "NCCL_DEBUG" not in env
            assert main["resources"] == stored["router"]["resources"]
            continue
        assert env["NCCL_DEBUG"] == "INFO"
        args = main["args"]
        assert [args[args.index(flag) + 1] for flag in
                ("--kv-cache-memory-bytes", "--max-model-len", "--dtype")] == [
            str(2**30), "2048", "float32"]


def test_unservable_weights_degrade_and_create_nothing(
        cluster: TestCluster, operators: Callable[..., Operator], weights: Path,
        tmp_path: Path) -> None:
    operators()
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(tmp_path / "nowhere"))

    def degraded() -> dict[str, Any]:
        c = condition(pool(cluster), "Degraded")
        return c if c.get("status") == "True" else {}
    c = wait_for("Degraded", degraded)
    assert c["reason"] == "WeightsUnreachable"
    assert str(tmp_path / "nowhere") in c["message"] and "config.json" in c["message"]
    assert condition(pool(cluster), "Ready")["status"] == "False"
    time.sleep(1.5)  # a few resyncs: still nothing half-way
    everything = get_json(cluster, "pods,services,secrets,poddisruptionbudgets",
                          "-l", "tandem.dev/pool=demo")["items"]
    assert everything == []
    assert ("Degraded" in [r for r, _ in events(cluster)])
    assert "WeightsUnreachable" in cluster.kubectl("describe", "ipool", "demo").stdout

    patch_spec(cluster, {"model": {"name": "demo", "weights": {"uri": f"file://{weights}",
                                                               "version": "v1"}}})
    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 1})
    assert condition(pool(cluster), "Degraded")["status"] == "False"


def test_an_operator_killed_mid_rollout_finishes_it_after_a_restart(
        cluster: TestCluster, operators: Callable[..., Operator], weights: Path) -> None:
    first = operators()
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(
        weights, prefill={"replicas": 2}, decode={"replicas": 2},
        rollout={"maxSurge": 1, "maxUnavailable": 0}))
    wait_serving(cluster, {"prefill": 2, "decode": 2, "router": 1})
    patch_spec(cluster, {"engine": {"image": "tandem/engine:0.2.0"}})

    def images() -> list[str]:
        return [p["spec"]["containers"][0]["image"] for p in pods(cluster)]
    wait_for("the first new pods", lambda: "tandem/engine:0.2.0" in images())
    first.kill()
    assert default_engine_image() in images()  # mid-rollout indeed
    make_ready(cluster)
    time.sleep(1.0)  # nothing moves while no operator runs
    assert default_engine_image() in images()

    operators()
    wait_serving(cluster, {"prefill": 2, "decode": 2, "router": 1})
    assert set(images()) == {"tandem/engine:0.2.0"}


def test_two_peered_operators_act_as_one(
        cluster: TestCluster, operators: Callable[..., Operator], weights: Path) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
        "metadata": {"name": "tandem", "namespace": "default"}}))
    common = ("--peering", "tandem", "--metrics-port", "0", "--liveness-port", "0")
    low = operators(*common, "--priority", "10")
    high = operators(*common, "--priority", "20")
    wait_for("both peers registered", lambda: len(
        get_json(cluster, "kopfpeering", "tandem").get("status") or {}) == 2, timeout=30)
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(weights))
    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 1})
    time.sleep(1.5)  # a duplicate operator would have created a second set by now
    assert counts(cluster) == {"prefill": 1, "decode": 1, "router": 1}
    assert "created prefill pod" in high.log.read_text()
    assert "created" not in low.log.read_text()  # paused in favour of the higher priority


# ---- reconcile itself, in-process (no kopf) -----------------------------------------------------


def test_reconcile_converges_then_writes_nothing(cluster: TestCluster, weights: Path) -> None:
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(weights))

    async def scenario() -> None:
        kube = await Kube.connect(cluster.kubeconfig)
        ctx = Context(kube=kube)
        try:
            first = await reconcile(await kube.get_pool("default", "demo"), ctx)
            # 8 objects, 2 NetworkPolicies (the example enables them) and 3 pods
            assert len(first.actions) == 13 and not first.errors
            for _ in range(10):
                await asyncio.to_thread(make_ready, cluster)
                outcome = await reconcile(await kube.get_pool("default", "demo"), ctx)
                if not outcome.actions:
                    break
            before = await kube.get_pool("default", "demo")
            assert condition(before, "Progressing")["reason"] == "Complete"
            again = await reconcile(before, ctx)
            after = await kube.get_pool("default", "demo")
            assert again.actions == () and again.errors == ()
            assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]

            # A spec the schema should have refused (an API server without CEL): the operator
            # refuses it too, says so in status, and touches no pod.
            broken = copy.deepcopy(after)
            broken["spec"]["rollout"] = {"maxSurge": 0, "maxUnavailable": 0}
            outcome = await reconcile(broken, ctx)
            assert outcome.actions == ()
            c = condition(await kube.get_pool("default", "demo"), "Degraded")
            assert (c["status"], c["reason"]) == ("True", "InvalidSpec")
            assert "must not both be 0" in c["message"]
            assert counts(cluster) == {"prefill": 1, "decode": 1, "router": 1}
        finally:
            await ctx.fleet.close()
            await kube.close()

    asyncio.run(scenario())
