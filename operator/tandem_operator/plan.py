"""What to do next for one pool: desired state versus observed pods and objects, as data.

`plan(spec, observed)` is pure and idempotent: given the same observation it returns the same
steps, and each step is safe to repeat (a create of something that now exists is planned no
more once it is observed). Reconcile carries the steps out, so the rules that keep a pool
serving live here, where they are tested exhaustively without an API server:

* scale-up creates pods on the weights the engines serve now (`serving_weights`), never on a
  weights change still to be refit; while a refit runs, its transaction decides instead
  (`Observed.pod_weights`, from `refit`), and each new pod carries the pool-wide epoch of
  those weights;
* scale-down drains first, picking not-ready pods, then the newest;
* a pod whose template hash differs from the spec's is rolled within maxSurge/maxUnavailable
  (per role, in pods: a percentage resolves against the role's replicas as a Deployment's
  does, `Rollout.budget`; draining pods still count towards the surge), both engine roles
  progressing in the same steps; the last ready pod of a role is never taken — when maxSurge is
  0 and that rule would stall a rollout, one pod is surged anyway;
* decode pods leave only while a prefill pod is ready (new decode engines need one), and
  prefill pods scaled to zero leave only once decode pods run as mixed engines;
* failed pods are deleted and replaced, missing pods and objects are (re)created, objects
  the spec no longer asks for (NetworkPolicies, a PodMonitor once disabled) are deleted, and a
  credentials Secret from before the ZMQ CURVE keys gets the keypairs it lacks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem_engine.fleet.adapters import AdapterRef
from tandem_engine.weights import WeightsRef

from tandem_operator import manifests as m
from tandem_operator.kube import parse_time
from tandem_operator.spec import ENGINE_GROUPS, GROUPS, Group, PoolSpec

# ---- what is observed ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PodView:
    """The facts about one of the pool's pods that planning needs."""

    name: str
    group: Group
    role: str = ""  # the engine role it runs (prefill, decode, mixed) or "router"
    template_hash: str = ""
    weights: WeightsRef | None = None
    epoch: int | None = None  # the weight epoch of `weights` (tandem.dev/weights-epoch)
    draft_uri: str | None = None  # the draft checkpoint loaded with them (tandem.dev/draft-uri)
    phase: str = "Pending"
    ready: bool = False
    deleting: bool = False
    draining_since: str | None = None
    ready_since: str = ""  # the Ready condition's lastTransitionTime, while ready
    created: str = ""
    ip: str | None = None
    uid: str = ""
    # the LoRA adapters its engine serves (tandem.dev/adapters); None: not annotated
    adapters: tuple[AdapterRef, ...] | None = None

    @property
    def failed(self) -> bool:
        # restartPolicy Always: a pod that ended at all will not serve again.
        return self.phase in ("Failed", "Succeeded")

    @property
    def live(self) -> bool:
        """Counts towards the group's replicas: not going away for any reason."""
        return not (self.deleting or self.failed or self.draining_since)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PodView | None:
        meta = body.get("metadata") or {}
        labels = meta.get("labels") or {}
        group = labels.get(m.COMPONENT_LABEL)
        if group not in GROUPS:
            return None
        ann = meta.get("annotations") or {}
        status = body.get("status") or {}
        condition = next((c for c in status.get("conditions") or ()
                          if c.get("type") == "Ready" and c.get("status") == "True"), None)
        ready = condition is not None
        weights = None
        if ann.get(m.WEIGHTS_VERSION) and ann.get(m.WEIGHTS_URI):
            weights = WeightsRef(uri=ann[m.WEIGHTS_URI], version=ann[m.WEIGHTS_VERSION])
        phase = status.get("phase") or "Pending"
        try:
            epoch = max(0, int(ann[m.WEIGHTS_EPOCH])) if m.WEIGHTS_EPOCH in ann else None
        except ValueError:
            epoch = None  # an annotation we did not write
        return cls(name=meta.get("name", ""), group=group, uid=meta.get("uid", ""),
                   role=labels.get(m.ROLE_LABEL, ""),
                   template_hash=ann.get(m.TEMPLATE_HASH, ""), weights=weights, epoch=epoch,
                   draft_uri=ann.get(m.DRAFT_URI) or None, phase=phase,
                   ready=ready and phase == "Running",
                   deleting=bool(meta.get("deletionTimestamp")),
                   draining_since=ann.get(m.DRAINING_SINCE) or None,
                   ready_since=str((condition or {}).get("lastTransitionTime") or ""),
                   created=meta.get("creationTimestamp") or "", ip=status.get("podIP") or None,
                   adapters=m.read_adapters_annotation(ann.get(m.ADAPTERS)))


@dataclass(frozen=True)
class Observed:
    """One observation of a pool: its pods, its other objects (by (kind, name)), the status it
    had, whether its weights are unreachable (checked when no engine runs yet), and the
    weights new engine pods load when a refit transaction decides them."""

    pods: tuple[PodView, ...] = ()
    objects: Mapping[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)
    previous: Mapping[str, Any] = field(default_factory=dict)
    weights_error: str | None = None
    pod_weights: WeightsRef | None = None
    monitoring_served: bool = False  # the cluster serves PodMonitors (prometheus-operator)
    now: float | None = None  # when it was observed (wall clock); None: every Ready pod counts
    # as available at once (rollout.minReadySeconds needs the clock)
    revisions: tuple[Mapping[str, Any], ...] = ()  # its ControllerRevisions (rollout.py)
    # the LoRA adapters new engine pods start with, when an adapter transaction decides
    # them (adapters.py); None: the spec's
    pod_adapters: tuple[AdapterRef, ...] | None = None

    def group(self, group: Group) -> list[PodView]:
        return [p for p in self.pods if p.group == group and not p.deleting]

    def engine_pods(self) -> list[PodView]:
        return [p for p in self.pods if p.group in ENGINE_GROUPS
                and not p.deleting and not p.failed]


# ---- the steps ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateObject:
    body: Mapping[str, Any]

    @property
    def kind(self) -> str:
        return self.body["kind"]

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]


@dataclass(frozen=True)
class CreateAdminSecret:
    """The token is generated when acting: plans stay deterministic."""

    name: str


@dataclass(frozen=True)
class AddCurveKeys:
    """Complete an existing credentials Secret with the ZMQ CURVE keypairs it lacks
    ("server", "client"); generated when acting, like the token."""

    name: str
    pairs: tuple[str, ...]


@dataclass(frozen=True)
class DeleteObject:
    """An object the spec no longer asks for (a NetworkPolicy once disabled)."""

    kind: str
    name: str


@dataclass(frozen=True)
class PatchObject:
    kind: str
    name: str
    patch: Mapping[str, Any]


@dataclass(frozen=True)
class CreatePod:
    group: Group
    body: Mapping[str, Any]
    reason: str  # ScaleUp | Replace | RollingUpdate


@dataclass(frozen=True)
class DrainPod:
    """Start (or continue) draining a pod, then delete it."""

    pod: PodView
    reason: str  # ScaleDown | RollingUpdate | Draining (already started)


@dataclass(frozen=True)
class DeletePod:
    pod: PodView
    reason: str  # Failed


Action = (CreateObject | CreateAdminSecret | AddCurveKeys | PatchObject | DeleteObject
          | CreatePod | DrainPod | DeletePod)
# The steps on the pool's objects (not its pods): reconcile takes them first.
OBJECT_ACTIONS = (CreateObject, CreateAdminSecret, AddCurveKeys, PatchObject, DeleteObject)


# ---- planning -----------------------------------------------------------------------------------


def serving_weights(spec: PoolSpec, observed: Observed) -> WeightsRef:
    """The weights new pods load: what most engines serve now; the spec's when none runs (or
    when the spec's ties for most), and when the spec's come from another volume (a new claim
    or model image: new pods mount it, and the pods roll instead of refitting)."""
    counts = Counter(p.weights for p in observed.engine_pods()
                     if p.weights is not None and p.weights.volume == spec.weights.volume)
    if not counts:
        return spec.weights
    most = max(counts.values())
    candidates = [w for w, n in counts.items() if n == most]
    if spec.weights in candidates:
        return spec.weights
    return min(candidates, key=lambda w: (w.version, w.uri))


def pod_epoch(observed: Observed, weights: WeightsRef) -> int:
    """The weight epoch new pods on `weights` start with: the one the pool's engines on those
    weights carry; else the pool-wide epoch in status."""
    epochs = [p.epoch for p in observed.engine_pods()
              if p.weights == weights and p.epoch is not None]
    if epochs:
        return max(epochs)
    return int((observed.previous.get("weights") or {}).get("epoch") or 0)


def scale_down_order(pods: list[PodView], refitting: frozenset[str] = frozenset()
                     ) -> list[PodView]:
    """Which pods to take first: not ready, then the newest (name breaks ties) — and engines
    a refit has out of service last (they are not ready for a moment, and draining one
    would keep its requests waiting for the drain timeout)."""
    return sorted(pods, key=lambda p: (p.name in refitting, p.ready, _neg(p.created),
                                       _neg(p.name)))


def refitting(observed: Observed) -> frozenset[str]:
    """Pods a refit transaction has taken out of service and not yet verified."""
    refit = observed.previous.get("refit") or {}
    if refit.get("phase") in ("Succeeded", "RolledBack", "Halted"):
        return frozenset()
    return frozenset(name for name, record in (refit.get("engines") or {}).items()
                     if isinstance(record, Mapping) and not record.get("verified"))


def deletion_drains(pods: list[PodView]) -> list[list[PodView]]:
    """The stages a deleted pool's engines drain in, each only once the one before is idle.

    A draining engine refuses every new submission, a decode engine's pull of a prompt
    prefilled elsewhere and a failover included: drained all at once, a request between its
    prefill and its decode engine would find no engine to continue on. So the engines that
    hand requests on (prefill, and mixed ones, which may prefill for others) go first, and
    finish with no KV left pinned for a pull; the decode engines go last (they hand nothing
    on: their requests end where they run). A pool of mixed engines only keeps its last one
    serving until the others are idle. Engines not running (no address, not Running, being
    deleted already) have nothing to drain."""
    engines = sorted((p for p in pods if p.group in ENGINE_GROUPS and p.ip and not p.deleting
                      and p.phase == "Running"), key=lambda p: p.name)
    last = [p for p in engines if p.role == "decode"] or engines[-1:]
    first = [p for p in engines if p not in last]
    return [stage for stage in (first, last) if stage]


def deletion_deadline(deletion_timestamp: str | None, drain_timeout_seconds: int,
                      now: float) -> float:
    """When a deleted pool's drain ends (wall clock): its drain timeout after the deletion
    (so an operator restarted mid-drain does not start the grace period over); from `now`
    when the timestamp is missing or not one the API server writes."""
    try:
        start = parse_time(deletion_timestamp or "").timestamp()
    except ValueError:
        start = now
    return start + drain_timeout_seconds


def _neg(s: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in s)


def plan(spec: PoolSpec, observed: Observed) -> list[Action]:
    if observed.weights_error is not None:
        return []  # nothing half-way: the pool waits for weights it can load
    actions: list[Action] = _plan_objects(spec, observed)
    weights = observed.pod_weights or serving_weights(spec, observed)
    epoch = pod_epoch(observed, weights)
    for group in GROUPS:
        actions += _plan_group(spec, group, observed, weights, epoch)
    return actions


def pod_adapters(spec: PoolSpec, observed: Observed) -> tuple[AdapterRef, ...]:
    """The adapters a new engine pod starts with: the adapter transaction's choice, else
    the spec's."""
    return observed.pod_adapters if observed.pod_adapters is not None else spec.adapters


def _plan_objects(spec: PoolSpec, observed: Observed) -> list[Action]:
    actions: list[Action] = []
    secret = m.admin_secret_name(spec.name)
    have_secret = observed.objects.get(("Secret", secret))
    if have_secret is None:
        actions.append(CreateAdminSecret(secret))
    elif pairs := m.missing_curve_pairs(dict(have_secret)):
        actions.append(AddCurveKeys(secret, pairs))
    desired = m.support_objects(spec)
    if observed.monitoring_served:
        desired += m.monitoring_objects(spec)
    wanted = {(body["kind"], body["metadata"]["name"]) for body in desired}
    optional = [*m.optional_objects(spec), *m.monitoring_names(spec)]
    actions += [DeleteObject(kind, name) for kind, name in optional
                if (kind, name) in observed.objects and (kind, name) not in wanted]
    for body in desired:
        have = observed.objects.get((body["kind"], body["metadata"]["name"]))
        if have is None:
            actions.append(CreateObject(body))
            continue
        patch = m.drift_patch(body, dict(have))
        if patch is not None:
            actions.append(PatchObject(body["kind"], body["metadata"]["name"], patch))
    return actions


def _ready(pods: list[PodView]) -> int:
    return sum(p.ready for p in pods)


def _available(pods: list[PodView], spec: PoolSpec, observed: Observed) -> int:
    """Ready pods that have been Ready for spec.rollout.minReadySeconds (one whose Ready
    time is unknown counts: it was ready before this operator looked)."""
    wait = spec.rollout.min_ready_seconds
    if observed.now is None or wait <= 0:
        return _ready(pods)

    def available(p: PodView) -> bool:
        if not p.ready or not p.ready_since:
            return p.ready
        try:
            return observed.now - parse_time(p.ready_since).timestamp() >= wait
        except ValueError:
            return True
    return sum(available(p) for p in pods)


def _partner_allows(spec: PoolSpec, group: Group, observed: Observed, old: list[PodView]
                    ) -> bool:
    """May ready pods of `group` leave now, as far as the other engine role is concerned?

    Mixed decode engines make way for decode-only ones only while a prefill engine is ready;
    prefill engines scaled to zero leave only once the decode engines run mixed."""
    if group == "decode" and any(p.role == "mixed" for p in old) \
            and spec.engine_role("decode") == "decode":
        return _ready([p for p in observed.group("prefill") if p.live]) >= 1
    if group == "prefill" and spec.prefill.replicas == 0:
        want = m.template_hash(spec, "decode")
        decode = [p for p in observed.group("decode") if p.live]
        return (_ready(decode) >= 1 and all(p.template_hash == want for p in decode))
    return True


def _create_reason(spec: PoolSpec, group: Group, observed: Observed, failed: bool,
                   rolling: bool, present: int) -> str:
    if failed:
        return "Replace"
    if rolling:
        return "RollingUpdate"
    previous = (observed.previous.get(group) or {}).get("replicas", 0)
    unchanged = observed.previous.get("observedGeneration") == spec.generation
    if unchanged and previous >= spec.replicas(group) > present:
        return "Replace"  # deleted out from under us
    return "ScaleUp"


def _plan_group(spec: PoolSpec, group: Group, observed: Observed, weights: WeightsRef,
                epoch: int) -> list[Action]:
    replicas = spec.replicas(group)
    surge, unavailable = spec.rollout.budget(replicas)
    want = m.template_hash(spec, group)
    mine = observed.group(group)
    failed = [p for p in mine if p.failed]
    draining = [p for p in mine if not p.failed and p.draining_since]
    live = [p for p in mine if p.live]
    new = [p for p in live if p.template_hash == want]
    old = [p for p in live if p.template_hash != want]

    actions: list[Action] = [DeletePod(p, "Failed") for p in failed]
    actions += [DrainPod(p, "Draining") for p in draining]
    reason = _create_reason(spec, group, observed, bool(failed), bool(old),
                            len(live) + len(draining))
    partner_ok = _partner_allows(spec, group, observed, old)

    def create(n: int) -> list[Action]:
        adapters = pod_adapters(spec, observed)
        return [CreatePod(group, m.pod(spec, group, weights, epoch, adapters), reason)
                for _ in range(n)]

    if not old:
        if len(new) < replicas:
            return actions + create(replicas - len(new))
        extra = scale_down_order(new, refitting(observed))[:len(new) - replicas]
        if not partner_ok:
            extra = [p for p in extra if not p.ready]
        return actions + [DrainPod(p, "ScaleDown") for p in extra]

    # A rollout: new pods up to replicas (+ surge), old ones out within the availability floor.
    floor = max(replicas - unavailable, 1) if replicas >= 1 else 0
    total = len(live) + len(draining)
    creates = max(0, min(replicas - len(new), replicas + surge - total))
    leaving = [p for p in old if not p.ready]  # costs no availability
    extra_new = scale_down_order(new, refitting(observed))[:max(0, len(new) - replicas)]
    budget = max(0, _available(live, spec, observed) - floor) if partner_ok else 0
    extra_new_ready = [p for p in extra_new if p.ready][:budget]
    budget -= len(extra_new_ready)
    leaving += [p for p in scale_down_order(old, refitting(observed)) if p.ready][:budget]
    removals = [*[p for p in extra_new if not p.ready], *extra_new_ready]
    stalled = (surge == 0 and creates == 0 and not leaving and not removals and not draining
               and len(new) < replicas and all(p.ready for p in new))
    if stalled:  # honour "never the last ready pod" by surging one pod instead
        creates = max(0, min(replicas - len(new), replicas + 1 - total))
    actions += create(creates)
    actions += [DrainPod(p, "ScaleDown") for p in removals]
    actions += [DrainPod(p, "RollingUpdate") for p in leaving]
    return actions


# ---- status -------------------------------------------------------------------------------------

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Refitting")
ADAPTER_CONDITION = "AdapterRefitting"  # with spec.engine.lora only

Condition = tuple[bool, str, str]  # status, reason, message


@dataclass(frozen=True)
class RefitReport:
    """What the pool's refit transaction says for status (built by `refit`): its record
    (`status.refit`), the Refitting condition, a Degraded one while a failed refit stands,
    and the version every engine serves once the transaction settled it."""

    record: Mapping[str, Any] | None  # None: status.refit stays as it was
    refitting: Condition
    degraded: Condition | None = None
    current: str | None = None


@dataclass(frozen=True)
class AdapterReport:
    """What the pool's adapter transaction says for status (built by `adapters`): its
    record (`status.adapterRefit`), the AdapterRefitting condition, a Degraded one while a
    failed change stands, each adapter's versions per role (`status.adapters`) and the
    kubectl column's text (`status.adapterSummary`)."""

    record: Mapping[str, Any]
    refitting: Condition
    degraded: Condition | None = None
    adapters: list[dict[str, str]] = field(default_factory=list)
    summary: str = ""


@dataclass(frozen=True)
class RolloutReport:
    """What the pod-template rollout says for status (built by `rollout`): its record
    (`status.rollout`) and, once it missed its progress deadline, the Progressing
    condition."""

    record: Mapping[str, Any]
    progressing: Condition | None = None  # None: as the pods say


def condition(previous: Mapping[str, Any], type_: str, status: bool, reason: str,
              message: str, generation: int, now: str) -> dict[str, Any]:
    """A condition whose lastTransitionTime moves only when its status does."""
    value = "True" if status else "False"
    before = next((c for c in previous.get("conditions") or () if c.get("type") == type_), None)
    since = now
    if before is not None and before.get("status") == value and before.get("lastTransitionTime"):
        since = before["lastTransitionTime"]
    return {"type": type_, "status": value, "reason": reason, "message": message[:4000],
            "observedGeneration": generation, "lastTransitionTime": since}


def group_status(spec: PoolSpec, group: Group, observed: Observed) -> dict[str, int]:
    pods = [p for p in observed.group(group) if not p.failed]
    want = m.template_hash(spec, group)
    return {"replicas": len(pods), "ready": _ready(pods),
            "updated": sum(p.template_hash == want for p in pods)}


def updated_ready(spec: PoolSpec, observed: Observed) -> dict[Group, int]:
    """Per group, the pods on the spec's template that are ready and staying: a rollout's
    progress."""
    want = {g: m.template_hash(spec, g) for g in GROUPS}
    return {g: sum(p.ready and p.live and p.template_hash == want[g] for p in observed.group(g))
            for g in GROUPS}


def current_version(observed: Observed) -> str:
    """The weights version every engine serves; empty when they differ or none runs."""
    versions = {p.weights.version if p.weights else "" for p in observed.engine_pods()}
    return versions.pop() if len(versions) == 1 else ""


def _counts(groups: Mapping[str, Mapping[str, int]], spec: PoolSpec, key: str) -> str:
    return ", ".join(f"{g} {groups[g][key]}/{spec.replicas(g)}" for g in GROUPS)


def status(spec: PoolSpec, observed: Observed, *, now: str, errors: tuple[str, ...] = (),
           refit: RefitReport | None = None, rollout: RolloutReport | None = None,
           adapters: AdapterReport | None = None) -> dict[str, Any]:
    """The status block for this observation (plus the errors met acting on it, and what the
    refit transaction, the adapter transaction and the rollout, if any, report)."""
    prev, gen = observed.previous, spec.generation
    groups = {g: group_status(spec, g, observed) for g in GROUPS}
    current = current_version(observed)
    if refit is not None and refit.current is not None:
        current = refit.current
    failed = [p.name for p in observed.pods if p.failed and not p.deleting]

    degraded: Condition
    if observed.weights_error is not None:
        degraded = (True, "WeightsUnreachable", observed.weights_error)
    elif errors:
        degraded = (True, "ApplyFailed", "; ".join(errors))
    elif refit is not None and refit.degraded is not None:
        degraded = refit.degraded
    elif adapters is not None and adapters.degraded is not None:
        degraded = adapters.degraded
    elif failed:
        degraded = (True, "PodFailed", f"pods failed and are being replaced: "
                                       f"{', '.join(sorted(failed))}")
    else:
        degraded = (False, "AsExpected", "every step of the last reconcile succeeded")

    missing = [g for g in GROUPS if spec.replicas(g) > 0 and groups[g]["ready"] == 0]
    if observed.weights_error is not None:
        ready = (False, "WeightsUnreachable", observed.weights_error)
    elif missing:
        ready = (False, f"{missing[0].capitalize()}NotReady",
                 f"no ready {' or '.join(missing)} pod; ready: {_counts(groups, spec, 'ready')}")
    else:
        ready = (True, "Serving", f"serving {spec.model_name} at {m.router_endpoint(spec)}; "
                                  f"ready: {_counts(groups, spec, 'ready')}")

    outdated = any(groups[g]["updated"] < groups[g]["replicas"] for g in GROUPS)
    draining = any(p.draining_since for p in observed.pods if not p.deleting and not p.failed)
    if observed.weights_error is not None:
        progressing = (False, "WeightsUnreachable", "waiting for a spec with loadable weights")
    elif outdated:
        progressing = (True, "RollingUpdate", f"updated: {_counts(groups, spec, 'updated')}")
    elif failed:
        progressing = (True, "Replacing", f"replacing failed pods: {', '.join(sorted(failed))}")
    elif any(groups[g]["replicas"] < spec.replicas(g) for g in GROUPS):
        progressing = (True, "ScalingUp", f"pods: {_counts(groups, spec, 'replicas')}")
    elif draining or any(groups[g]["replicas"] > spec.replicas(g) for g in GROUPS):
        progressing = (True, "ScalingDown", f"pods: {_counts(groups, spec, 'replicas')}")
    elif refit is not None and refit.refitting[0]:  # engines leave service while they refit
        progressing = (True, "Refitting", f"refit under way; ready: "
                                          f"{_counts(groups, spec, 'ready')}")
    elif any(groups[g]["ready"] < spec.replicas(g) for g in GROUPS):
        progressing = (True, "PodsStarting", f"ready: {_counts(groups, spec, 'ready')}")
    else:
        progressing = (False, "Complete", f"every pod is updated and ready: "
                                          f"{_counts(groups, spec, 'ready')}")
    if rollout is not None and rollout.progressing is not None \
            and observed.weights_error is None:
        progressing = rollout.progressing  # past its deadline: failed, rolled back or halted

    target = spec.weights.version
    refitting: Condition
    if refit is not None:
        refitting = refit.refitting
    elif not observed.engine_pods():
        refitting = (False, "NoEngines", f"no engine runs yet; new engines load {target}")
    elif current == target:
        refitting = (False, "WeightsCurrent", f"every engine serves {target}")
    else:
        refitting = (False, "RefitPending", f"weights {target} requested; engines serve "
                                            f"{current or 'mixed versions'}")

    conditions = [condition(prev, t, *c, gen, now) for t, c in zip(
        CONDITION_TYPES, (ready, progressing, degraded, refitting), strict=True)]
    if adapters is not None:  # pools whose engines serve LoRA adapters (spec.engine.lora)
        conditions.append(condition(prev, ADAPTER_CONDITION, *adapters.refitting, gen, now))
    # The epoch new engines start with: that of the weights they load.
    epoch = pod_epoch(observed, observed.pod_weights or serving_weights(spec, observed))
    out = {"observedGeneration": gen, "conditions": conditions, **groups,
           "weights": {"current": current, "target": target, "epoch": epoch},
           "routerEndpoint": m.router_endpoint(spec), "selector": m.scale_selector(spec)}
    if refit is not None and refit.record is not None:
        out["refit"] = dict(refit.record)
    elif "refit" in prev:
        out["refit"] = prev["refit"]
    if adapters is not None:
        out["adapterRefit"] = dict(adapters.record)
        out["adapters"] = list(adapters.adapters)
        out["adapterSummary"] = adapters.summary
    else:  # the kubectl column says it (an empty cell would shift the row's words)
        out["adapterSummary"] = "none"
        if "adapterRefit" in prev:
            out["adapterRefit"] = prev["adapterRefit"]
    if rollout is not None:
        out["rollout"] = dict(rollout.record)
    elif "rollout" in prev:
        out["rollout"] = prev["rollout"]
    return out


def invalid_status(previous: Mapping[str, Any], generation: int, message: str, now: str
                   ) -> dict[str, Any]:
    """The status of a pool whose spec the operator cannot parse (nothing is acted on)."""
    reason = "InvalidSpec"
    conditions = [
        condition(previous, "Ready", False, reason, message, generation, now),
        condition(previous, "Progressing", False, reason, "waiting for a valid spec",
                  generation, now),
        condition(previous, "Degraded", True, reason, message, generation, now),
        condition(previous, "Refitting", False, reason, "waiting for a valid spec",
                  generation, now)]
    return {**previous, "observedGeneration": generation, "conditions": conditions}
