"""The engines' admin API as the refit orchestration calls it (httpx, a deadline on every
call, the pool's bearer token). Errors carry the engine, the call and the engine's own
message, because they end up in a Degraded condition a human reads."""

from __future__ import annotations

from typing import Any

import httpx


class AdminError(Exception):
    def __init__(self, engine: str, call: str, message: str, status: int | None = None):
        super().__init__(f"engine {engine}: {call}: {message}")
        self.engine, self.call, self.message, self.status = engine, call, message, status


class FleetAdmin:
    def __init__(self, token: str | None = None, timeout: float = 10.0,
                 refit_timeout: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout)
        self.refit_timeout = refit_timeout

    async def close(self) -> None:
        await self._client.aclose()

    async def state(self, url: str) -> dict[str, Any] | None:
        """GET /v1/state, or None when the engine does not answer."""
        try:
            r = await self._client.get(f"{url}/v1/state")
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    async def call(self, engine: str, url: str, path: str, body: dict[str, Any] | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        try:
            r = await self._client.post(f"{url}{path}", json=body,
                                        timeout=timeout or self._client.timeout)
        except httpx.HTTPError as exc:
            raise AdminError(engine, f"POST {path}", f"{type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            try:
                body = r.json()
                detail = (body.get("error") or {}).get("message") or body.get("detail") or r.text
            except (ValueError, AttributeError):
                detail = r.text
            raise AdminError(engine, f"POST {path}", f"HTTP {r.status_code}: {detail}",
                             r.status_code)
        return r.json()
