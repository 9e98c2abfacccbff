"""A `spec.adapters` edit becomes a fleet-wide adapter transaction, kept in the pool's status.

The rules and steps live once, torch-free, in `tandem_engine.fleet.adapters` (waves,
in-place loads, canary verification, rollback, halt). This module is the operator's half,
as `refit` is for the weights: which transaction the pool is in (a new one whenever
`spec.adapters` differs from the target in `status.adapterRefit`, superseding the old one,
which starts from the set the pool last served as a whole), which engines take part (the
pool's running engine pods, as for a refit), one `advance` per reconcile, and what it
means for status (`status.adapters`: each adapter's version per role; the
`AdapterRefitting` condition; Degraded after a failure), for the pods' `tandem.dev/adapters`
annotations, and for the adapters new pods start with.

A weights refit goes first: while one runs, the adapter transaction waits (an engine
being refit is not RUNNING, and after the refit it serves the adapters again only if they
fit the new weights: engine/loras.py). Restart-safe the same way as a refit: the record is
read from status at every pass and each engine's next step is decided from what it serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem_engine.fleet import Event
from tandem_engine.fleet.adapters import (
    AdapterObs,
    AdapterRef,
    AdapterSet,
    AdapterTransaction,
    adapter_set,
    advance,
    begin,
    describe,
    managed,
    on_goal,
    reopen,
)
from tandem_engine.fleet.transaction import Phase
from tandem_engine.weights import checkpoint_path

from tandem_operator import manifests as m
from tandem_operator.kube import Kube, KubeError
from tandem_operator.plan import AdapterReport, Condition, Observed, PodView
from tandem_operator.refit import FleetClients, participants, pool_admin, wave_size
from tandem_operator.spec import PoolSpec

log = logging.getLogger("tandem_operator.adapters")

MESSAGE_LIMIT = 4000  # of an engine's error kept in status.adapterRefit.failure


@dataclass
class AdapterPass:
    """What one pass did and found: the transaction (None: the pool serves no adapters),
    its status report, the adapters new engine pods start with, events and errors."""

    tx: AdapterTransaction | None = None
    report: AdapterReport | None = None
    pod_adapters: tuple[AdapterRef, ...] | None = None
    events: list[Event] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.tx is not None and not self.tx.phase.finished


def load(record: Mapping[str, Any] | None) -> AdapterTransaction | None:
    """The transaction in status.adapterRefit, or None (none yet, or unreadable)."""
    if not record:
        return None
    try:
        return AdapterTransaction.from_dict(record)
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("status.adapterRefit is not a transaction record (%s); starting afresh",
                    exc)
        return None


def settled(old: AdapterTransaction | None, observed: Observed) -> AdapterSet:
    """The adapters the pool last served as a whole: where a new transaction starts from
    and a failed one goes back to. Without a record, what most engine pods were started
    with or verified on (their annotations)."""
    if old is not None:
        return dict(old.target) if old.phase is Phase.SUCCEEDED else dict(old.previous)
    sets = Counter(frozenset(p.adapters) for p in observed.engine_pods()
                   if p.adapters is not None)
    if not sets:
        return {}
    best = max(sets, key=lambda s: (sets[s], sorted(a.identity for a in s)))
    return adapter_set(best)


def new_pod_adapters(tx: AdapterTransaction) -> tuple[AdapterRef, ...]:
    """What a pod created now starts with: a set the pool verified — the target once the
    transaction succeeded, else the previous set (the pod then joins the transaction like
    any engine behind, and is verified on the target)."""
    chosen = tx.target if tx.phase is Phase.SUCCEEDED else tx.previous
    return tuple(a for _, a in sorted(chosen.items()))


def configure(tx: AdapterTransaction, spec: PoolSpec) -> None:
    """spec.refit's strategy and onFailure, and the wave size a refit uses (an edit applies
    at once)."""
    tx.strategy, tx.on_failure = spec.refit.strategy, spec.refit.on_failure
    tx.max_unavailable = wave_size(spec)


def annotations(tx: AdapterTransaction, engines: list[AdapterObs],
                pods: Mapping[str, PodView]) -> dict[str, dict[str, str]]:
    """ADAPTERS annotations to patch: a serving engine's pod names the adapters it serves
    of those the transaction knows (target and previous), where that changed."""
    known = {a.identity: a for a in (*tx.target.values(), *tx.previous.values())}
    out: dict[str, dict[str, str]] = {}
    for e in engines:
        if not e.serving or e.loras is None:
            continue
        served = managed(tx, e)
        if not served <= known.keys():
            continue  # a version loaded some other way: its folder is not known
        have = pods[e.name].adapters
        if have is not None and frozenset(a.identity for a in have) == served:
            continue
        out[e.name] = {m.ADAPTERS: m.adapters_annotation([known[i] for i in served])}
    return out


async def adapter_pass(kube: Kube, fleet: FleetClients, spec: PoolSpec, observed: Observed,
                       weights_refitting: bool, now: float | None = None) -> AdapterPass:
    """Start, supersede or continue the pool's adapter transaction: one `advance`."""
    now = time.time() if now is None else now
    if spec.engine.lora is None:
        return AdapterPass()  # engines without LoRA slots serve no adapters
    old = load(observed.previous.get("adapterRefit"))
    want = adapter_set(spec.adapters)
    out = AdapterPass()
    tx = old
    if tx is None or tx.target != want:
        tx = begin(want, settled(old, observed), now)
        if old is not None and not old.phase.finished:
            out.events.append(Event(
                "AdapterRefitSuperseded", f"adapter change to {describe(old.target)} "
                f"({old.phase}, wave {old.wave}) superseded by {describe(want)}: engines "
                "continue from where they are"))
    configure(tx, spec)
    out.tx = tx
    pods = {p.name: p for p in participants(observed)}
    tx.engines = {n: r for n, r in tx.engines.items() if n in pods}
    engines: list[AdapterObs] = []
    if pods:
        admin = await pool_admin(fleet, spec, observed)
        states = await asyncio.gather(*(admin.probe(m.engine_admin_url(p.ip)) for p in
                                        pods.values()))
        engines = [AdapterObs.from_state(p.name, p.group, m.engine_admin_url(p.ip), s)
                   for p, s in zip(pods.values(), states, strict=True)]
        if not weights_refitting:
            out.events += reopen(tx, engines, now)
            paths = {a.name: checkpoint_path(a.uri) for a in tx.goal.values()}
            out.events += await advance(tx, engines, admin, paths, now)
            patches = annotations(tx, engines, pods)
            results = await asyncio.gather(
                *(kube.annotate("Pod", spec.namespace, name, patch)
                  for name, patch in patches.items()), return_exceptions=True)
            for name, result in zip(patches, results, strict=True):
                if isinstance(result, KubeError):
                    out.errors.append(f"annotate pod {name} with its adapters: {result}")
                elif isinstance(result, BaseException):
                    raise result
    out.pod_adapters = new_pod_adapters(tx)
    out.report = report(tx, engines, pods, weights_refitting)
    return out


# ---- what it says -------------------------------------------------------------------------------


def _roles(tx: AdapterTransaction, engines: list[AdapterObs], pods: Mapping[str, PodView]
           ) -> list[dict[str, str]]:
    """status.adapters: per adapter (wanted, or still served), the versions each role's
    serving engines serve (comma-separated; empty: none), and the one every engine serves."""
    serving = [e for e in engines if e.serving and e.loras is not None]
    served: dict[str, dict[str, set[str]]] = {}
    for e in serving:
        for identity in managed(tx, e):
            name, _, version = identity.partition("@")
            served.setdefault(name, {}).setdefault(pods[e.name].group, set()).add(version)
    out = []
    for name in sorted(set(tx.target) | set(served)):
        by_role = served.get(name, {})
        everywhere = {v for vs in by_role.values() for v in vs}
        on_all = all(any(i.partition("@")[0] == name for i in managed(tx, e)) for e in serving)
        current = next(iter(everywhere)) if len(everywhere) == 1 and on_all and serving else ""
        target = tx.target.get(name)
        out.append({"name": name, "version": target.version if target else "",
                    "current": current,
                    "prefill": ",".join(sorted(by_role.get("prefill", ()))),
                    "decode": ",".join(sorted(by_role.get("decode", ())))})
    return out


def _summary(rows: list[dict[str, str]]) -> str:
    """The kubectl column: `sql@2 chat@1`; an adapter still rolling shows every version
    served (`sql@1|2`), one not served yet `sql@-`."""
    parts = []
    for row in rows:
        versions = sorted(set(filter(None, (row["prefill"] + "," + row["decode"]).split(","))))
        parts.append(f"{row['name']}@{row['current'] or '|'.join(versions) or '-'}")
    return " ".join(parts) or "none"


def report(tx: AdapterTransaction, engines: list[AdapterObs], pods: Mapping[str, PodView],
           weights_refitting: bool = False) -> AdapterReport:
    goal = tx.goal
    answering = [e for e in engines if e.serving and e.loras is not None]
    progress = (f"{sum(on_goal(tx, e) for e in answering)}/{len(answering)} engines serve "
                f"{describe(goal)}")
    route = f"{describe(tx.previous)} → {describe(tx.target)}"
    failure = (f"engine {tx.failure.engine} failed at {tx.failure.step}: {tx.failure.message}"
               if tx.failure else "no failure recorded")
    took = f"{(tx.finished_at or 0.0) - tx.started_at:.1f} s"
    condition: Condition
    degraded: Condition | None = None
    if weights_refitting and not tx.phase.finished:
        condition = (True, "WaitingForRefit", f"adapters {route} wait for the weights refit "
                                              f"under way; {progress}")
    elif tx.phase is Phase.PROGRESSING:
        condition = (True, str(tx.strategy), f"adapters {route} ({tx.strategy}): wave "
                                             f"{tx.wave}, {progress}")
    elif tx.phase is Phase.ROLLING_BACK:
        condition = (True, "RollingBack", f"adapters {route} failed; rolling back: {progress}")
        degraded = (True, "AdapterRefitFailed", f"adapters {describe(tx.target)} failed: "
                                                f"{failure}; rolling back to "
                                                f"{describe(tx.previous)}")
    elif tx.phase is Phase.SUCCEEDED:
        condition = (False, "AdaptersCurrent", f"every engine serves {describe(tx.target)}"
                                               + (f"; the change {route} took {took}"
                                                  if tx.wave else ""))
    elif tx.phase is Phase.ROLLED_BACK:
        condition = (False, "AdapterRefitRolledBack", f"adapters {route} rolled back after "
                                                      f"{took}")
        degraded = (True, "AdapterRefitRolledBack", f"adapters {describe(tx.target)} rolled "
                                                    f"back: {failure}. Every engine serves "
                                                    f"{describe(tx.previous)} again; fix "
                                                    "spec.adapters (or set it back)")
    else:
        condition = (False, "AdapterRefitHalted", f"adapters {route} halted after {took}; "
                                                  f"{progress}")
        degraded = (True, "AdapterRefitHalted", f"adapters {describe(tx.target)} halted: "
                                                f"{failure}; edit spec.adapters to go on or "
                                                "back")
    record: dict[str, Any] = {k: v for k, v in tx.to_dict().items() if v is not None}
    record["progress"] = progress
    if "failure" in record:
        record["failure"]["message"] = record["failure"]["message"][:MESSAGE_LIMIT]
    rows = _roles(tx, engines, pods) if engines else [
        {"name": a.name, "version": a.version, "current": "", "prefill": "", "decode": ""}
        for _, a in sorted(tx.target.items())]
    return AdapterReport(record=record, refitting=condition, degraded=degraded,
                         adapters=rows, summary=_summary(rows))
