"""The operator's own Prometheus metrics, served on `/metrics` (`--metrics-port`).

One registry of its own (not the process-global default), so tests that run the operator
in-process see exactly these series: reconciles and their errors and duration, the pools being
reconciled, their pods by role and phase, their engines desired and ready by role and weights
version, the steps taken by kind, refit transactions by how they ended and how long they took,
Kubernetes API errors, and the process's memory. Names, labels and buckets: docs/metrics.md.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from tandem_engine.fleet.transaction import Phase

from tandem_operator.spec import ENGINE_GROUPS

if TYPE_CHECKING:
    from tandem_operator.plan import Observed
    from tandem_operator.spec import PoolSpec

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)

RECONCILES = Counter("tandem_operator_reconciles", "Reconciles run", registry=REGISTRY)
RECONCILE_ERRORS = Counter("tandem_operator_reconcile_errors",
                           "Reconciles that met an error (API call failed, step refused)",
                           registry=REGISTRY)
RECONCILE_SECONDS = Histogram(
    "tandem_operator_reconcile_seconds", "Time of one reconcile (observe, plan, act, status)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    registry=REGISTRY)
POOLS = Gauge("tandem_operator_pools", "InferencePools this operator reconciles",
              registry=REGISTRY)
PODS = Gauge("tandem_operator_pods", "Pods of each pool by group and phase",
             ["namespace", "pool", "role", "phase"], registry=REGISTRY)
POOL_ENGINES = Gauge(
    "tandem_operator_pool_engines", "Engines of each pool by role and weights version: desired "
    "(the spec's replicas at the spec's version) and ready (ready engine pods, by the version "
    "they run)", ["namespace", "pool", "role", "weights_version", "kind"], registry=REGISTRY)
API_ERRORS = Counter(
    "tandem_operator_api_errors", "Kubernetes API calls answered with an error (or not at all: "
    "reason is then the client's exception), by verb and the API's reason; expected ones such "
    "as a 404 on GET included", ["verb", "reason"], registry=REGISTRY)
ACTIONS = Counter("tandem_operator_actions", "Steps taken, by kind",
                  ["kind"], registry=REGISTRY)
DRAINS = Counter("tandem_operator_drains", "Engine drains finished, by outcome",
                 ["outcome"], registry=REGISTRY)

REFITS = Counter("tandem_operator_refits", "Refit transactions ended, by outcome (Succeeded, "
                 "RolledBack, Halted, Superseded)", ["outcome"], registry=REGISTRY)
# Every outcome's series from the start, at 0: dashboards (rate, increase) and alerts have a
# baseline before the first refit ends, and a missing name means a renamed metric.
for _outcome in (*(str(p) for p in Phase if p.finished), "Superseded"):
    REFITS.labels(_outcome)
REFIT_SECONDS = Histogram(
    "tandem_operator_refit_seconds", "Time from a refit's first step to every engine settled "
    "(succeeded, rolled back or halted)",
    buckets=(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
             7200.0),
    registry=REGISTRY)

# The pool's conditions as kube-state-metrics writes a Deployment's: one series per
# condition at 1, its status and reason as labels (alerts: a rollout past its deadline, a
# refit that does not end).
POOL_CONDITION = Gauge(
    "tandem_operator_pool_condition", "The pool's status conditions (value 1): type, status "
    "(True, False) and reason", ["namespace", "pool", "type", "status", "reason"],
    registry=REGISTRY)
# spec.autoscaling, for dashboards and the SLO alert: each bound beside what the planner
# observed over the window (`metric`: ttft_seconds, itl_seconds at the SLO's percentile;
# kv_usage 0..1 of the fullest decode engine; queue_depth, waiting requests per engine of
# `role`). A metric with no traffic in the window has no observed series.
AUTOSCALING_SLO = Gauge(
    "tandem_operator_autoscaling_slo", "spec.autoscaling's bounds, by the role each one sizes "
    "and metric (ttft_seconds, itl_seconds, kv_usage, queue_depth)",
    ["namespace", "pool", "role", "metric"], registry=REGISTRY)
AUTOSCALING_OBSERVED = Gauge(
    "tandem_operator_autoscaling_observed", "What the autoscaling planner observed over its "
    "window, by role and metric (as tandem_operator_autoscaling_slo)",
    ["namespace", "pool", "role", "metric"], registry=REGISTRY)
AUTOSCALING_DECISIONS = Counter(
    "tandem_operator_autoscaling_decisions", "Replica changes the autoscaling planner made, by "
    "role and direction (up, down)", ["role", "direction"], registry=REGISTRY)
for _role in ("prefill", "decode"):
    for _direction in ("up", "down"):
        AUTOSCALING_DECISIONS.labels(_role, _direction)

_pod_series: dict[tuple[str, str], set[tuple[str, str]]] = {}
_engine_series: dict[tuple[str, str], set[tuple[str, str, str]]] = {}
_condition_series: dict[tuple[str, str], set[tuple[str, str, str]]] = {}
_slo_series: dict[tuple[str, str], dict[Gauge, set[tuple[str, str]]]] = {}


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Serve /metrics on a daemon thread."""
    start_http_server(port, addr=address, registry=REGISTRY)


def record_pods(namespace: str, pool: str, pods: Iterable[tuple[str, str]]) -> None:
    """Set the pod counts of one pool from (role, phase) pairs; zero the pairs now gone."""
    counts: dict[tuple[str, str], int] = {}
    for key in pods:
        counts[key] = counts.get(key, 0) + 1
    for key in _pod_series.get((namespace, pool), set()) - counts.keys():
        PODS.remove(namespace, pool, *key)
    for (role, phase), n in counts.items():
        PODS.labels(namespace, pool, role, phase).set(n)
    _pod_series[(namespace, pool)] = set(counts)


def pool_engines(spec: PoolSpec, observed: Observed) -> dict[tuple[str, str, str], int]:
    """(role, weights_version, kind) -> engines: `desired` from the spec (its replicas of
    each engine role, at its weights version), `ready` from the pods (ready engine pods by the
    role and version they run; 0 for a desired pair none of them is)."""
    counts: Tally[tuple[str, str, str]] = Tally()
    for group in ENGINE_GROUPS:
        if spec.replicas(group) > 0:
            role = str(spec.engine_role(group))
            counts[(role, spec.weights.version, "desired")] += spec.replicas(group)
            counts[(role, spec.weights.version, "ready")] += 0
    for pod in observed.engine_pods():
        if pod.ready:
            role = str(pod.role or spec.engine_role(pod.group))
            counts[(role, pod.weights.version if pod.weights else "", "ready")] += 1
    return dict(counts)


def record_pool_engines(namespace: str, pool: str,
                        counts: dict[tuple[str, str, str], int]) -> None:
    """Set one pool's `tandem_operator_pool_engines` (from `pool_engines`); drop the series
    now gone (a version no engine runs any more)."""
    for key in _engine_series.get((namespace, pool), set()) - counts.keys():
        POOL_ENGINES.remove(namespace, pool, *key)
    for (role, version, kind), n in counts.items():
        POOL_ENGINES.labels(namespace, pool, role, version, kind).set(n)
    _engine_series[(namespace, pool)] = set(counts)


def record_conditions(namespace: str, pool: str, conditions: Iterable[dict[str, str]]) -> None:
    """Set one pool's `tandem_operator_pool_condition` from its status conditions."""
    now = {(c["type"], c["status"], c.get("reason", "")) for c in conditions}
    for key in _condition_series.get((namespace, pool), set()) - now:
        POOL_CONDITION.remove(namespace, pool, *key)
    for key in now:
        POOL_CONDITION.labels(namespace, pool, *key).set(1)
    _condition_series[(namespace, pool)] = now


def record_autoscaling(namespace: str, pool: str,
                       slo: dict[tuple[str, str], float],
                       observed: dict[tuple[str, str], float]) -> None:
    """Set one pool's autoscaling bounds and observations, (role, metric) -> value; drop
    the series now gone (autoscaling turned off, a metric with no traffic)."""
    held = _slo_series.setdefault((namespace, pool), {})
    for gauge, values in ((AUTOSCALING_SLO, slo), (AUTOSCALING_OBSERVED, observed)):
        for key in held.get(gauge, set()) - values.keys():
            gauge.remove(namespace, pool, *key)
        for (role, metric), value in values.items():
            gauge.labels(namespace, pool, role, metric).set(value)
        held[gauge] = set(values)


def forget_pool(namespace: str, pool: str) -> None:
    for key in _pod_series.pop((namespace, pool), set()):
        PODS.remove(namespace, pool, *key)
    for key in _engine_series.pop((namespace, pool), set()):
        POOL_ENGINES.remove(namespace, pool, *key)
    for key in _condition_series.pop((namespace, pool), set()):
        POOL_CONDITION.remove(namespace, pool, *key)
    for gauge, keys in _slo_series.pop((namespace, pool), {}).items():
        for key in keys:
            gauge.remove(namespace, pool, *key)
