"""End to end from the built images, as a platform team meets Tandem on a cluster.

Everything here runs from `make images`' output, not from this machine's venv: the test
kubelet (image mode) mounts each pod's image from local podman storage and runs its
command chrooted into it, as the image's user, in its own mount and pid namespaces.

1. `helm install` the chart into `tandem-system`: the operator pod runs from the operator
   image and serves the pools in `default`;
2. `kubectl apply` a pool of 1 prefill + 1 decode engine + 1 router with the engine image
   the chart names (the operator's default); an init container of each pod writes the
   demo checkpoints (v1, and v2 for the refit) into the pod's emptyDir with `tandem
   demo-model`, as the quickstart does with a real model;
3. OpenAI completions through the router pod equal the offline engine on the same
   checkpoint written on this machine (the KV cache moved prefill → decode over NIXL);
4. a weights-version `kubectl patch` refits both engines in place (no pod restarts), and
   completions then equal the offline engine on v2;
5. `helm uninstall` after the pool is deleted.

Meanwhile a second pool, `slow`, whose engine takes 100 s to load (the engine's test knob
TANDEM_TEST_LOAD_DELAY_S), shows that a long load is not killed: its pod runs, answering
/healthz, LOADING and not Ready, for 100 s under the default startup probe, then
turns Ready without a restart. (Under the old liveness probe, 30 s delay + 6 × 10 s, it
died at ~90 s.) It loads while the demo pool is exercised, so the wait costs little.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from kcluster.cluster import TestCluster
from kcluster.fixtures import test_cluster  # noqa: F401
from kcluster.podrunner import PodRunner
from tandem_engine import LLM, SamplingParams
from tandem_engine.cli.demo_model import write_demo_model
from tandem_engine.model.device import auto_dtype
from test_images import built_images
from test_operator_cluster import wait_for
from test_operator_e2e import SYSTEM, condition, get, helm, live_pods, run_deployment

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello there", "Once upon a time in a land far away"]
SEEDS = {"v1": 0, "v2": 1}
SLOW_LOAD_S = 100  # past the ~90 s at which the old liveness probe killed a loading engine


@pytest.fixture
def kubelet(test_cluster: TestCluster) -> Iterator[PodRunner]:  # noqa: F811
    runner = PodRunner(test_cluster, images=True).start()
    try:
        yield runner
    finally:
        runner.stop()


def pool_manifest(name: str = "demo", load_delay_s: int = 0) -> str:
    """The quickstart's pool, with the demo checkpoints instead of a download (`slow`: one
    mixed engine whose load takes `load_delay_s`, and its router)."""
    doc = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["model"] = {"name": "demo", "weights": {"uri": "file:///models/v1", "version": "v1"}}
    spec["engine"].pop("image", None)  # the chart's engine image, through the operator
    spec["engine"]["resources"] = {"requests": {"cpu": "100m", "memory": "512Mi"}}
    spec["engine"]["kvCache"] = {"numBlocks": 128}
    spec["engine"]["initContainers"] = [{
        "name": "demo-model",
        "command": ["sh", "-c", " && ".join(
            f"tandem demo-model --seed {seed} /models/{version}"
            for version, seed in SEEDS.items())],
        "volumeMounts": [{"name": "models", "mountPath": "/models"}]}]
    spec["refit"] = {"drainTimeoutSeconds": 30}
    if load_delay_s:
        spec["engine"]["env"] = [{"name": "TANDEM_TEST_LOAD_DELAY_S",
                                  "value": str(load_delay_s)}]
        spec["prefill"]["replicas"] = 0
    return yaml.safe_dump(doc)


def engine_pod(cluster: TestCluster, pool: str) -> dict | None:
    items = get(cluster, "pods", "-l",
                f"tandem.dev/pool={pool},app.kubernetes.io/component=decode")["items"]
    return items[0] if items else None


def pod_ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions", []))


def get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def offline(tmp: Path, version: str) -> list[list[int]]:
    """The offline engine's tokens, in the dtype the pods' `--dtype auto` picks on this
    CPU: the pods' env lacks the suite's TANDEM_CPU_BF16=0, so on an AVX-512 BF16 or AMX
    CPU they serve the float32 demo model in bfloat16."""
    model = write_demo_model(tmp / version, seed=SEEDS[version])
    dtype = auto_dtype("cpu", "float32", env={})
    outs = LLM(model, dtype=dtype).generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def served(client: openai.OpenAI) -> list[list[int]]:
    return [client.completions.create(
        model="demo", prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True}
    ).choices[0].model_extra["token_ids"] for prompt in PROMPTS]


def dump(cluster: TestCluster, kubelet: PodRunner) -> None:
    for p in get(cluster, "pods", "-A")["items"]:
        name = p["metadata"]["name"]
        print(f"---- {name} ----\n{json.dumps(p.get('status', {}), indent=1)[-2000:]}\n"
              f"{kubelet.logs(name)[-3000:]}")


def test_helm_install_a_pool_completions_and_a_refit_all_from_images(
        test_cluster: TestCluster, kubelet: PodRunner, tmp_path: Path) -> None:  # noqa: F811
    images = built_images()
    cluster = test_cluster
    helm(cluster, "install", "tandem", str(ROOT / "charts" / "tandem"), "--create-namespace",
         "--set", "replicaCount=1")
    operator_pod = run_deployment(cluster, "tandem-operator", SYSTEM)
    try:
        wait_for("the operator pod (its image) to be ready", lambda: any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in get(cluster, "pod", operator_pod, "-n", SYSTEM).get("status", {}).get(
                "conditions", [])), timeout=90)
        assert get(cluster, "pod", operator_pod, "-n", SYSTEM)["spec"]["containers"][0][
            "image"] == images.operator

        cluster.kubectl("apply", "-f", "-", input=pool_manifest("slow", SLOW_LOAD_S))
        slow_applied = time.monotonic()
        slow = wait_for("the slow pool's engine pod to run", lambda: (
            p if (p := engine_pod(cluster, "slow")) and kubelet.pod_ip(p["metadata"]["name"])
            and p.get("status", {}).get("phase") == "Running" else None), timeout=90)
        slow_name = slow["metadata"]["name"]
        slow_ip = kubelet.pod_ip(slow_name)
        wait_for("the slow engine to answer /healthz while it loads", lambda: get_ok(
            f"http://{slow_ip}:8080/healthz"), timeout=60)
        token = base64.b64decode(get(cluster, "secret", "slow-admin-token")["data"]["token"])
        state = httpx.get(f"http://{slow_ip}:8080/v1/state", timeout=5,
                          headers={"Authorization": f"Bearer {token.decode()}"}).json()
        assert state["state"] == "LOADING", state

        cluster.kubectl("apply", "-f", "-", input=pool_manifest())
        wait_for("the pool to be Ready", lambda: condition(
            get(cluster, "ipool", "demo"), "Ready") == "True", timeout=300)
    except AssertionError:
        dump(cluster, kubelet)
        raise
    pods = {c: live_pods(cluster, c) for c in ("prefill", "decode", "router")}
    assert {c: len(p) for c, p in pods.items()} == {"prefill": 1, "decode": 1, "router": 1}
    for group in pods.values():
        assert group[0]["spec"]["containers"][0]["image"] == images.engine

    router_ip = kubelet.pod_ip(pods["router"][0]["metadata"]["name"])
    client = openai.OpenAI(base_url=f"http://{router_ip}:8000/v1", api_key="x",
                           max_retries=0, timeout=60)
    assert served(client) == offline(tmp_path, "v1")

    cluster.kubectl("patch", "ipool", "demo", "--type", "merge", "-p", json.dumps(
        {"spec": {"model": {"weights": {"uri": "file:///models/v2", "version": "v2"}}}}))
    try:
        wait_for("the refit to v2", lambda: (
            (p := get(cluster, "ipool", "demo"))["status"].get("weights", {}).get("current")
            == "v2" and condition(p, "Refitting") != "True"), timeout=180)
    except AssertionError:
        dump(cluster, kubelet)
        raise
    assert served(client) == offline(tmp_path, "v2")
    after = {c: live_pods(cluster, c) for c in ("prefill", "decode")}
    for c, group in after.items():  # in place: the same pods, never restarted
        assert [p["metadata"]["name"] for p in group] == \
            [p["metadata"]["name"] for p in pods[c]]
        assert group[0]["status"]["containerStatuses"][0]["restartCount"] == 0

    # The slow pool: still loading (if the demo was quick), never restarted, then Ready.
    loaded_at = slow_applied + SLOW_LOAD_S
    if time.monotonic() < loaded_at - 15:
        pod = engine_pod(cluster, "slow")
        assert pod["metadata"]["name"] == slow_name and not pod_ready(pod)
        assert condition(get(cluster, "ipool", "slow"), "Ready") != "True"
    try:
        slow_pool = wait_for("the slow pool to be Ready once loaded", lambda: (
            p if condition(p := get(cluster, "ipool", "slow"), "Ready") == "True" else None),
            timeout=max(loaded_at - time.monotonic(), 0) + 90)
    except AssertionError:
        dump(cluster, kubelet)
        raise
    assert time.monotonic() - slow_applied >= SLOW_LOAD_S
    pod = engine_pod(cluster, "slow")
    assert pod["metadata"]["name"] == slow_name, "the slow engine's pod was replaced"
    assert [c["restartCount"] for c in pod["status"]["containerStatuses"]] == [0]
    assert slow_pool["status"]["decode"]["ready"] == 1

    for name in ("demo", "slow"):
        cluster.kubectl("delete", "ipool", name, "--wait=false")
    wait_for("every pod of the pools to be gone", lambda: not get(
        cluster, "pods", "-l", "tandem.dev/pool")["items"], timeout=90)
    helm(cluster, "uninstall", "tandem")
