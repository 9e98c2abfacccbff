"""The one Kubernetes API client of Tandem, for the operator and the router's engine discovery.

Built on kubernetes_asyncio (asyncio, aiohttp: the transport kopf already runs on). Torch-free.

Configuration, read when asked for (never at import): the given kubeconfig, else
$KUBECONFIG (its files merged as kubectl merges them), else the pod's service account, else
~/.kube/config. A kubeconfig user may authenticate with a token or token file, a client
certificate, basic auth, an OIDC auth-provider or an `exec` credential plugin (what EKS, GKE
and AKS kubeconfigs use); exec credentials are fetched again before they expire (at least
every minute when the plugin gives no expiry), service account tokens are re-read every
minute (the kubelet rotates them).

Bodies are plain JSON dicts end to end (no generated model classes), so what a caller builds
is exactly what the API server gets. Every call has a deadline; every failure is a
`KubeError` with the HTTP status (0: no answer at all), the reason and the call.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.config import ConfigException, load_incluster_config, load_kube_config

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
EXEC_REFRESH_SECONDS = 60.0  # how often an exec plugin without expiry is asked again


class KubeConfigError(ValueError):
    """No usable cluster configuration: names where it looked and what to do."""


class KubeError(RuntimeError):
    """An API call answered with an error status (or not at all: status 0)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


# ---- configuration ------------------------------------------------------------------------------


async def load_configuration(kubeconfig: str | os.PathLike[str] | None = None, *,
                             env: Mapping[str, str] | None = None,
                             service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> Configuration:
    """Where the API server is and how to authenticate (see the module docstring for the
    order). Runs an exec credential plugin once; raises KubeConfigError."""
    env = os.environ if env is None else env
    cfg = Configuration()
    paths = str(kubeconfig) if kubeconfig else env.get("KUBECONFIG", "")
    if not paths and env.get("KUBERNETES_SERVICE_HOST"):
        token = service_account_dir / "token"
        if not token.is_file():
            raise KubeConfigError(f"no service account token at {token}: does the pod mount "
                                  "one (automountServiceAccountToken)?")
        try:
            load_incluster_config(client_configuration=cfg, environ=dict(env),
                                  token_filename=str(token),
                                  cert_filename=str(service_account_dir / "ca.crt"))
        except ConfigException as exc:
            raise KubeConfigError(f"in-cluster configuration ({service_account_dir}): "
                                  f"{exc}") from exc
        return cfg
    if not paths:
        default = Path(env.get("HOME") or Path.home()) / ".kube" / "config"
        if not default.is_file():
            raise KubeConfigError("no Kubernetes API configuration: set KUBECONFIG, or run in "
                                  "a pod (KUBERNETES_SERVICE_HOST is not set)")
        paths = str(default)
    if not any(Path(p).expanduser().is_file() for p in paths.split(os.pathsep) if p):
        raise KubeConfigError(f"cannot read the kubeconfig {paths}: no such file")
    try:
        loader = await load_kube_config(config_file=paths, client_configuration=cfg,
                                        persist_config=False)
    except (ConfigException, KeyError, TypeError, AssertionError, ValueError, OSError) as exc:
        raise KubeConfigError(f"kubeconfig {paths}: {type(exc).__name__}: {exc}") from exc
    # kubernetes_asyncio keeps the current context's user on the loader (its own
    # refresh_token reads it there too).
    user = getattr(loader, "_user", None)
    if user is not None and "exec" in user:
        cfg.refresh_api_key_hook = _ExecRefresh(loader)
    return cfg


class _ExecRefresh:
    """Asks the exec plugin again before its token expires (the loader skips the plugin
    while the token it has is fresh), at most once a minute; one call at a time."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.next = time.monotonic() + EXEC_REFRESH_SECONDS
        self.lock = asyncio.Lock()

    async def __call__(self, cfg: Configuration) -> None:
        if time.monotonic() < self.next:
            return
        async with self.lock:
            if time.monotonic() < self.next:
                return
            await self.loader.load_from_exec_plugin()
            # A plugin that answers with a client certificate instead keeps the first one:
            # the connection pool's TLS context is made once.
            token = getattr(self.loader, "token", None)
            if token:
                cfg.api_key["BearerToken"] = token
            self.next = time.monotonic() + EXEC_REFRESH_SECONDS


@dataclass(frozen=True)
class Credentials:
    """The configuration as another client (kopf's) takes it."""

    server: str
    ca_path: str | None
    insecure: bool
    scheme: str | None  # of the Authorization header: Bearer, Basic
    token: str | None
    certificate_path: str | None
    private_key_path: str | None


async def credentials(cfg: Configuration) -> Credentials:
    header = await cfg.get_api_key_with_prefix("BearerToken") or ""
    scheme, _, token = header.partition(" ")
    return Credentials(server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
                       scheme=scheme or None, token=token or None,
                       certificate_path=cfg.cert_file, private_key_path=cfg.key_file)


# ---- the client ---------------------------------------------------------------------------------


class KubeClient:
    """Requests and watches over one connection pool. Create it inside the event loop that
    uses it; `close()` when done."""

    def __init__(self, cfg: Configuration, *, timeout: float = 15.0,
                 user_agent: str = "tandem") -> None:
        self.cfg = cfg
        self.timeout = timeout
        self.api = ApiClient(cfg)
        self.api.user_agent = user_agent

    @property
    def server(self) -> str:
        return self.cfg.host

    async def close(self) -> None:
        await self.api.close()

    async def _send(self, method: str, path: str, query: Mapping[str, Any] | None,
                    body: Any, content_type: str | None,
                    timeout: float | tuple[float, float]) -> aiohttp.ClientResponse:
        headers = {"Accept": "application/json",
                   "Content-Type": content_type or "application/json"}
        call = f"{method} {path}" + (f"?{urlencode(query)}" if query else "")
        try:
            return await self.api.call_api(
                path, method, query_params=dict(query or {}), header_params=headers,
                body=body, auth_settings=["BearerToken"], _preload_content=False,
                _request_timeout=timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise KubeError(0, type(exc).__name__, f"{call}: {exc}") from exc

    @staticmethod
    async def _fail(rsp: aiohttp.ClientResponse, call: str) -> KubeError:
        raw = await rsp.read()
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:
            data = {}
        data = data if isinstance(data, dict) else {}
        message = data.get("message") or raw[:200].decode(errors="replace")
        return KubeError(rsp.status, str(data.get("reason") or rsp.reason), f"{call}: {message}")

    async def request(self, method: str, path: str, *, query: Mapping[str, Any] | None = None,
                      body: Any = None, content_type: str | None = None,
                      timeout: float | None = None) -> dict[str, Any]:
        """One call; the decoded JSON answer ({} when empty)."""
        call = f"{method} {path}"
        rsp = await self._send(method, path, query, body, content_type, timeout or self.timeout)
        try:
            if not 200 <= rsp.status <= 299:
                raise await self._fail(rsp, call)
            try:
                raw = await rsp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise KubeError(0, type(exc).__name__, f"{call}: {exc}") from exc
        finally:
            rsp.release()
        try:
            data = json.loads(raw) if raw else {}
        except ValueError as exc:
            raise KubeError(rsp.status, "BadJSON", f"{call}: {raw[:200]!r}") from exc
        return data if isinstance(data, dict) else {}

    async def watch(self, path: str, query: Mapping[str, Any], *,
                    idle_timeout: float) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch request (`watch=true` is added), until the server ends it.
        A connection silent for `idle_timeout` seconds is broken: KubeError(0, ...)."""
        call = f"GET {path} (watch)"
        rsp = await self._send("GET", path, {**query, "watch": "true"}, None, None,
                               (self.timeout, idle_timeout))
        try:
            if not 200 <= rsp.status <= 299:
                raise await self._fail(rsp, call)
            while True:
                try:
                    line = await rsp.content.readline()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    raise KubeError(0, type(exc).__name__, f"{call}: {exc}") from exc
                if not line:
                    return
                if line.strip():
                    try:
                        yield json.loads(line)
                    except ValueError as exc:
                        raise KubeError(0, "BadJSON", f"{call}: {line[:200]!r}") from exc
        finally:
            rsp.release()
