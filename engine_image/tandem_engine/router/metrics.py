"""The router's Prometheus metrics, in a registry of its own.

Latencies are what a client sees (time to first token, the gap between streamed
tokens, the whole request), so they are measured here rather than in the engines. Its
own registry keeps two routers in one test process, or a router beside an engine,
from colliding in prometheus_client's global one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# The same bounds as the engine's request histograms (server/metric_families.py), so the
# router's and the engines' latencies line up on one dashboard (docs/metrics.md).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0)
# The router's own overhead: tens of microseconds when all is well.
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                    0.05, 0.1, 0.25, 1.0)

# Outcomes of an HTTP generation request.
OUTCOMES = ("success", "invalid", "unavailable", "failed", "cancelled")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "tandem_router_time_to_first_token_seconds",
            "From the request's arrival to its first generated token", buckets=LATENCY_BUCKETS,
            registry=r)
        self.inter_token_latency = Histogram(
            "tandem_router_inter_token_latency_seconds",
            "Gap between consecutive generated tokens of one choice", buckets=TOKEN_GAP_BUCKETS,
            registry=r)
        self.e2e_latency = Histogram(
            "tandem_router_e2e_request_latency_seconds",
            "From the request's arrival to its last token", buckets=LATENCY_BUCKETS, registry=r)
        self.ingress_latency = Histogram(
            "tandem_router_ingress_seconds",
            "Router overhead in: from the HTTP request's arrival to its submission on an "
            "engine socket (first attempt of each choice)", buckets=OVERHEAD_BUCKETS,
            registry=r)
        self.egress_latency = Histogram(
            "tandem_router_egress_seconds",
            "Router overhead out: from an engine output's arrival to its bytes being handed "
            "to the HTTP server", buckets=OVERHEAD_BUCKETS, registry=r)
        self.requests = Counter(
            "tandem_router_requests", "HTTP generation requests by outcome", ["outcome"],
            registry=r)
        self.engine_requests = Counter(
            "tandem_router_engine_requests", "Requests submitted to each engine (failovers "
            "included)", ["engine"], registry=r)
        self.failovers = Counter(
            "tandem_router_failovers", "Requests resubmitted to another engine", ["reason"],
            registry=r)
        self.resumed = Counter(
            "tandem_router_resumed_choices", "Choices that completed after failing over "
            "mid-stream: resubmitted to another engine after tokens had been streamed, and "
            "resumed from them", registry=r)
        self.disaggregated = Counter(
            "tandem_router_disaggregated_requests", "Choices routed disaggregated (prefill "
            "engine, then a decode engine pulling its KV), by outcome: handoff (the decode "
            "engine pulled), finished_at_prefill (done after the first token), no_pin (the "
            "prefill engine pinned nothing: continued colocated), version_changed (the "
            "prefill engine was refit under the request: continued colocated), fallback "
            "(the prefill failed: served colocated)", ["outcome"], registry=r)
        self.handoff_versions = Counter(
            "tandem_router_kv_handoff_versions", "KV handoffs by the weight version of the "
            "prefill engine that computed the KV and of the decode engine that pulls it, as "
            "this router saw them at the handoff (during a refit the two must never differ)",
            ["prefill_version", "decode_version"], registry=r)
        self.generated_tokens = Counter(
            "tandem_router_generated_tokens", "Tokens streamed back to clients", registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)

    def watch_engines(self, views: Callable[[], Iterable[Any]]) -> None:
        """Export per-engine gauges from `views()` (EngineView snapshots) at scrape time."""
        self.registry.register(_EngineCollector(views))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ChoiceLatency:
    """The latencies of one choice as its client sees them: time to first token, the gap
    between tokens (per token of a delta), end to end; and the tokens streamed. Does
    nothing without metrics."""

    def __init__(self, metrics: RouterMetrics | None, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self._last_token_at: float | None = None

    def observe(self, num_tokens: int, finished: bool) -> None:
        """A delta of `num_tokens` tokens is on its way to the client now."""
        m = self.metrics
        if m is None:
            return
        now = time.monotonic()
        if num_tokens:
            if self._last_token_at is None:
                m.time_to_first_token.observe(now - self.arrival)
            else:
                m.inter_token_latency.observe((now - self._last_token_at) / num_tokens)
            self._last_token_at = now
            m.generated_tokens.inc(num_tokens)
        if finished:
            m.e2e_latency.observe(now - self.arrival)


class _EngineCollector(Collector):
    def __init__(self, views: Callable[[], Iterable[Any]]) -> None:
        self._views = views

    def collect(self):
        up = GaugeMetricFamily("tandem_router_engine_up",
                               "1 if the engine is connected and heartbeating", labels=["engine"])
        serving = GaugeMetricFamily("tandem_router_engine_serving",
                                    "1 if the engine is alive and RUNNING", labels=["engine"])
        inflight = GaugeMetricFamily("tandem_router_engine_inflight",
                                     "Requests this router has in flight on the engine",
                                     labels=["engine"])
        for v in self._views():
            up.add_metric([v.key], 1.0 if v.alive else 0.0)
            serving.add_metric([v.key], 1.0 if v.serving else 0.0)
            inflight.add_metric([v.key], float(v.inflight))
        yield from (up, serving, inflight)
