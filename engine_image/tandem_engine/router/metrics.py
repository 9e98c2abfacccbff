"""The router's Prometheus metrics, in a registry of its own.

Latencies are what a client sees (time to first token, the gap between streamed
tokens, the whole request), so they are measured here rather than in the engines. Its
own registry keeps two routers in one test process, or a router beside an engine,
from colliding in prometheus_client's global one.

Opt-in (`tandem-router --engine-metrics-url`, which `tandem serve` sets): the router's
`/metrics` also carries its engines' own series (`vllm:*`, `tandem_*`), fetched from each
engine's read-only metrics port at every scrape, so one scrape of a local stack sees
what a scrape of `vllm serve` sees. Each fetch has a short deadline; an engine that does
not answer in time is left out of that scrape and counted, never an error. In Kubernetes
the router does not do this: Prometheus scrapes every pod itself (docs/metrics.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

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
OUTCOMES = ("success", "invalid", "unavailable", "failed", "cancelled", "shed")

# Seconds one scrape of the router waits for its engines' /metrics (all fetched at once):
# well inside Prometheus' default 10 s scrape timeout, even with an engine frozen.
ENGINE_SCRAPE_TIMEOUT = 1.0


class RouterMetrics:
    """The router's own metrics; with `engine_metrics_urls`, its engines' too (`scrape`)."""

    def __init__(self, engine_metrics_urls: Sequence[str] = (),
                 engine_scrape_timeout: float = ENGINE_SCRAPE_TIMEOUT) -> None:
        self.registry = CollectorRegistry()
        self.engine_metrics_urls = tuple(engine_metrics_urls)
        self.engine_scrape_timeout = engine_scrape_timeout
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
        self.engine_time_to_first_token = Histogram(
            "tandem_router_engine_time_to_first_token_seconds",
            "Per engine: from the HTTP request's arrival to the first token the engine "
            "made for it (the engine that made a choice's first token), for the "
            "autoscaler and per-engine SLOs", ["engine"], buckets=LATENCY_BUCKETS,
            registry=r)
        self.generated_tokens = Counter(
            "tandem_router_generated_tokens", "Tokens streamed back to clients", registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.engine_scrape_errors = Counter(
            "tandem_router_engine_metrics_scrape_errors", "Fetches of an engine's /metrics "
            "(--engine-metrics-url) that failed or missed their deadline: that engine's "
            "series were left out of the router's answer", ["url"], registry=r)
        for url in self.engine_metrics_urls:
            self.engine_scrape_errors.labels(url)

    def watch_admission(self, admission: Any) -> None:
        """Export admission's counts (admission.py) at scrape time."""
        self.registry.register(_AdmissionCollector(admission))

    def watch_engines(self, views: Callable[[], Iterable[Any]]) -> None:
        """Export per-engine gauges from `views()` (EngineView snapshots) at scrape time."""
        self.registry.register(_EngineCollector(views))

    def render(self) -> bytes:
        """The router's own series."""
        return generate_latest(self.registry)

    async def scrape(self) -> bytes:
        """What `GET /metrics` answers: the router's own series, then (opt-in) those of
        every engine that answered within the deadline, each family once."""
        if not self.engine_metrics_urls:
            return self.render()
        texts = await self._fetch_engines()
        return await asyncio.to_thread(self._merge, texts)

    async def _fetch_engines(self) -> list[str]:
        """The engines' /metrics texts, fetched concurrently; one that fails or is late is
        left out (and counted)."""
        timeout = self.engine_scrape_timeout
        async with httpx.AsyncClient(timeout=timeout) as client:
            async def fetch(url: str) -> str | None:
                try:
                    async with asyncio.timeout(timeout):
                        reply = await client.get(url)
                    reply.raise_for_status()
                    return reply.text
                except (httpx.HTTPError, TimeoutError) as exc:
                    self.engine_scrape_errors.labels(url).inc()
                    log.debug("engine metrics %s left out of this scrape: %r", url, exc)
                    return None

            texts = await asyncio.gather(*(fetch(u) for u in self.engine_metrics_urls))
        return [t for t in texts if t is not None]

    def _merge(self, texts: list[str]) -> bytes:
        # Render the router's own registry first: its scrape errors counted just now show.
        own = self.render()
        families = merge_families(texts, reserved=_family_names(self.registry))
        return own + generate_latest(_Families(families))


def merge_families(texts: Iterable[str], reserved: set[str] = frozenset()) -> list[Metric]:
    """The families of several Prometheus text expositions as one: a family's samples from
    every text under its first HELP and TYPE. A family of another type under the same
    name, a family in `reserved` (the router's own) and a repeated sample (same name and
    labels) are dropped, so the result is always a valid exposition. Engines' series
    carry their own `engine_id` and `role` labels, so two engines never repeat one."""
    merged: dict[str, Metric] = {}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for text in texts:
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as exc:
            log.warning("an engine's /metrics does not parse, left out: %s", exc)
            continue
        for family in parsed:
            if family.name in reserved:
                continue
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation,
                                                    family.type, family.unit)
            elif into.type != family.type:
                continue
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in seen:
                    seen.add(key)
                    into.samples.append(sample)
    return list(merged.values())


def _family_names(registry: CollectorRegistry) -> set[str]:
    return {family.name for family in registry.collect()}


class _Families(Collector):
    """Already collected families, for `generate_latest`."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


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
        queued = GaugeMetricFamily("tandem_router_engine_queue_depth",
                                   "Requests waiting in the engine's queue, as its last load "
                                   "report said", labels=["engine"])
        blocks = GaugeMetricFamily(
            "tandem_router_kv_index_blocks", "Block hashes this router's index holds for the "
            "engine: its prefix cache, from its KV events", labels=["engine"])
        synced = GaugeMetricFamily(
            "tandem_router_kv_index_synced", "1 while the engine's index is in sync with its "
            "KV events (0: waiting for a snapshot)", labels=["engine"])
        lag = GaugeMetricFamily(
            "tandem_router_kv_event_lag_seconds", "How long the engine's latest KV event "
            "batch took from the engine to this router", labels=["engine"])
        resyncs = CounterMetricFamily(
            "tandem_router_kv_index_resyncs", "Times the engine's index lost sync and asked "
            "for a snapshot, by reason (gap: a batch missing; oversized: more hashes than "
            "the engine's KV pool holds)", labels=["engine", "reason"])
        for v in self._views():
            up.add_metric([v.key], 1.0 if v.alive else 0.0)
            serving.add_metric([v.key], 1.0 if v.serving else 0.0)
            inflight.add_metric([v.key], float(v.inflight))
            queued.add_metric([v.key], float(v.num_waiting))
            blocks.add_metric([v.key], float(v.kv_index_blocks))
            synced.add_metric([v.key], 1.0 if v.kv_synced else 0.0)
            lag.add_metric([v.key], v.kv_lag)
            for reason, count in v.kv_resyncs:
                resyncs.add_metric([v.key, reason], float(count))
        yield from (up, serving, inflight, queued, blocks, synced, lag, resyncs)


class _AdmissionCollector(Collector):
    """Requests in flight, refused by tenant and reason, admitted by tenant, and each
    tenant's work in flight (admission.py)."""

    def __init__(self, admission: Any) -> None:
        self._admission = admission

    def collect(self):
        a = self._admission
        inflight = GaugeMetricFamily("tandem_router_inflight_requests",
                                     "Generation requests this router has in flight")
        inflight.add_metric([], float(a.inflight))
        limit = GaugeMetricFamily("tandem_router_max_num_requests",
                                  "The router's bound on requests in flight "
                                  "(--max-num-requests; 0: none)")
        limit.add_metric([], float(a.max_num_requests or 0))
        shed = CounterMetricFamily(
            "tandem_router_shed_requests", "Requests refused before any engine saw them, by "
            "tenant and reason (router_full, engines_full, rate_limit_rpm, rate_limit_tpm, "
            "model_not_allowed)", labels=["tenant", "reason"])
        for (tenant, reason), n in sorted(a.refused.items()):
            shed.add_metric([tenant, reason], float(n))
        admitted = CounterMetricFamily("tandem_router_admitted_requests",
                                       "Requests admitted, by tenant", labels=["tenant"])
        served = GaugeMetricFamily("tandem_router_tenant_outstanding_tokens",
                                   "Tokens each tenant's requests in flight may cost (prompt "
                                   "+ max_tokens): its fair-queuing tag's base",
                                   labels=["tenant"])
        active = GaugeMetricFamily("tandem_router_tenant_inflight_requests",
                                   "Requests in flight by tenant", labels=["tenant"])
        for tenant, n in sorted(a.admitted.items()):
            admitted.add_metric([tenant], float(n))
        for tenant, outstanding, n in a.tenants():
            served.add_metric([tenant], float(outstanding))
            active.add_metric([tenant], float(n))
        yield from (inflight, limit, shed, admitted, served, active)
