"""The operator's client for the engines' admin HTTP API (tandem_engine.server.admin).

Every call has a timeout and carries the pool's admin bearer token. An engine that does not
answer is reported as an `EngineAdminError`, never waited on without bound: reconcile must
keep going when one engine hangs.

Draining: a paused engine stops stepping (its in-flight requests wait with it), so a drain
must not pause. `drain` asks the engine to stop admitting (`POST /v1/drain`) and polls
`/v1/state` until nothing runs or waits. An engine without that endpoint reports
`DrainResult.supported = False`; the operator then relies on the engine's own SIGTERM drain
(`--shutdown-grace`, inside the pod's termination grace period) when it deletes the pod.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from tandem_operator.manifests import ENGINE_ADMIN_PORT


class EngineAdminError(RuntimeError):
    """An admin call failed: unreachable engine, timeout, or an error status."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class DrainResult:
    supported: bool  # the engine has POST /v1/drain
    drained: bool  # nothing ran or waited when the drain ended
    num_running: int = 0
    num_waiting: int = 0
    seconds: float = 0.0


def admin_url(pod_ip: str, port: int = ENGINE_ADMIN_PORT) -> str:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}"


class EngineAdmin:
    """Admin calls to engines, on one shared aiohttp session."""

    def __init__(self, *, timeout: float = 5.0, poll_interval: float = 0.5) -> None:
        self.timeout = timeout
        self.poll_interval = poll_interval
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def _call(self, method: str, base: str, path: str, token: str | None,
                    body: dict[str, Any] | None = None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        url = base + path
        try:
            async with self._client().request(method, url, json=body, headers=headers) as rsp:
                try:
                    data = await rsp.json(content_type=None)
                except ValueError:
                    data = {}
                if rsp.status >= 400:
                    message = ((data or {}).get("error") or {}).get("message") or rsp.reason
                    raise EngineAdminError(f"{method} {url}: {rsp.status} {message}",
                                           rsp.status)
                return data if isinstance(data, dict) else {}
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineAdminError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc

    async def state(self, base: str, token: str | None = None) -> dict[str, Any]:
        """GET /v1/state: state, weight_version, weight_epoch, num_running, num_waiting..."""
        return await self._call("GET", base, "/v1/state", token)

    async def pause(self, base: str, token: str | None) -> dict[str, Any]:
        """Stop stepping (in-flight requests keep their KV and wait)."""
        return await self._call("POST", base, "/v1/pause", token)

    async def unpause(self, base: str, token: str | None) -> dict[str, Any]:
        return await self._call("POST", base, "/v1/unpause", token)

    async def drain(self, base: str, token: str | None, timeout: float) -> DrainResult:
        """Stop admitting, then wait (at most `timeout` s) until nothing runs or waits."""
        started = time.monotonic()
        try:
            await self._call("POST", base, "/v1/drain", token)
        except EngineAdminError as exc:
            if exc.status in (404, 405):
                return DrainResult(supported=False, drained=False)
            raise
        deadline = started + timeout
        while True:
            state = await self.state(base, token)
            running, waiting = int(state.get("num_running", 0)), int(state.get("num_waiting", 0))
            if running == 0 and waiting == 0:
                return DrainResult(True, True, 0, 0, time.monotonic() - started)
            if time.monotonic() >= deadline:
                return DrainResult(True, False, running, waiting, time.monotonic() - started)
            await asyncio.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
