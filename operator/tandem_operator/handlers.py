"""The kopf wiring: thin handlers that only decide *when* a pool is reconciled, and the
watches that tell a reconcile what the pool has.

One daemon per pool owns that pool's reconciles, so two never run at once for one pool. It
reconciles, then sleeps until woken or until the resync interval passes (sooner while a refit
runs: the reconcile asks for it). Everything else only wakes it: the pool's
create/update/resume handlers and any event on a pod or object labelled with the pool's name.
A burst of events while a reconcile runs costs one more reconcile, not one each. Deleting a
pool stops its daemon; the finalizer (the delete handler) drains the engines until the
requests in flight have finished or the pool's drain timeout has passed, then garbage
collection removes the pods.

kopf watches the pools' pods and objects (server-side filtered by the pool label) into two
indexes, and hands the daemon the pool's live body: a steady pool is reconciled without a
single API call. The reconcile falls back to reading the cluster while a watch does not show
the operator's own last writes yet (`kube.Writes`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import kopf
from tandem_engine.refit_policy import DEFAULT_DRAIN_TIMEOUT_S

from tandem_operator import metrics
from tandem_operator.autoscaler import Autoscalers, PodReader, PrometheusReader
from tandem_operator.kube import KINDS, POOL_OBJECT_KINDS, Kube, KubeError, login_credentials
from tandem_operator.manifests import POOL_LABEL
from tandem_operator.plan import deletion_deadline
from tandem_operator.reconcile import Context, Watched, drain_pool, reconcile
from tandem_operator.spec import GROUP, PLURAL, VERSION, PoolSpec, SpecError

log = logging.getLogger("tandem_operator.handlers")

FINALIZER = "tandem.dev/drain-engines"


@dataclass
class Settings:
    """Operator-wide knobs (from the command line), handed to kopf in its memo."""

    resync_seconds: float = 5.0  # reconcile at least this often, events or not
    debounce_seconds: float = 0.05  # let a burst of events land before reconciling
    check_weights: bool = True
    kubeconfig: str | None = None
    prometheus_url: str | None = None  # the autoscaling planner's metrics (else the pods')


@dataclass
class Runtime:
    """What the handlers share: the settings, the clients, one wake-up event per pool."""

    settings: Settings
    ctx: Context
    wakers: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)

    def waker(self, namespace: str, name: str) -> asyncio.Event:
        return self.wakers.setdefault((namespace, name), asyncio.Event())

    def wake(self, namespace: str | None, name: str | None) -> None:
        if namespace and name:
            self.waker(namespace, name).set()


def _runtime(memo: Any) -> Runtime:
    return memo.tandem


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    ours: Settings = getattr(memo, "settings", None) or Settings()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="tandem.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="tandem.dev", key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # our own events say what happened
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    for kind in ("Pod", *POOL_OBJECT_KINDS):  # only what some pool owns, filtered by the server
        settings.watching.label_selectors[KINDS[kind]] = POOL_LABEL
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # httpx (the refit's admin calls) logs every request at INFO; a refit polls each
        # engine on every pass. Our events say what happened.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    kube = await Kube.connect(ours.kubeconfig)
    reader = PrometheusReader(ours.prometheus_url) if ours.prometheus_url else PodReader()
    memo.tandem = Runtime(ours, Context(kube=kube, check_weights=ours.check_weights,
                                        autoscalers=Autoscalers(reader=reader)))


@kopf.on.cleanup()
async def close(memo: Any, **_: Any) -> None:
    rt: Runtime | None = getattr(memo, "tandem", None)
    if rt is not None:
        await rt.ctx.drains.close()
        await rt.ctx.fleet.close()
        await rt.ctx.autoscalers.close()
        await rt.ctx.kube.close()


@kopf.on.login()
async def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    """The same credentials as our own client, read now (kopf asks again after a 401)."""
    ours: Settings = getattr(memo, "settings", None) or Settings()
    c = await login_credentials(ours.kubeconfig)
    return kopf.ConnectionInfo(
        server=c.server, ca_path=c.ca_path, insecure=c.insecure, scheme=c.scheme,
        token=c.token, certificate_path=c.certificate_path,
        private_key_path=c.private_key_path)


# ---- what each pool has, as kopf's watches see it -----------------------------------------------


@kopf.index(*KINDS["Pod"], labels={POOL_LABEL: kopf.PRESENT})
def tandem_pods(namespace: str, labels: Any, body: Any, **_: Any) -> dict[Any, Any]:
    """(namespace, pool) -> the pool's pods."""
    return {(namespace, labels[POOL_LABEL]): dict(body)}


def tandem_objects(namespace: str, labels: Any, body: Any, resource: Any, **_: Any
                   ) -> dict[Any, Any]:
    """(namespace, pool) -> (kind, body) of the pool's Secret, Services, PDBs, RBAC and
    NetworkPolicies."""
    return {(namespace, labels[POOL_LABEL]): (resource.kind, dict(body))}


def watched(pods: kopf.Index, objects: kopf.Index, namespace: str, name: str) -> Watched:
    """One pool's share of the indexes, as reconcile takes it."""
    key = (namespace, name)
    return Watched(pods=tuple(pods.get(key, ())),
                   objects={(kind, body["metadata"]["name"]): body
                            for kind, body in objects.get(key, ())})


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
@kopf.on.resume(GROUP, VERSION, PLURAL)
def wake_pool(namespace: str, name: str, memo: Any, **_: Any) -> None:
    _runtime(memo).wake(namespace, name)


@kopf.on.event(*KINDS["Pod"], labels={POOL_LABEL: kopf.PRESENT})
def wake_owner(namespace: str, labels: Any, memo: Any, **_: Any) -> None:
    rt: Runtime | None = getattr(memo, "tandem", None)
    if rt is not None:
        rt.wake(namespace, labels.get(POOL_LABEL))


for _kind in POOL_OBJECT_KINDS:  # one index and one wake-up over all of them
    kopf.index(*KINDS[_kind], labels={POOL_LABEL: kopf.PRESENT})(tandem_objects)
    kopf.on.event(*KINDS[_kind], labels={POOL_LABEL: kopf.PRESENT})(wake_owner)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def pool_daemon(namespace: str, name: str, body: Any, stopped: Any, memo: Any,
                      tandem_pods: kopf.Index, tandem_objects: kopf.Index, **_: Any) -> None:
    """`body` is live (kopf updates it from its watch); so are the indexes, which kopf hands
    to every handler under their functions' names."""
    rt = _runtime(memo)
    waker = rt.waker(namespace, name)
    metrics.POOLS.inc()
    try:
        while not stopped:
            waker.clear()
            requeue: float | None = None
            pool: dict[str, Any] | None = dict(body)
            if not rt.ctx.kube.writes.shown("InferencePool", namespace, name, body):
                try:  # the watch has not shown our last status write yet
                    pool = await rt.ctx.kube.get_pool(namespace, name)
                except KubeError as exc:
                    log.warning("%s/%s: cannot read the pool: %s", namespace, name, exc)
            if pool is None or (pool.get("metadata") or {}).get("deletionTimestamp"):
                break
            try:
                requeue = (await reconcile(pool, rt.ctx, watched(
                    tandem_pods, tandem_objects, namespace, name))).requeue_after
            except Exception:  # a bug in one pass must not end the pool's reconciles
                log.exception("%s/%s: reconcile failed", namespace, name)
                metrics.RECONCILE_ERRORS.inc()
            await _sleep(waker, stopped, rt.settings, requeue)
    finally:
        await rt.ctx.fleet.forget(namespace, name)
        rt.ctx.autoscalers.forget(namespace, name)
        metrics.POOLS.dec()
        metrics.forget_pool(namespace, name)
        rt.wakers.pop((namespace, name), None)


async def _sleep(waker: asyncio.Event, stopped: Any, settings: Settings,
                 requeue: float | None = None) -> None:
    """Until woken, stopped, or the resync interval (or the sooner `requeue`) passes."""
    wake = asyncio.ensure_future(waker.wait())
    stop = asyncio.ensure_future(stopped.wait())
    timeout = settings.resync_seconds if requeue is None else min(requeue,
                                                                   settings.resync_seconds)
    try:
        await asyncio.wait({wake, stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        wake.cancel()
        stop.cancel()
    if waker.is_set() and not stopped:
        await asyncio.sleep(settings.debounce_seconds)


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def finalize_pool(body: Any, memo: Any, **_: Any) -> None:
    """Let the engines' requests in flight finish (`drain_pool`, within the pool's drain
    timeout after the deletion) before the pool and its pods go. A failed read of the
    cluster is retried while the grace period lasts; nothing keeps a pool past it."""
    pool = dict(body)
    meta = pool.get("metadata") or {}
    where = f"{meta.get('namespace')}/{meta.get('name')}"
    try:
        await drain_pool(pool, _runtime(memo).ctx)
    except KubeError as exc:
        try:
            timeout = PoolSpec.from_body(pool).refit.drain_timeout_seconds
        except SpecError:
            timeout = DEFAULT_DRAIN_TIMEOUT_S
        deadline = deletion_deadline(meta.get("deletionTimestamp"), timeout, time.time())
        if time.time() < deadline:
            raise kopf.TemporaryError(f"drain of the deleted pool {where}: {exc}",
                                      delay=1) from exc
        log.warning("drain of the deleted pool %s given up: %s", where, exc)
    except Exception:  # a bug must not keep a pool from going away
        log.exception("drain of the deleted pool %s failed", where)
