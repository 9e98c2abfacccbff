"""LoRA adapters by editing the InferencePool (`spec.adapters`): the operator's adapter
transaction.

First the operator's own rules, without engines: the spec, the pods' args and template
hash (an adapter change never rolls pods), where a transaction starts from, what new pods
start with, annotations, and the status report. Then one pool of 1 prefill + 2 decode
engines and a router on the test cluster (real `tandem-engine` processes run by the test
kubelet, `tandem-operator` as a subprocess): a new adapter version and a new adapter rolled
in waves under streaming load with 0 failed requests and no pod restarted, answers equal
to the offline engine under each adapter, and an edit whose adapter loads but computes
NaN rolled back (the good adapter added in the same edit is unloaded again) before any
request ran under it.
"""

from __future__ import annotations

import json
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
from tandem_engine.fleet.adapters import (
    STAGING_PREFIX,
    AdapterObs,
    AdapterRef,
    AdapterTransaction,
    adapter_set,
    begin,
)
from tandem_engine.fleet.transaction import Failure, Phase
from tandem_engine.lifecycle import EngineState
from tandem_operator import manifests as m
from tandem_operator.adapters import annotations, new_pod_adapters, report, settled
from tandem_operator.plan import Observed, PodView, pod_adapters
from tandem_operator.spec import PoolSpec, SpecError
from test_operator_cluster import wait_for
from test_operator_refit import Load
from test_operator_refit import Pool as RefitPool

ROOT = Path(__file__).resolve().parents[2]
SQL1 = AdapterRef("sql", "1", "pvc://adapters/sql/v1")
SQL2 = AdapterRef("sql", "2", "pvc://adapters/sql/v2")
CHAT1 = AdapterRef("chat", "1", "file:///adapters/chat-v1")


# ---- the operator's rules, no engines -----------------------------------------------------------


def make_spec(adapters: list[AdapterRef] = (), lora: dict[str, Any] | None = None,
              **spec: Any) -> PoolSpec:
    full: dict[str, Any] = {
        "model": {"name": "m", "weights": {"uri": "file:///models/v1", "version": "v1"}},
        "engine": {"lora": {"maxLoras": 2, "maxLoraRank": 8} if lora is None else lora},
        "adapters": [a.to_dict() for a in adapters]}
    full.update(spec)
    return PoolSpec.from_body({"metadata": {"name": "pool", "namespace": "ns", "uid": "u",
                                            "generation": 2}, "spec": full})


def engine_pod(name: str, adapters: tuple[AdapterRef, ...] | None = (SQL1,),
               **kw: Any) -> PodView:
    group = "prefill" if "prefill" in name else "decode"
    return PodView(name=name, group=group, role=group, phase="Running", ready=True,
                   ip="10.0.0.1", adapters=adapters, **kw)


def test_the_spec_names_what_it_refuses() -> None:
    cases = [
        ({"adapters": [SQL1.to_dict()], "engine": {}}, "adapters need engine.lora"),
        ({"adapters": [SQL1.to_dict(), SQL2.to_dict()]}, "'sql' is listed twice"),
        ({"adapters": [{**SQL1.to_dict(), "name": "m"}]}, "cannot be named 'm'"),
        ({"adapters": [{**SQL1.to_dict(), "name": f"{STAGING_PREFIX}x"}]}, "the operator's"),
        ({"adapters": [{**SQL1.to_dict(), "name": "bad name"}]}, "spec.adapters[0].name"),
        ({"adapters": [{**SQL1.to_dict(), "version": "-1"}]}, "spec.adapters[0].version"),
        ({"adapters": [{**SQL1.to_dict(), "uri": "s3://bucket/sql"}]}, "spec.adapters[0].uri"),
        ({"adapters": [{"name": "sql", "version": "1"}]}, "spec.adapters[0].uri is required"),
        ({"engine": {"lora": {"maxLoras": 65}}}, "spec.engine.lora.maxLoras"),
    ]
    for patch, words in cases:
        body = {"metadata": {"name": "pool"}, "spec": {
            "model": {"name": "m", "weights": {"uri": "file:///models/v1", "version": "v1"}},
            "engine": {"lora": {}}, **patch}}
        with pytest.raises(SpecError) as err:
            PoolSpec.from_body(body)
        assert words in str(err.value), (patch, str(err.value))


def test_engines_start_with_lora_slots_and_the_adapters_they_are_given() -> None:
    spec = make_spec([SQL1, CHAT1], lora={"maxLoras": 3, "maxLoraRank": 8,
                                          "maxCpuLoras": 6})
    pod = m.pod(spec, "decode", spec.weights, 1, (SQL1, CHAT1))
    args = pod["spec"]["containers"][0]["args"]
    at = args.index("--enable-lora")
    assert args[at:at + 7] == ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8",
                               "--max-cpu-loras", "6"]
    modules = args[args.index("--lora-modules") + 1:]
    assert modules[:2] == ["chat@1=/adapters/chat-v1",
                           f"sql@1={m.weights_source(SQL1.uri).mount_path}/sql/v1"]
    # The claim holding an adapter is mounted, and the engines may load from it.
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert claims == ["adapters"]
    assert m.weights_source(SQL1.uri).mount_path in args
    assert json.loads(pod["metadata"]["annotations"][m.ADAPTERS]) == [CHAT1.to_dict(),
                                                                      SQL1.to_dict()]
    assert m.read_adapters_annotation(pod["metadata"]["annotations"][m.ADAPTERS]) == (
        CHAT1, SQL1)
    router = m.pod(spec, "router", spec.weights)["spec"]["containers"][0]["args"]
    assert "--enable-lora" not in router and "--lora-modules" not in router
    # Without spec.engine.lora: no LoRA flags, no annotation.
    plain = PoolSpec.from_body({"metadata": {"name": "pool"}, "spec": {"model": {
        "name": "m", "weights": {"uri": "file:///models/v1", "version": "v1"}}}})
    pod = m.pod(plain, "decode", plain.weights)
    assert "--enable-lora" not in pod["spec"]["containers"][0]["args"]
    assert m.ADAPTERS not in pod["metadata"]["annotations"]


def test_an_adapter_edit_rolls_no_pod_unless_a_new_volume_must_be_mounted() -> None:
    before = make_spec([SQL1])
    # Another version, another adapter on a mounted claim or a file:// path, one removed:
    # all in place.
    sql_x = AdapterRef("x", "1", "pvc://adapters/x")
    for after in (make_spec([SQL2]), make_spec([SQL2, CHAT1]), make_spec([SQL1, sql_x])):
        assert all(m.template_hash(after, g) == m.template_hash(before, g)
                   for g in ("prefill", "decode", "router")), after.adapters
    assert m.template_hash(make_spec([sql_x]), "decode") == m.template_hash(
        make_spec([SQL1, sql_x]), "decode")
    # An adapter on a claim the pods do not mount yet rolls the engine pods once, as
    # removing the last adapter on a claim does (they stop mounting it).
    other = make_spec([SQL1, AdapterRef("x", "1", "pvc://more/x")])
    assert m.template_hash(other, "decode") != m.template_hash(before, "decode")
    assert m.template_hash(other, "router") == m.template_hash(before, "router")
    assert m.template_hash(make_spec([CHAT1]), "decode") != m.template_hash(before, "decode")
    assert m.template_hash(make_spec([CHAT1]), "decode") == m.template_hash(make_spec([]),
                                                                            "decode")
    # LoRA slots are the pods' template: changing them rolls the engine pods.
    slots = make_spec([SQL1], lora={"maxLoras": 4, "maxLoraRank": 8})
    assert m.template_hash(slots, "decode") != m.template_hash(before, "decode")


def test_a_transaction_starts_from_what_the_pool_last_served() -> None:
    # No record yet: what most engine pods were started with or verified on.
    pods = (engine_pod("decode-a", (SQL1,)), engine_pod("decode-b", (SQL1,)),
            engine_pod("prefill-a", (SQL2,)), engine_pod("decode-c", None))
    assert settled(None, Observed(pods=pods)) == {"sql": SQL1}
    assert settled(None, Observed()) == {}
    done = begin(adapter_set([SQL2]), adapter_set([SQL1]), 1.0)
    done.phase = Phase.SUCCEEDED
    assert settled(done, Observed(pods=pods)) == {"sql": SQL2}
    for phase in (Phase.PROGRESSING, Phase.ROLLED_BACK, Phase.HALTED):
        done.phase = phase
        assert settled(done, Observed(pods=pods)) == {"sql": SQL1}


def test_new_pods_start_with_a_set_the_pool_verified() -> None:
    tx = begin(adapter_set([SQL2, CHAT1]), adapter_set([SQL1]), 1.0)
    assert new_pod_adapters(tx) == (SQL1,)  # then they join the transaction
    tx.phase = Phase.SUCCEEDED
    assert new_pod_adapters(tx) == (CHAT1, SQL2)
    tx.phase = Phase.ROLLED_BACK
    assert new_pod_adapters(tx) == (SQL1,)
    spec = make_spec([SQL2])
    assert pod_adapters(spec, Observed()) == (SQL2,)  # before any transaction: the spec's
    assert pod_adapters(spec, Observed(pod_adapters=(SQL1,))) == (SQL1,)


def obs(name: str, *loras: str, state: EngineState | None = EngineState.RUNNING
        ) -> AdapterObs:
    role = "prefill" if "prefill" in name else "decode"
    return AdapterObs(name, role, f"http://{name}", state, tuple(loras))


def test_serving_engines_name_their_adapters_in_annotations() -> None:
    tx = begin(adapter_set([SQL2]), adapter_set([SQL1]), 1.0)
    pods = {p.name: p for p in (engine_pod("decode-a", (SQL1,)), engine_pod("decode-b", (SQL1,)),
                                engine_pod("decode-c", (SQL1,)))}
    out = annotations(tx, [obs("decode-a", "sql@2"), obs("decode-b", "sql@1"),
                           obs("decode-c", "sql@7"), obs("decode-d", "sql@2", state=None)],
                      pods)
    # decode-b is unchanged; decode-c serves a version loaded some other way (no folder
    # known); decode-d does not answer.
    assert out == {"decode-a": {m.ADAPTERS: m.adapters_annotation([SQL2])}}


def test_the_report_tells_each_role_s_versions_and_a_failure() -> None:
    tx = begin(adapter_set([SQL2, CHAT1]), adapter_set([SQL1]), 10.0)
    tx.wave = 1
    pods = {p.name: p for p in (engine_pod("prefill-a"), engine_pod("decode-a"),
                                engine_pod("decode-b"))}
    engines = [obs("prefill-a", "sql@2", "chat@1"), obs("decode-a", "sql@2", "chat@1"),
               obs("decode-b", "sql@1")]
    said = report(tx, engines, pods)
    assert said.refitting[:2] == (True, "Rolling")
    assert "wave 1, 2/3 engines serve chat@1, sql@2" in said.refitting[2]
    assert said.adapters == [
        {"name": "chat", "version": "1", "current": "", "prefill": "1", "decode": "1"},
        {"name": "sql", "version": "2", "current": "", "prefill": "2", "decode": "1,2"}]
    assert said.summary == "chat@1 sql@1|2"
    assert said.record["progress"] == "2/3 engines serve chat@1, sql@2"
    assert AdapterTransaction.from_dict(said.record) == tx

    tx.phase, tx.finished_at = Phase.ROLLED_BACK, 14.5
    tx.failure = Failure("decode-a", "verify", "canary under sql@2: not finite")
    settled_engines = [obs(n, "sql@1") for n in pods]
    said = report(tx, settled_engines, pods)
    assert said.refitting[:2] == (False, "AdapterRefitRolledBack")
    assert said.degraded is not None and said.degraded[:2] == (True, "AdapterRefitRolledBack")
    for words in ("decode-a failed at verify", "not finite", "Every engine serves sql@1 again",
                  "fix spec.adapters"):
        assert words in said.degraded[2]
    assert said.summary == "chat@- sql@1"

    tx = begin(adapter_set([SQL1]), adapter_set([SQL1]), 1.0)
    tx.phase = Phase.SUCCEEDED
    said = report(tx, settled_engines, pods)
    assert said.refitting[:2] == (False, "AdaptersCurrent") and said.degraded is None
    assert said.summary == "sql@1"
    waiting = report(begin(adapter_set([SQL2]), adapter_set([SQL1]), 1.0), settled_engines,
                     pods, weights_refitting=True)
    assert waiting.refitting[:2] == (True, "WaitingForRefit")


# ---- a pool on the test cluster -----------------------------------------------------------------

PROMPT = "The quick brown fox"
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def folders(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT folders of the tiny model: sql v1 and v2, chat v1, `nan`: sql-v2's with weights
    so large that every logit under it is non-finite (it loads; generating fails), and
    `truncated`: sql-v2's cut in half (the engine refuses to load it)."""
    from safetensors.torch import load_file, save_file
    from test_lora import make_adapter

    root = tmp_path_factory.mktemp("pool-adapters")
    out = {name: make_adapter(tiny_llama, root / name, rank, TARGETS, seed)
           for name, rank, seed in (("sql-v1", 4, 31), ("sql-v2", 8, 32), ("chat-v1", 4, 33))}
    weights = "adapter_model.safetensors"
    nan = out["nan"] = Path(shutil.copytree(out["sql-v2"], root / "nan"))
    save_file({k: v * 1e20 for k, v in load_file(str(out["sql-v2"] / weights)).items()},
              str(nan / weights))
    cut = out["truncated"] = Path(shutil.copytree(out["sql-v2"], root / "truncated"))
    data = (cut / weights).read_bytes()
    (cut / weights).write_bytes(data[:len(data) // 2])
    return out


def reference(model: Path, folder: Path | None, name: str = "x", version: str = "1"
              ) -> list[int]:
    from tandem_engine import LLM, SamplingParams
    from tandem_engine.lora_request import LoRARequest

    llm = LLM(model, enable_lora=True, max_loras=2, max_lora_rank=8)
    lora = None if folder is None else LoRARequest(name, str(folder), version)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0,
                                                ignore_eos=True), lora_request=lora)
    return list(out[0].outputs[0].token_ids)


class Pool(RefitPool):
    """The refit tests' pool, with adapters: 1 prefill + 2 decode engines."""

    def all_serve_adapters(self, *identities: str, engines: int = 3) -> bool:
        states = self.engines()
        return len(states) == engines and all(
            s is not None and s["state"] == "RUNNING" and not s["draining"]
            and sorted(s.get("loras") or ()) == sorted(identities) for s in states.values())

    def patch_adapters(self, adapters: list[dict[str, str]]) -> None:
        self.patch_spec({"adapters": adapters})

    def settle_adapters(self, phase: str, *identities: str, timeout: float = 120.0) -> None:
        def done() -> bool:
            record = self.status().get("adapterRefit") or {}
            return record.get("phase") == phase and self.all_serve_adapters(*identities)
        try:
            wait_for(f"adapters {phase}, every engine serving {identities}", done,
                     timeout=timeout, every=0.3)
        except AssertionError:
            print(json.dumps(self.status(), indent=1)[-6000:])
            raise

    def completion(self, model: str) -> list[int]:
        r = httpx.post(f"{self.router_url()}/completions", timeout=60, json={
            "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]


class ServiceWatch:
    """Polls every engine while it runs: did any leave service (pause, drain, suspend)?"""

    def __init__(self, pool: Pool) -> None:
        self.pool, self.away = pool, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            for name, s in self.pool.engines().items():
                if s is not None and (s["state"] != "RUNNING" or s["draining"]):
                    self.away.add(name)
            time.sleep(0.05)

    def __enter__(self) -> ServiceWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def adapter(name: str, version: str, folder: Path) -> dict[str, str]:
    return {"name": name, "version": version, "uri": folder.as_uri()}


@pytest.fixture(scope="module")
def pool(tiny_llama: Path, folders: dict[str, Path],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    pytest.importorskip("nixl_cu12")
    folder = tmp_path_factory.mktemp("adapter-pool")
    with TestCluster() as cluster:
        cluster.install_crds(ROOT / "crds")
        runner = PodRunner(cluster).start()
        p = Pool(cluster, runner, folder)
        try:
            doc = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
            doc["metadata"]["name"] = "demo"
            spec = doc["spec"]
            spec["model"] = {"name": "tiny", "weights": {"uri": tiny_llama.as_uri(),
                                                         "version": "v1"}}
            spec.update(prefill={"replicas": 1}, decode={"replicas": 2},
                        router={"replicas": 1}, rollout={"maxSurge": 1, "maxUnavailable": 1},
                        adapters=[adapter("sql", "1", folders["sql-v1"])])
            engine = spec.setdefault("engine", {})
            engine["kvCache"] = {"numBlocks": 256}
            engine["lora"] = {"maxLoras": 2, "maxLoraRank": 8}
            engine["weightsRoots"] = [str(tmp_path_factory.getbasetemp())]
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
            wait_for("the pool to be Ready", lambda: p.condition("Ready").get("status")
                     == "True" and p.all_serve_adapters("sql@1"), timeout=180, every=0.5)
            wait_for("the router to see every engine with sql", lambda: sorted(
                e["role"] for e in httpx.get(f"{p.router_url()}/engines", timeout=5
                                             ).json()["engines"]
                if e["state"] == "RUNNING" and "sql@1" in e.get("loras", ()))
                == ["decode", "decode", "prefill"], timeout=60)
            yield p
        except BaseException:
            for pod in p.get("pods")["items"]:
                print(f"---- {pod['metadata']['name']} ----\n"
                      f"{runner.logs(pod['metadata']['name'])[-2500:]}")
            raise
        finally:
            for op in p.operators:
                op.stop()
                print(f"---- {op.log.name} (tail) ----\n{op.log.read_text()[-8000:]}")
            runner.stop()


@pytest.mark.slow
def test_a_new_version_and_a_new_adapter_roll_in_place_under_load(
        pool: Pool, tiny_llama: Path, folders: dict[str, Path]) -> None:
    assert pool.status()["adapterSummary"] == "sql@1"
    row = pool.cluster.kubectl("get", "ipool", "demo", "--no-headers").stdout.split()
    assert "sql@1" in row, row
    assert pool.completion("sql") == reference(tiny_llama, folders["sql-v1"], "sql")
    pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pool.engine_pods()}
    incarnations = {n: s["incarnation"] for n, s in pool.engines().items() if s}
    seen = {e[0] for e in pool.events()}
    with Load(pool.router_url(), models=("tiny", "sql")) as load, ServiceWatch(pool) as watch:
        time.sleep(1.0)
        pool.patch_adapters([adapter("sql", "2", folders["sql-v2"]),
                             adapter("chat", "1", folders["chat-v1"])])
        pool.settle_adapters("Succeeded", "sql@2", "chat@1")
        time.sleep(0.5)
    assert not load.failures, load.failures
    assert load.by_model.get("tiny") and load.by_model.get("sql"), load.by_model
    # In place: no engine left service, no pod was replaced, no engine restarted.
    assert watch.away == set(), watch.away
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in pool.engine_pods()} == pods
    assert {n: s["incarnation"] for n, s in pool.engines().items() if s} == incarnations

    st = pool.status()
    record = st["adapterRefit"]
    assert record["phase"] == "Succeeded" and record["wave"] == 2  # 1 per role, 2 decode
    assert record["progress"] == "3/3 engines serve chat@1, sql@2"
    assert sorted(record["engines"]) == sorted(pods)
    assert st["adapters"] == [
        {"name": "chat", "version": "1", "current": "1", "prefill": "1", "decode": "1"},
        {"name": "sql", "version": "2", "current": "2", "prefill": "2", "decode": "2"}]
    assert st["adapterSummary"] == "chat@1 sql@2"
    row = pool.cluster.kubectl("get", "ipool", "demo", "--no-headers").stdout
    assert "chat@1 sql@2" in row, row
    condition = pool.condition("AdapterRefitting")
    assert (condition["status"], condition["reason"]) == ("False", "AdaptersCurrent")
    assert pool.condition("Degraded")["status"] == "False"
    reasons = [r for name, r, _ in pool.events() if name not in seen]
    assert reasons.count("AdapterRefitWave") == 2, reasons
    assert {"AdapterRefitStarted", "AdapterRefitSucceeded"} <= set(reasons)
    for p in pool.engine_pods():  # new pods start with what the engines serve
        assert m.read_adapters_annotation(p["metadata"]["annotations"][m.ADAPTERS]) == (
            AdapterRef("chat", "1", folders["chat-v1"].as_uri()),
            AdapterRef("sql", "2", folders["sql-v2"].as_uri()))
    # Each adapter answers as the offline engine does under it; the base model too.
    assert pool.completion("sql") == reference(tiny_llama, folders["sql-v2"], "sql", "2")
    assert pool.completion("chat") == reference(tiny_llama, folders["chat-v1"], "chat")
    assert pool.completion("tiny") == reference(tiny_llama, None)
    models = httpx.get(f"{pool.router_url()}/models", timeout=10).json()["data"]
    assert {d["id"]: d.get("parent") for d in models} == {"tiny": None, "sql": "tiny",
                                                          "chat": "tiny"}


@pytest.mark.slow
def test_an_adapter_that_computes_nan_is_rolled_back_before_it_serves(
        pool: Pool, folders: dict[str, Path]) -> None:
    pool.settle_adapters("Succeeded", "sql@2", "chat@1")
    seen = {e[0] for e in pool.events()}
    good = [adapter("sql", "2", folders["sql-v2"]), adapter("chat", "1", folders["chat-v1"])]
    with Load(pool.router_url(), models=("tiny", "sql", "chat")) as load:
        time.sleep(0.5)
        # A good new adapter and a version of sql that loads but computes NaN, in one edit.
        pool.patch_adapters([*good, adapter("sql", "3", folders["nan"]),
                             adapter("poem", "1", folders["sql-v1"])][1:])
        pool.settle_adapters("RolledBack", "sql@2", "chat@1")
        time.sleep(0.5)
    assert not load.failures, load.failures  # no request ever ran under sql@3
    st = pool.status()
    failure = st["adapterRefit"]["failure"]
    assert failure["step"] == "verify" and "sql@3" in failure["message"]
    degraded = pool.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "AdapterRefitRolledBack")
    for words in (failure["engine"], "Every engine serves chat@1, sql@2 again"):
        assert words in degraded["message"], degraded["message"]
    assert st["adapterSummary"] == "chat@1 poem@- sql@2"
    reasons = [r for name, r, _ in pool.events() if name not in seen]
    assert {"AdapterRefitFailed", "AdapterRefitRollingBack", "AdapterRefitRolledBack"} <= set(
        reasons), reasons
    # No staging adapter is left behind anywhere.
    assert all(not any(i.startswith(STAGING_PREFIX) for i in s["loras"])
               for s in pool.engines().values() if s)

    # Setting the spec back ends it: every engine already serves it.
    pool.patch_adapters(good)
    pool.settle_adapters("Succeeded", "sql@2", "chat@1")
    assert pool.condition("Degraded")["status"] == "False"
    # Removing an adapter unloads it everywhere; requests naming it are then a 404.
    pool.patch_adapters(good[:1])
    pool.settle_adapters("Succeeded", "sql@2")
    r = httpx.post(f"{pool.router_url()}/completions", timeout=30, json={
        "model": "chat", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and "chat" in r.json()["error"]["message"], r.text


@pytest.mark.slow
def test_a_truncated_adapter_is_refused_and_halts_where_onfailure_says(
        pool: Pool, folders: dict[str, Path]) -> None:
    pool.settle_adapters("Succeeded", "sql@2")
    pool.cluster.kubectl("patch", "inferencepool", "demo", "--type=merge", "-p",
                         json.dumps({"spec": {"refit": {"onFailure": "Halt"}}}))
    try:
        with Load(pool.router_url(), models=("tiny", "sql")) as load:
            time.sleep(0.5)
            pool.patch_adapters([adapter("sql", "4", folders["truncated"])])
            pool.settle_adapters("Halted", "sql@2")  # the engines refused it: nothing changed
            time.sleep(0.5)
        assert not load.failures, load.failures
        failure = pool.status()["adapterRefit"]["failure"]
        assert failure["step"] == "POST /v1/load_lora_adapter", failure
        assert "HTTP 400" in failure["message"], failure
        degraded = pool.condition("Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "AdapterRefitHalted")
        assert "edit spec.adapters" in degraded["message"]
        assert pool.condition("AdapterRefitting")["reason"] == "AdapterRefitHalted"
    finally:
        pool.cluster.kubectl("patch", "inferencepool", "demo", "--type=merge", "-p",
                             json.dumps({"spec": {"refit": {"onFailure": "Rollback"}}}))
    pool.patch_adapters([adapter("sql", "2", folders["sql-v2"])])
    pool.settle_adapters("Succeeded", "sql@2")
