"""The autoscaling planner's I/O and memory: read the pool's metrics, decide, say what changes.

Each reconcile of a pool with `spec.autoscaling` calls `Autoscalers.run`. Every
`read_interval` (5 s, or a fifth of a shorter window) it reads the metrics (`PodReader`:
each ready router's and engine's own `/metrics`, concurrently, each with a deadline;
`PrometheusReader` with `tandem-operator --prometheus-url`: the same signals as PromQL over
the window), runs the pure planner (`autoscale.decide`), and returns a `ScalePass`: the
replicas to write into the pool's spec, status.autoscaling and the events to post.
Reconcile writes `spec.prefill.replicas` / `spec.decode.replicas` as an HPA writes a
Deployment's: the rest of the operator (scale-up, drain-first scale-down, rollouts, refits)
follows the spec as it always did, and the target survives a restart of the operator.

Why the pods by default: no Prometheus needed, and the engines already export every signal.
At 100 pods that is 100 small HTTP GETs per pool every 5 s (about 20 kB each, parsed in
well under a millisecond), about 400 kB/s for the operator: fine for one pool of that size;
with many large pools, point the operator at the Prometheus that already scrapes them.

In memory: each pool's window of samples, the planner's recent recommendations and the
measured capacity per engine (also written to status, and read back from there after a
restart). A restarted operator waits for half a window of samples before deciding.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from tandem_operator import manifests as m
from tandem_operator import metrics
from tandem_operator.autoscale import (
    DOWN_FRACTION,
    ROLES,
    Autoscaling,
    Decision,
    History,
    Observation,
    RoleLoad,
    decide,
)
from tandem_operator.engine_command import ENGINE_METRICS_PORT
from tandem_operator.kube import now as wall_now
from tandem_operator.plan import Observed, PodView
from tandem_operator.signals import RoleSignals, Signals, Window, parse
from tandem_operator.spec import PoolSpec

log = logging.getLogger("tandem_operator.autoscaler")

READ_SECONDS = 5.0  # the longest gap between two reads of a pool's metrics
READ_TIMEOUT = 2.0  # one pod's /metrics, or one Prometheus query
EVENT_REASON = "SuccessfulRescale"  # as the HorizontalPodAutoscaler's


def read_interval(spec: Autoscaling) -> float:
    return min(READ_SECONDS, spec.window_seconds / 5)


def _fmt(value: float) -> str:
    """A number for status (the API has no floats): 4 significant digits."""
    return f"{value:.4g}"


# ---- pure: signals -> observation -> status -------------------------------------------------


def observation(spec: PoolSpec, observed: Observed, signals: Signals,
                capacity: Mapping[str, float], refit: bool) -> Observation:
    """What the planner sees: desired replicas from the spec (a rollout's surge pods are
    not counted), the window's signals, the drains under way, the desired engines not
    ready yet and the refit."""
    want = {g: m.template_hash(spec, g) for g in ROLES}
    pods = [p for p in observed.pods if p.group in ROLES and not p.deleting and not p.failed]
    rollout = any(p.template_hash != want[p.group] for p in pods)

    def load(role: str) -> RoleLoad:
        s: RoleSignals = signals.role(role)
        desired = spec.role(role).replicas
        ready = sum(1 for p in pods if p.group == role and p.ready and not p.draining_since)
        return RoleLoad(replicas=desired, demand=s.tokens_per_second,
                        capacity=capacity.get(role), queue_depth=s.queue_depth,
                        kv_usage=s.kv_usage,
                        draining=sum(1 for p in pods if p.group == role and p.draining_since),
                        starting=max(0, desired - ready))

    return Observation(load("prefill"), load("decode"), signals.ttft_seconds,
                       signals.itl_seconds, refit=refit, rollout=rollout)


def measured_capacity(spec: Autoscaling, obs: Observation, signals: Signals,
                      capacity: Mapping[str, float]) -> dict[str, float]:
    """Tokens/s one engine of each role serves, learnt from this window:

    * saturated (requests waiting, or the role's SLO violated): the engines do all they
      can, so the per-engine rate is their capacity now;
    * loaded within the SLO (latency between `DOWN_FRACTION` of its bound and the bound):
      the per-engine rate is at least their capacity, so it raises the estimate;
    * anything lighter teaches nothing."""
    out = dict(capacity)
    for role in ROLES:
        s = signals.role(role)
        if s.engines <= 0 or s.tokens_per_second <= 0:
            continue
        per_engine = s.tokens_per_second / s.engines
        latency, bound = ((obs.ttft_seconds, spec.slo.ttft_seconds) if role == "prefill"
                          else (obs.itl_seconds, spec.slo.itl_seconds))
        if s.queue_depth > 0 or (latency is not None and latency > bound):
            out[role] = per_engine
        elif latency is not None and latency > DOWN_FRACTION * bound:
            out[role] = max(out.get(role, 0.0), per_engine)
    return out


def slo_series(spec: Autoscaling, obs: Observation) -> tuple[dict[tuple[str, str], float],
                                                             dict[tuple[str, str], float]]:
    """(bounds, observed) for `metrics.record_autoscaling`, keyed (role, metric)."""
    slo = spec.slo
    bounds = {("prefill", "ttft_seconds"): slo.ttft_seconds,
              ("decode", "itl_seconds"): slo.itl_seconds}
    seen: dict[tuple[str, str], float] = {}
    if obs.ttft_seconds is not None:
        seen[("prefill", "ttft_seconds")] = obs.ttft_seconds
    if obs.itl_seconds is not None:
        seen[("decode", "itl_seconds")] = obs.itl_seconds
    if slo.kv_usage_ceiling is not None:
        bounds[("decode", "kv_usage")] = slo.kv_usage_ceiling
    seen[("decode", "kv_usage")] = obs.decode.kv_usage
    for role in ROLES:
        if slo.queue_depth is not None:
            bounds[(role, "queue_depth")] = slo.queue_depth
        seen[(role, "queue_depth")] = obs.load(role).queue_depth
    return bounds, seen


def status_block(spec: Autoscaling, signals: Signals, obs: Observation, decision: Decision,
                 capacity: Mapping[str, float], previous: Mapping[str, Any], stamp: str
                 ) -> dict[str, Any]:
    """status.autoscaling after a decision: what was observed, each role's desired size and
    why, its measured capacity, and its last change (from, to, reason, time), kept until the
    next one."""
    observed: dict[str, Any] = {"windowSeconds": round(spec.window_seconds),
                                "percentile": round(spec.slo.percentile * 100),
                                "latencySource": signals.latency_source or "none"}
    for key, value in (("ttftSeconds", signals.ttft_seconds),
                       ("itlSeconds", signals.itl_seconds),
                       ("handoffSeconds", signals.handoff_seconds)):
        if value is not None:
            observed[key] = _fmt(value)
    observed["prefill"] = {"engines": signals.prefill.engines,
                           "promptTokensPerSecond": _fmt(signals.prefill.tokens_per_second),
                           "queueDepth": _fmt(signals.prefill.queue_depth)}
    observed["decode"] = {"engines": signals.decode.engines,
                          "generationTokensPerSecond": _fmt(signals.decode.tokens_per_second),
                          "queueDepth": _fmt(signals.decode.queue_depth),
                          "kvUsage": _fmt(signals.decode.kv_usage)}
    out: dict[str, Any] = {"time": stamp, "observed": observed}
    for role in ROLES:
        d = decision.of(role)
        block: dict[str, Any] = {"desired": d.target, "reason": d.reason[:1000]}
        if role in capacity:
            block["capacityTokensPerSecond"] = _fmt(capacity[role])
        last = (previous.get(role) or {}).get("lastScale")
        if d.changed:
            last = {"from": d.current, "to": d.target, "reason": d.reason[:1000],
                    "time": stamp}
        if last:
            block["lastScale"] = last
        out[role] = block
    return out


def capacity_from_status(previous: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for role in ROLES:
        try:
            out[role] = float((previous.get(role) or {})["capacityTokensPerSecond"])
        except (KeyError, TypeError, ValueError):
            continue
    return out


# ---- the reads ----------------------------------------------------------------------------------


class Reader(Protocol):
    async def read(self, state: PoolState, spec: PoolSpec, pods: list[PodView], now: float
                   ) -> Signals | None:
        """The window's signals, or None while there is not yet enough data to decide on."""
        ...

    async def close(self) -> None: ...


def _reachable(pods: list[PodView]) -> list[PodView]:
    return [p for p in pods if p.ready and p.ip and not p.deleting and not p.failed]


class PodReader:
    """Each ready pod's own /metrics: engines on their read-only metrics port, routers on
    their HTTP port. A pod that does not answer within the deadline is left out of this
    read (its earlier samples still count)."""

    def __init__(self, timeout: float = READ_TIMEOUT) -> None:
        self.timeout = timeout
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
        return self._client

    async def _one(self, pod: PodView) -> str | None:
        port = m.ROUTER_HTTP_PORT if pod.group == "router" else ENGINE_METRICS_PORT
        try:
            async with asyncio.timeout(self.timeout):
                reply = await self._http().get(f"http://{pod.ip}:{port}/metrics")
            reply.raise_for_status()
            return reply.text
        except (httpx.HTTPError, TimeoutError) as exc:
            log.debug("metrics of %s not read: %r", pod.name, exc)
            return None

    async def read(self, state: PoolState, spec: PoolSpec, pods: list[PodView], now: float
                   ) -> Signals | None:
        scaling = spec.autoscaling
        assert scaling is not None
        live = _reachable(pods)
        texts = await asyncio.gather(*(self._one(p) for p in live))
        for pod, text in zip(live, texts, strict=True):
            if text is None:
                continue
            try:
                state.window.add(pod.name, pod.group, parse(text, now, pod.group == "router"))
            except ValueError as exc:
                log.warning("%s/%s: metrics of %s do not parse: %s", spec.namespace,
                            spec.name, pod.name, exc)
        state.window.keep((p.name for p in pods if not p.deleting), now, scaling.window_seconds)
        if now - state.started < scaling.window_seconds / 2:
            return None
        return state.window.signals(now, scaling.window_seconds, scaling.slo.percentile)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


class PrometheusReader:
    """The same signals as PromQL over the window, from a Prometheus that scrapes the pools
    (the chart's PodMonitor labels every series with `namespace` and `pool`)."""

    def __init__(self, url: str, timeout: float = READ_TIMEOUT) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._client: httpx.AsyncClient | None = None

    def queries(self, spec: PoolSpec) -> dict[str, str]:
        """PromQL per signal. Engine series are deduplicated by `engine_id` (`max by`): a
        pod scraped twice (a PodMonitor and the prometheus.io annotations, or a router that
        also carries its engines' series) counts once."""
        scaling = spec.autoscaling
        assert scaling is not None
        sel = f'namespace="{spec.namespace}",pool="{spec.name}"'
        w = f"{round(scaling.window_seconds)}s"
        q = scaling.slo.percentile

        def router_quantile(name: str) -> str:
            return (f"histogram_quantile({q}, sum by (le) (rate({name}_bucket{{{sel}}}"
                    f"[{w}])))")

        def engines(how: str, role: str, metric: str, rate: bool = False) -> str:
            series = f'{metric}{{{sel},role="{role}"}}'
            if rate:
                series = f"rate({series}[{w}])"
            return f"{how}(max by (engine_id) ({series}))"

        return {
            "ttft": router_quantile("tandem_router_time_to_first_token_seconds"),
            "itl": router_quantile("tandem_router_inter_token_latency_seconds"),
            "handoff": (f"histogram_quantile({q}, sum by (le) (max by (le, engine_id) (rate("
                        f'tandem_kv_handoff_seconds_bucket{{{sel},role="decode"}}[{w}]))))'),
            "prefill_tokens": engines("sum", "prefill", "vllm:prompt_tokens_total", rate=True),
            "decode_tokens": engines("sum", "decode", "vllm:generation_tokens_total",
                                     rate=True),
            "prefill_queue": engines("avg", "prefill", "vllm:num_requests_waiting"),
            "decode_queue": engines("avg", "decode", "vllm:num_requests_waiting"),
            "decode_kv": engines("max", "decode", "vllm:kv_cache_usage_perc"),
            "prefill_engines": engines("count", "prefill", "vllm:num_requests_waiting"),
            "decode_engines": engines("count", "decode", "vllm:num_requests_waiting"),
        }

    async def _query(self, promql: str) -> float | None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
        async with asyncio.timeout(self.timeout):
            reply = await self._client.get(f"{self.url}/api/v1/query", params={"query": promql})
        reply.raise_for_status()
        result = reply.json()["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if value != value else value  # NaN: no observations in the window

    async def read(self, state: PoolState, spec: PoolSpec, pods: list[PodView], now: float
                   ) -> Signals | None:
        queries = self.queries(spec)
        try:
            values = dict(zip(queries, await asyncio.gather(
                *(self._query(q) for q in queries.values())), strict=True))
        except (httpx.HTTPError, TimeoutError, KeyError, ValueError) as exc:
            log.warning("%s/%s: Prometheus %s not read: %r", spec.namespace, spec.name,
                        self.url, exc)
            return None

        def role(name: str, tokens: str) -> RoleSignals:
            return RoleSignals(int(values[f"{name}_engines"] or 0), values[tokens] or 0.0,
                               values[f"{name}_queue"] or 0.0,
                               values.get(f"{name}_kv") or 0.0)

        latency = values["ttft"] is not None or values["itl"] is not None
        return Signals(role("prefill", "prefill_tokens"), role("decode", "decode_tokens"),
                       values["ttft"], values["itl"], values["handoff"],
                       "prometheus" if latency else "")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


# ---- one pass -----------------------------------------------------------------------------------


@dataclass
class PoolState:
    started: float
    window: Window = field(default_factory=Window)
    history: History = field(default_factory=History)
    capacity: dict[str, float] | None = None
    next_read: float = 0.0


@dataclass(frozen=True)
class ScalePass:
    targets: dict[str, int] = field(default_factory=dict)  # role -> replicas to write
    status: dict[str, Any] | None = None  # status.autoscaling (None: as it was)
    events: tuple[tuple[str, str], ...] = ()  # (reason, message)
    next_in: float | None = None  # seconds to the next read


@dataclass
class Autoscalers:
    """Every pool's planner state, and the reader they share."""

    reader: Reader = field(default_factory=PodReader)
    pools: dict[tuple[str, str], PoolState] = field(default_factory=dict)
    clock: Any = time.monotonic

    async def run(self, spec: PoolSpec, observed: Observed, refit: bool) -> ScalePass:
        scaling = spec.autoscaling
        key = (spec.namespace, spec.name)
        if scaling is None:
            self.pools.pop(key, None)
            return ScalePass()
        now = self.clock()
        state = self.pools.get(key)
        if state is None:
            state = self.pools[key] = PoolState(started=now)
        if now < state.next_read:
            return ScalePass(next_in=state.next_read - now)
        interval = read_interval(scaling)
        state.next_read = now + interval
        previous = observed.previous.get("autoscaling") or {}
        if state.capacity is None:
            state.capacity = capacity_from_status(previous)
        signals = await self.reader.read(state, spec, list(observed.pods), now)
        if signals is None:
            return ScalePass(next_in=interval)
        obs = observation(spec, observed, signals, state.capacity, refit)
        state.capacity = measured_capacity(scaling, obs, signals, state.capacity)
        obs = observation(spec, observed, signals, state.capacity, refit)
        decision = decide(scaling, obs, state.history, now)
        state.history = decision.history
        metrics.record_autoscaling(spec.namespace, spec.name, *slo_series(scaling, obs))
        targets, events = {}, []
        for role in ROLES:
            d = decision.of(role)
            if d.changed:
                targets[role] = d.target
                direction = "up" if d.target > d.current else "down"
                metrics.AUTOSCALING_DECISIONS.labels(role, direction).inc()
                events.append((EVENT_REASON, f"{role} engines {d.current} -> {d.target}: "
                                             f"{d.reason}"))
        block = status_block(scaling, signals, obs, decision, state.capacity, previous,
                             wall_now())
        return ScalePass(targets, block, tuple(events), interval)

    def forget(self, namespace: str, name: str) -> None:
        self.pools.pop((namespace, name), None)

    async def close(self) -> None:
        await self.reader.close()
