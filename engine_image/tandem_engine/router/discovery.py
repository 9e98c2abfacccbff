"""Engine discovery in Kubernetes: the router follows its pool's engine pods.

`tandem-router --discover-pool NAME` watches the pods labelled `tandem.dev/pool=NAME`
whose `tandem.dev/role` is prefill, decode or mixed, and keeps one engine connection per
pod that has an IP, is not being deleted and is Ready, at `<podIP>:<containerPort zmq>`.
A pod that goes away, stops being Ready or changes IP loses its engine; requests in
flight there fail over like on any lost engine.

The rule "which pod is which engine" is the pure function `pod_endpoint`, and
`EndpointTable` turns a list or a watch event into the engines to add and remove, so
both are tested without an API server. `PodWatcher` is the Kubernetes I/O (httpx, no
client library): list, then watch from the list's resourceVersion; a watch that ends
is resumed from the last resourceVersion seen; 410 Gone or a broken watch re-lists
after a backoff. Every request has a timeout. While the API is unreachable the router
keeps the engines it has.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import random
import re
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tandem_engine.router.engines import EnginePool

log = logging.getLogger(__name__)

POOL_LABEL = "tandem.dev/pool"
ROLE_LABEL = "tandem.dev/role"
ENGINE_ROLES = frozenset({"prefill", "decode", "mixed"})
ZMQ_PORT_NAME = "zmq"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")

Pod = Mapping[str, Any]


class DiscoveryError(ValueError):
    """Discovery cannot start: no usable cluster configuration or a bad pool name."""


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


# ---- where the API server is ------------------------------------------------------------------


@dataclass(frozen=True)
class KubeConfig:
    """How to reach and authenticate to the API server."""

    server: str  # scheme://host:port, no trailing slash
    verify: ssl.SSLContext | bool = True
    token: str | None = None
    token_file: Path | None = None  # read on every request: projected tokens rotate
    auth: tuple[str, str] | None = None  # basic auth

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.token_file is not None:
            token = self.token_file.read_text().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}


def load_kube_config(env: Mapping[str, str] | None = None,
                     service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeConfig:
    """From $KUBECONFIG when set (its first file), else the pod's service account."""
    env = os.environ if env is None else env
    paths = [p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p]
    if paths:
        return kube_config_from_file(Path(paths[0]))
    return in_cluster_config(env, service_account_dir)


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


def in_cluster_config(env: Mapping[str, str],
                      service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeConfig:
    host = env.get("KUBERNETES_SERVICE_HOST")
    if not host:
        raise DiscoveryError("no Kubernetes API to discover engines from: set KUBECONFIG, or "
                             "run in a pod (KUBERNETES_SERVICE_HOST is not set)")
    port = env.get("KUBERNETES_SERVICE_PORT", "443")
    token_file = service_account_dir / "token"
    if not token_file.is_file():
        raise DiscoveryError(f"no service account token at {token_file}: does the pod mount "
                             "one (automountServiceAccountToken)?")
    ca = service_account_dir / "ca.crt"
    verify = ssl.create_default_context(cafile=str(ca)) if ca.is_file() else True
    host = f"[{host}]" if ":" in host else host
    return KubeConfig(server=f"https://{host}:{port}", verify=verify, token_file=token_file)


def kube_config_from_file(path: Path) -> KubeConfig:
    """The current context of a kubeconfig file (YAML, or JSON)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise DiscoveryError(f"cannot read the kubeconfig {path}: {exc}") from exc
    doc = _parse_yaml_or_json(text, path)
    base = path.parent
    try:
        context_name = doc.get("current-context")
        context = _named(doc, "contexts", context_name, path)["context"]
        cluster = _named(doc, "clusters", context["cluster"], path)["cluster"]
        user: dict[str, Any] = {}
        if context.get("user"):
            user = _named(doc, "users", context["user"], path).get("user") or {}
        server = cluster["server"].rstrip("/")
    except (KeyError, TypeError, AttributeError) as exc:
        raise DiscoveryError(f"kubeconfig {path}: malformed ({exc!r} missing)") from exc
    if "exec" in user or "auth-provider" in user:
        raise DiscoveryError(f"kubeconfig {path}: exec and auth-provider credentials are not "
                             "supported; use a token or client certificate")
    verify: ssl.SSLContext | bool = True
    if server.startswith("https://"):
        verify = _ssl_context(cluster, user, base)
    token = user.get("token")
    token_file = _path(user["tokenFile"], base) if user.get("tokenFile") else None
    auth = (user["username"], user.get("password", "")) if user.get("username") else None
    return KubeConfig(server=server, verify=verify, token=token, token_file=token_file,
                      auth=auth)


def _parse_yaml_or_json(text: str, path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except ValueError:
        try:
            import yaml
        except ImportError as exc:
            raise DiscoveryError(f"kubeconfig {path} is YAML and PyYAML is not installed"
                                 ) from exc
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise DiscoveryError(f"kubeconfig {path} is neither JSON nor YAML: {exc}") from exc
    if not isinstance(doc, dict):
        raise DiscoveryError(f"kubeconfig {path}: expected a mapping at the top")
    return doc


def _named(doc: Mapping[str, Any], section: str, name: str | None, path: Path
           ) -> dict[str, Any]:
    for entry in doc.get(section) or []:
        if entry.get("name") == name:
            return entry
    raise DiscoveryError(f"kubeconfig {path}: no entry {name!r} in {section}")


def _path(value: str, base: Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def _ssl_context(cluster: Mapping[str, Any], user: Mapping[str, Any], base: Path
                 ) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    if cluster.get("certificate-authority-data"):
        ctx.load_verify_locations(
            cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
    elif cluster.get("certificate-authority"):
        ctx.load_verify_locations(cafile=str(_path(cluster["certificate-authority"], base)))
    if cluster.get("insecure-skip-tls-verify"):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    cert, key = user.get("client-certificate-data"), user.get("client-key-data")
    if cert and key:
        # load_cert_chain reads files only: hand it private temporary copies.
        with tempfile.TemporaryDirectory() as tmp:
            cert_file, key_file = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
            for file, data in ((cert_file, cert), (key_file, key)):
                file.touch(mode=0o600)
                file.write_bytes(base64.b64decode(data))
            ctx.load_cert_chain(str(cert_file), str(key_file))
    elif user.get("client-certificate") and user.get("client-key"):
        ctx.load_cert_chain(str(_path(user["client-certificate"], base)),
                            str(_path(user["client-key"], base)))
    return ctx


# ---- the list + watch loop --------------------------------------------------------------------


class _Relist(Exception):
    """The watch cannot continue from its resourceVersion (410 Gone, or broken)."""


class PodWatcher:
    """Lists and watches one pool's pods and reports each change of engine addresses.

    `on_change` is awaited for every non-empty change, in order. Runs until cancelled."""

    def __init__(self, config: KubeConfig, namespace: str, pool: str,
                 on_change: Callable[[Change], Awaitable[None]], *,
                 request_timeout: float = 10.0, watch_seconds: int = 240,
                 backoff_initial: float = 0.5, backoff_max: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        if not _LABEL_VALUE.match(pool):
            raise DiscoveryError(f"pool name {pool!r} is not a Kubernetes label value "
                                 "(letters, digits, '-', '_', '.', at most 63 characters)")
        self.config = config
        self.namespace = namespace
        self.pool = pool
        self.table = EndpointTable(pool)
        self.on_change = on_change
        self.request_timeout = request_timeout
        self.watch_seconds = watch_seconds
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.transport = transport
        self._failures = 0  # failed list/watch attempts since a watch last worked
        self._url = f"{config.server}/api/v1/namespaces/{namespace}/pods"

    async def run(self) -> None:
        async with httpx.AsyncClient(verify=self.config.verify, auth=self.config.auth,
                                     timeout=self.request_timeout,
                                     transport=self.transport) as client:
            while True:
                try:
                    version = await self._list(client)
                    while True:
                        version = await self._watch(client, version)
                except _Relist as exc:
                    log.info("pool %s: re-listing pods (%s)", self.pool, exc)
                    self._failures += 1
                except (httpx.HTTPError, ValueError, OSError) as exc:
                    log.warning("pool %s: the Kubernetes API at %s failed: %s", self.pool,
                                self.config.server, _describe(exc))
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

    async def _list(self, client: httpx.AsyncClient) -> str:
        r = await client.get(self._url, params={"labelSelector": f"{POOL_LABEL}={self.pool}"},
                             headers=self.config.headers())
        r.raise_for_status()
        body = r.json()
        await self._report(self.table.reset(body.get("items") or []))
        log.info("pool %s: %d engine(s) in namespace %s", self.pool,
                 len(self.table.endpoints), self.namespace)
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, client: httpx.AsyncClient, version: str) -> str:
        """One watch request from `version`; returns the last resourceVersion seen when
        the server ends it, raises _Relist when it cannot go on."""
        params = {"labelSelector": f"{POOL_LABEL}={self.pool}", "watch": "true",
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(self.watch_seconds)}
        if version:
            params["resourceVersion"] = version
        # The server closes the watch after watch_seconds; a silent connection past that
        # (plus slack) is broken.
        timeout = httpx.Timeout(self.request_timeout, read=self.watch_seconds
                                + self.request_timeout)
        started = asyncio.get_running_loop().time()
        async with client.stream("GET", self._url, params=params, timeout=timeout,
                                 headers=self.config.headers()) as r:
            if r.status_code == 410:
                raise _Relist("410 Gone: the resourceVersion expired")
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                self._failures = 0  # the watch works
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    code = obj.get("code")
                    raise _Relist(f"watch error {code}: {obj.get('message', '')}".strip())
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind != "BOOKMARK":
                    await self._report(self.table.apply(kind, obj))
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


def _describe(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}: {exc.response.text[:200]}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# ---- the router's pool, fed by the watcher ----------------------------------------------------


class DiscoveredEnginePool(EnginePool):
    """An `EnginePool` whose engines are the pool's Ready pods, followed while it runs."""

    def __init__(self, pool: str, namespace: str, config: KubeConfig, *,
                 router_id: str | None = None, heartbeat_deadline: float = 2.0,
                 handshake_timeout: float = 1.0, **watch_options: Any) -> None:
        super().__init__([], router_id=router_id, heartbeat_deadline=heartbeat_deadline,
                         handshake_timeout=handshake_timeout, allow_empty=True)
        self.watcher = PodWatcher(config, namespace, pool, self.apply, **watch_options)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await super().start()
        self._task = asyncio.create_task(self.watcher.run(), name="pod watch")

    async def close(self) -> None:
        task, self._task = self._task, None
        # Cancel until it is done: a cancellation landing while the watcher closes an
        # engine connection can be absorbed there.
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        await super().close()

    async def apply(self, change: Change) -> None:
        for key in sorted(change.removed):
            log.info("pool %s: engine %s left", self.watcher.pool, key)
            await self.remove(key)
        for address in sorted(change.added):
            log.info("pool %s: engine %s joined", self.watcher.pool, address)
            await self.add(address)
