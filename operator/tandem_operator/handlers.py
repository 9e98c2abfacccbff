"""The kopf wiring: thin handlers that only decide *when* a pool is reconciled.

One daemon per pool owns that pool's reconciles, so two never run at once for one pool. It
reconciles, then sleeps until woken or until the resync interval passes (sooner while a refit
runs: the reconcile asks for it). Everything else only wakes it: the pool's
create/update/resume handlers and any event on a pod labelled with the pool's name. A burst
of events while a reconcile runs costs one more reconcile, not one each. Deleting a pool
stops its daemon; the finalizer (the delete handler) drains the engines, best effort, then
garbage collection removes the pods.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf

from tandem_operator import metrics
from tandem_operator.engines import EngineAdmin
from tandem_operator.kube import Kube, KubeError, load_configuration
from tandem_operator.manifests import POOL_LABEL
from tandem_operator.reconcile import Context, drain_pool, reconcile
from tandem_operator.spec import GROUP, PLURAL, VERSION

log = logging.getLogger("tandem_operator.handlers")

FINALIZER = "tandem.dev/drain-engines"


@dataclass
class Settings:
    """Operator-wide knobs (from the command line), handed to kopf in its memo."""

    resync_seconds: float = 5.0  # reconcile at least this often, events or not
    debounce_seconds: float = 0.05  # let a burst of events land before reconciling
    check_weights: bool = True
    kubeconfig: str | None = None


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
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # httpx (the refit's admin calls) logs every request at INFO; a refit polls each
        # engine on every pass. Our events say what happened.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    kube = Kube.from_configuration(load_configuration(ours.kubeconfig))
    memo.tandem = Runtime(ours, Context(kube=kube, admin=EngineAdmin(),
                                        check_weights=ours.check_weights))


@kopf.on.cleanup()
async def close(memo: Any, **_: Any) -> None:
    rt: Runtime | None = getattr(memo, "tandem", None)
    if rt is not None:
        await rt.ctx.drains.close()
        await rt.ctx.fleet.close()
        await rt.ctx.admin.close()
        rt.ctx.kube.close()


@kopf.on.login()
def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    """The same credentials as our own client (kubeconfig read now, not at import)."""
    ours: Settings = getattr(memo, "settings", None) or Settings()
    cfg = load_configuration(ours.kubeconfig)
    header = (cfg.get_api_key_with_prefix("BearerToken")
              or cfg.get_api_key_with_prefix("authorization"))
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        username=cfg.username or None, password=cfg.password or None,
        scheme=scheme or None, token=token or None, certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
@kopf.on.resume(GROUP, VERSION, PLURAL)
def wake_pool(namespace: str, name: str, memo: Any, **_: Any) -> None:
    _runtime(memo).wake(namespace, name)


@kopf.on.event("", "v1", "pods", labels={POOL_LABEL: kopf.PRESENT})
def wake_owner(namespace: str, labels: Any, memo: Any, **_: Any) -> None:
    rt: Runtime | None = getattr(memo, "tandem", None)
    if rt is not None:
        rt.wake(namespace, labels.get(POOL_LABEL))


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def pool_daemon(namespace: str, name: str, body: Any, stopped: Any, memo: Any,
                      **_: Any) -> None:
    rt = _runtime(memo)
    waker = rt.waker(namespace, name)
    metrics.POOLS.inc()
    try:
        while not stopped:
            waker.clear()
            requeue: float | None = None
            try:
                pool = await rt.ctx.kube.get_pool(namespace, name)
            except KubeError as exc:
                log.warning("%s/%s: cannot read the pool: %s", namespace, name, exc)
                pool = dict(body)
            if pool is None or (pool.get("metadata") or {}).get("deletionTimestamp"):
                break
            try:
                requeue = (await reconcile(pool, rt.ctx)).requeue_after
            except Exception:  # a bug in one pass must not end the pool's reconciles
                log.exception("%s/%s: reconcile failed", namespace, name)
                metrics.RECONCILE_ERRORS.inc()
            await _sleep(waker, stopped, rt.settings, requeue)
    finally:
        await rt.ctx.fleet.forget(namespace, name)
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
    """Drain every engine (best effort, bounded by drainTimeoutSeconds) before the pool and
    its pods go."""
    try:
        await drain_pool(dict(body), _runtime(memo).ctx)
    except Exception:  # best effort: never keep a pool from going away
        log.exception("drain of deleted pool %s/%s failed",
                      body.get("metadata", {}).get("namespace"),
                      body.get("metadata", {}).get("name"))
