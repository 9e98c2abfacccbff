"""All of the operator's Kubernetes I/O (besides kopf's own watching), in one place.

Requests go through `tandem_engine.kubeclient`, the client the router's discovery uses too
(kubernetes_asyncio: kubeconfig with exec credential plugins or the pod's service account, a
deadline on every call). Bodies stay plain JSON dicts end to end, so what `manifests` builds
is exactly what the API server gets.

What a reconcile reads comes from kopf's watches (indexes of each pool's pods and objects,
and the pool's own live body), not from a LIST per pass. A watch lags behind the operator's
own writes, and acting on a view that misses them would, say, create a pod twice. So `Writes`
remembers the resourceVersion every write produced, and a watched view is trusted only once
it shows each of them (client-go's "expectations"); until then the reconcile reads the
cluster directly.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from tandem_engine.kubeclient import (
    Credentials,
    KubeClient,
    KubeError,
    credentials,
    load_configuration,
)

from tandem_operator import metrics
from tandem_operator.manifests import POOL_LABEL
from tandem_operator.spec import GROUP, PLURAL, VERSION

__all__ = ["KINDS", "POOL_OBJECT_KINDS", "Kube", "KubeError", "Writes", "login_credentials",
           "now", "parse_time"]

# kind -> (API group, version, plural); every kind here is namespaced.
KINDS: dict[str, tuple[str, str, str]] = {
    "Pod": ("", "v1", "pods"),
    "Secret": ("", "v1", "secrets"),
    "Service": ("", "v1", "services"),
    "ServiceAccount": ("", "v1", "serviceaccounts"),
    "Event": ("", "v1", "events"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
    "ControllerRevision": ("apps", "v1", "controllerrevisions"),  # pod-template history
    "Role": ("rbac.authorization.k8s.io", "v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
    "InferencePool": (GROUP, VERSION, PLURAL),
    # prometheus-operator's, present only where its CRDs are: see `Kube.serves`.
    "PodMonitor": ("monitoring.coreos.com", "v1", "podmonitors"),
}
# What a pool owns besides its pods (the credentials Secret, `manifests.support_objects` and
# its pod-template revisions, `rollout`): the operator watches these, labelled with the pool's
# name.
POOL_OBJECT_KINDS = ("Secret", "Service", "ServiceAccount", "PodDisruptionBudget", "Role",
                     "RoleBinding", "NetworkPolicy", "ControllerRevision")
MERGE_PATCH = "application/merge-patch+json"
WRITE_TTL_SECONDS = 60.0  # a write a watch never shows stops holding the watch back
DISCOVERY_TTL_SECONDS = 60.0  # how long an answer of `Kube.serves` stands


def now() -> str:
    """The current time as Kubernetes writes it (RFC 3339, UTC, whole seconds)."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(stamp: str) -> dt.datetime:
    return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)


async def login_credentials(kubeconfig: str | None = None) -> Credentials:
    """The operator's credentials, read now (an exec plugin runs again), for kopf's client."""
    return await credentials(await load_configuration(kubeconfig))


# ---- the operator's own writes, until the watches show them --------------------------------------


def _version(body: Mapping[str, Any] | None) -> int | None:
    """resourceVersion as a number (Kubernetes' are comparable integers), None if not one."""
    raw = ((body or {}).get("metadata") or {}).get("resourceVersion")
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class _Write:
    version: int | None  # the resourceVersion the write produced (None: unknown)
    deleted: bool
    pool: str | None  # the pool label of the object written (None: unknown, any pool)
    at: float  # time.monotonic()

    def shown_by(self, body: Mapping[str, Any] | None) -> bool:
        """Whether a watched body (None: the watch has no such object) includes the write."""
        if body is None:
            return self.deleted
        if self.deleted and not (body.get("metadata") or {}).get("deletionTimestamp"):
            return False  # still there and not being deleted: the watch is behind
        if self.deleted and self.version is None:
            return True
        seen = _version(body)
        return seen is not None and self.version is not None and seen >= self.version


class Writes:
    """The objects this process wrote, with the resourceVersion each write produced."""

    def __init__(self, ttl: float = WRITE_TTL_SECONDS) -> None:
        self.ttl = ttl
        self._writes: dict[tuple[str, str, str], _Write] = {}

    def __len__(self) -> int:
        return len(self._writes)

    def record(self, kind: str, namespace: str, name: str, answer: Mapping[str, Any] | None,
               *, deleted: bool = False) -> None:
        meta = (answer or {}).get("metadata") or {}
        if (answer or {}).get("kind") == "Status":  # a delete that answers with a Status
            meta = {}
        now = time.monotonic()  # forget what nobody asked about for long (a deleted pool's)
        for key in [k for k, w in self._writes.items() if now - w.at > self.ttl]:
            del self._writes[key]
        self._writes[(kind, namespace, name)] = _Write(
            _version(answer) if meta else None, deleted,
            (meta.get("labels") or {}).get(POOL_LABEL), now)

    def shown(self, kind: str, namespace: str, name: str,
              body: Mapping[str, Any] | None) -> bool:
        """Whether `body` (as a watch has it) shows this process's last write of the object;
        forgets the write once it does."""
        key = (kind, namespace, name)
        write = self._writes.get(key)
        if write is None or write.shown_by(body) or time.monotonic() - write.at > self.ttl:
            self._writes.pop(key, None)
            return True
        return False

    def missing(self, namespace: str, pool: str, kinds: Iterable[str],
                watched: Mapping[tuple[str, str], Mapping[str, Any]]) -> list[str]:
        """The writes to the pool's objects of these kinds that `watched` ((kind, name) ->
        body) does not show yet, as "Kind/name"; those it shows are forgotten."""
        kinds = frozenset(kinds)
        return [f"{kind}/{name}" for (kind, ns, name), write in list(self._writes.items())
                if ns == namespace and kind in kinds and write.pool in (pool, None)
                and not self.shown(kind, ns, name, watched.get((kind, name)))]

    def forget_gone(self, namespace: str, pool: str, kinds: Iterable[str],
                    fresh: Mapping[tuple[str, str], Mapping[str, Any]]) -> None:
        """After a direct read: a written object that no longer exists (someone deleted it
        since) will never show up in a watch."""
        kinds = frozenset(kinds)
        for (kind, ns, name), write in list(self._writes.items()):
            if (ns == namespace and kind in kinds and write.pool in (pool, None)
                    and not write.deleted and (kind, name) not in fresh):
                self._writes.pop((kind, ns, name), None)


# ---- the client ---------------------------------------------------------------------------------


class Kube:
    """Namespaced CRUD over plain dicts, events and the pool's status subresource."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client
        self.writes = Writes()
        self.instance = os.environ.get("POD_NAME") or socket.gethostname()
        self._served: dict[str, tuple[bool, float]] = {}  # kind -> (served, when asked)

    @classmethod
    async def connect(cls, kubeconfig: str | os.PathLike[str] | None = None, *,
                      timeout: float = 15.0) -> Kube:
        """$KUBECONFIG (or the given file) if set, else the pod's service account, else
        ~/.kube/config; call it inside the event loop that uses the client."""
        cfg = await load_configuration(kubeconfig)
        return cls(KubeClient(cfg, timeout=timeout, user_agent="tandem-operator"))

    async def close(self) -> None:
        await self.client.close()

    async def _request(self, verb: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """Every API call of the operator's goes through here: an error answer (or none) is
        counted by verb and reason (`tandem_operator_api_errors_total`) and raised."""
        try:
            return await self.client.request(verb, path, **kwargs)
        except KubeError as exc:
            metrics.API_ERRORS.labels(verb, exc.reason or str(exc.status)).inc()
            raise

    @staticmethod
    def path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        group, version, plural = KINDS[kind]
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        path = f"{prefix}/namespaces/{quote(namespace)}/{plural}"
        if name is not None:
            path += f"/{quote(name)}"
        if sub is not None:
            path += f"/{sub}"
        return path

    async def serves(self, kind: str) -> bool:
        """Whether the API server serves `kind` now (its group's discovery lists it), asked
        at most once a minute. An unanswered question counts as not served: the caller then
        neither creates nor deletes such objects."""
        answer = self._served.get(kind)
        if answer is not None and time.monotonic() - answer[1] < DISCOVERY_TTL_SECONDS:
            return answer[0]
        group, version, plural = KINDS[kind]
        try:
            found = await self._request(
                "GET", f"/apis/{group}/{version}" if group else f"/api/{version}")
            served = any(r.get("name") == plural for r in found.get("resources") or ())
        except KubeError:
            served = False
        self._served[kind] = (served, time.monotonic())
        return served

    # ---- objects --------------------------------------------------------------------------------

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", self.path(kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, labels: Mapping[str, str]
                   ) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        data = await self._request("GET", self.path(kind, namespace),
                                         query={"labelSelector": selector} if selector else None)
        items = data.get("items") or []
        # A selector the server ignored must not make us act on another pool's pods.
        return [i for i in items if all(((i.get("metadata") or {}).get("labels") or {})
                                        .get(k) == v for k, v in labels.items())]

    async def create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        ns = body["metadata"]["namespace"]
        created = await self._request("POST", self.path(body["kind"], ns), body=dict(body))
        name = (created.get("metadata") or {}).get("name")
        if name:
            self.writes.record(body["kind"], ns, name, created)
        return created

    async def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]
                    ) -> dict[str, Any]:
        patched = await self._request("PATCH", self.path(kind, namespace, name),
                                            body=dict(patch), content_type=MERGE_PATCH)
        self.writes.record(kind, namespace, name, patched)
        return patched

    async def annotate(self, kind: str, namespace: str, name: str,
                       annotations: Mapping[str, str | None]) -> dict[str, Any]:
        return await self.patch(kind, namespace, name,
                                {"metadata": {"annotations": dict(annotations)}})

    async def delete(self, kind: str, namespace: str, name: str, *,
                     grace_seconds: int | None = None, uid: str | None = None) -> bool:
        """Delete (False when already gone). `uid` guards against deleting a namesake."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            answer = await self._request("DELETE", self.path(kind, namespace, name),
                                               body=body)
        except KubeError as exc:
            if exc.status in (404, 409):  # gone, or the uid is a namesake's
                return False
            raise
        self.writes.record(kind, namespace, name, answer, deleted=True)
        return True

    # ---- the pool -------------------------------------------------------------------------------

    async def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.get("InferencePool", namespace, name)

    async def patch_pool_status(self, namespace: str, name: str, status: Mapping[str, Any]
                                ) -> dict[str, Any]:
        patched = await self._request(
            "PATCH", self.path("InferencePool", namespace, name, "status"),
            body={"status": dict(status)}, content_type=MERGE_PATCH)
        self.writes.record("InferencePool", namespace, name, patched)
        return patched

    async def event(self, pool: Mapping[str, Any], reason: str, message: str,
                    type_: str = "Normal") -> None:
        """A core/v1 Event on the pool (what `kubectl describe ipool` lists)."""
        meta = pool.get("metadata") or {}
        stamp = now()
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"generateName": f"{meta.get('name', 'pool')}.",
                             "namespace": meta.get("namespace", "default")},
                "involvedObject": {"apiVersion": pool.get("apiVersion", f"{GROUP}/{VERSION}"),
                                   "kind": pool.get("kind", "InferencePool"),
                                   "name": meta.get("name"),
                                   "namespace": meta.get("namespace"),
                                   "uid": meta.get("uid")},
                "reason": reason, "message": message[:1024], "type": type_,
                "source": {"component": "tandem-operator"},
                "reportingComponent": "tandem-operator", "reportingInstance": self.instance,
                "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1}
        await self._request("POST", self.path("Event", body["metadata"]["namespace"]),
                                  body=body)
