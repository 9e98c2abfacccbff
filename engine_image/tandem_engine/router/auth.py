"""The router's API keys: who may use the OpenAI API.

Keys come from `tandem-router --api-key KEY` (repeatable) and from the environment
variable TANDEM_API_KEY (several keys separated by commas; the operator sets it from the
pool's Secret, and `tandem serve --api-key` passes its keys this way, so they never show
in `ps`). Any configured key is accepted, as `Authorization: Bearer KEY`, the header the
OpenAI clients send. Every path needs one except the probes and the scrape (`OPEN_PATHS`);
a request without a valid key gets 401 in the OpenAI error shape. Keys are compared
through their SHA-256 digests with `hmac.compare_digest`, against every configured key
each time, so neither the time taken nor the answer tells how much of a guess was right.
With no key configured the router serves anyone (and `main` logs a warning saying so).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from tandem_engine.router.openai_format import error_body

API_KEY_ENV = "TANDEM_API_KEY"  # a contract: the operator and `tandem serve` set it
# Kubernetes probes, Prometheus and vLLM's /health stay reachable without a key.
OPEN_PATHS = frozenset({"/health", "/healthz", "/readyz", "/metrics"})


def resolve_api_keys(flag_keys: Iterable[str] | None = None,
                     environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The keys `--api-key` and $TANDEM_API_KEY configure together, blanks dropped, each
    once. A key with whitespace or a comma inside is refused (ValueError): it could not
    be sent in a header, or would be split when passed through the environment."""
    keys: list[str] = []
    for key in [*(flag_keys or ()), *environ.get(API_KEY_ENV, "").split(",")]:
        key = key.strip()
        if not key:
            continue
        if any(c.isspace() or c == "," for c in key) or not key.isprintable():
            raise ValueError(f"an API key (--api-key or ${API_KEY_ENV}) holds whitespace, a "
                             "comma or an unprintable character: use printable characters "
                             "only, and commas only between keys in the variable")
        if key not in keys:
            keys.append(key)
    return tuple(keys)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeyMiddleware:
    """ASGI middleware: answers 401 to an HTTP request outside `OPEN_PATHS` that does not
    carry one of `keys` as a bearer token. A plain ASGI wrapper (not Starlette's
    BaseHTTPMiddleware), so streamed responses and disconnects pass through untouched."""

    def __init__(self, app: Any, keys: Iterable[str]) -> None:
        self.app = app
        self._digests = [_digest(k.encode()) for k in keys]
        if not self._digests:
            raise ValueError("ApiKeyMiddleware needs at least one key")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        message = self._refusal(_bearer(scope["headers"]))
        if message is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(message, "invalid_request_error", None,
                                     "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="tandem"')]})
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, presented: bytes | None) -> str | None:
        """Why the presented key is refused, or None when it is one of the keys."""
        if presented is None:
            return ("no API key provided: send it in an Authorization header using Bearer "
                    "auth (Authorization: Bearer YOUR_KEY; the openai client's api_key)")
        digest = _digest(presented)
        matched = False
        for known in self._digests:  # no early exit: every key is compared every time
            matched |= hmac.compare_digest(digest, known)
        if matched:
            return None
        return ("incorrect API key provided: use one of the keys the router was started "
                f"with (tandem-router --api-key, or ${API_KEY_ENV})")


def _bearer(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            if scheme.lower() != b"bearer" or not token:
                return None
            return token
    return None
