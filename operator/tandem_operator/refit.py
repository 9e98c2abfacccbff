"""A weights edit becomes a fleet-wide refit transaction, kept in the pool's status.

The rules of a refit (each engine's next step, waves, verification, rollback, halt) live
once, in the torch-free `tandem_engine.fleet` that `tandem refit` shares. This module is the
operator's half: which transaction the pool is in (a new one whenever spec.model.weights
differs from the target in `status.refit`, superseding the old one), which engines take part
(the pool's running engine pods, never those being deleted or drained for scale-down), one
`advance` pass per reconcile, and what that pass means for status, for the pods' weights
annotations and for the weights new pods load.

Restart-safe: the transaction is read from `status.refit` at every pass and written back
after it, and each engine's next step is decided from what the engine reports, so a pass
repeated after a crash takes no step twice. An engine the transaction does not know that is
out of service (left paused or suspended by a superseded transaction, or by a step whose
record was lost) is adopted and brought to the goal: nothing stays paused. An engine that
turns up on other weights after the transaction finished (a pod started late, a container
restarted from its original arguments) reopens it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tandem_engine.fleet import (
    EngineAdmin,
    EngineObs,
    EngineRecord,
    Event,
    Phase,
    Transaction,
    advance,
    observe,
)
from tandem_engine.lifecycle import LEAVING_STATES, EngineState
from tandem_engine.weights import WeightsRef

from tandem_operator import manifests as m
from tandem_operator import metrics
from tandem_operator.kube import Kube, KubeError
from tandem_operator.plan import Condition, Observed, PodView, RefitReport
from tandem_operator.spec import ENGINE_GROUPS, PoolSpec

log = logging.getLogger("tandem_operator.refit")

REQUEUE_SECONDS = 0.5  # the next pass while a transaction runs (engine steps are quick)
MESSAGE_LIMIT = 4000  # of an engine's error kept in status.refit.failure


class FleetClients:
    """One `EngineAdmin` per pool (it carries the pool's admin token), kept across passes:
    the refit's calls and the drains of engines leaving the pool."""

    def __init__(self) -> None:
        self._admins: dict[tuple[str, str], tuple[str | None, EngineAdmin]] = {}

    async def admin(self, namespace: str, name: str, token: str | None) -> EngineAdmin:
        have = self._admins.get((namespace, name))
        if have is not None and have[0] == token:
            return have[1]
        if have is not None:
            await have[1].close()
        admin = EngineAdmin(token)
        self._admins[(namespace, name)] = (token, admin)
        return admin

    async def forget(self, namespace: str, name: str) -> None:
        have = self._admins.pop((namespace, name), None)
        if have is not None:
            await have[1].close()

    async def close(self) -> None:
        for _, admin in self._admins.values():
            await admin.close()
        self._admins.clear()


@dataclass
class RefitPass:
    """What one pass did and found: the transaction (None: the pool needs none), its status
    report, the weights new engine pods load, events to post and errors met."""

    tx: Transaction | None = None
    report: RefitReport | None = None
    pod_weights: WeightsRef | None = None
    events: list[Event] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.tx is not None and not self.tx.phase.finished


# ---- the transaction the pool is in -------------------------------------------------------------


def load(record: Mapping[str, Any] | None) -> Transaction | None:
    """The transaction in status.refit, or None (none yet, or a record this cannot read)."""
    if not record:
        return None
    try:
        return Transaction.from_dict(dict(record))
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("status.refit is not a transaction record (%s); starting afresh", exc)
        return None


def participants(observed: Observed) -> list[PodView]:
    """Engine pods that take part: running, with an address, and not leaving the pool."""
    return [p for p in observed.engine_pods()
            if p.ip and p.phase == "Running" and not p.draining_since]


def needs_refit(spec: PoolSpec, observed: Observed) -> bool:
    """Without any transaction yet: whether an engine pod runs other weights than the spec's
    from the same volume (weights on another volume come with new pods: `rolling`)."""
    return any(p.weights is not None and p.weights != spec.weights
               and p.weights.volume == spec.weights.volume for p in observed.engine_pods())


def rolling(spec: PoolSpec, observed: Observed) -> list[PodView]:
    """Engine pods whose weights come from another volume than the spec's (another claim,
    another model image): no engine can reach the spec's weights in place, so the pods roll
    (their template names the volume: `manifests.template_hash`) and new ones load them."""
    return [p for p in observed.engine_pods()
            if p.weights is not None and p.weights.volume != spec.weights.volume]


def reused_version(spec: PoolSpec, old: Transaction | None, observed: Observed
                   ) -> WeightsRef | None:
    """Weights the pool runs (or is moving to) under the spec's version but from another
    uri, or None. Engines are told apart by version alone, so other weights under a name
    already in use cannot be refit to: they would count as done."""
    known = [p.weights for p in observed.engine_pods() if p.weights is not None]
    if old is not None:
        known.append(old.previous)
        if not old.phase.finished:
            known.append(old.target)
    want = spec.weights
    return next((w for w in known if w.version == want.version and w.uri != want.uri), None)


def configure(tx: Transaction, spec: PoolSpec) -> None:
    """The spec's refit settings, applied at every pass (an edit applies at once)."""
    tx.strategy, tx.inflight = spec.refit.strategy, spec.refit.inflight
    tx.on_failure = spec.refit.on_failure
    tx.max_perplexity_ratio = spec.refit.max_perplexity_ratio
    tx.min_uncertainty_ratio = spec.refit.min_uncertainty_ratio
    tx.low_memory = spec.refit.low_memory
    tx.drain_timeout = float(spec.refit.drain_timeout_seconds)
    tx.max_unavailable = wave_size(spec)


def wave_size(spec: PoolSpec) -> int:
    """Engines per role a wave takes (a refit's, an adapter change's): one number for both
    roles, the smaller role's rollout budget (a percentage resolves per role)."""
    return max(1, min((spec.rollout.budget(spec.replicas(g))[1]
                       for g in ENGINE_GROUPS if spec.replicas(g) > 0), default=1))


async def pool_admin(fleet: FleetClients, spec: PoolSpec, observed: Observed) -> EngineAdmin:
    """The admin client of the pool's engines, with the pool's admin token."""
    secret = observed.objects.get(("Secret", m.admin_secret_name(spec.name)))
    token = m.secret_token(dict(secret)) if secret else None
    return await fleet.admin(spec.namespace, spec.name, token)


def settled_weights(old: Transaction | None, observed: Observed,
                    target: WeightsRef) -> WeightsRef:
    """The weights the pool last served as a whole: where a failed refit goes back to."""
    if old is not None and old.phase is Phase.SUCCEEDED:
        return old.target
    if old is not None and old.phase is not Phase.HALTED:
        return old.previous  # superseded or rolled back: its starting point still holds
    counts = Counter(p.weights for p in observed.engine_pods() if p.weights is not None)
    others = [w for w in counts if w != target]
    if not others:
        return target
    return max(others, key=lambda w: (counts[w], w.version, w.uri))


def settled_draft(old: Transaction | None, observed: Observed, previous: WeightsRef
                  ) -> str | None:
    """The draft checkpoint that goes with `previous` (`settled_weights`): the one the last
    transaction loaded with it, else the one its engine pods were started or refitted with."""
    if old is not None and old.phase is Phase.SUCCEEDED and old.target == previous:
        return old.target_draft
    if old is not None and old.previous == previous:
        return old.previous_draft
    drafts = Counter(p.draft_uri for p in observed.engine_pods()
                     if p.weights == previous and p.draft_uri is not None)
    return max(drafts, key=lambda d: (drafts[d], d)) if drafts else None


def begin(spec: PoolSpec, old: Transaction | None, observed: Observed) -> Transaction:
    """A transaction toward the spec's weights (and the spec's draft checkpoint), numbered
    above every epoch the pool has seen."""
    target = spec.weights
    epochs = [p.epoch for p in observed.engine_pods() if p.epoch is not None]
    epochs.append(int((observed.previous.get("weights") or {}).get("epoch") or 0))
    if old is not None:
        epochs += [old.epoch, old.rollback_epoch or 0]
    previous = settled_weights(old, observed, target)
    tx = Transaction(target=target, previous=previous, epoch=max(epochs) + 1,
                     target_draft=spec.draft_uri,
                     previous_draft=settled_draft(old, observed, previous))
    configure(tx, spec)
    return tx


def new_pod_weights(tx: Transaction, observed: Observed) -> WeightsRef:
    """The weights a pod created now loads: ones some engine already serves verified, so
    no untested checkpoint is loaded at start-up and each version keeps its engines; the
    pod then joins the transaction like any engine not on the goal."""
    target, previous = tx.target, tx.previous
    annotated = Counter(p.weights for p in observed.engine_pods() if p.weights is not None)
    if tx.phase is Phase.SUCCEEDED:
        return target
    if tx.phase is Phase.PROGRESSING:
        return target if annotated[target] else previous
    if tx.phase in (Phase.ROLLING_BACK, Phase.ROLLED_BACK):
        return previous
    if not annotated:  # halting or halted: what most engines serve, the old weights on a tie
        return previous
    return max(annotated, key=lambda w: (annotated[w], w == previous, w.version))


# ---- one pass -----------------------------------------------------------------------------------


def _rejoin(tx: Transaction, engines: list[EngineObs], now: float) -> list[Event]:
    """A finished transaction holds while every engine serves its final weights; an engine
    on other weights reopens it (it joins the next wave like any engine behind)."""
    if tx.phase not in (Phase.SUCCEEDED, Phase.ROLLED_BACK):
        return []
    final = tx.target if tx.phase is Phase.SUCCEEDED else tx.previous
    strays = [e for e in engines if e.state is not None and e.state not in LEAVING_STATES
              and e.version != final.version]
    if not strays:
        return []
    tx.phase = Phase.PROGRESSING if tx.phase is Phase.SUCCEEDED else Phase.ROLLING_BACK
    tx.finished_at, tx.started_at = None, now
    for e in strays:
        tx.engines.pop(e.name, None)
    names = ", ".join(f"{e.name} ({e.version})" for e in strays)
    return [Event("RefitResumed", f"{names} not on {final.version}: refitting "
                                  f"{'it' if len(strays) == 1 else 'them'} to {final.version}")]


def _adopt(tx: Transaction, engines: list[EngineObs], now: float) -> None:
    """Out-of-service engines the transaction does not know join it, and a drain it did
    not record (lost with a status write) is timed from now."""
    for e in engines:
        if e.state is None or e.state in LEAVING_STATES:
            continue
        record = tx.engines.get(e.name)
        if record is None and not e.serving:
            record = tx.engines[e.name] = EngineRecord(since=now, version=e.version)
        if record is not None and e.state is EngineState.RUNNING and e.draining \
                and record.drained_at is None:
            record.drained_at = now


def annotations(tx: Transaction, engines: list[EngineObs], pods: Mapping[str, PodView]
                ) -> dict[str, dict[str, str]]:
    """Pod annotations to patch, by pod: a serving engine's pod names the weights and epoch
    it serves (verified: an engine refused traffic until its canary passed), so new pods
    and `serving_weights` follow."""
    out: dict[str, dict[str, str]] = {}
    for e in engines:
        pod = pods[e.name]
        if not e.serving or (pod.weights is not None and pod.weights.version == e.version
                             and pod.epoch == e.epoch):
            continue
        known = [(w.uri, draft) for w, draft in ((tx.target, tx.target_draft),
                                                 (tx.previous, tx.previous_draft))
                 if w.version == e.version]
        uri = known[0][0] if known else e.uri or (pod.weights.uri if pod.weights else "")
        if uri:
            out[e.name] = {m.WEIGHTS_VERSION: e.version, m.WEIGHTS_URI: uri,
                           m.WEIGHTS_EPOCH: str(e.epoch)}
            if known and known[0][1] is not None:  # the draft refitted with them
                out[e.name][m.DRAFT_URI] = known[0][1]
    return out


async def refit_pass(kube: Kube, fleet: FleetClients, spec: PoolSpec, observed: Observed,
                     now: float | None = None) -> RefitPass:
    """Start, supersede or continue the pool's refit: one `advance` over its engines."""
    now = time.time() if now is None else now
    old = load(observed.previous.get("refit"))
    out = RefitPass()
    tx = old
    if tx is None or tx.target != spec.weights:
        behind = rolling(spec, observed)
        if behind or (tx is not None and tx.target.volume != spec.weights.volume
                      and not needs_refit(spec, observed)):
            if behind:  # new pods come with the weights; the transaction waits for none
                stopped = bool((observed.previous.get("rollout") or {}).get(
                    "progressDeadlineExceeded"))
                out.report = _rolling_report(spec, behind, stopped)
            return out
        reused = reused_version(spec, old, observed)
        if reused is not None:  # the edit cannot be refit: whatever the pool did goes on
            out.report = _reused_report(spec, reused)
        elif tx is not None or needs_refit(spec, observed):
            tx = begin(spec, old, observed)
            if old is not None and not old.phase.finished:
                out.events.append(Event(
                    "RefitSuperseded", f"refit to {old.target.version} ({old.phase}, wave "
                    f"{old.wave}) superseded by {tx.target.version}: engines under way "
                    f"continue from where they are to {tx.target.version}"))
                metrics.REFITS.labels("Superseded").inc()
    if tx is None:
        return out
    configure(tx, spec)
    out.tx = tx
    pods = {p.name: p for p in participants(observed)}
    tx.engines = {n: r for n, r in tx.engines.items() if n in pods}
    engines: list[EngineObs] = []
    if pods:
        admin = await pool_admin(fleet, spec, observed)
        engines = await observe(admin, [
            (p.name, p.role, m.engine_admin_url(p.ip)) for p in pods.values()])
        # One that does not answer yet (starting) joins once it does.
        engines = [e for e in engines if e.state is not None or e.name in tx.engines]
        out.events += _rejoin(tx, engines, now)
        running = not tx.phase.finished
        if running:
            _adopt(tx, engines, now)
        out.events += await advance(tx, engines, admin, now)
        if running and tx.phase.finished:
            metrics.REFITS.labels(str(tx.phase)).inc()
            metrics.REFIT_SECONDS.observe(max(0.0, (tx.finished_at or now) - tx.started_at))
        patches = annotations(tx, engines, pods)
        results = await asyncio.gather(
            *(kube.annotate("Pod", spec.namespace, name, patch)
              for name, patch in patches.items()), return_exceptions=True)
        for name, result in zip(patches, results, strict=True):
            if isinstance(result, KubeError):
                out.errors.append(f"annotate pod {name} with its weights: {result}")
            elif isinstance(result, BaseException):
                raise result
    out.pod_weights = new_pod_weights(tx, observed)
    said = report(tx, engines)
    out.report = said if out.report is None else replace(out.report, record=said.record)
    return out


def _rolling_report(spec: PoolSpec, behind: list[PodView], stopped: bool = False
                    ) -> RefitReport:
    """Refitting while the weights come with new pods: True while they roll; False once the
    rollout bringing them missed its deadline (the Progressing condition says what now)."""
    w = spec.weights
    source = w.volume or "the pods' filesystem"
    names = ", ".join(sorted(p.name for p in behind))
    if stopped:
        return RefitReport(None, (False, "RollingPodsStopped", (
            f"weights {w.version} come from {source}, which {len(behind)} engine pod(s) do "
            f"not mount ({names}), and the rollout bringing them made no progress within "
            "spec.rollout.progressDeadlineSeconds: see the Progressing condition")))
    return RefitReport(None, (True, "RollingPods", (
        f"weights {w.version} come from {source}, which {len(behind)} engine pod(s) do not "
        f"mount ({names}): they are replaced within spec.rollout's budget, the new pods "
        "loading the weights, instead of refitting in place")))


def _reused_report(spec: PoolSpec, reused: WeightsRef) -> RefitReport:
    w = spec.weights
    message = (f"spec.model.weights names version {w.version} at {w.uri}, but the pool knows "
               f"{w.version} as {reused.uri}; engines are told apart by version, so these "
               f"weights cannot be refit to under that name: give them a new "
               f"spec.model.weights.version")
    return RefitReport(record=None, refitting=(False, "WeightsVersionReused", message),
                       degraded=(True, "WeightsVersionReused", message))


# ---- what it says -------------------------------------------------------------------------------


def _without_nulls(value: Any) -> Any:
    """A merge patch reads null as "remove": the record leaves out what is unset."""
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _failure(tx: Transaction) -> str:
    f = tx.failure
    if f is None:
        return "no failure recorded"
    return f"engine {f.engine} failed at {f.step}: {f.message}"


def report(tx: Transaction, engines: list[EngineObs]) -> RefitReport:
    goal = tx.goal
    on_goal = sum(e.serving and e.version == goal.version for e in engines)
    progress = f"{on_goal}/{len(engines)} engines serve {goal.version}"
    by_name = {e.name: e for e in engines}
    under_way = [f"{n} {r.step or 'queued'} ({by_name[n].state or 'not answering'}, "
                 f"{by_name[n].version or '?'})"
                 for n, r in sorted(tx.engines.items())
                 if n in by_name and not (by_name[n].serving and (
                     tx.phase is Phase.HALTING or by_name[n].version == goal.version))]
    doing = f"; under way: {', '.join(under_way)}" if under_way else ""
    took = f"{(tx.finished_at or 0.0) - tx.started_at:.1f} s"
    route = f"{tx.previous.version} → {tx.target.version}"
    refitting: Condition
    degraded: Condition | None = None
    current: str | None = None
    if tx.phase is Phase.PROGRESSING:
        refitting = (True, tx.strategy, f"refit {route} (epoch {tx.epoch}, {tx.strategy}, "
                                        f"in-flight requests: {tx.inflight}): wave {tx.wave}, "
                                        f"{progress}{doing}")
    elif tx.phase is Phase.ROLLING_BACK:
        refitting = (True, "RollingBack", f"refit {route} failed; rolling back to "
                                          f"{tx.previous.version} (epoch {tx.goal_epoch}): "
                                          f"{progress}{doing}")
        degraded = (True, "RefitFailed", f"refit to {tx.target.version} failed: "
                                         f"{_failure(tx)}; rolling back to "
                                         f"{tx.previous.version}")
    elif tx.phase is Phase.HALTING:
        refitting = (True, "Halting", f"refit {route} failed; halting where it is (engines "
                                      f"under way go back to serving){doing}")
        degraded = (True, "RefitFailed", f"refit to {tx.target.version} failed: "
                                         f"{_failure(tx)}; halting")
    elif tx.phase is Phase.SUCCEEDED:
        current = tx.target.version
        refitting = (False, "RefitSucceeded", f"every engine serves {tx.target.version} "
                                              f"(epoch {tx.epoch}); the refit {route} took "
                                              f"{took}")
    elif tx.phase is Phase.ROLLED_BACK:
        current = tx.previous.version
        refitting = (False, "RefitRolledBack", f"refit {route} rolled back after {took}; "
                                               f"every engine serves {tx.previous.version}")
        degraded = (True, "RefitRolledBack", f"refit to {tx.target.version} "
                                             f"({tx.target.uri}) rolled back: {_failure(tx)}. "
                                             f"Every engine serves {tx.previous.version} "
                                             f"again; fix spec.model.weights (or set it back "
                                             f"to {tx.previous.version})")
    else:
        versions = Counter(e.version for e in engines if e.state is not None)
        serving = ", ".join(f"{n} on {v}" for v, n in sorted(versions.items()))
        refitting = (False, "RefitHalted", f"refit {route} halted after {took}; engines: "
                                           f"{serving or 'none answering'}")
        degraded = (True, "RefitHalted", f"refit to {tx.target.version} ({tx.target.uri}) "
                                         f"halted: {_failure(tx)}. Engines serve {serving or '?'}"
                                         f"; edit spec.model.weights to go on or back")
    record = {**_without_nulls(tx.to_dict()), "progress": progress}
    if "failure" in record:  # bounded as the CRD says (an engine's error can be long)
        record["failure"]["message"] = record["failure"]["message"][:MESSAGE_LIMIT]
    return RefitReport(record=record, refitting=refitting, degraded=degraded, current=current)
