"""All of the operator's Kubernetes I/O (besides kopf's own watching), in one place.

The `kubernetes` client loads the configuration (kubeconfig or in-cluster service account,
token refresh included) and sends the requests; bodies stay plain JSON dicts end to end (no
generated model classes), so what `manifests` builds is exactly what the API server gets. The
client is synchronous: every call runs on a small thread pool of its own, with a timeout.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import socket
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client, config

from tandem_operator.spec import GROUP, PLURAL, VERSION

# kind -> (API prefix, plural); every kind here is namespaced.
KINDS: dict[str, tuple[str, str]] = {
    "Pod": ("/api/v1", "pods"),
    "Secret": ("/api/v1", "secrets"),
    "Service": ("/api/v1", "services"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Event": ("/api/v1", "events"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "InferencePool": (f"/apis/{GROUP}/{VERSION}", PLURAL),
}
MERGE_PATCH = "application/merge-patch+json"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(RuntimeError):
    """An API call answered with an error status (or not at all: status 0)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def now() -> str:
    """The current time as Kubernetes writes it (RFC 3339, UTC, whole seconds)."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(stamp: str) -> dt.datetime:
    return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)


def load_configuration(kubeconfig: str | os.PathLike[str] | None = None
                       ) -> client.Configuration:
    """$KUBECONFIG (or the given file) if set, else the pod's service account, else
    ~/.kube/config. Read at call time, not at import time."""
    cfg = client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        config.load_kube_config(config_file=str(path).split(os.pathsep)[0],
                                client_configuration=cfg, persist_config=False)
    elif os.environ.get("KUBERNETES_SERVICE_HOST") and SERVICE_ACCOUNT_DIR.exists():
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(client_configuration=cfg, persist_config=False)
    return cfg


class Kube:
    """Namespaced CRUD over plain dicts, events and the pool's status subresource."""

    def __init__(self, api: client.ApiClient, *, timeout: float = 15.0,
                 threads: int = 16) -> None:
        self.api = api
        self.timeout = timeout
        self._executor = ThreadPoolExecutor(max_workers=threads,
                                            thread_name_prefix="tandem-kube")
        self.instance = os.environ.get("POD_NAME") or socket.gethostname()

    @classmethod
    def from_configuration(cls, cfg: client.Configuration, **kwargs: Any) -> Kube:
        cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize or 0,
                                          kwargs.get("threads", 16))
        return cls(client.ApiClient(cfg), **kwargs)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.api.close()

    # ---- transport ------------------------------------------------------------------------------

    def _send(self, method: str, path: str, query: Mapping[str, Any] | None,
              body: Any, content_type: str | None) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        if query:
            path = f"{path}?{urlencode(query)}"
        method, url, headers, body, post = self.api.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"])
        try:
            rsp = self.api.call_api(method, url, headers, body, post,
                                    _request_timeout=self.timeout)
            raw = rsp.read()
        except Exception as exc:  # urllib3 errors, timeouts: no answer at all
            raise KubeError(0, type(exc).__name__, f"{method} {path}: {exc}") from exc
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:
            data = {"message": raw[:200].decode(errors="replace")}
        if not 200 <= rsp.status <= 299:
            raise KubeError(rsp.status, str(data.get("reason") or rsp.reason),
                            f"{method} {path}: {data.get('message') or raw[:200]!r}")
        return data

    async def request(self, method: str, path: str, *, query: Mapping[str, Any] | None = None,
                      body: Any = None, content_type: str | None = None) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, self._send, method, path, query, body, content_type)

    @staticmethod
    def path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        prefix, plural = KINDS[kind]
        path = f"{prefix}/namespaces/{quote(namespace)}/{plural}"
        if name is not None:
            path += f"/{quote(name)}"
        if sub is not None:
            path += f"/{sub}"
        return path

    # ---- objects --------------------------------------------------------------------------------

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", self.path(kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, labels: Mapping[str, str]
                   ) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        data = await self.request("GET", self.path(kind, namespace),
                                  query={"labelSelector": selector} if selector else None)
        items = data.get("items") or []
        # A selector the server ignored must not make us act on another pool's pods.
        return [i for i in items if all(((i.get("metadata") or {}).get("labels") or {})
                                        .get(k) == v for k, v in labels.items())]

    async def create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        ns = body["metadata"]["namespace"]
        return await self.request("POST", self.path(body["kind"], ns), body=dict(body))

    async def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]
                    ) -> dict[str, Any]:
        return await self.request("PATCH", self.path(kind, namespace, name), body=dict(patch),
                                  content_type=MERGE_PATCH)

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
            await self.request("DELETE", self.path(kind, namespace, name), body=body)
        except KubeError as exc:
            if exc.status in (404, 409):  # gone, or the uid is a namesake's
                return False
            raise
        return True

    # ---- the pool -------------------------------------------------------------------------------

    async def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.get("InferencePool", namespace, name)

    async def patch_pool_status(self, namespace: str, name: str, status: Mapping[str, Any]
                                ) -> dict[str, Any]:
        return await self.request("PATCH", self.path("InferencePool", namespace, name, "status"),
                                  body={"status": dict(status)}, content_type=MERGE_PATCH)

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
        await self.create(body)
