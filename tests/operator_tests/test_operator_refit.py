"""Rolling weight updates by editing the InferencePool: the operator's refit transaction.

First the operator's own rules, without engines (which transaction a pool is in, the weights
new pods load, annotations, reopening and adopting, the status report, the merge patch of
status). Then one pool of 2 prefill + 2 decode engines and a router on the test cluster,
real `tandem-engine` processes run by the test kubelet and `tandem-operator` as a
subprocess, through every scenario in turn: a `kubectl patch` of the weights under
streaming load, a corrupt checkpoint rolled back, the operator SIGKILLed mid-refit, a
second edit during a refit, an engine pod deleted during one, the operator SIGKILLed in each
phase of a rolling refit, and a scale-up during one.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kcluster.cluster import TestCluster
from kcluster.podrunner import PodRunner
from tandem_engine.fleet import EngineObs, EngineRecord, Failure, Phase, Transaction
from tandem_engine.weights import WeightsRef
from tandem_operator import manifests as m
from tandem_operator.plan import Observed, PodView
from tandem_operator.reconcile import merge_patch
from tandem_operator.refit import (
    _adopt,
    _rejoin,
    annotations,
    begin,
    load,
    needs_refit,
    new_pod_weights,
    participants,
    report,
    reused_version,
)
from tandem_operator.spec import PoolSpec
from test_operator_cluster import Operator, wait_for

ROOT = Path(__file__).resolve().parents[2]
V1 = WeightsRef("file:///models/v1", "v1")
V2 = WeightsRef("file:///models/v2", "v2")


# ---- the operator's rules, no engines -----------------------------------------------------------


def make_spec(weights: WeightsRef = V2, **spec: Any) -> PoolSpec:
    full: dict[str, Any] = {"model": {"name": "m", "weights": {"uri": weights.uri,
                                                              "version": weights.version}}}
    full.update(spec)
    return PoolSpec.from_body({"metadata": {"name": "pool", "namespace": "ns", "uid": "u",
                                            "generation": 2}, "spec": full})


def engine_pod(name: str, weights: WeightsRef | None = V1, epoch: int = 0, **kw: Any) -> PodView:
    group = "prefill" if "prefill" in name else "decode"
    base: dict[str, Any] = {"phase": "Running", "ready": True, "ip": "10.0.0.1"}
    return PodView(name=name, group=group, role=group, weights=weights, epoch=epoch,
                   **{**base, **kw})


def obs(name: str, state: str | None = "RUNNING", version: str = "v1", epoch: int = 0,
        draining: bool = False) -> EngineObs:
    role = "prefill" if "prefill" in name else "decode"
    return EngineObs(name, role, f"http://{name}", state, version, epoch, draining)


def test_a_weights_edit_begins_a_transaction_over_every_epoch_seen() -> None:
    spec = make_spec(refit={"strategy": "AllAtOnce", "inflight": "Recompute",
                            "drainTimeoutSeconds": 9, "onFailure": "Halt"},
                     rollout={"maxSurge": 1, "maxUnavailable": 2})
    pods = (engine_pod("p-prefill-a", epoch=3), engine_pod("p-decode-a", epoch=1))
    observed = Observed(pods=pods, previous={"weights": {"epoch": 2}})
    assert needs_refit(spec, observed) and not needs_refit(make_spec(V1), observed)
    tx = begin(spec, None, observed)
    assert (tx.target, tx.previous, tx.epoch) == (V2, V1, 4)
    assert (tx.strategy, tx.inflight, tx.drain_timeout, tx.on_failure, tx.max_unavailable) == (
        "AllAtOnce", "Recompute", 9.0, "Halt", 2)
    assert begin(make_spec(), None, observed).max_unavailable == 1  # a refit takes >= 1
    # Superseding: the old transaction's starting point stays the way back, its epochs count.
    old = Transaction(V2, V1, epoch=7, rollback_epoch=8)
    newer = begin(make_spec(WeightsRef("file:///models/v3", "v3")), old, observed)
    assert (newer.previous.version, newer.epoch) == ("v1", 9)
    old.phase = Phase.SUCCEEDED
    assert begin(make_spec(WeightsRef("file:///models/v3", "v3")), old, observed
                 ).previous.version == "v2"


def test_other_weights_under_a_version_in_use_cannot_be_refit_to() -> None:
    moved = WeightsRef("file:///elsewhere/v1", "v1")
    observed = Observed(pods=(engine_pod("p-prefill-a"), engine_pod("p-decode-a")))
    assert reused_version(make_spec(moved), None, observed) == V1
    assert reused_version(make_spec(V2), None, observed) is None
    v3 = WeightsRef("file:///models/v3", "v3")
    under_way = Transaction(v3, V1, epoch=2)
    fixed = make_spec(WeightsRef("file:///fixed/v3", "v3"))
    assert reused_version(fixed, under_way, observed) == WeightsRef(v3.uri, "v3")
    under_way.phase = Phase.ROLLED_BACK  # no engine runs v3 any more: the name is free
    assert reused_version(fixed, under_way, observed) is None


def test_participants_leave_out_pods_that_are_leaving_or_not_running() -> None:
    pods = (engine_pod("p-prefill-a"), engine_pod("p-prefill-b", draining_since="t"),
            engine_pod("p-decode-a", deleting=True), engine_pod("p-decode-b", ip=None),
            engine_pod("p-decode-c", phase="Pending"), engine_pod("p-decode-d", phase="Failed"))
    assert [p.name for p in participants(Observed(pods=pods))] == ["p-prefill-a"]


def test_new_pods_load_weights_some_engine_serves_verified() -> None:
    tx = Transaction(V2, V1, epoch=2)
    only_v1 = Observed(pods=(engine_pod("p-prefill-a"), engine_pod("p-decode-a")))
    assert new_pod_weights(tx, only_v1) == V1  # nothing verified on v2 yet
    one_on_v2 = Observed(pods=(engine_pod("p-prefill-a", V2), engine_pod("p-decode-a")))
    assert new_pod_weights(tx, one_on_v2) == V2
    for phase, expected in ((Phase.SUCCEEDED, V2), (Phase.ROLLING_BACK, V1),
                            (Phase.ROLLED_BACK, V1)):
        tx.phase = phase
        assert new_pod_weights(tx, one_on_v2) == expected
    tx.phase = Phase.HALTED  # the majority; the old weights on a tie
    assert new_pod_weights(tx, one_on_v2) == V1
    two_on_v2 = Observed(pods=(*one_on_v2.pods, engine_pod("p-decode-b", V2)))
    assert new_pod_weights(tx, two_on_v2) == V2


def test_serving_engines_name_their_weights_and_epoch_in_annotations() -> None:
    tx = Transaction(V2, V1, epoch=5)
    pods = {p.name: p for p in (engine_pod("p-prefill-a"), engine_pod("p-decode-a"),
                                engine_pod("p-decode-b", V2, epoch=5))}
    engines = [obs("p-prefill-a", version="v2", epoch=5),  # verified: annotate
               obs("p-decode-a", "SUSPENDED", "v2", 5),  # not serving yet: not yet
               obs("p-decode-b", version="v2", epoch=5)]  # already says so
    assert annotations(tx, engines, pods) == {"p-prefill-a": {
        m.WEIGHTS_VERSION: "v2", m.WEIGHTS_URI: V2.uri, m.WEIGHTS_EPOCH: "5"}}


def test_a_finished_transaction_reopens_for_an_engine_on_other_weights() -> None:
    tx = Transaction(V2, V1, epoch=5, phase=Phase.SUCCEEDED,
                     finished_at=10.0, engines={"p-decode-a": EngineRecord(verified=True)})
    assert _rejoin(tx, [obs("p-decode-a", version="v2")], now=20.0) == []
    (event,) = _rejoin(tx, [obs("p-decode-a", version="v1"), obs("p-prefill-a", "STOPPED")],
                       now=20.0)
    assert event.reason == "RefitResumed" and "p-decode-a (v1)" in event.message
    assert (tx.phase, tx.finished_at, tx.engines) == (Phase.PROGRESSING, None, {})
    tx = Transaction(V2, V1, epoch=5, phase=Phase.ROLLED_BACK)
    assert _rejoin(tx, [obs("p-decode-a", version="v2")], now=1.0)
    assert tx.phase is Phase.ROLLING_BACK and tx.goal.version == "v1"


def test_out_of_service_engines_the_transaction_does_not_know_are_adopted() -> None:
    tx = Transaction(V2, V1, epoch=5)
    _adopt(tx, [obs("p-prefill-a"), obs("p-prefill-b", "PAUSED"),
                obs("p-decode-a", version="v2", draining=True), obs("p-decode-b", "STOPPING"),
                obs("p-decode-c", None)], now=3.0)
    assert sorted(tx.engines) == ["p-decode-a", "p-prefill-b"]
    assert tx.engines["p-decode-a"].drained_at == 3.0  # its drain is timed from now
    assert tx.engines["p-prefill-b"].drained_at is None


def test_the_report_tells_conditions_progress_and_a_failure() -> None:
    tx = Transaction(V2, V1, epoch=5, wave=1, started_at=1.0,
                     engines={"p-prefill-a": EngineRecord(step="refit")})
    engines = [obs("p-prefill-a", "SUSPENDED"), obs("p-decode-a")]
    r = report(tx, engines)
    assert r.refitting[:2] == (True, "Rolling") and r.degraded is None and r.current is None
    assert "wave 1" in r.refitting[2] and "p-prefill-a refit (SUSPENDED" in r.refitting[2]
    assert r.record["progress"] == "0/2 engines serve v2"
    assert load(r.record) == tx  # the record reads back as the same transaction
    assert "failure" not in r.record and "finished_at" not in r.record  # no nulls in status
    tx.phase, tx.rollback_epoch, tx.finished_at = Phase.ROLLED_BACK, 6, 4.0
    tx.failure = Failure("p-prefill-a", "POST /v1/refit", "HTTP 422: " + "x" * 9000)
    r = report(tx, [obs("p-prefill-a"), obs("p-decode-a")])
    assert r.refitting[:2] == (False, "RefitRolledBack") and r.current == "v1"
    assert r.degraded is not None and r.degraded[:2] == (True, "RefitRolledBack")
    assert "engine p-prefill-a failed at POST /v1/refit: HTTP 422" in r.degraded[2]
    assert len(r.record["failure"]["message"]) == 4000
    tx.phase = Phase.HALTED
    r = report(tx, [obs("p-prefill-a", version="v2"), obs("p-decode-a")])
    assert r.degraded is not None and r.degraded[1] == "RefitHalted"
    assert "1 on v1, 1 on v2" in r.degraded[2]
    assert load({"phase": "Progressing"}) is None  # not a record: begin afresh


def test_status_is_written_as_a_merge_patch_that_removes_what_went_away() -> None:
    old = {"weights": {"current": "v1", "epoch": 1}, "refit": {"engines": {"a": {"step": "x"},
                                                                         "b": {}}}}
    new = {"weights": {"current": "v1", "epoch": 2}, "refit": {"engines": {"a": {"step": "x"}}},
           "routerEndpoint": "u"}
    assert merge_patch(old, new) == {"weights": {"epoch": 2}, "refit": {"engines": {"b": None}},
                                     "routerEndpoint": "u"}
    assert merge_patch(new, new) == {}


# ---- a pool of real engines on the test cluster -------------------------------------------------


class Pool:
    """The shared pool: its cluster, kubelet and operator, and what the test asks of them."""

    def __init__(self, cluster: TestCluster, kubelet: PodRunner, folder: Path) -> None:
        self.cluster, self.kubelet, self.folder = cluster, kubelet, folder
        self.operators: list[Operator] = []
        self.operator = self.start_operator()
        self.refitting: set[tuple[str, str]] = set()  # (status, reason) of Refitting seen

    def start_operator(self) -> Operator:
        log = self.folder / f"operator-{len(self.operators)}.log"
        op = Operator(self.cluster, log, "--standalone", "--metrics-port", "0",
                      "--liveness-port", "0")
        self.operators.append(op)
        return op

    def get(self, *args: str) -> Any:
        return json.loads(self.cluster.kubectl("get", *args, "-o", "json").stdout)

    def body(self) -> dict[str, Any]:
        return self.get("inferencepool", "demo")

    def status(self) -> dict[str, Any]:
        st = self.body().get("status") or {}
        self.refitting |= {(c["status"], c["reason"]) for c in st.get("conditions") or ()
                           if c["type"] == "Refitting"}
        return st

    def condition(self, kind: str) -> dict[str, Any]:
        return next((c for c in self.status().get("conditions") or () if c["type"] == kind), {})

    def engine_pods(self) -> list[dict[str, Any]]:
        items = self.get("pods", "-l", "tandem.dev/pool=demo,tandem.dev/engine=true")["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def engines(self) -> dict[str, dict[str, Any] | None]:
        """Each live engine pod's /v1/state (None: not answering)."""
        out: dict[str, dict[str, Any] | None] = {}
        for p in self.engine_pods():
            ip = p.get("status", {}).get("podIP")
            try:
                out[p["metadata"]["name"]] = httpx.get(f"http://{ip}:8080/v1/state",
                                                       timeout=5).json() if ip else None
            except httpx.HTTPError:
                out[p["metadata"]["name"]] = None
        return out

    def out_of_service(self) -> list[str]:
        """Engines paused, suspended, draining or in a transition (what a refit does)."""
        return [n for n, s in self.engines().items()
                if s is not None and (s["state"] != "RUNNING" or s["draining"])]

    def all_serve(self, version: str, engines: int = 4) -> bool:
        states = self.engines()
        return len(states) == engines and all(
            s is not None and s["state"] == "RUNNING" and not s["draining"]
            and s["weight_version"] == version for s in states.values())

    def patch_spec(self, spec: dict[str, Any]) -> None:
        self.cluster.kubectl("patch", "inferencepool", "demo", "--type=merge", "-p",
                             json.dumps({"spec": spec}))

    def patch_weights(self, uri: str, version: str) -> None:
        self.patch_spec({"model": {"weights": {"uri": uri, "version": version}}})
        # status.weights.target follows the edit at once
        wait_for(f"status.weights.target {version}",
                 lambda: self.status().get("weights", {}).get("target") == version, timeout=10,
                 every=0.1)

    def settle(self, version: str, phase: str = "Succeeded", timeout: float = 120.0) -> None:
        def done() -> bool:
            st = self.status()
            return ((st.get("refit") or {}).get("phase") == phase
                    and st.get("weights", {}).get("target") == (st["refit"].get("target") or {}
                                                                 ).get("version")
                    and self.all_serve(version))
        try:
            wait_for(f"refit {phase}, every engine serving {version}", done, timeout=timeout,
                     every=0.3)
        except AssertionError:
            print(json.dumps(self.status(), indent=1)[-6000:])
            raise

    def events(self) -> list[tuple[str, str, str]]:
        items = self.get("events")["items"]
        return [(e["metadata"]["name"], e["reason"], e["message"]) for e in items
                if e["involvedObject"].get("name") == "demo"
                and e["involvedObject"].get("kind") == "InferencePool"]

    def new_events(self, before: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
        seen = {name for name, _, _ in before}
        return [(r, msg) for name, r, msg in self.events() if name not in seen]

    def router_url(self) -> str:
        items = self.get("pods", "-l", "tandem.dev/pool=demo,tandem.dev/role=router")["items"]
        return f"http://{items[0]['status']['podIP']}:8000/v1"


class Load:
    """Streaming completions of `max_tokens` through the router from a few threads until
    stopped, under each of `models` in turn; every failure is kept, and how many answered
    (in all, and per model)."""

    def __init__(self, url: str, threads: int = 3, max_tokens: int = 16,
                 models: tuple[str, ...] = ("tiny",)) -> None:
        self.url, self.max_tokens, self.models = url, max_tokens, models
        self.failures: list[str] = []
        self.done = 0
        self.by_model: dict[str, int] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(threads)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, i: int) -> None:
        import openai

        client = openai.OpenAI(base_url=self.url, api_key="x", max_retries=0, timeout=60)
        n = 0
        while not self._stop.is_set():
            model = self.models[(i + n) % len(self.models)]
            n += 1
            try:
                text = "".join(c.choices[0].text for c in client.completions.create(
                    model=model, prompt=f"Request {i}.{n}: once upon a time",
                    max_tokens=self.max_tokens,
                    temperature=0, stream=True, extra_body={"ignore_eos": True}))
                assert text, "an empty completion"
                self.done += 1
                self.by_model[model] = self.by_model.get(model, 0) + 1
            except Exception as exc:  # every failure is reported by the test
                self.failures.append(f"{model}: {type(exc).__name__}: {exc}")


@pytest.fixture(scope="module")
def checkpoints(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> dict[str, Path]:
    from tandem_engine.cli.demo_model import write_demo_model

    root = tmp_path_factory.mktemp("refit-weights")
    v2 = write_demo_model(root / "v2", seed=1)
    corrupt = root / "corrupt"
    shutil.copytree(v2, corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[:len(data) // 2])
    return {"v1": tiny_llama, "v2": v2, "corrupt": corrupt}


@pytest.fixture(scope="module")
def pool(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Pool]:
    pytest.importorskip("nixl_cu12")
    folder = tmp_path_factory.mktemp("refit-pool")
    with TestCluster() as cluster:
        cluster.install_crds(ROOT / "crds")
        runner = PodRunner(cluster).start()
        p = Pool(cluster, runner, folder)
        try:
            doc = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
            doc["metadata"]["name"] = "demo"
            spec = doc["spec"]
            spec["model"] = {"name": "tiny", "weights": {
                "uri": checkpoints["v1"].as_uri(), "version": "v1"}}
            spec.update(prefill={"replicas": 2}, decode={"replicas": 2},
                        router={"replicas": 1}, rollout={"maxSurge": 1, "maxUnavailable": 0},
                        refit={"drainTimeoutSeconds": 30})
            spec.setdefault("engine", {})["kvCache"] = {"numBlocks": 256}
            # Refits load checkpoints from several pytest folders: allow all of them.
            spec["engine"]["weightsRoots"] = [str(tmp_path_factory.getbasetemp())]
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
            wait_for("the pool to be Ready", lambda: p.condition("Ready").get("status")
                     == "True" and p.all_serve("v1"), timeout=180, every=0.5)
            wait_for("the router to see every engine", lambda: sorted(
                e["role"] for e in httpx.get(f"{p.router_url()}/engines", timeout=5
                                             ).json()["engines"] if e["state"] == "RUNNING")
                == ["decode", "decode", "prefill", "prefill"], timeout=60)
            yield p
        except BaseException:
            for pod in p.get("pods")["items"]:
                print(f"---- {pod['metadata']['name']} ----\n"
                      f"{runner.logs(pod['metadata']['name'])[-2500:]}")
            raise
        finally:
            for op in p.operators:
                op.stop()
            for op in p.operators:
                print(f"---- {op.log.name} (tail) ----\n{op.log.read_text()[-8000:]}")
            runner.stop()


def reference(checkpoint: Path, prompt: str) -> list[int]:
    from tandem_engine import LLM, SamplingParams

    out = LLM(checkpoint).generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                            ignore_eos=True))
    return out[0].outputs[0].token_ids


def completion_ids(pool: Pool, prompt: str) -> list[int]:
    r = httpx.post(f"{pool.router_url()}/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.slow
def test_a_patched_weights_version_rolls_every_engine_under_load(
        pool: Pool, checkpoints: dict[str, Path]) -> None:
    before = pool.events()
    pool.refitting.clear()
    with Load(pool.router_url()) as load:
        time.sleep(1.0)
        pool.patch_weights(checkpoints["v2"].as_uri(), "v2")
        # Rolling with maxUnavailable 1: one prefill and one decode engine at a time.
        wait_for("the first wave under way", pool.out_of_service, timeout=20, every=0.05)
        pool.settle("v2")
        time.sleep(0.5)
    assert not load.failures, load.failures
    assert load.done > 0

    st = pool.status()
    assert st["weights"]["current"] == st["weights"]["target"] == "v2"
    assert st["refit"]["phase"] == "Succeeded" and st["refit"]["wave"] == 2
    assert st["refit"]["progress"] == "4/4 engines serve v2"
    epoch = st["refit"]["epoch"]
    assert st["weights"]["epoch"] == epoch >= 1
    assert {s["weight_epoch"] for s in pool.engines().values() if s} == {epoch}
    for p in pool.engine_pods():  # new pods follow what the engines were verified on
        ann = p["metadata"]["annotations"]
        assert (ann[m.WEIGHTS_VERSION], ann[m.WEIGHTS_URI], ann[m.WEIGHTS_EPOCH]) == (
            "v2", checkpoints["v2"].as_uri(), str(epoch))
    assert ("True", "Rolling") in pool.refitting  # seen while it ran
    refitting, degraded = pool.condition("Refitting"), pool.condition("Degraded")
    assert (refitting["status"], refitting["reason"]) == ("False", "RefitSucceeded")
    assert degraded["status"] == "False" and pool.condition("Ready")["status"] == "True"
    reasons = [r for r, _ in pool.new_events(before)]
    assert reasons.count("EngineRefitted") == 4 and reasons.count("RefitWave") == 2
    assert {"RefitStarted", "RefitSucceeded"} <= set(reasons)
    row = pool.cluster.kubectl("get", "ipool", "demo", "--no-headers").stdout.split()
    assert row[5:9] == ["v2", "v2", "Succeeded", "True"], row
    story = pool.cluster.kubectl("describe", "ipool", "demo").stdout
    assert "RefitSucceeded" in story and "every engine serves v2" in story
    print(story)

    # The pool now answers with the new weights (greedy, against a fresh engine).
    prompt = "The quick brown fox"
    v2_tokens = reference(checkpoints["v2"], prompt)
    assert v2_tokens != reference(checkpoints["v1"], prompt)
    assert completion_ids(pool, prompt) == v2_tokens
    # The router's record of every handoff: prefill and decode always on one version.
    metrics = httpx.get(pool.router_url().removesuffix("/v1") + "/metrics", timeout=10).text
    pairs = [(dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(n)) for labels, n in
             re.findall(r'^tandem_router_kv_handoff_versions_total\{(.*)\} (\S+)$', metrics,
                        re.M)]
    seen = {(lb["prefill_version"], lb["decode_version"]) for lb, n in pairs if n > 0}
    assert ("v2", "v2") in seen and all(p == d for p, d in seen), seen


@pytest.mark.slow
def test_a_corrupt_checkpoint_rolls_back_without_failing_a_request(
        pool: Pool, checkpoints: dict[str, Path]) -> None:
    pool.settle("v2")
    before = pool.events()
    with Load(pool.router_url()) as load:
        time.sleep(0.5)
        pool.patch_weights(checkpoints["corrupt"].as_uri(), "broken")
        pool.settle("v2", phase="RolledBack")
        time.sleep(0.5)
    assert not load.failures, load.failures

    st = pool.status()
    engine_epochs = {s["weight_epoch"] for s in pool.engines().values() if s}
    assert len(engine_epochs) == 1  # nobody was refitted: every engine kept its epoch
    assert st["weights"] == {"current": "v2", "target": "broken",
                             "epoch": engine_epochs.pop()}
    assert st["refit"]["rollback_epoch"] == st["refit"]["epoch"] + 1
    failure = st["refit"]["failure"]
    assert failure["step"] == "POST /v1/refit"
    degraded = pool.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "RefitRolledBack")
    for words in (failure["engine"], "POST /v1/refit", "HTTP 422", "refused",
                  "Every engine serves v2 again"):
        assert words in degraded["message"], degraded["message"]
    reasons = [r for r, _ in pool.new_events(before)]
    assert {"RefitStarted", "RefitFailed", "RefitRolledBack", "Degraded"} <= set(reasons)
    row = pool.cluster.kubectl("get", "ipool", "demo", "--no-headers").stdout.split()
    assert row[5:8] == ["v2", "broken", "RolledBack"], row
    assert all(p["metadata"]["annotations"][m.WEIGHTS_VERSION] == "v2"
               for p in pool.engine_pods())

    # onFailure Halt: the engines under way go back to serving and the refit stops there.
    pool.patch_spec({"refit": {"onFailure": "Halt"}})
    pool.patch_weights(checkpoints["corrupt"].as_uri(), "broken-again")
    pool.settle("v2", phase="Halted")
    st = pool.status()
    assert st["refit"]["wave"] == 1 and st["refit"]["failure"]["step"] == "POST /v1/refit"
    degraded = pool.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "RefitHalted")
    assert "Engines serve 4 on v2" in degraded["message"], degraded["message"]
    assert pool.condition("Refitting")["reason"] == "RefitHalted"


@pytest.mark.slow
def test_an_operator_killed_mid_refit_completes_it_after_a_restart(
        pool: Pool, checkpoints: dict[str, Path]) -> None:
    """All at once, in-flight requests recomputed: every engine is out of service when the
    operator dies; the restarted one brings them all to the new weights, no request lost."""
    pool.settle("v2", phase="Halted")
    pool.patch_spec({"refit": {"strategy": "AllAtOnce", "inflight": "Recompute",
                               "onFailure": "Rollback"}})
    pool.refitting.clear()
    with Load(pool.router_url()) as load:
        time.sleep(0.5)
        pool.patch_weights(checkpoints["v1"].as_uri(), "v3")
        wait_for("every engine out of service", lambda: len(pool.out_of_service()) == 4,
                 timeout=20, every=0.05)
        pool.operator.kill()
        stuck = pool.out_of_service()
        time.sleep(1.5)  # nothing brings an engine back while no operator runs
        assert stuck and pool.out_of_service() == stuck
        pool.operator = pool.start_operator()
        pool.settle("v3")
    assert not load.failures, load.failures
    assert ("True", "AllAtOnce") in pool.refitting
    assert pool.status()["refit"]["wave"] == 1
    assert not pool.out_of_service()
    assert pool.condition("Degraded")["status"] == "False"  # a good edit clears the halt


@pytest.mark.slow
def test_a_second_edit_during_a_refit_supersedes_it(
        pool: Pool, checkpoints: dict[str, Path]) -> None:
    pool.settle("v3")
    pool.patch_spec({"refit": {"strategy": "Rolling", "inflight": "Drain"}})
    before = pool.events()
    with Load(pool.router_url()) as load:
        pool.patch_weights(checkpoints["v2"].as_uri(), "v4")
        wait_for("an engine out of service", pool.out_of_service, timeout=20, every=0.05)
        pool.patch_weights(checkpoints["v1"].as_uri(), "v5")
        pool.settle("v5")
    assert not load.failures, load.failures
    assert not pool.out_of_service()
    st = pool.status()
    assert (st["refit"]["target"]["version"], st["refit"]["previous"]["version"]) == ("v5", "v3")
    reasons = [r for r, _ in pool.new_events(before)]
    assert "RefitSuperseded" in reasons and reasons.count("RefitSucceeded") == 1


@pytest.mark.slow
def test_a_pod_deleted_during_a_refit_is_replaced_and_joins_it(
        pool: Pool, checkpoints: dict[str, Path]) -> None:
    pool.settle("v5")
    names_before = {p["metadata"]["name"] for p in pool.engine_pods()}
    pool.patch_weights(checkpoints["v2"].as_uri(), "v6")
    busy = wait_for("the first wave under way", pool.out_of_service, timeout=20, every=0.05)
    # An engine the refit has not reached yet goes away.
    victim = next(p["metadata"]["name"] for p in pool.engine_pods()
                  if p["metadata"]["name"] not in busy)
    pool.cluster.kubectl("delete", "pod", victim, "--wait=false")
    pool.settle("v6", timeout=150)
    names = {p["metadata"]["name"] for p in pool.engine_pods()}
    assert victim not in names and len(names - names_before) == 1
    replacement = (names - names_before).pop()
    state = pool.engines()[replacement]
    assert state is not None and state["weight_version"] == "v6"
    assert pool.status()["refit"]["progress"] == "4/4 engines serve v6"

    # Other weights under the same version name: refused with the reason, nothing moves.
    pool.patch_weights(checkpoints["v1"].as_uri(), "v6")
    degraded = wait_for("Degraded WeightsVersionReused", lambda: (
        c if (c := pool.condition("Degraded")).get("reason") == "WeightsVersionReused"
        else None), timeout=10)
    assert "give them a new spec.model.weights.version" in degraded["message"]
    assert pool.status()["refit"]["phase"] == "Succeeded" and pool.all_serve("v6")
    assert all(p["metadata"]["annotations"][m.WEIGHTS_URI] == checkpoints["v2"].as_uri()
               for p in pool.engine_pods())
    pool.patch_weights(checkpoints["v2"].as_uri(), "v6")
    wait_for("Degraded cleared", lambda: pool.condition("Degraded")["status"] == "False",
             timeout=10)


# ---- the operator killed in each phase; a scale-up during a refit --------------------------------


def quiet(pool: Pool, timeout: float = 150.0) -> str:
    """Waits until no refit runs and the four engines serve one version; returns it."""
    def one_version() -> str | None:
        phase = (pool.status().get("refit") or {}).get("phase")
        states = pool.engines()
        versions = {s["weight_version"] for s in states.values() if s}
        if phase in (None, "Succeeded", "RolledBack", "Halted") and len(versions) == 1 \
                and pool.all_serve(next(iter(versions))):
            return versions.pop()
        return None
    return wait_for("a quiet pool", one_version, timeout=timeout, every=0.3)


def other_checkpoint(pool: Pool, checkpoints: dict[str, Path]) -> str:
    """The uri of whichever of v1 and v2 the engines do not serve now."""
    uris = {p["metadata"]["annotations"][m.WEIGHTS_URI] for p in pool.engine_pods()}
    v1 = checkpoints["v1"].as_uri()
    return checkpoints["v2"].as_uri() if uris == {v1} else v1


def engines_at_step(pool: Pool, target: str, step: str) -> tuple[str | None, list[str]]:
    """(the refit's phase, engines whose recorded step is `step`) for the refit to `target`."""
    refit = pool.status().get("refit") or {}
    if (refit.get("target") or {}).get("version") != target:
        return None, []
    return refit.get("phase"), sorted(n for n, r in (refit.get("engines") or {}).items()
                                      if r.get("step") == step)


def handoff_versions(pool: Pool) -> set[tuple[str, str]]:
    """(prefill, decode) versions of every KV handoff the router made."""
    metrics = httpx.get(pool.router_url().removesuffix("/v1") + "/metrics", timeout=10).text
    pairs = [(dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(n)) for labels, n in
             re.findall(r'^tandem_router_kv_handoff_versions_total\{(.*)\} (\S+)$', metrics,
                        re.M)]
    return {(lb["prefill_version"], lb["decode_version"]) for lb, n in pairs if n > 0}


# Where the operator is killed, by the phase an engine is in and the step the transaction
# recorded for it last: draining (no engine changed yet), suspended (its weights may be
# loading), refitted (new weights, still suspended) and awaiting verification (unpaused,
# refusing traffic until its canary passes).
KILL_PHASES = {"drain": "drain", "suspend": "suspend", "refit": "refit", "verify": "unpause"}


@pytest.mark.slow
def test_an_operator_killed_in_each_phase_of_a_rolling_refit_finishes_it(
        pool: Pool, checkpoints: dict[str, Path]) -> None:
    """Rolling, draining under load: the operator is SIGKILLed as soon as an engine is in
    each phase of KILL_PHASES in turn (a fresh refit each time, the weights alternating
    between v1 and v2); each restarted operator finishes the refit and leaves no engine
    paused, suspended or draining, with no request failed."""
    quiet(pool)
    pool.patch_spec({"refit": {"strategy": "Rolling", "inflight": "Drain",
                               "onFailure": "Rollback"}})
    caught: dict[str, tuple[list[str], dict[str, str]]] = {}
    with Load(pool.router_url(), threads=4) as load:
        time.sleep(0.5)
        for phase_name, step in KILL_PHASES.items():
            # A step can pass between two polls on a busy machine (a drain under light
            # load lasts as long as the requests in flight): then let that refit finish
            # and try a fresh one.
            for attempt in range(4):
                target = f"killed-at-{phase_name}" + (f"-{attempt}" if attempt else "")
                pool.patch_weights(other_checkpoint(pool, checkpoints), target)
                deadline = time.monotonic() + 60
                while True:
                    phase, at_step = engines_at_step(pool, target, step)
                    if at_step or phase not in (None, "Progressing") \
                            or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                if at_step:
                    break
                pool.settle(target)
            else:
                pytest.fail(f"never saw an engine at step {step} ({phase_name}; refit "
                            f"{phase}) in 4 refits: the step passed between two polls")
            pool.operator.kill()
            frozen = (pool.status().get("refit") or {}).get("engines") or {}
            caught[phase_name] = (at_step, {n: r.get("step", "") for n, r in frozen.items()})
            pool.operator = pool.start_operator()
            pool.settle(target)
            assert not pool.out_of_service()
            st = pool.status()
            assert st["weights"]["current"] == target
            assert st["refit"]["progress"] == f"4/4 engines serve {target}"
            assert {s["weight_epoch"] for s in pool.engines().values() if s} == {
                st["refit"]["epoch"]}
    print("killed at:", json.dumps(caught, indent=1))
    assert not load.failures, load.failures
    assert load.done > 0
    assert all(p == d for p, d in handoff_versions(pool))
    assert pool.condition("Degraded")["status"] == "False"


def weight_version_arg(pod: dict[str, Any]) -> str:
    args = pod["spec"]["containers"][0]["args"]
    return args[args.index("--weight-version") + 1]


@pytest.mark.slow
def test_a_scale_up_during_a_refit_joins_it(pool: Pool, checkpoints: dict[str, Path]) -> None:
    """A third decode pod created while a Rolling refit runs starts on weights some engine
    serves verified (the invariant holds), joins the refit and ends on the target; scaled
    back to two, the newest pod is drained and deleted. No request fails throughout."""
    previous = quiet(pool)
    pool.patch_spec({"refit": {"strategy": "Rolling", "inflight": "Drain",
                               "onFailure": "Rollback"}})
    before = {p["metadata"]["name"] for p in pool.engine_pods()}
    target = "scaled-up"

    def serving(version: str, engines: int) -> bool:
        return (pool.status().get("refit") or {}).get("phase") == "Succeeded" \
            and pool.all_serve(version, engines=engines)

    with Load(pool.router_url(), threads=4) as load:
        time.sleep(0.5)
        pool.patch_weights(other_checkpoint(pool, checkpoints), target)
        wait_for("the first wave under way", pool.out_of_service, timeout=20, every=0.05)
        pool.patch_spec({"decode": {"replicas": 3}})
        new = wait_for("a third decode pod", lambda: [
            p for p in pool.engine_pods() if p["metadata"]["name"] not in before],
            timeout=20, every=0.1)
        assert len(new) == 1 and new[0]["metadata"]["labels"]["tandem.dev/role"] == "decode"
        name, started_on = new[0]["metadata"]["name"], weight_version_arg(new[0])
        # It loads what an engine already serves verified: the old weights while the first
        # wave is under way, the target once an engine was verified on it.
        assert started_on in (previous, target), started_on
        wait_for(f"five engines serving {target}", lambda: serving(target, 5), timeout=150,
                 every=0.3)
        st = pool.status()
        assert st["refit"]["progress"] == f"5/5 engines serve {target}"
        assert not pool.out_of_service()
        state = pool.engines()[name]
        assert state is not None and state["weight_version"] == target
        assert state["weight_epoch"] == st["refit"]["epoch"]

        pool.patch_spec({"decode": {"replicas": 2}})
        wait_for(f"{name} drained and deleted", lambda: name not in {
            p["metadata"]["name"] for p in pool.get(
                "pods", "-l", "tandem.dev/pool=demo,tandem.dev/engine=true")["items"]},
            timeout=90, every=0.3)
        wait_for(f"four engines serving {target}", lambda: serving(target, 4), timeout=30,
                 every=0.3)
        time.sleep(0.5)
    print(f"{name} started on {started_on}")
    assert not load.failures, load.failures
    assert load.done > 0
    assert {p["metadata"]["name"] for p in pool.engine_pods()} == before
    assert all(p == d for p, d in handoff_versions(pool))
    assert pool.condition("Ready")["status"] == "True"
