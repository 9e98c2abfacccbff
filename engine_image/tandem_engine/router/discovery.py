"""Engine discovery in Kubernetes: the router follows its pool's engine pods.

`tandem-router --discover-pool NAME` watches the pods labelled `tandem.dev/pool=NAME`
whose `tandem.dev/role` is prefill, decode or mixed, and keeps one engine connection per
pod that serves one (`pod_endpoint`), at `<podIP>:<containerPort zmq>`. A pod that goes
away, stops running or changes IP loses its engine; requests in flight there fail over
like on any lost engine.

The rule "which pod is which engine" is the pure function `pod_endpoint`, and
`EndpointTable` turns a list or a watch event into the engines to add and remove, so
both are tested without an API server. `PodWatcher` is the Kubernetes I/O, through
`tandem_engine.kubeclient` (the operator's client too: kubeconfig with exec credential
plugins, or the pod's service account): list, then watch from the list's
resourceVersion; a watch that ends is resumed from the last resourceVersion seen; 410
Gone or a broken watch re-lists after a backoff. Every request has a timeout. While the
API is unreachable the router keeps the engines it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import Configuration

from tandem_engine.kubeclient import SERVICE_ACCOUNT_DIR, KubeClient, KubeError
from tandem_engine.lifecycle import EngineRole
from tandem_engine.router.engines import EnginePool
from tandem_engine.zmq_auth import CurveClient

log = logging.getLogger(__name__)

POOL_LABEL = "tandem.dev/pool"
ROLE_LABEL = "tandem.dev/role"
ENGINE_ROLES = frozenset(str(r) for r in EngineRole)
ZMQ_PORT_NAME = "zmq"

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")

Pod = Mapping[str, Any]


class DiscoveryError(ValueError):
    """Discovery cannot start: a bad pool or namespace name."""


# ---- which pod is which engine (pure) ---------------------------------------------------------


def pod_endpoint(pod: Pod, pool: str) -> str | None:
    """The engine address `IP:PORT` a pod serves, or None while it serves none.

    A pod serves when it carries the pool's labels with an engine role, is not being
    deleted, has an IP, is Running with its containers running, and a container port is
    named zmq. Readiness is deliberately not required: an engine that is paused (for a
    drain or a refit) is not Ready, yet it keeps its in-flight requests and their KV, and
    the router must keep them. The router's own view of each engine's state keeps
    engines that are not RUNNING out of new routing choices."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(POOL_LABEL) != pool or labels.get(ROLE_LABEL) not in ENGINE_ROLES:
        return None
    if meta.get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip:
        return None
    containers = status.get("containerStatuses") or []
    if status.get("phase") != "Running" or not containers or not all(
            "running" in (c.get("state") or {}) for c in containers):
        return None
    port = zmq_port(pod)
    if port is None:
        return None
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def zmq_port(pod: Pod) -> int | None:
    """The containerPort named zmq in any of the pod's containers."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == ZMQ_PORT_NAME and isinstance(port.get("containerPort"), int):
                return port["containerPort"]
    return None


@dataclass(frozen=True)
class Change:
    """Engine addresses to connect to and to drop."""

    added: frozenset[str] = frozenset()
    removed: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


class EndpointTable:
    """Each pod's engine address (if it serves one), kept current by lists and events.

    Keyed by namespace/name, so a replayed or repeated event changes nothing, and two
    pods that somehow share an address keep it until both are gone."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self._by_pod: dict[str, str] = {}

    @property
    def endpoints(self) -> frozenset[str]:
        return frozenset(self._by_pod.values())

    def reset(self, pods: Iterable[Pod]) -> Change:
        """A fresh list of pods replaces everything known."""
        before = self.endpoints
        self._by_pod = {}
        for pod in pods:
            self._set(pod)
        return self._diff(before)

    def apply(self, event_type: str, pod: Pod) -> Change:
        """One watch event: ADDED, MODIFIED or DELETED (others change nothing)."""
        before = self.endpoints
        if event_type == "DELETED":
            self._by_pod.pop(_pod_key(pod), None)
        elif event_type in ("ADDED", "MODIFIED"):
            self._set(pod)
        return self._diff(before)

    def _set(self, pod: Pod) -> None:
        key = _pod_key(pod)
        endpoint = pod_endpoint(pod, self.pool)
        if endpoint is None:
            self._by_pod.pop(key, None)
        else:
            self._by_pod[key] = endpoint

    def _diff(self, before: frozenset[str]) -> Change:
        after = self.endpoints
        return Change(added=after - before, removed=before - after)


def _pod_key(pod: Pod) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


# ---- the namespace -----------------------------------------------------------------------------


def resolve_namespace(namespace: str | None, env: Mapping[str, str] | None = None,
                      service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> str:
    """--namespace, else $POD_NAMESPACE, else the service account's namespace, else default."""
    env = os.environ if env is None else env
    if not namespace:
        namespace = env.get("POD_NAMESPACE") or None
    if not namespace:
        with contextlib.suppress(OSError):
            namespace = (service_account_dir / "namespace").read_text().strip() or None
    namespace = namespace or "default"
    if not _NAMESPACE.match(namespace):
        raise DiscoveryError(f"namespace {namespace!r} is not a Kubernetes namespace name "
                             "(lowercase letters, digits and '-', at most 63 characters)")
    return namespace


# ---- the list + watch loop --------------------------------------------------------------------


class _Relist(Exception):
    """The watch cannot continue from its resourceVersion (410 Gone, or broken)."""


class PodWatcher:
    """Lists and watches one pool's pods and reports each change of engine addresses.

    `on_change` is awaited for every non-empty change, in order. Runs until cancelled."""

    def __init__(self, client: KubeClient, namespace: str, pool: str,
                 on_change: Callable[[Change], Awaitable[None]], *,
                 watch_seconds: int = 240, backoff_initial: float = 0.5,
                 backoff_max: float = 30.0) -> None:
        check_pool_name(pool)
        self.client = client
        self.namespace = namespace
        self.pool = pool
        self.table = EndpointTable(pool)
        self.on_change = on_change
        self.watch_seconds = watch_seconds
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._failures = 0  # failed list/watch attempts since a watch last worked
        self._path = f"/api/v1/namespaces/{namespace}/pods"
        self._selector = f"{POOL_LABEL}={pool}"

    async def run(self) -> None:
        while True:
            try:
                version = await self._list()
                while True:
                    version = await self._watch(version)
            except _Relist as exc:
                log.info("pool %s: re-listing pods (%s)", self.pool, exc)
                self._failures += 1
            except KubeError as exc:
                log.warning("pool %s: the Kubernetes API at %s failed: %s", self.pool,
                            self.client.server, exc)
                self._failures += 1
            except Exception:  # a surprise must not end discovery for good
                log.exception("pool %s: discovery failed; starting over", self.pool)
                self._failures += 1
            # The first re-list after a watch that worked is immediate; failures in a
            # row back off exponentially, with jitter, up to backoff_max.
            if self._failures > 1:
                delay = min(self.backoff_max,
                            self.backoff_initial * 2 ** (self._failures - 2))
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))

    async def _list(self) -> str:
        body = await self.client.request("GET", self._path,
                                         query={"labelSelector": self._selector})
        await self._report(self.table.reset(body.get("items") or []))
        log.info("pool %s: %d engine(s) in namespace %s", self.pool,
                 len(self.table.endpoints), self.namespace)
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, version: str) -> str:
        """One watch request from `version`; returns the last resourceVersion seen when
        the server ends it, raises _Relist when it cannot go on."""
        query = {"labelSelector": self._selector, "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(self.watch_seconds)}
        if version:
            query["resourceVersion"] = version
        started = asyncio.get_running_loop().time()
        # The server closes the watch after watch_seconds; a silent connection past that
        # (plus slack) is broken.
        events = self.client.watch(self._path, query,
                                   idle_timeout=self.watch_seconds + self.client.timeout)
        try:
            async for event in events:
                self._failures = 0  # the watch works
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    code = obj.get("code")
                    raise _Relist(f"watch error {code}: {obj.get('message', '')}".strip())
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind != "BOOKMARK":
                    await self._report(self.table.apply(kind, obj))
        except KubeError as exc:
            if exc.status == 410:
                raise _Relist("410 Gone: the resourceVersion expired") from exc
            raise
        finally:
            await events.aclose()
        if not version:
            raise _Relist("the watch ended and no resourceVersion is known")
        elapsed = asyncio.get_running_loop().time() - started
        if elapsed >= 1.0:
            self._failures = 0
        else:  # a server that ends watches at once must not make us spin
            await asyncio.sleep(1.0 - elapsed)
        return version

    async def _report(self, change: Change) -> None:
        if change:
            await self.on_change(change)


def check_pool_name(pool: str) -> str:
    if not _LABEL_VALUE.match(pool):
        raise DiscoveryError(f"pool name {pool!r} is not a Kubernetes label value "
                             "(letters, digits, '-', '_', '.', at most 63 characters)")
    return pool


# ---- the router's pool, fed by the watcher ----------------------------------------------------


class DiscoveredEnginePool(EnginePool):
    """An `EnginePool` whose engines are the pool's engine pods, followed while it runs.
    `config`: where the API server is (`kubeclient.load_configuration`)."""

    def __init__(self, pool: str, namespace: str, config: Configuration, *,
                 router_id: str | None = None, heartbeat_deadline: float = 2.0,
                 handshake_timeout: float = 1.0, request_timeout: float = 10.0,
                 curve: CurveClient | None = None, **watch_options: Any) -> None:
        super().__init__([], router_id=router_id, heartbeat_deadline=heartbeat_deadline,
                         handshake_timeout=handshake_timeout, allow_empty=True, curve=curve)
        self.discovered = check_pool_name(pool)
        self.namespace = namespace
        self.config = config
        self.request_timeout = request_timeout
        self.watch_options = watch_options
        self._kube: KubeClient | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await super().start()
        # The client's connection pool belongs to this event loop: made here, not before.
        self._kube = KubeClient(self.config, timeout=self.request_timeout,
                                  user_agent="tandem-router")
        watcher = PodWatcher(self._kube, self.namespace, self.discovered, self.apply,
                             **self.watch_options)
        self._task = asyncio.create_task(watcher.run(), name="pod watch")

    async def close(self) -> None:
        task, self._task = self._task, None
        # Cancel until it is done: a cancellation landing while the watcher closes an
        # engine connection can be absorbed there.
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        kube, self._kube = self._kube, None
        if kube is not None:
            await kube.close()
        await super().close()

    async def apply(self, change: Change) -> None:
        for key in sorted(change.removed):
            log.info("pool %s: engine %s left", self.discovered, key)
            await self.remove(key)
        for address in sorted(change.added):
            log.info("pool %s: engine %s joined", self.discovered, address)
            await self.add(address)
