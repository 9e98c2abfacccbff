"""The autoscaling planner end to end: real engines on the test cluster, a load step.

The operator reads each ready pod's own /metrics, and the pool's capacity is made scarce
(`maxNumSeqs: 2`, so that eight streams queue on one decode engine): a step up in load
violates the pool's SLO (`queueDepth`: waiting requests per engine) and the violated role
scales up within window + stabilization; the step down scales it back down through the
drain; no request fails throughout; every decision is an Event and shows in
`kubectl describe ipool`. The same with a refit started mid-scale (it completes, no KV
handoff pairs two versions), and with a bad pod template applied mid-scale (rolled back at
its progress deadline). With `TANDEM_AUTOSCALE_TRACE=<file>` the run writes its trace
(engines per role, the observed p90 TTFT/ITL and queue depth over time) for
`benchmarks/autoscale_figure.py`.
"""

from __future__ import annotations

import json
import os
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
from test_operator_cluster import wait_for
from test_operator_refit import Load, Pool

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

WINDOW = 10
DEADLINE = 20  # spec.rollout.progressDeadlineSeconds
SCALE_DOWN_STABILIZATION = 10
AUTOSCALING = {
    "prefill": {"minReplicas": 1, "maxReplicas": 2},
    "decode": {"minReplicas": 1, "maxReplicas": 2},
    "slo": {"ttftSeconds": "30", "itlSeconds": "5", "queueDepth": 1},
    "windowSeconds": WINDOW,
    "scaleUpStabilizationSeconds": 0,
    "scaleDownStabilizationSeconds": SCALE_DOWN_STABILIZATION,
}


class Trace:
    """Samples of the pool every half second: engines per role (desired, ready) and what
    the planner observed (status.autoscaling)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.rows: list[dict[str, Any]] = []
        self.marks: list[tuple[float, str]] = []
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def mark(self, what: str) -> None:
        self.marks.append((time.monotonic() - self.start, what))

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                body = self.pool.body()
            except Exception:  # a missed sample is only a gap
                continue
            st, spec = body.get("status") or {}, body["spec"]
            seen = (st.get("autoscaling") or {}).get("observed") or {}
            self.rows.append({
                "t": round(time.monotonic() - self.start, 2),
                "prefill_desired": spec["prefill"]["replicas"],
                "decode_desired": spec["decode"]["replicas"],
                "prefill_ready": (st.get("prefill") or {}).get("ready", 0),
                "decode_ready": (st.get("decode") or {}).get("ready", 0),
                "ttft": seen.get("ttftSeconds"), "itl": seen.get("itlSeconds"),
                "prefill_queue": (seen.get("prefill") or {}).get("queueDepth"),
                "decode_queue": (seen.get("decode") or {}).get("queueDepth")})

    def __enter__(self) -> Trace:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        out = os.environ.get("TANDEM_AUTOSCALE_TRACE")
        if out:
            Path(out).write_text(json.dumps({"rows": self.rows, "marks": self.marks,
                                             "autoscaling": AUTOSCALING}, indent=1))


@pytest.fixture(scope="module")
def pool(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    pytest.importorskip("nixl_cu12")
    folder = tmp_path_factory.mktemp("autoscale-pool")
    with TestCluster() as cluster:
        cluster.install_crds(ROOT / "crds")
        runner = PodRunner(cluster).start()
        p = Pool(cluster, runner, folder)
        try:
            doc = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
            spec = doc["spec"]
            spec["model"] = {"name": "tiny", "weights": {"uri": tiny_llama.as_uri(),
                                                         "version": "v1"}}
            spec.update(prefill={"replicas": 1}, decode={"replicas": 1},
                        router={"replicas": 1}, refit={"drainTimeoutSeconds": 60},
                        rollout={"maxSurge": 1, "maxUnavailable": 0,
                                 "progressDeadlineSeconds": DEADLINE},
                        autoscaling=AUTOSCALING)
            spec["engine"] = {"kvCache": {"numBlocks": 256}, "maxNumSeqs": 2,
                              "weightsRoots": [str(tmp_path_factory.getbasetemp())]}
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
            wait_for("the pool to be Ready", lambda: p.condition("Ready").get("status")
                     == "True" and p.all_serve("v1", engines=2), timeout=180, every=0.5)
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


def replicas(pool: Pool) -> tuple[int, int]:
    spec = pool.body()["spec"]
    return spec["prefill"]["replicas"], spec["decode"]["replicas"]


def ready_engines(pool: Pool) -> tuple[int, int]:
    pods = pool.engine_pods()

    def ready(role: str) -> int:
        return sum(1 for p in pods if p["metadata"]["labels"].get("tandem.dev/role") == role
                   and any(c["type"] == "Ready" and c["status"] == "True"
                           for c in p.get("status", {}).get("conditions") or ()))
    return ready("prefill"), ready("decode")


def test_a_load_step_scales_the_violated_role_up_then_back_down_through_drains(
        pool: Pool) -> None:
    before = pool.events()
    with Trace(pool) as trace:
        # Light load: one stream fits the engines; the planner holds at the minimum.
        with Load(pool.router_url(), 1, 16) as light:
            time.sleep(WINDOW)
        assert replicas(pool) == (1, 1), pool.body()["status"].get("autoscaling")
        # The step: eight streams of 48 tokens on two decode slots queue ~6 requests.
        trace.mark("load step up: 8 streams")
        stepped = time.monotonic()
        with Load(pool.router_url(), 8, 48) as heavy:
            wait_for("decode to scale up", lambda: replicas(pool)[1] == 2,
                     timeout=WINDOW + 30, every=0.5)
            reacted = time.monotonic() - stepped
            trace.mark(f"decode 1 -> 2 after {reacted:.1f} s")
            wait_for("the second decode engine to be ready",
                     lambda: ready_engines(pool)[1] == 2, timeout=120, every=0.5)
            time.sleep(WINDOW)
        trace.mark("load step down: 0 streams")
        # The step down: the planner scales back within window + stabilization, draining.
        wait_for("decode to scale back down", lambda: replicas(pool)[1] == 1,
                 timeout=WINDOW + SCALE_DOWN_STABILIZATION + 30, every=0.5)
        trace.mark("decode 2 -> 1")
        wait_for("one decode engine left", lambda: ready_engines(pool)[1] == 1
                 and len(pool.engine_pods()) == 2, timeout=120, every=0.5)
    assert light.failures == [] and heavy.failures == [], light.failures + heavy.failures
    assert heavy.done > 0
    new = pool.new_events(before)
    rescales = [msg for reason, msg in new if reason == "SuccessfulRescale"]
    assert any(m.startswith("decode engines 1 -> 2: ") and "queue depth" in m
               for m in rescales), new
    assert any(m.startswith("decode engines 2 -> 1: ") for m in rescales), new
    assert any(reason == "Draining" and "scale down" in msg for reason, msg in new), new
    described = pool.cluster.kubectl("describe", "inferencepool", "demo").stdout
    assert "SuccessfulRescale" in described and "decode engines 2 -> 1" in described
    last = pool.body()["status"]["autoscaling"]["decode"]["lastScale"]
    assert (last["from"], last["to"]) == (2, 1)
    print(f"reaction: load step to decode scaled up in {reacted:.1f} s")


def handoff_versions(pool: Pool) -> dict[tuple[str, str], float]:
    """The router's KV handoffs by (prefill engine version, decode engine version)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(pool.router_url().removesuffix("/v1") + "/metrics", timeout=10).text
    return {(s.labels["prefill_version"], s.labels["decode_version"]): s.value
            for f in text_string_to_metric_families(text)
            if f.name == "tandem_router_kv_handoff_versions"
            for s in f.samples if s.name.endswith("_total")}


def test_a_refit_mid_scale_completes_and_fails_nothing(
        pool: Pool, tmp_path_factory: pytest.TempPathFactory) -> None:
    from tandem_engine.cli.demo_model import write_demo_model

    v2 = write_demo_model(tmp_path_factory.mktemp("autoscale-v2") / "v2", seed=1)
    wait_for("the pool back at one engine per role", lambda: replicas(pool) == (1, 1)
             and len(pool.engine_pods()) == 2, timeout=60, every=0.5)
    with Load(pool.router_url(), 8, 48) as heavy:
        wait_for("decode to scale up", lambda: replicas(pool)[1] == 2, timeout=WINDOW + 30,
                 every=0.5)
        # The refit starts as soon as the new decode engine serves, the load still on. (Had
        # it started while that engine was still loading, the wave planner, which leaves an
        # engine that does not answer yet out of its count, could drain the one prefill and
        # the one old decode engine at once: a 503 seen once in three runs; see the note.)
        wait_for("the new decode engine to serve", lambda: ready_engines(pool)[1] == 2,
                 timeout=120, every=0.5)
        pool.patch_weights(v2.as_uri(), "v2")

        def refit_done() -> bool:
            st = pool.status()
            engines = pool.engines()
            want = sum(replicas(pool))
            return ((st.get("refit") or {}).get("phase") == "Succeeded"
                    and len(engines) == want and all(
                        s is not None and s["state"] == "RUNNING"
                        and s["weight_version"] == "v2" for s in engines.values()))

        wait_for("the refit to succeed on every engine, the new one included", refit_done,
                 timeout=180, every=0.5)
    assert heavy.failures == [], heavy.failures
    assert heavy.done > 0
    mixed = {pair: n for pair, n in handoff_versions(pool).items() if pair[0] != pair[1] and n}
    assert mixed == {}, f"KV handed between versions: {mixed}"
    assert ("v2", "v2") in handoff_versions(pool)
    wait_for("decode to scale back down after the refit", lambda: replicas(pool)[1] == 1,
             timeout=WINDOW + SCALE_DOWN_STABILIZATION + 30, every=0.5)


def templates(pool: Pool) -> set[str]:
    return {p["metadata"]["annotations"]["tandem.dev/template-hash"]
            for p in pool.engine_pods()}


def test_a_bad_template_mid_scale_rolls_back_at_its_deadline_and_fails_nothing(
        pool: Pool) -> None:
    wait_for("the pool back at one engine per role", lambda: replicas(pool) == (1, 1)
             and len(pool.engine_pods()) == 2, timeout=60, every=0.5)
    good = templates(pool)
    before = pool.events()
    with Load(pool.router_url(), 8, 48) as heavy:
        wait_for("decode to scale up", lambda: replicas(pool)[1] == 2, timeout=WINDOW + 30,
                 every=0.5)
        # engines on this template exit at once: argparse refuses the flag
        pool.patch_spec({"engine": {"args": ["--no-such-flag"]}})
        wait_for("the rollout to pass its deadline", lambda: (
            pool.condition("Progressing").get("reason") == "ProgressDeadlineExceeded"),
            timeout=DEADLINE + 60, every=0.5)
        assert pool.condition("Progressing")["status"] == "False"

        def back() -> bool:
            pods = pool.engine_pods()
            want = sum(replicas(pool))
            return (templates(pool) == good and len(pods) == want
                    and sum(ready_engines(pool)) == want)

        wait_for("every engine back on the good template, the planner's count of them",
                 back, timeout=120, every=0.5)
    assert heavy.failures == [], heavy.failures
    assert heavy.done > 0
    new = pool.new_events(before)
    assert any(reason == "RolledBack" for reason, _ in new), new
    assert any(reason == "SuccessfulRescale" for reason, _ in new), new
    assert "revision" in pool.condition("Progressing")["message"]
