"""The operator's own Prometheus metrics, served on `/metrics` (`--metrics-port`).

One registry of its own (not the process-global default), so tests that run the operator
in-process see exactly these series: reconciles and their errors and duration, the pools being
reconciled, their pods by role and phase, the steps taken by kind, refit transactions by how
they ended and how long they took, and the process's memory.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)

RECONCILES = Counter("tandem_operator_reconciles", "Reconciles run", registry=REGISTRY)
RECONCILE_ERRORS = Counter("tandem_operator_reconcile_errors",
                           "Reconciles that met an error (API call failed, step refused)",
                           registry=REGISTRY)
RECONCILE_SECONDS = Histogram(
    "tandem_operator_reconcile_seconds", "Time of one reconcile (observe, plan, act, status)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=REGISTRY)
POOLS = Gauge("tandem_operator_pools", "InferencePools this operator reconciles",
              registry=REGISTRY)
PODS = Gauge("tandem_operator_pods", "Pods of each pool by group and phase",
             ["namespace", "pool", "role", "phase"], registry=REGISTRY)
ACTIONS = Counter("tandem_operator_actions", "Steps taken, by kind",
                  ["kind"], registry=REGISTRY)
DRAINS = Counter("tandem_operator_drains", "Engine drains finished, by outcome",
                 ["outcome"], registry=REGISTRY)

REFITS = Counter("tandem_operator_refits", "Refit transactions ended, by outcome (Succeeded, "
                 "RolledBack, Halted, Superseded)", ["outcome"], registry=REGISTRY)
REFIT_SECONDS = Histogram(
    "tandem_operator_refit_seconds", "Time from a refit's first step to every engine settled "
    "(succeeded, rolled back or halted)",
    buckets=(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0),
    registry=REGISTRY)

_pod_series: dict[tuple[str, str], set[tuple[str, str]]] = {}


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


def forget_pool(namespace: str, pool: str) -> None:
    for key in _pod_series.pop((namespace, pool), set()):
        PODS.remove(namespace, pool, *key)
