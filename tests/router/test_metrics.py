"""The metrics contract of docs/metrics.md, as a dashboard reads it.

One real engine process on the tiny model, requests over its ZMQ socket, `/metrics` scraped
over HTTP on both of its ports and parsed with prometheus_client's own parser: the
vLLM-compatible names with the served model name, token and request counts equal to what
the requests used, latency histograms counting every request, no `_created` series;
speculative decoding's counters (in process, on an engine with and without it). And the
operator's per-pool engine gauge (a pure function of spec and observation) and its
Kubernetes API error counter.
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from tandem_engine.cli.serve import free_port
from tandem_engine.kubeclient import KubeError
from tandem_operator import metrics as operator_metrics
from tandem_operator.kube import Kube
from tandem_operator.plan import Observed
from test_engine_process import Client, EngineProcess
from test_operator_plan import V2, make_spec, pod

SERVED = "tiny-served"
MAX_TOKENS = 4
ENGINE_LABELS = {"engine_id": "e0", "model_name": SERVED, "role": "mixed"}
# The contract a dashboard is written against (docs/metrics.md): family name -> type.
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_success": "counter",
}


def scrape(port: int) -> list[Sample]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    families = list(text_string_to_metric_families(text.decode()))
    types = {f.name: f.type for f in families}
    for name, kind in VLLM_FAMILIES.items():
        assert types.get(name) == kind, f"{name}: {types.get(name)}"
    return [s for f in families for s in f.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name
             and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    metrics_port = free_port()
    proc = EngineProcess(tiny_llama, tmp_path_factory.mktemp("metrics"),
                         "--served-model-name", SERVED, "--metrics-port", str(metrics_port))
    proc.metrics_port = metrics_port  # type: ignore[attr-defined]
    yield proc
    proc.close()


def test_engine_exports_the_vllm_contract(engine: EngineProcess) -> None:
    client = Client(engine.port)
    shared = list(range(100, 140))  # 40 tokens: two full 16-token blocks to cache
    prompts = [shared, [7, 8, 9, 10, 11], shared]
    for i, prompt in enumerate(prompts):
        outs = client.run(f"m{i}", prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                          ignore_eos=True)
        assert outs[-1].finish_reason == "length"
        if i == 1:
            hits_before = value(scrape(engine.metrics_port),  # type: ignore[attr-defined]
                                "vllm:prefix_cache_hits_total")
    samples = scrape(engine.metrics_port)  # type: ignore[attr-defined]
    n = len(prompts)

    # Every engine series carries the engine, the served model name and the role.
    for s in samples:
        assert {k: s.labels.get(k) for k in ENGINE_LABELS} == ENGINE_LABELS, s
    assert not [s.name for s in samples if s.name.endswith("_created")]
    assert value(samples, "vllm:prompt_tokens_total") == sum(map(len, prompts))
    assert value(samples, "vllm:generation_tokens_total") == n * MAX_TOKENS
    assert value(samples, "vllm:num_preemptions_total") == 0  # one request at a time
    assert value(samples, "vllm:request_success_total", finished_reason="length") == n
    for reason in ("stop", "abort", "error"):
        assert value(samples, "vllm:request_success_total", finished_reason=reason) == 0
    assert value(samples, "vllm:time_to_first_token_seconds_count") == n
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == n
    assert value(samples, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == n
    assert 0 < value(samples, "vllm:inter_token_latency_seconds_count") <= n * (MAX_TOKENS - 1)
    assert value(samples, "vllm:num_requests_running") == 0
    assert value(samples, "vllm:kv_cache_usage_perc") == 0
    # The repeated prompt's two full blocks come from the prefix cache.
    hits = value(samples, "vllm:prefix_cache_hits_total")
    assert hits - hits_before >= 32
    assert value(samples, "vllm:prefix_cache_queries_total") >= hits
    # Tandem's own: the lifecycle state, the weights, the refits.
    assert value(samples, "tandem_engine_state", state="RUNNING") == 1
    assert value(samples, "tandem_engine_state", state="PAUSED") == 0
    assert value(samples, "tandem_weights_info", epoch="0") == 1
    assert value(samples, "tandem_refits_total", outcome="succeeded") == 0
    # Both ports serve the one registry.
    admin = scrape(engine.admin_port)
    assert value(admin, "vllm:prompt_tokens_total") == sum(map(len, prompts))


def test_speculative_decoding_metrics_under_vllm_names(tiny_llama: Path) -> None:
    """With speculation on: vLLM's spec_decode counters equal the engine's totals, and
    decode steps are counted and timed by whether they verified proposals; with it off,
    none of them is exported."""
    from fastapi.testclient import TestClient
    from reference import random_prompts
    from tandem_engine import LLM, SamplingParams
    from tandem_engine.engine.stats import StepTiming
    from tandem_engine.server.admin import build_admin_app
    from tandem_engine.server.control import EngineControl
    from tandem_engine.server.worker import EngineWorker

    def step(decode_tokens: int, seconds: float) -> StepTiming:
        return StepTiming(1, 0 if decode_tokens else 8, decode_tokens, 0.0, 0.0, seconds,
                          0.0, 0.0)

    def scrape(llm: LLM, steps: bool = False) -> list[Sample]:
        worker = EngineWorker(llm.engine, engine_id="e0", model_name=SERVED)
        if steps:
            worker.stats.observe_spec_steps([step(5, 0.03)], verified=True)
            worker.stats.observe_spec_steps([step(1, 0.01), step(0, 0.5)], verified=False)
        text = TestClient(build_admin_app(EngineControl(worker))).get("/metrics").text
        return [s for f in text_string_to_metric_families(text) for s in f.samples]

    unit = random_prompts(2048, [9], seed=1)[0]
    spec = LLM(tiny_llama, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    spec.generate([unit * 4, unit * 3], SamplingParams(
        max_tokens=32, temperature=0.0, ignore_eos=True, repetition_penalty=0.01))
    stats = spec.engine.stats.speculative
    assert stats.num_accepted_tokens > 0, "no proposal accepted: the test proves nothing"
    samples = scrape(spec, steps=True)
    assert value(samples, "vllm:spec_decode_num_drafts_total") == stats.num_drafts
    assert value(samples, "vllm:spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert value(samples, "vllm:spec_decode_num_accepted_tokens_total") \
        == stats.num_accepted_tokens
    by_position = {s.labels["position"]: s.value for s in samples
                   if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert by_position == {str(i): n for i, n in enumerate(stats.accepted_per_position)}
    # A step without decode tokens (a prefill) is neither kind.
    assert value(samples, "tandem_spec_decode_steps_total", kind="verify") == 1
    assert value(samples, "tandem_spec_decode_steps_total", kind="plain") == 1
    assert value(samples, "tandem_spec_decode_step_seconds_total", kind="verify") \
        == pytest.approx(0.03)
    assert value(samples, "tandem_spec_decode_step_seconds_total", kind="plain") \
        == pytest.approx(0.01)
    plain = scrape(LLM(tiny_llama))
    assert not [s.name for s in plain if "spec_decode" in s.name]


class _FailingClient:
    """A KubeClient whose every call fails with `error`."""

    def __init__(self, error: KubeError) -> None:
        self.error = error

    async def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        raise self.error


def test_operator_counts_api_errors_by_verb_and_reason() -> None:
    def errors(verb: str, reason: str) -> float:
        return operator_metrics.REGISTRY.get_sample_value(
            "tandem_operator_api_errors_total", {"verb": verb, "reason": reason}) or 0.0

    before = errors("GET", "NotFound"), errors("PATCH", "ClientConnectorError")
    kube = Kube(_FailingClient(KubeError(404, "NotFound", "GET pods/x")))  # type: ignore[arg-type]
    assert asyncio.run(kube.get("Pod", "ns", "x")) is None  # a 404 is an answer, and counted
    kube = Kube(_FailingClient(KubeError(0, "ClientConnectorError", "refused")))  # type: ignore[arg-type]
    with pytest.raises(KubeError):
        asyncio.run(kube.patch("Pod", "ns", "x", {"metadata": {}}))
    assert (errors("GET", "NotFound"), errors("PATCH", "ClientConnectorError")) == (
        before[0] + 1, before[1] + 1)


def test_pool_engines_desired_and_ready_by_role_and_version() -> None:
    spec = make_spec(prefill={"replicas": 1}, decode={"replicas": 2})
    pods = (pod(spec, "prefill"), pod(spec, "decode"), pod(spec, "decode", weights=V2),
            pod(spec, "decode", ready=False), pod(spec, "router"))
    counts = operator_metrics.pool_engines(spec, Observed(pods=pods))
    assert counts == {("prefill", "v1", "desired"): 1, ("prefill", "v1", "ready"): 1,
                      ("decode", "v1", "desired"): 2, ("decode", "v1", "ready"): 1,
                      ("decode", "v2", "ready"): 1}
    operator_metrics.record_pool_engines("ns", "pool", counts)
    operator_metrics.record_pool_engines("ns", "pool", {("decode", "v1", "ready"): 3})
    gauge = operator_metrics.REGISTRY.get_sample_value
    assert gauge("tandem_operator_pool_engines", {
        "namespace": "ns", "pool": "pool", "role": "decode", "weights_version": "v1",
        "kind": "ready"}) == 3
    assert gauge("tandem_operator_pool_engines", {  # a version no engine runs: gone
        "namespace": "ns", "pool": "pool", "role": "decode", "weights_version": "v2",
        "kind": "ready"}) is None
    operator_metrics.forget_pool("ns", "pool")
    assert gauge("tandem_operator_pool_engines", {
        "namespace": "ns", "pool": "pool", "role": "decode", "weights_version": "v1",
        "kind": "ready"}) is None
