"""The gate in front of the engine's admin API: the token first, then a bounded body.

FastAPI reads and parses a route's body (its pydantic model) before the route's own
code runs, so a token checked inside a route comes too late: an unauthenticated
`POST /v1/refit` with a 200 MB body was read, parsed (the engine grew from 0.8 to 2 GB)
and only then refused. `AdminGuard` is a plain ASGI middleware in front of the whole app
that decides from the request line and headers alone, before anything reads a byte of
the body:

* With an admin token configured, every request that is not a read (any method but GET
  and HEAD, on any path, routes yet to be written included) must carry
  `Authorization: Bearer TOKEN` (`tandem_engine.bearer`: digests, `hmac.compare_digest`);
  else 401. Reads stay open: the probes (`/healthz`, `/readyz`) for the kubelet,
  `/metrics` for Prometheus, and `GET /v1/state`, a snapshot of what `/metrics` already
  exports (state, weights, queue, device); the operator and `tandem serve` send the
  token anyway. The app's OpenAPI description and docs are off (`admin.py`).
* Every body is bounded (`MAX_ADMIN_BODY_BYTES`): a declared `Content-Length` over it
  answers 413 unread; a body of unknown length (chunked) is counted as it streams and
  cut at the limit, 413. The body is read here (at most the limit, once) and handed to
  the app. How long it may take to arrive is the HTTP protocol's rule (`http_guard.py`,
  `tandem-engine --body-timeout`: 408), as are the header deadline and the lingering
  close that lets a client still sending read its refusal.

A refusal before the body is read says `Connection: close`: the unread rest is never
parsed, and the client cannot reuse a connection in an unknown state. No input reaches the
engine's code before these checks, so no admin request, authenticated or not, can grow
the engine's memory by more than the limit, or make it exit.
"""

from __future__ import annotations

import json
from typing import Any

from tandem_engine.bearer import BearerTokens, bearer_token

MAX_ADMIN_BODY_BYTES = 64 * 1024  # the largest admin body (a canary's 256 ids) is ~2 KB
READ_METHODS = frozenset({"GET", "HEAD"})

UNAUTHORIZED = ("this admin call needs 'Authorization: Bearer <token>' with the engine's "
                "admin token (--admin-token-file or $TANDEM_ADMIN_TOKEN)")


def guard_admin_app(app: Any, admin_token: str | None) -> Any:
    """Put `AdminGuard` in front of a FastAPI `app` (the admin app, the metrics app, or
    the loading one that answers on those ports first): the token and the body bound
    before any route runs."""
    app.add_middleware(AdminGuard, token=admin_token)
    return app


def too_large(size: int | None, limit: int) -> str:
    got = "" if size is None else f" ({size} bytes)"
    return (f"the request body{got} is over the admin API's limit of {limit} bytes: admin "
            "calls take small JSON bodies (a refit's URI, a canary's prompt)")


class AdminGuard:
    """ASGI middleware: the token for every non-read request, then the body bound."""

    def __init__(self, app: Any, token: str | None = None,
                 max_body_bytes: int = MAX_ADMIN_BODY_BYTES) -> None:
        self.app = app
        self._tokens = None if token is None else BearerTokens([token])
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (self._tokens is not None and scope["method"] not in READ_METHODS
                and not self._tokens.accepts(bearer_token(scope["headers"]))):
            await _refuse(send, 401, UNAUTHORIZED,
                          [(b"www-authenticate", b'Bearer realm="tandem-engine admin"')])
            return
        declared = _content_length(scope["headers"])
        if declared is not None and declared > self.max_body_bytes:
            await _refuse(send, 413, too_large(declared, self.max_body_bytes))
            return
        body = await self._read_body(receive, send)
        if body is None:  # refused, or the client went away
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Any, send: Any) -> bytes | None:
        """The whole body, at most `max_body_bytes` of it; None once a refusal was sent
        (or the client disconnected: the protocol's body deadline included)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _refuse(send, 413, too_large(None, self.max_body_bytes))
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Any):
    """A `receive` that gives the app the body read already, then the server's own
    messages (the disconnect)."""
    pending = True

    async def replay() -> dict[str, Any]:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The declared Content-Length (the server rejected a malformed one already)."""
    for name, value in headers:
        if name.lower() == b"content-length" and value.strip().isdigit():
            return int(value)
    return None


async def _refuse(send: Any, status: int, message: str,
                  headers: list[tuple[bytes, bytes]] = ()) -> None:
    """The admin API's error shape ({"error": {"message", "code"}}), closing the
    connection: its unread body is never read."""
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})
