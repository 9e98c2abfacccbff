"""What the autoscaling planner reads: Prometheus text into samples (`signals.parse`), a
window of samples into signals (`signals.Window`), and the operator's pure steps around the
planner (`autoscaler`: observation, measured capacity, status, the alert series). The reads
from real engines and routers are in test_operator_autoscale.py."""

from __future__ import annotations

import math

import pytest
from tandem_engine.router.metrics import RouterMetrics
from tandem_operator.autoscale import SLO, Autoscaling, Bounds, History, decide
from tandem_operator.autoscaler import (
    PrometheusReader,
    capacity_from_status,
    measured_capacity,
    observation,
    slo_series,
    status_block,
)
from tandem_operator.plan import Observed, PodView
from tandem_operator.signals import Histogram, RoleSignals, Sample, Signals, Window, parse
from tandem_operator.spec import PoolSpec

ENGINE_TEXT = """\
# HELP vllm:num_requests_waiting Requests waiting for the running batch
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{role="decode"}} {waiting}
# HELP vllm:kv_cache_usage_perc Share of KV blocks in use (0..1)
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{role="decode"}} {kv}
# HELP vllm:prompt_tokens_total Prompt tokens of admitted requests
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{role="decode"}} {prompt}
# HELP vllm:generation_tokens_total Tokens generated
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{role="decode"}} {generated}
# HELP vllm:inter_token_latency_seconds Gap between consecutive outputs
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{{role="decode",le="0.01"}} {fast}
vllm:inter_token_latency_seconds_bucket{{role="decode",le="0.1"}} {total}
vllm:inter_token_latency_seconds_bucket{{role="decode",le="+Inf"}} {total}
vllm:inter_token_latency_seconds_count{{role="decode"}} {total}
vllm:inter_token_latency_seconds_sum{{role="decode"}} 1.0
"""


def engine_text(waiting: float = 0, kv: float = 0.0, prompt: float = 0, generated: float = 0,
                fast: float = 0, total: float = 0) -> str:
    return ENGINE_TEXT.format(waiting=waiting, kv=kv, prompt=prompt, generated=generated,
                              fast=fast, total=total)


def test_an_engine_scrape_parses_into_its_counters_gauges_and_latencies() -> None:
    s = parse(engine_text(waiting=3, kv=0.5, prompt=100, generated=40, fast=9, total=10),
              time=7.0, router=False)
    assert (s.time, s.waiting, s.kv_usage, s.prompt_tokens, s.generation_tokens) == (
        7.0, 3, 0.5, 100, 40)
    assert s.itl.bounds == (0.01, 0.1, math.inf) and s.itl.counts == (9, 10, 10)
    assert s.ttft.count == 0  # this engine has not observed a first token


def test_a_router_scrape_gives_the_client_side_latencies() -> None:
    metrics = RouterMetrics()
    for seconds in (0.02, 0.03, 0.2, 0.6):
        metrics.time_to_first_token.observe(seconds)
    metrics.inter_token_latency.observe(0.004)
    s = parse(metrics.render().decode(), time=1.0, router=True)
    assert s.ttft.count == 4 and s.itl.count == 1
    # three of four at or under 0.25: the p50 lies in the (0.025, 0.05] bucket
    assert 0.025 < s.ttft.quantile(0.5) <= 0.05


def test_text_that_is_not_prometheus_is_refused() -> None:
    with pytest.raises(ValueError):
        parse("vllm:num_requests_waiting{ 3\n", time=0.0, router=False)


@pytest.mark.parametrize("counts,q,want", [
    ((0, 0, 0), 0.9, None),  # nothing observed
    ((10, 10, 10), 0.5, 0.05),  # all in the first bucket: interpolated from 0
    ((0, 10, 10), 0.5, 0.55),  # all in (0.1, 1]: half way
    ((0, 0, 10), 0.9, 1.0),  # in +Inf: the highest finite bound, as PromQL answers
])
def test_quantiles_interpolate_inside_the_bucket_as_histogram_quantile(
        counts: tuple[float, ...], q: float, want: float | None) -> None:
    h = Histogram((0.1, 1.0, math.inf), counts)
    got = h.quantile(q)
    assert got == pytest.approx(want) if want is not None else got is None


def test_a_restarted_pod_counts_from_zero_not_negative() -> None:
    before = Histogram((1.0, math.inf), (50, 60))
    after = Histogram((1.0, math.inf), (2, 3))
    assert after.minus(before) == after
    assert Histogram((1.0, math.inf), (55, 70)).minus(before).counts == (5, 10)


def window_of(samples: dict[str, tuple[str, list[Sample]]]) -> Window:
    w = Window()
    for pod, (group, kept) in samples.items():
        for s in kept:
            w.add(pod, group, s)
    return w


def itl(fast: float, total: float) -> Histogram:
    return Histogram((0.01, 0.1, math.inf), (fast, total, total))


def test_the_window_measures_what_was_gained_in_it_summed_over_pods() -> None:
    w = window_of({
        "d1": ("decode", [Sample(0.0, generation_tokens=0, itl=itl(0, 0)),
                          Sample(10.0, generation_tokens=100, itl=itl(90, 100), waiting=2,
                                 kv_usage=0.4)]),
        "d2": ("decode", [Sample(0.0, generation_tokens=50, itl=itl(0, 0)),
                          Sample(10.0, generation_tokens=250, itl=itl(0, 100), waiting=4,
                                 kv_usage=0.7)]),
        "p1": ("prefill", [Sample(0.0, prompt_tokens=1000), Sample(10.0, prompt_tokens=3000)]),
    })
    s = w.signals(now=10.0, window_seconds=10.0, percentile=0.9)
    assert s.decode == RoleSignals(2, 30.0, 3.0, 0.7)  # (100 + 200) / 10 s; mean queue; max KV
    assert s.prefill.tokens_per_second == 200.0
    # 90 of 200 gaps under 10 ms, 110 in (0.01, 0.1]: p90 near the top of that bucket
    assert s.latency_source == "engine" and 0.08 < s.itl_seconds < 0.1
    assert s.ttft_seconds is None  # no first token observed in the window


def test_samples_older_than_the_window_do_not_count_and_gone_pods_are_forgotten() -> None:
    w = window_of({"d1": ("decode", [Sample(0.0, itl=itl(0, 100)), Sample(50.0, itl=itl(0, 100)),
                                     Sample(60.0, itl=itl(10, 110))]),
                   "d2": ("decode", [Sample(60.0, itl=itl(0, 0))])})
    s = w.signals(now=60.0, window_seconds=10.0, percentile=0.5)
    assert s.itl_seconds == pytest.approx(0.005)  # only the 10 fast gaps of the last 10 s
    w.keep(["d1"], now=60.0, window_seconds=10.0)
    assert list(w.samples) == ["d1"] and [x.time for x in w.samples["d1"]] == [50.0, 60.0]


def test_the_routers_latencies_win_over_the_engines() -> None:
    router_ttft = Histogram((0.1, 1.0, math.inf), (0, 10, 10))
    w = window_of({"r": ("router", [Sample(0.0), Sample(5.0, ttft=router_ttft)]),
                   "p": ("prefill", [Sample(0.0), Sample(5.0, ttft=Histogram(
                       (0.1, 1.0, math.inf), (10, 10, 10)))])})
    s = w.signals(now=5.0, window_seconds=10.0, percentile=0.5)
    assert s.latency_source == "router" and s.ttft_seconds == pytest.approx(0.55)


SCALING = Autoscaling(SLO(ttft_seconds=1.0, itl_seconds=0.1, kv_usage_ceiling=0.9,
                          queue_depth=2), Bounds(1, 4), Bounds(1, 4),
                      scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=0)


def pool_spec(prefill: int = 1, decode: int = 2) -> PoolSpec:
    return PoolSpec.from_body({
        "apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool",
        "metadata": {"name": "demo", "namespace": "default", "uid": "u", "generation": 1},
        "spec": {"model": {"name": "m", "weights": {"uri": "file:///w", "version": "v1"}},
                 "prefill": {"replicas": prefill}, "decode": {"replicas": decode},
                 "autoscaling": {"slo": {"ttftSeconds": "1", "itlSeconds": "0.1",
                                         "queueDepth": 2, "kvUsageCeiling": 90},
                                 "prefill": {"maxReplicas": 4},
                                 "decode": {"maxReplicas": 4}}}})


def pod(spec: PoolSpec, name: str, group: str, *, old: bool = False,
        draining: bool = False) -> PodView:
    from tandem_operator import manifests as m

    return PodView(name=name, group=group,  # type: ignore[arg-type]
                   template_hash="old" if old else m.template_hash(spec, group),  # type: ignore[arg-type]
                   phase="Running", ready=True, ip="10.0.0.1",
                   draining_since="2026-01-01T00:00:00Z" if draining else None)


def test_the_observation_counts_desired_engines_not_a_rollouts_surge_pods() -> None:
    spec = pool_spec(1, 2)
    pods = (pod(spec, "p-old", "prefill", old=True), pod(spec, "p-new", "prefill"),
            pod(spec, "d1", "decode"), pod(spec, "d2", "decode", draining=True))
    o = observation(spec, Observed(pods=pods), Signals(itl_seconds=0.05), {}, refit=False)
    assert (o.prefill.replicas, o.decode.replicas) == (1, 2)  # the spec's, not 2 prefill pods
    assert o.rollout and o.decode.draining == 1 and not o.refit
    assert o.decode.starting == 1  # two desired, one ready and not draining


def test_a_desired_engine_not_ready_yet_is_starting() -> None:
    spec = pool_spec(1, 3)
    pods = (pod(spec, "p", "prefill"), pod(spec, "d1", "decode"), pod(spec, "d2", "decode"))
    o = observation(spec, Observed(pods=pods), Signals(), {}, refit=False)
    assert (o.prefill.starting, o.decode.starting) == (0, 1)


def test_capacity_is_learnt_only_from_loaded_windows_and_capped_by_a_violation() -> None:
    loaded = Signals(decode=RoleSignals(2, 400.0), itl_seconds=0.08)  # in the band
    spec = pool_spec()
    o = observation(spec, Observed(), loaded, {}, refit=False)
    assert measured_capacity(SCALING, o, loaded, {}) == {"decode": 200.0}
    idle = Signals(decode=RoleSignals(2, 20.0), itl_seconds=0.01)
    assert measured_capacity(SCALING, o, idle, {"decode": 200.0}) == {"decode": 200.0}
    queued = Signals(decode=RoleSignals(1, 900.0, 3.0), itl_seconds=0.01)  # saturated
    assert measured_capacity(SCALING, o, queued, {}) == {"decode": 900.0}
    violated = Signals(decode=RoleSignals(2, 300.0), itl_seconds=0.3)
    o = observation(spec, Observed(), violated, {}, refit=False)
    assert measured_capacity(SCALING, o, violated, {"decode": 200.0}) == {"decode": 150.0}


def test_status_keeps_the_last_change_until_the_next_and_reads_back_its_capacity() -> None:
    spec = pool_spec(1, 2)
    serving = Observed(pods=(pod(spec, "p", "prefill"), pod(spec, "d1", "decode"),
                             pod(spec, "d2", "decode")))
    signals = Signals(decode=RoleSignals(2, 100.0, 5.0), itl_seconds=0.05)
    o = observation(spec, serving, signals, {}, refit=False)
    decision = decide(SCALING, o, History(), now=0.0)
    assert decision.decode.target == 3  # queue depth 5 > 2
    block = status_block(SCALING, signals, o, decision, {"decode": 42.0}, {}, "T1")
    assert block["decode"]["lastScale"] == {"from": 2, "to": 3, "time": "T1",
                                            "reason": decision.decode.reason}
    assert block["observed"]["itlSeconds"] == "0.05" and "ttftSeconds" not in block["observed"]
    assert capacity_from_status(block) == {"decode": 42.0}
    calm = Signals(decode=RoleSignals(2, 10.0, 1.0), itl_seconds=0.08)
    o = observation(spec, serving, calm, {}, refit=False)
    later = status_block(SCALING, calm, o, decide(SCALING, o, History(), now=1.0), {},
                         block, "T2")
    assert later["decode"]["lastScale"]["time"] == "T1"  # unchanged since


def test_the_alert_series_pair_each_bound_with_what_was_observed() -> None:
    spec = pool_spec()
    o = observation(spec, Observed(), Signals(decode=RoleSignals(2, 1.0, 3.0, 0.5),
                                              ttft_seconds=1.5), {}, refit=False)
    bounds, seen = slo_series(SCALING, o)
    assert bounds[("prefill", "ttft_seconds")] == 1.0 and seen[("prefill", "ttft_seconds")] == 1.5
    assert ("decode", "itl_seconds") in bounds and ("decode", "itl_seconds") not in seen
    assert seen[("decode", "queue_depth")] == 3.0 and bounds[("decode", "kv_usage")] == 0.9


def test_the_prometheus_queries_select_the_pool_and_the_window() -> None:
    queries = PrometheusReader("http://prom:9090/").queries(pool_spec())
    assert queries["ttft"] == (
        'histogram_quantile(0.9, sum by (le) (rate(tandem_router_time_to_first_token_seconds_'
        'bucket{namespace="default",pool="demo"}[60s])))')
    assert 'role="decode"' in queries["decode_tokens"] and "[60s]" in queries["decode_tokens"]
