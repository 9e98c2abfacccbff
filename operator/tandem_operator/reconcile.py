"""One idempotent pass over one pool: observe -> refit -> plan -> act (one batch of steps) ->
status.

Level-triggered: every call starts from what the cluster says, never from memory, so the
operator may be killed and restarted at any moment and the next pass picks up where the last
one left. Even a drain keeps its progress in the cluster (the pod's `tandem.dev/draining-since`
annotation, whose time bounds the drain); the asyncio task polling the engine is only the
in-memory half, started again after a restart. A refit keeps its transaction in
`status.refit`: each pass takes one round of engine steps (`refit`) and asks to be run again
soon while the transaction lasts. A spec the schema accepts but the operator cannot serve
(weights it cannot find at first load) creates nothing and says why in the `Degraded`
condition.

What a pass observes comes from kopf's watches when the handlers pass them in (`Watched`) and
they show the operator's own last writes; otherwise (and without kopf) it lists and reads the
pool's pods and objects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq
from tandem_engine.fleet import AdminError, EngineAdmin, admin_url
from tandem_engine.weights import CHECKPOINT_FORMS, WeightsRef, checkpoint_problem

from tandem_operator import manifests as m
from tandem_operator import metrics, rollout
from tandem_operator.adapters import AdapterPass, adapter_pass
from tandem_operator.autoscaler import Autoscalers, ScalePass
from tandem_operator.kube import POOL_OBJECT_KINDS, Kube, KubeError, now, parse_time
from tandem_operator.plan import (
    OBJECT_ACTIONS,
    Action,
    AddCurveKeys,
    CreateAdminSecret,
    CreateObject,
    CreatePod,
    DeleteObject,
    DeletePod,
    DrainPod,
    Observed,
    PatchObject,
    PodView,
    deletion_deadline,
    deletion_drains,
    invalid_status,
    plan,
    status,
)
from tandem_operator.refit import REQUEUE_SECONDS, FleetClients, RefitPass, refit_pass
from tandem_operator.rollout import REVISION_KIND, RolloutStep
from tandem_operator.spec import ENGINE_GROUPS, PoolSpec, SpecError

log = logging.getLogger("tandem_operator.reconcile")

_EVENT_REASONS = {"ScaleUp": "Created", "Replace": "Replaced", "RollingUpdate": "RollingUpdate"}


@dataclass
class Drains:
    """The engine drains in flight in this process, by pod uid (their state is in the pods)."""

    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def start(self, key: str, work: Awaitable[None]) -> None:
        if key in self.tasks:
            return

        async def run() -> None:
            try:
                await work
            finally:
                self.tasks.pop(key, None)

        self.tasks[key] = asyncio.get_running_loop().create_task(run(), name=f"drain {key}")

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Context:
    """What a reconcile needs besides the pool: clients and operator-wide settings."""

    kube: Kube
    check_weights: bool = True  # look for the weights (folder or .gguf) before the first pods
    drains: Drains = field(default_factory=Drains)
    fleet: FleetClients = field(default_factory=FleetClients)  # admin calls to the engines
    autoscalers: Autoscalers = field(default_factory=Autoscalers)  # spec.autoscaling's planner


@dataclass(frozen=True)
class Watched:
    """One pool's pods and objects as kopf's watches have them (the operator's indexes)."""

    pods: tuple[Mapping[str, Any], ...] = ()
    objects: Mapping[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    actions: tuple[Action, ...] = ()
    errors: tuple[str, ...] = ()
    status: Mapping[str, Any] = field(default_factory=dict)
    requeue_after: float | None = None  # reconcile again this soon (a refit under way)


def curve_keys(pairs: tuple[str, ...]) -> dict[str, str]:
    """New ZMQ CURVE keypairs for `pairs` ("server", "client"), as `manifests.CURVE_KEYS`
    names -> Z85 text."""
    keys: dict[str, str] = {}
    for pair in pairs:
        public, secret = zmq.curve_keypair()
        public_key, secret_key = m.CURVE_KEYS[pair]
        keys[public_key], keys[secret_key] = public.decode(), secret.decode()
    return keys


def weights_problem(weights: WeightsRef) -> str | None:
    """Why the operator cannot serve these weights, or None when it can. Only `file://`
    weights are looked for: a claim or a model image is mounted in the pods, not here."""
    if weights.volume is not None:
        return None
    problem = checkpoint_problem(weights.path)
    if problem is not None:
        return (f"weights {weights.version} at {weights.uri}: {problem} on the operator's "
                f"filesystem; point spec.model.weights.uri at {CHECKPOINT_FORMS}")
    return None


def _name(body: Mapping[str, Any]) -> str:
    return str((body.get("metadata") or {}).get("name") or "")


def _owned(body: Mapping[str, Any], uid: str) -> bool:
    refs = (body.get("metadata") or {}).get("ownerReferences") or ()
    return not uid or any(r.get("uid") == uid and r.get("controller") for r in refs)


async def observe(ctx: Context, spec: PoolSpec, pool: Mapping[str, Any],
                  watched: Watched | None = None) -> Observed:
    ns, kinds = spec.namespace, ("Pod", *POOL_OBJECT_KINDS)
    wanted = [("Secret", m.admin_secret_name(spec.name)),
              *((o["kind"], o["metadata"]["name"]) for o in m.support_objects(spec))]
    wanted += [key for key in m.optional_objects(spec) if key not in wanted]
    pods: list[Mapping[str, Any]] | None = None
    bodies: Mapping[tuple[str, str], Mapping[str, Any]] = {}
    if watched is not None:
        seen = {**{("Pod", _name(p)): p for p in watched.pods}, **watched.objects}
        behind = ctx.kube.writes.missing(ns, spec.name, kinds, seen)
        if behind:
            log.debug("%s/%s: the watches do not show %s yet; reading the cluster", ns,
                      spec.name, ", ".join(behind))
        else:
            pods, bodies = list(watched.pods), watched.objects
    if pods is None:
        pods = await ctx.kube.list("Pod", ns, {m.POOL_LABEL: spec.name})
        found = await asyncio.gather(*(ctx.kube.get(kind, ns, name) for kind, name in wanted))
        revisions = await ctx.kube.list(REVISION_KIND, ns, {m.POOL_LABEL: spec.name})
        bodies = {**{key: body for key, body in zip(wanted, found, strict=True)
                     if body is not None},
                  **{(REVISION_KIND, _name(r)): r for r in revisions}}
        if watched is not None:
            ctx.kube.writes.forget_gone(ns, spec.name, kinds,
                                        {**{("Pod", _name(p)): p for p in pods}, **bodies})
    views = tuple(v for p in pods if _owned(p, spec.uid)
                  if (v := PodView.from_body(p)) is not None)
    objects = {key: bodies[key] for key in wanted
               if key in bodies and _owned(bodies[key], spec.uid)}
    # Monitoring objects are read directly: their kinds exist only in some clusters, so the
    # operator does not watch them.
    monitoring = await ctx.kube.serves("PodMonitor")
    if monitoring:
        for kind, name in m.monitoring_names(spec):
            body = await ctx.kube.get(kind, ns, name)
            if body is not None and _owned(body, spec.uid):
                objects[(kind, name)] = body
    engines_run = any(v.group in ENGINE_GROUPS and not v.deleting and not v.failed
                      for v in views)
    problem = None
    if ctx.check_weights and not engines_run:
        problem = await asyncio.to_thread(weights_problem, spec.weights)
    return Observed(pods=views, objects=objects, previous=pool.get("status") or {},
                    weights_error=problem, monitoring_served=monitoring, now=time.time(),
                    revisions=tuple(body for (kind, _), body in bodies.items()
                                    if kind == REVISION_KIND and _owned(body, spec.uid)))


async def reconcile(pool: Mapping[str, Any], ctx: Context, watched: Watched | None = None
                    ) -> Outcome:
    """Bring one pool one step closer to its spec and write what was observed to status.
    `watched`: the pool's pods and objects from kopf's watches (None: read the cluster)."""
    meta = pool.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return Outcome()  # the finalizer drains; garbage collection removes the rest
    started = time.monotonic()
    metrics.RECONCILES.inc()
    previous = pool.get("status") or {}
    try:
        spec = PoolSpec.from_body(pool)
    except SpecError as exc:
        new = invalid_status(previous, int(meta.get("generation") or 0), str(exc), now())
        metrics.RECONCILE_ERRORS.inc()
        try:
            await _write_status(ctx, pool, previous, new)
        except KubeError as write_error:
            return Outcome(errors=(str(exc), f"status: {write_error}"), status=new)
        return Outcome(errors=(str(exc),), status=new)
    try:
        observed = await observe(ctx, spec, pool, watched)
    except KubeError as exc:
        metrics.RECONCILE_ERRORS.inc()
        log.warning("%s/%s: cannot observe the pool: %s", spec.namespace, spec.name, exc)
        return Outcome(errors=(str(exc),))
    refit = await _refit(ctx, spec, pool, observed)
    if refit.pod_weights is not None:
        observed = dataclasses.replace(observed, pod_weights=refit.pod_weights)
    changing = await _adapters(ctx, spec, pool, observed, refit.running)
    if changing.pod_adapters is not None:
        observed = dataclasses.replace(observed, pod_adapters=changing.pod_adapters)
    scaled, scale_errors = await _autoscale(ctx, spec, observed, refit.running)
    if scaled.targets and not scale_errors:
        try:
            pool, spec = await _rescale(ctx, spec, pool, scaled)
        except (KubeError, SpecError) as exc:
            scale_errors = [f"autoscaling: replicas not written: {exc}"]
    # While a failed rollout is rolled back, pods follow the last good template (rollout.py).
    rolled, rollout_errors = await _rollout(ctx, spec, pool, observed)
    effective = rolled.effective
    actions = plan(effective, observed)
    errors = await act(ctx, effective, pool, actions) + rollout_errors
    errors += refit.errors + changing.errors + scale_errors
    new = status(effective, observed, now=now(), errors=tuple(errors), refit=refit.report,
                 rollout=rolled.report, adapters=changing.report)
    if spec.autoscaling is not None:
        block = scaled.status if scaled.status is not None else previous.get("autoscaling")
        if block is not None:
            new["autoscaling"] = block
    try:
        await _write_status(ctx, pool, previous, new)
    except KubeError as exc:
        errors.append(f"status: {exc}")
    if errors:
        metrics.RECONCILE_ERRORS.inc()
    metrics.record_pods(spec.namespace, spec.name,
                        ((p.group, p.phase) for p in observed.pods if not p.deleting))
    metrics.record_pool_engines(spec.namespace, spec.name, metrics.pool_engines(spec, observed))
    metrics.record_conditions(spec.namespace, spec.name, new.get("conditions") or ())
    metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    soon = [t for t in (REQUEUE_SECONDS if refit.running or changing.running else None,
                        scaled.next_in) if t is not None]
    return Outcome(tuple(actions), tuple(errors), new, min(soon) if soon else None)


async def _autoscale(ctx: Context, spec: PoolSpec, observed: Observed, refit: bool
                     ) -> tuple[ScalePass, list[str]]:
    """One pass of the pool's planner (reads its metrics when due); never raises."""
    try:
        return await ctx.autoscalers.run(spec, observed, refit), []
    except Exception as exc:  # a bug in the planner must not stop the pool's other steps
        log.exception("%s/%s: autoscaling pass failed", spec.namespace, spec.name)
        return ScalePass(), [f"autoscaling: {type(exc).__name__}: {exc}"]


async def _rescale(ctx: Context, spec: PoolSpec, pool: Mapping[str, Any], scaled: ScalePass
                   ) -> tuple[Mapping[str, Any], PoolSpec]:
    """Write the planner's replicas into the pool's spec (as an HPA writes a Deployment's)
    and post its events; the pool as it is now and its spec."""
    patch = {"spec": {role: {"replicas": n} for role, n in scaled.targets.items()}}
    patched = await ctx.kube.patch("InferencePool", spec.namespace, spec.name, patch)
    for reason, message in scaled.events:
        await _event(ctx, patched, reason, message)
    return patched, PoolSpec.from_body(patched)


async def _rollout(ctx: Context, spec: PoolSpec, pool: Mapping[str, Any], observed: Observed
                   ) -> tuple[RolloutStep, list[str]]:
    """The rollout's pass (`rollout.step`): its revisions written (the spec's template as
    the newest, the oldest past the history limit deleted) and its Event posted; what failed
    is retried by the next pass."""
    decided = rollout.step(spec, pool, observed, now())
    kept, ns, errors = decided.history, spec.namespace, []
    try:
        if kept.create is not None:
            try:
                await ctx.kube.create(kept.create)
            except KubeError as exc:
                if exc.status != 409:  # 409: written already (a watch behind our writes)
                    raise
        if kept.renumber is not None:
            name, number = kept.renumber
            await ctx.kube.patch(REVISION_KIND, ns, name, {"revision": number})
        for name in kept.trim:
            await ctx.kube.delete(REVISION_KIND, ns, name)
    except KubeError as exc:
        errors.append(f"revision history: {exc}")
    if decided.event is not None:
        await _event(ctx, pool, *decided.event, "Warning")
    return decided, errors


Pass = TypeVar("Pass", RefitPass, AdapterPass)


async def _transaction(ctx: Context, spec: PoolSpec, pool: Mapping[str, Any], what: str,
                       step: Awaitable[Pass], failed: Callable[[list[str]], Pass]) -> Pass:
    """One pass of one of the pool's transactions (the refit's, the adapters'), its events
    posted; never raises: a bug in one pass must not stop the pool's other steps."""
    try:
        result = await step
    except Exception as exc:
        log.exception("%s/%s: %s pass failed", spec.namespace, spec.name, what)
        return failed([f"{what}: {type(exc).__name__}: {exc}"])
    for event in result.events:
        await _event(ctx, pool, event.reason, event.message,
                     "Warning" if event.warning else "Normal")
    return result


async def _refit(ctx: Context, spec: PoolSpec, pool: Mapping[str, Any], observed: Observed
                 ) -> RefitPass:
    return await _transaction(ctx, spec, pool, "refit",
                              refit_pass(ctx.kube, ctx.fleet, spec, observed),
                              lambda errors: RefitPass(errors=errors))


async def _adapters(ctx: Context, spec: PoolSpec, pool: Mapping[str, Any], observed: Observed,
                    weights_refitting: bool) -> AdapterPass:
    return await _transaction(ctx, spec, pool, "adapters",
                              adapter_pass(ctx.kube, ctx.fleet, spec, observed,
                                           weights_refitting),
                              lambda errors: AdapterPass(errors=errors))


# ---- acting -------------------------------------------------------------------------------------


async def act(ctx: Context, spec: PoolSpec, pool: Mapping[str, Any], actions: list[Action]
              ) -> list[str]:
    """Carry out one batch: objects first (pods need the Secret and the ServiceAccount), then
    every pod step at once. Returns the errors met; nothing raises."""
    objects = [a for a in actions if isinstance(a, OBJECT_ACTIONS)]
    pods = [a for a in actions if not isinstance(a, OBJECT_ACTIONS)]
    errors: list[str] = []
    created: list[str] = []
    for batch in (objects, pods):
        results = await asyncio.gather(*(_act(ctx, spec, pool, a) for a in batch),
                                       return_exceptions=True)
        for action, result in zip(batch, results, strict=True):
            metrics.ACTIONS.labels(type(action).__name__).inc()
            if isinstance(result, BaseException):
                if not isinstance(result, KubeError | AdminError):
                    log.error("%s/%s: %s failed", spec.namespace, spec.name, action,
                              exc_info=result)
                errors.append(f"{_describe(action)}: {result}")
            elif isinstance(action, CreateObject | CreateAdminSecret):
                created.append(_describe(action).removeprefix("create "))
        if created:  # one event for the pool's plumbing; the pods get one each
            await _event(ctx, pool, "Created", f"created {', '.join(created)}")
            created = []
    return errors


def _describe(action: Action) -> str:
    if isinstance(action, CreatePod):
        return f"create {action.group} pod"
    if isinstance(action, DrainPod | DeletePod):
        return f"{type(action).__name__.removesuffix('Pod').lower()} pod {action.pod.name}"
    if isinstance(action, CreateObject):
        return f"create {action.kind} {action.name}"
    if isinstance(action, CreateAdminSecret):
        return f"create Secret {action.name}"
    if isinstance(action, AddCurveKeys):
        return f"add ZMQ keys to Secret {action.name}"
    if isinstance(action, DeleteObject):
        return f"delete {action.kind} {action.name}"
    return f"patch {action.kind} {action.name}"


async def _act(ctx: Context, spec: PoolSpec, pool: Mapping[str, Any], action: Action) -> None:
    kube, ns = ctx.kube, spec.namespace
    if isinstance(action, CreateObject):
        await kube.create(action.body)
    elif isinstance(action, CreateAdminSecret):
        await kube.create(m.admin_secret(spec, secrets.token_urlsafe(32),
                                         curve_keys(tuple(m.CURVE_KEYS))))
    elif isinstance(action, AddCurveKeys):
        await kube.patch("Secret", ns, action.name,
                         {"data": m.curve_keys_data(curve_keys(action.pairs))})
        await _event(ctx, pool, "Updated", f"added ZMQ CURVE keys ({', '.join(action.pairs)}) "
                     f"to Secret {action.name}")
    elif isinstance(action, DeleteObject):
        if await kube.delete(action.kind, ns, action.name):
            await _event(ctx, pool, "Deleted", f"deleted {action.kind} {action.name} (no "
                         "longer in the spec)")
    elif isinstance(action, PatchObject):
        await kube.patch(action.kind, ns, action.name, action.patch)
        await _event(ctx, pool, "Updated", f"updated {action.kind} {action.name} to the spec")
    elif isinstance(action, CreatePod):
        created = await kube.create(action.body)
        name = (created.get("metadata") or {}).get("name", "?")
        what = {"ScaleUp": "", "Replace": " to replace a missing or failed pod",
                "RollingUpdate": " on the new pod template"}[action.reason]
        await _event(ctx, pool, _EVENT_REASONS[action.reason],
                     f"created {action.group} pod {name}{what}")
    elif isinstance(action, DeletePod):
        await kube.delete("Pod", ns, action.pod.name, uid=action.pod.uid or None)
        await _event(ctx, pool, "Deleted",
                     f"deleted {action.pod.group} pod {action.pod.name} ({action.pod.phase}); "
                     "a replacement follows")
    elif isinstance(action, DrainPod):
        await _start_drain(ctx, spec, pool, action)


async def _event(ctx: Context, pool: Mapping[str, Any], reason: str, message: str,
                 type_: str = "Normal") -> None:
    meta = pool.get("metadata") or {}
    log.log(logging.WARNING if type_ == "Warning" else logging.INFO, "%s/%s: %s: %s",
            meta.get("namespace"), meta.get("name"), reason, message)
    try:
        await ctx.kube.event(pool, reason, message, type_)
    except KubeError as exc:  # an event is worth a log line, never a failed step
        log.warning("event %s (%s) not posted: %s", reason, message, exc)


# ---- drains -------------------------------------------------------------------------------------


async def _start_drain(ctx: Context, spec: PoolSpec, pool: Mapping[str, Any], action: DrainPod
                       ) -> None:
    pod = action.pod
    since = pod.draining_since
    if since is None:
        since = now()
        await ctx.kube.annotate("Pod", spec.namespace, pod.name, {m.DRAINING_SINCE: since})
        why = "scale down" if action.reason == "ScaleDown" else "rolling update"
        await _event(ctx, pool, "Draining",
                     f"draining {pod.group} pod {pod.name} ({why}, at most "
                     f"{spec.refit.drain_timeout_seconds} s)")
    try:
        deadline = parse_time(since).timestamp() + spec.refit.drain_timeout_seconds
    except ValueError:
        deadline = time.time()  # an annotation we did not write: do not wait on it
    ctx.drains.start(pod.uid or f"{spec.namespace}/{pod.name}",
                     _drain_then_delete(ctx, spec, pool, pod, deadline))


async def _admin(ctx: Context, spec: PoolSpec) -> EngineAdmin:
    """The pool's engine admin client, with the token from its Secret."""
    secret = await ctx.kube.get("Secret", spec.namespace, m.admin_secret_name(spec.name))
    token = m.secret_token(secret) if secret else None
    return await ctx.fleet.admin(spec.namespace, spec.name, token)


async def _drain_then_delete(ctx: Context, spec: PoolSpec, pool: Mapping[str, Any],
                             pod: PodView, deadline: float) -> None:
    outcome, note = "skipped", "it ran no engine"
    remaining = deadline - time.time()
    if pod.group != "router" and pod.ip and pod.phase == "Running" and remaining > 0:
        try:
            admin = await _admin(ctx, spec)
            result = await admin.drain(pod.name, admin_url(pod.ip, m.ENGINE_ADMIN_PORT),
                                       remaining)
            if not result.supported:
                outcome, note = "delegated", "the engine drains itself on SIGTERM"
            elif result.drained:
                outcome, note = "drained", f"drained in {result.seconds:.1f} s"
            else:
                outcome = "timeout"
                note = (f"drain timed out with {result.num_running} running, "
                        f"{result.num_waiting} waiting")
        except (AdminError, KubeError) as exc:
            outcome, note = "failed", f"admin API: {exc}"
    elif pod.group != "router" and remaining <= 0:
        outcome, note = "timeout", "drain timed out"
    try:
        if await ctx.kube.delete("Pod", spec.namespace, pod.name, uid=pod.uid or None):
            await _event(ctx, pool, "Deleted", f"deleted {pod.group} pod {pod.name} ({note})")
    except KubeError as exc:
        log.warning("%s/%s: pod %s not deleted after its drain: %s", spec.namespace, spec.name,
                    pod.name, exc)
        outcome = "failed"
    metrics.DRAINS.labels(outcome).inc()


async def drain_pool(pool: Mapping[str, Any], ctx: Context) -> None:
    """Before a deleted pool's pods go: every engine stops admitting new requests and the
    ones in flight finish, within the pool's `refit.drainTimeoutSeconds` counted from the
    deletion (the grace period; the engines' `--shutdown-grace` and the pods'
    terminationGracePeriodSeconds derive from the same field). The engines drain in the
    stages of `plan.deletion_drains`, so that a request between its prefill and its decode
    engine always finds one that admits it. Then the finalizer lets garbage collection
    remove the pods: the routers, whose streams have ended, with them.

    Raises KubeError when the pool's pods or Secret cannot be read (the handler retries
    until the grace period is over). An engine that does not answer has nothing left to
    wait for."""
    try:
        spec = PoolSpec.from_body(pool)
    except SpecError:
        return
    meta = pool.get("metadata") or {}
    deadline = deletion_deadline(meta.get("deletionTimestamp"),
                                 spec.refit.drain_timeout_seconds, time.time())
    pods = await ctx.kube.list("Pod", spec.namespace, {m.POOL_LABEL: spec.name})
    views = [v for p in pods if _owned(p, spec.uid) if (v := PodView.from_body(p)) is not None]
    stages = deletion_drains(views)
    if not stages:
        return
    secret = await ctx.kube.get("Secret", spec.namespace, m.admin_secret_name(spec.name))
    # Its own client: the pool's daemon, stopping now, closes the pool's shared one.
    admin = EngineAdmin(m.secret_token(secret) if secret else None)
    started, left = time.monotonic(), []
    try:
        names = " then ".join(", ".join(v.name for v in stage) for stage in stages)
        await _event(ctx, pool, "Draining",
                     f"pool deleted: draining its engines ({names}) so that requests in "
                     f"flight finish, for at most {max(0.0, deadline - time.time()):.0f} s "
                     f"more (refit.drainTimeoutSeconds {spec.refit.drain_timeout_seconds})")
        for i, stage in enumerate(stages):
            hands_on = i < len(stages) - 1  # its handoffs must be done before the next goes
            results = await asyncio.gather(*(
                admin.drain(v.name, admin_url(v.ip or "", m.ENGINE_ADMIN_PORT),
                            max(0.0, deadline - time.time()), pins=hands_on)
                for v in stage), return_exceptions=True)
            for v, r in zip(stage, results, strict=True):
                if isinstance(r, AdminError):
                    log.info("%s/%s: drain of %s: %s", spec.namespace, spec.name, v.name, r)
                    metrics.DRAINS.labels("failed").inc()
                    continue
                if isinstance(r, BaseException):
                    raise r
                if r.supported and not r.drained:
                    left.append(f"{v.name} ({r.num_running} running, {r.num_waiting} "
                                f"waiting, {r.pinned_blocks} KV blocks pinned)")
                metrics.DRAINS.labels("delegated" if not r.supported else "drained"
                                      if r.drained else "timeout").inc()
    finally:
        await admin.close()
    took = time.monotonic() - started
    if left:
        await _event(ctx, pool, "DrainTimedOut",
                     f"pool deleted: the grace period ended after {took:.1f} s with "
                     f"{'; '.join(left)}; the pods go now (each engine's SIGTERM grace "
                     "then finishes or aborts what is left)", "Warning")
    else:
        await _event(ctx, pool, "Drained", f"pool deleted: every engine drained in "
                     f"{took:.1f} s; the pods go now")


# ---- status -------------------------------------------------------------------------------------


def _degraded(st: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((c for c in st.get("conditions") or () if c.get("type") == "Degraded"), None)


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The RFC 7386 merge patch that turns `old` into `new`: changed values, null for keys
    that went away (a refit's engine records do), nothing for what is equal."""
    patch: dict[str, Any] = {key: None for key in old.keys() - new.keys()}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            sub = merge_patch(before, value)
            if sub:
                patch[key] = sub
        elif key not in old or before != value:
            patch[key] = value
    return patch


async def _write_status(ctx: Context, pool: Mapping[str, Any], previous: Mapping[str, Any],
                        new: Mapping[str, Any]) -> None:
    patch = merge_patch(previous, new)
    if not patch:
        return  # unchanged: no write, no watch event, no reconcile storm
    meta = pool.get("metadata") or {}
    await ctx.kube.patch_pool_status(meta["namespace"], meta["name"], patch)
    before, after = _degraded(previous), _degraded(new)
    if after and after["status"] == "True" and (
            not before or before.get("status") != "True"
            or before.get("reason") != after["reason"]):
        await _event(ctx, pool, "Degraded", f"{after['reason']}: {after['message']}", "Warning")
    elif before and before.get("status") == "True" and after and after["status"] != "True":
        await _event(ctx, pool, "Recovered", "the pool is no longer degraded")
