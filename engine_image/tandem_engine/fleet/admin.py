"""The one client of the engines' admin HTTP API (`tandem_engine.server.admin`), used by the
operator (refit passes, drains on scale-down and pool deletion), `tandem refit` and the tests.
Torch-free (httpx).

* Every call has a deadline (`timeout`; a refit and the canary get longer ones): an engine
  that does not answer is an error after it, never waited on without bound.
* One error type, `AdminError`: the engine, the call (`POST /v1/drain`) and the cause (the
  engine's own message with its HTTP status, or what the connection did: refused, timed
  out). They end up in a Degraded condition or a command's stderr, read by a human.
* The pool's bearer token is given once, to the client.
* Typed replies: the engine's state is an `admin_wire.EngineStatus`, the struct the engine
  builds it as; a reply that does not decode as one is an `AdminError` naming the field.
  Request bodies are the `admin_wire` structs' `to_body()`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from tandem_engine.admin_wire import EngineStatus, decode_status


class AdminError(Exception):
    """An admin call failed; `status` is the engine's HTTP status (None: no HTTP status).
    `no_answer`: the engine never answered (refused, reset, timed out: it may have died),
    as opposed to answering with an error or a malformed reply."""

    def __init__(self, engine: str, call: str, message: str, status: int | None = None,
                 *, no_answer: bool = False):
        super().__init__(f"engine {engine}: {call}: {message}")
        self.engine, self.call, self.message, self.status = engine, call, message, status
        self.no_answer = no_answer


@dataclass(frozen=True)
class DrainResult:
    supported: bool  # the engine has POST /v1/drain
    drained: bool  # nothing ran or waited (nor stayed pinned, when asked) when the drain ended
    num_running: int = 0
    num_waiting: int = 0
    seconds: float = 0.0
    pinned_blocks: int = 0


def admin_url(ip: str, port: int) -> str:
    """The admin API of an engine at this address (IPv6 in brackets)."""
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


class EngineAdmin:
    """Admin calls to the engines of one pool (one bearer token), on one connection pool."""

    def __init__(self, token: str | None = None, *, timeout: float = 10.0,
                 refit_timeout: float = 600.0, poll_interval: float = 0.5) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout)
        self.refit_timeout = refit_timeout
        self.poll_interval = poll_interval

    async def close(self) -> None:
        await self._client.aclose()

    async def _request(self, method: str, engine: str, url: str, path: str,
                       body: dict[str, Any] | None = None, timeout: float | None = None
                       ) -> dict[str, Any]:
        call = f"{method} {path}"
        try:
            r = await self._client.request(
                method, f"{url}{path}", json=body,
                timeout=timeout if timeout is not None else self._client.timeout)
        except httpx.HTTPError as exc:
            raise AdminError(engine, call, f"{type(exc).__name__}: {exc}",
                             no_answer=True) from exc
        try:
            data = r.json()
        except ValueError:
            data = None
        if r.status_code != 200:
            detail = r.text[:500]
            if isinstance(data, dict):
                detail = ((data.get("error") or {}).get("message") or data.get("detail")
                          or detail)
            raise AdminError(engine, call, f"HTTP {r.status_code}: {detail}", r.status_code)
        if not isinstance(data, dict):
            raise AdminError(engine, call, f"HTTP 200 without a JSON object: {r.text[:200]!r}",
                             r.status_code)
        return data

    async def state(self, url: str, engine: str | None = None) -> EngineStatus:
        """GET /v1/state: state, weights, num_running, num_waiting, draining..."""
        engine = engine or url
        data = await self._request("GET", engine, url, "/v1/state")
        try:
            return decode_status(data)
        except msgspec.ValidationError as exc:
            raise AdminError(engine, "GET /v1/state", f"malformed state {str(data)[:200]}: "
                             f"{exc}", 200) from exc

    async def probe(self, url: str) -> EngineStatus | None:
        """GET /v1/state, or None when the engine does not answer (an observation)."""
        try:
            return await self.state(url)
        except AdminError:
            return None

    async def call(self, engine: str, url: str, path: str, body: dict[str, Any] | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        """POST `path` (a lifecycle signal: /v1/pause, /v1/drain, /v1/refit ...)."""
        return await self._request("POST", engine, url, path, body, timeout)

    async def drain(self, engine: str, url: str, timeout: float, *, pins: bool = False
                    ) -> DrainResult:
        """Stop admitting (`POST /v1/drain`), then wait at most `timeout` seconds until
        nothing runs or waits — and with `pins`, until no KV stays pinned for a decode
        engine's pull either (a prefill engine's handoffs are done). A drain must not pause:
        a paused engine stops stepping and its requests would wait with it. An engine
        without the endpoint reports `supported=False`: it drains itself on SIGTERM
        (`--shutdown-grace`)."""
        started = time.monotonic()
        try:
            await self.call(engine, url, "/v1/drain")
        except AdminError as exc:
            if exc.status in (404, 405):
                return DrainResult(supported=False, drained=False)
            raise
        deadline = started + timeout
        while True:
            state = await self.state(url, engine)
            running, waiting = state.num_running, state.num_waiting
            pinned = state.num_pinned_blocks if pins else 0
            if running == 0 and waiting == 0 and pinned == 0:
                return DrainResult(True, True, 0, 0, time.monotonic() - started)
            if time.monotonic() >= deadline:
                return DrainResult(True, False, running, waiting, time.monotonic() - started,
                                   pinned)
            await asyncio.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
