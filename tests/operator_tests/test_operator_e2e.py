"""End to end on the test cluster, as a platform team meets Tandem.

`helm install` the chart (real helm 4) into its own namespace, `tandem-system`, as the
README does, run the operator Deployment's pod there as the chart renders it (the test
cluster has no controllers, so the test plays the ReplicaSet: one pod from the Deployment's
template; the test kubelet runs its `tandem-operator` command), `kubectl apply` an
InferencePool of 1 prefill, 2 decode and 1 router engines in `default` with real kubectl,
and the test kubelet starts real `tandem-engine` / `tandem-router` processes on their own
127.x addresses. Then the `openai` client gets disaggregated completions
(prefill → NIXL → decode) through the router pod's address that equal the offline
engine's, a scale-down under streaming load drains its engine and fails no request,
and deleting the pool under streaming load lets every stream in flight finish before the
pods go, then removes every pod.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from kcluster.cluster import TestCluster
from kcluster.fixtures import test_cluster  # noqa: F401
from kcluster.helm import helm_binary
from kcluster.podrunner import PodRunner
from tandem_engine import LLM, SamplingParams
from test_operator_cluster import wait_for

pytest.importorskip("nixl_cu12")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "tandem-system"  # the chart's namespace; the pool lives in `default`


def get(cluster: TestCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def live_pods(cluster: TestCluster, component: str) -> list[dict[str, Any]]:
    items = get(cluster, "pods", "-l",
                f"tandem.dev/pool=demo,app.kubernetes.io/component={component}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def condition(pool: dict[str, Any], kind: str) -> str | None:
    for c in pool.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return c["status"]
    return None


@pytest.fixture
def cluster(test_cluster: TestCluster) -> TestCluster:  # noqa: F811
    return test_cluster


@pytest.fixture
def kubelet(cluster: TestCluster) -> Iterator[PodRunner]:
    runner = PodRunner(cluster).start()
    try:
        yield runner
    finally:
        runner.stop()


def helm(cluster: TestCluster, *args: str) -> str:
    homes = {f"HELM_{kind}_HOME": str(cluster.folder / f"helm-{kind.lower()}")
             for kind in ("CACHE", "CONFIG", "DATA")}
    done = subprocess.run([str(helm_binary()), *args, "--namespace", SYSTEM,
                           "--kubeconfig", str(cluster.kubeconfig)],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cluster.folder), **homes})
    assert done.returncode == 0, f"helm {' '.join(args)} failed:\n{done.stderr}"
    return done.stdout


def run_deployment(cluster: TestCluster, name: str, namespace: str) -> str:
    """Play the ReplicaSet controller once: a pod from the Deployment's template."""
    deployment = get(cluster, "deployment", name, "-n", namespace)
    template = deployment["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": f"{name}-", "namespace": namespace,
                        "labels": template["metadata"]["labels"]},
           "spec": template["spec"]}
    return cluster.create(pod)["metadata"]["name"]


def pool_manifest(model: Path) -> str:
    doc = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
    spec = doc["spec"]
    spec["model"]["weights"]["uri"] = f"file://{model}"
    spec["model"]["name"] = "tiny"
    spec["decode"]["replicas"] = 2
    spec["engine"]["kvCache"] = {"numBlocks": 256}
    spec["refit"] = {"drainTimeoutSeconds": 30}
    return yaml.safe_dump(doc)


def test_helm_install_apply_a_pool_and_get_disaggregated_completions(
        cluster: TestCluster, kubelet: PodRunner, tiny_llama: Path) -> None:
    helm(cluster, "install", "tandem", str(ROOT / "charts" / "tandem"), "--create-namespace",
         "--set", "replicaCount=1")
    operator_pod = run_deployment(cluster, "tandem-operator", SYSTEM)
    wait_for("the operator pod to be ready", lambda: any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in get(cluster, "pod", operator_pod, "-n", SYSTEM).get("status", {})
        .get("conditions", [])), timeout=60)

    cluster.kubectl("apply", "-f", "-", input=pool_manifest(tiny_llama))
    try:
        # Ready means every group serves (a pod each); wait for every replica too.
        pool = wait_for("the pool to be Ready with every replica", lambda: (
            p if condition(p := get(cluster, "inferencepool", "demo"), "Ready") == "True"
            and p["status"]["decode"]["ready"] == 2 else None), timeout=180)
    except AssertionError:
        for p in get(cluster, "pods", "-A")["items"]:
            print(f"---- {p['metadata']['name']} ----\n"
                  f"{kubelet.logs(p['metadata']['name'])[-3000:]}")
        raise
    assert pool["status"]["prefill"]["ready"] == 1 and pool["status"]["decode"]["ready"] == 2
    table = cluster.kubectl("get", "ipool", "demo").stdout
    assert table.split()[:9] == ["NAME", "PREFILL", "PREFILL-READY", "DECODE",
                                 "DECODE-READY", "WEIGHTS", "TARGET", "REFIT", "READY"], table

    router_ip = kubelet.pod_ip(live_pods(cluster, "router")[0]["metadata"]["name"])
    client = openai.OpenAI(base_url=f"http://{router_ip}:8000/v1", api_key="x",
                           max_retries=0, timeout=60)
    wait_for("the router to see 1 prefill and 2 decode engines", lambda: sorted(
        e["role"] for e in httpx.get(f"http://{router_ip}:8000/v1/engines",
                                     timeout=5).json()["engines"]
        if e["state"] == "RUNNING") == ["decode", "decode", "prefill"], timeout=60)

    prompts = ["Hello there", "Once upon a time in a land far away"]
    refs = LLM(tiny_llama).generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                            ignore_eos=True))
    for prompt, ref in zip(prompts, refs, strict=True):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True,
                                                                 "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
        assert r.choices[0].text == ref.outputs[0].text

    # The KV moved over NIXL: the decode engines pulled blocks (admin API, pool token).
    secret = get(cluster, "secret", "demo-admin-token")
    token = base64.b64decode(secret["data"]["token"]).decode()
    pulled = 0
    for pod in live_pods(cluster, "decode"):
        state = httpx.get(f"http://{kubelet.pod_ip(pod['metadata']['name'])}:8080/v1/state",
                          headers={"Authorization": f"Bearer {token}"}, timeout=5).json()
        assert state["role"] == "decode" and state["kv_pulls"]["failed"] == 0
        pulled += state["kv_pulls"]["pulled_blocks"]
    assert pulled > 0

    # Scale decode 2 → 1 under streaming load: the leaving engine drains; nothing fails.
    failures: list[str] = []
    done = threading.Event()

    def stream_forever(i: int) -> None:
        while not done.is_set():
            try:
                text = "".join(c.choices[0].text for c in client.completions.create(
                    model="tiny", prompt=f"{prompts[i % 2]} {i}", max_tokens=24,
                    temperature=0, stream=True, extra_body={"ignore_eos": True}))
                assert text
            except Exception as exc:  # every failure is reported below
                failures.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=stream_forever, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        cluster.kubectl("patch", "inferencepool", "demo", "--type", "merge",
                        "-p", '{"spec": {"decode": {"replicas": 1}}}')
        wait_for("one decode pod left", lambda: len(live_pods(cluster, "decode")) == 1,
                 timeout=60)
        time.sleep(1.0)
    finally:
        done.set()
        for t in threads:
            t.join(60)
    assert not failures, failures
    story = cluster.kubectl("describe", "inferencepool", "demo").stdout
    assert "Draining" in story and "Deleted" in story, story

    # Delete the pool under streaming load: every stream in flight when `kubectl delete`
    # is issued runs to its length before the pods go (the operator drains the engines).
    assert_deleting_the_pool_finishes_its_streams(cluster, kubelet, client, token, prompts)
    wait_for("every pod of the pool to be gone", lambda: not get(
        cluster, "pods", "-l", "tandem.dev/pool=demo")["items"], timeout=90)
    story = [e for e in get(cluster, "events")["items"]
             if e["involvedObject"]["kind"] == "InferencePool"]
    assert any(e["reason"] == "Drained" for e in story), [e["message"] for e in story]
    helm(cluster, "uninstall", "tandem")


DELETE_TOKENS = 48  # tokens of each stream in flight across the deletion
FROZEN_S = 1.0  # the longest the prefill engine stays frozen (the router's heartbeat: 2 s)


def assert_deleting_the_pool_finishes_its_streams(
        cluster: TestCluster, kubelet: PodRunner, client: openai.OpenAI, token: str,
        prompts: list[str], streams: int = 6) -> None:
    """Streams back to back from `streams` threads, and `kubectl delete inferencepool`
    while they are in flight (no thread starts another once the delete is issued). So that
    some of them are surely between their prefill and their decode engine when the drain
    begins, the prefill engine is frozen (SIGSTOP) for a moment around the delete, with one
    more stream sent to it: every stream in flight at the delete completes with all its
    tokens and finish reason `length`."""
    prefill = live_pods(cluster, "prefill")[0]["metadata"]["name"]
    decode = live_pods(cluster, "decode")[0]["metadata"]["name"]
    decode_state = f"http://{kubelet.pod_ip(decode)}:8080/v1/state"
    deleting = threading.Event()
    lock = threading.Lock()
    records: list[tuple[int, str | None, str | None]] = []  # (tokens, finish, error)
    in_flight = [0]

    def stream(prompt: str) -> None:
        tokens, finish, error = 0, None, None
        try:
            for c in client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=DELETE_TOKENS, temperature=0,
                    stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}):
                if c.choices:
                    tokens += len(c.choices[0].model_extra.get("token_ids") or [])
                    finish = c.choices[0].finish_reason or finish
        except Exception as exc:  # every failure is reported below
            error = f"{type(exc).__name__}: {exc}"
        with lock:
            in_flight[0] -= 1
            records.append((tokens, finish, error))

    def stream_until_deleted(i: int) -> None:
        for n in itertools.count():
            with lock:
                if deleting.is_set():
                    return
                in_flight[0] += 1
            stream(f"{prompts[i % 2]} {i}.{n}")

    threads = [threading.Thread(target=stream_until_deleted, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    frozen = kubelet.pids(prefill)
    try:
        wait_for("a stream in flight on every thread, after a first one completed", lambda:
                 records and in_flight[0] == streams, timeout=60, every=0.01)
        for pid in frozen:
            os.killpg(pid, signal.SIGSTOP)
        with lock:
            in_flight[0] += 1
        threads.append(threading.Thread(target=stream, args=("Sent to a frozen engine",)))
        threads[-1].start()
        time.sleep(0.1)  # the router has submitted it to the frozen prefill engine
        with lock:
            deleting.set()
            done_before, across_delete = len(records), in_flight[0]
        cluster.kubectl("delete", "inferencepool", "demo", "--wait=false")
        # Drained at once with the prefill engine, the decode engine would refuse the
        # frozen engine's handoffs: wait to see whether it does.
        thaw_at = time.monotonic() + FROZEN_S
        while time.monotonic() < thaw_at and not httpx.get(
                decode_state, headers={"Authorization": f"Bearer {token}"},
                timeout=5).json()["draining"]:
            time.sleep(0.05)
    finally:
        for pid in frozen:
            os.killpg(pid, signal.SIGCONT)
        deleting.set()
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert across_delete > streams // 2, across_delete
    assert len(records) - done_before == across_delete  # those in flight at the delete
    bad = [r for r in records if r != (DELETE_TOKENS, "length", None)]
    assert not bad, bad
