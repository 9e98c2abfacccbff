"""Weights from where clusters keep them, end to end from the built images: a pool whose
checkpoint is on a PersistentVolumeClaim (`pvc://`) and one whose checkpoint is a model
image (`oci://`, built by `make model-image MODEL_DIR=...`), each serving under streaming
load and moving to new weights with no failed request.

The test kubelet runs every pod from its image (image mode): a claim is a folder the test
fills with the demo checkpoints v1 and v2; a model image is mounted from local podman
storage and its /model copied into the pod by the operator's init container. The operator
runs as a local process.

* pvc: v1 -> v2 on the same claim is a refit in place: the same engine pods, not restarted,
  serve v2 (the transaction Succeeded).
* oci: v1 -> v2 is another image: the pods roll (a new template; Refitting says RollingPods),
  the new pods copy the v2 image and serve v2, and the router never pairs versions.

Completions equal the offline engine's on the same checkpoint before and after.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from kcluster.cluster import TestCluster
from kcluster.podrunner import PodRunner
from tandem_engine.cli.demo_model import write_demo_model
from test_images import built_images
from test_images_e2e import PROMPTS, offline
from test_operator_cluster import Operator, wait_for
from test_operator_refit import Load

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SEEDS = {"v1": 0, "v2": 1}
MODEL_IMAGE = "localhost/tandem-test/model-demo"


class Cluster:
    def __init__(self, cluster: TestCluster, kubelet: PodRunner, engine_image: str) -> None:
        self.cluster, self.kubelet, self.engine_image = cluster, kubelet, engine_image

    def get(self, *args: str) -> Any:
        return json.loads(self.cluster.kubectl("get", *args, "-o", "json").stdout)

    def pool(self, name: str) -> dict[str, Any]:
        return self.get("ipool", name)

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        return next((c for c in (self.pool(name).get("status") or {}).get("conditions") or ()
                     if c["type"] == kind), {})

    def pods(self, name: str, selector: str = "tandem.dev/engine=true") -> list[dict[str, Any]]:
        items = self.get("pods", "-l", f"tandem.dev/pool={name},{selector}")["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def router_url(self, name: str) -> str:
        (router,) = self.pods(name, "tandem.dev/role=router")
        return f"http://{router['status']['podIP']}:8000/v1"

    def apply(self, name: str, uri: str) -> None:
        doc = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool",
               "metadata": {"name": name},
               "spec": {"model": {"name": "tiny", "weights": {"uri": uri, "version": "v1"}},
                        "engine": {"image": self.engine_image, "kvCache": {"numBlocks": 128}},
                        "prefill": {"replicas": 1}, "decode": {"replicas": 1},
                        "router": {"replicas": 1}, "refit": {"drainTimeoutSeconds": 30}}}
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

    def patch_weights(self, name: str, uri: str, version: str) -> None:
        self.cluster.kubectl("patch", "ipool", name, "--type=merge", "-p", json.dumps(
            {"spec": {"model": {"weights": {"uri": uri, "version": version}}}}))

    def serving(self, name: str, version: str, engines: int = 2) -> bool:
        pods = self.pods(name)
        return len(pods) == engines and all(
            p["metadata"]["annotations"].get("tandem.dev/weights-version") == version
            and any(c["type"] == "Ready" and c["status"] == "True"
                    for c in p.get("status", {}).get("conditions") or ()) for p in pods) \
            and self.condition(name, "Ready").get("status") == "True"

    def dump(self) -> None:
        for p in self.get("pods")["items"]:
            name = p["metadata"]["name"]
            print(f"---- {name} ----\n{json.dumps(p.get('status', {}), indent=1)[-1500:]}\n"
                  f"{self.kubelet.logs(name)[-2500:]}")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    images = built_images()
    folder = tmp_path_factory.mktemp("weights-sources")
    with TestCluster() as cluster:
        cluster.install_crds(ROOT / "crds")
        kubelet = PodRunner(cluster, images=True).start()
        operator = Operator(cluster, folder / "operator.log", "--standalone",
                            "--metrics-port", "0", "--liveness-port", "0",
                            "--skip-weights-check")
        try:
            yield Cluster(cluster, kubelet, images.engine)
        finally:
            operator.stop()
            print(f"---- operator (tail) ----\n{(folder / 'operator.log').read_text()[-6000:]}")
            kubelet.stop()


def served(url: str) -> list[list[int]]:
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    return [client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True}
    ).choices[0].model_extra["token_ids"] for prompt in PROMPTS]


def engine_state(world: Cluster, name: str) -> dict[str, tuple[str, int]]:
    return {p["metadata"]["name"]: (p["metadata"]["uid"],
                                    p["status"]["containerStatuses"][0]["restartCount"])
            for p in world.pods(name)}


def test_a_pvc_backed_pool_serves_and_refits_in_place_under_load(
        world: Cluster, tmp_path: Path) -> None:
    claim = world.kubelet.root / "claims" / "default" / "models"
    for version, seed in SEEDS.items():
        # readable by the pods' user, as a claim filled for them is (safetensors writes 0600)
        subprocess.run(["chmod", "-R", "a+rX", write_demo_model(claim / "demo" / version,
                                                                 seed=seed)], check=True)
    world.apply("onclaim", "pvc://models/demo/v1")
    try:
        wait_for("the pvc pool to serve v1", lambda: world.serving("onclaim", "v1"),
                 timeout=300, every=1.0)
        url = world.router_url("onclaim")
        assert served(url) == offline(tmp_path, "v1")
        before = engine_state(world, "onclaim")
        with Load(url, threads=2) as load:
            world.patch_weights("onclaim", "pvc://models/demo/v2", "v2")
            wait_for("the refit to v2 on the claim", lambda: (
                (world.pool("onclaim")["status"].get("refit") or {}).get("phase")
                == "Succeeded" and world.serving("onclaim", "v2")), timeout=180, every=1.0)
    except AssertionError:
        world.dump()
        raise
    assert load.failures == [], load.failures
    assert load.done > 0
    assert engine_state(world, "onclaim") == before  # in place: same pods, no restart
    assert served(url) == offline(tmp_path, "v2")


def build_model_image(tag: str, checkpoint: Path, context: Path) -> str:
    image = f"{MODEL_IMAGE}:{tag}"
    done = subprocess.run(["make", "-s", "model-image", f"MODEL_DIR={checkpoint}",
                           f"MODEL_IMAGE={image}", f"MODEL_CONTEXT={context}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"oci://{image}" in done.stdout
    return image


def test_an_oci_model_pool_serves_and_rolls_to_a_new_image_under_load(
        world: Cluster, tmp_path: Path) -> None:
    images = {version: build_model_image(
        version, write_demo_model(tmp_path / "checkpoints" / version, seed=seed),
        tmp_path / f"context-{version}") for version, seed in SEEDS.items()}
    world.apply("fromimage", f"oci://{images['v1']}")
    try:
        wait_for("the oci pool to serve v1", lambda: world.serving("fromimage", "v1"),
                 timeout=300, every=1.0)
        (engine,) = world.pods("fromimage", "tandem.dev/role=decode")
        assert engine["spec"]["initContainers"][0]["image"] == images["v1"]
        url = world.router_url("fromimage")
        assert served(url) == offline(tmp_path, "v1")
        before = set(engine_state(world, "fromimage"))
        reasons: set[str] = set()

        def rolled() -> bool:
            reasons.add(world.condition("fromimage", "Refitting").get("reason", ""))
            return world.serving("fromimage", "v2") and not (
                set(engine_state(world, "fromimage")) & before)

        with Load(url, threads=2) as load:
            world.patch_weights("fromimage", f"oci://{images['v2']}", "v2")
            wait_for("every engine pod replaced by one on the v2 image", rolled,
                     timeout=300, every=1.0)
            url = world.router_url("fromimage")
        assert load.failures == [], load.failures
    except AssertionError:
        world.dump()
        raise
    assert load.done > 0
    assert "RollingPods" in reasons, reasons
    for pod in world.pods("fromimage"):
        assert pod["spec"]["initContainers"][0]["image"] == images["v2"]
    assert served(url) == offline(tmp_path, "v2")
