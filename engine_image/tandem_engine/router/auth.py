"""The router's API keys: who may use the OpenAI API.

Keys come from `tandem-router --api-key-file FILE` (one key a line; repeatable), from the
environment variable TANDEM_API_KEY (several keys separated by commas; the operator sets
it from the pool's Secret, and `tandem serve` passes its keys this way) and from
`--api-key KEY` (repeatable). The file and the variable keep a key out of `ps`;
`--api-key` puts it on the command line, where any user of the machine can read it
(`/proc/PID/cmdline`). Any configured key is accepted, as `Authorization: Bearer KEY`,
the header the OpenAI clients send. Every path needs one except the probes and the
scrape (`OPEN_PATHS`); a request without a valid key gets 401 in the OpenAI error shape.
Keys are compared as `tandem_engine.bearer` compares every token (SHA-256 digests,
`hmac.compare_digest`, every key each time). With no key configured the router serves
anyone (and `main` logs a warning saying so).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tandem_engine.bearer import BearerTokens, bearer_token
from tandem_engine.router.openai_format import error_body

API_KEY_ENV = "TANDEM_API_KEY"  # a contract: the operator and `tandem serve` set it
# Kubernetes probes, Prometheus and vLLM's /health stay reachable without a key.
OPEN_PATHS = frozenset({"/health", "/healthz", "/readyz", "/metrics"})
MAX_KEY_FILE_BYTES = 1 << 20  # a key file is a few lines; anything larger is a mistake


def read_api_key_file(path: Path, flag: str = "--api-key-file") -> list[str]:
    """The keys in a key file: one a line, blank lines and surrounding whitespace dropped.
    ValueError naming the file (and `flag`) when it cannot be read or holds no key."""
    try:
        with Path(path).open("rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot be read ({exc.strerror or exc}); give a "
                         "readable file holding one API key a line") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"{flag} {path}: over {MAX_KEY_FILE_BYTES} bytes; give a file "
                         "holding one API key a line")
    try:
        keys = [line.strip() for line in data.decode().splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not UTF-8 text; give a file holding one API key "
                         "a line") from None
    if not keys:
        raise ValueError(f"{flag} {path}: holds no key; write one API key a line")
    return keys


def resolve_api_keys(flag_keys: Iterable[str] | None = None,
                     environ: Mapping[str, str] = os.environ,
                     key_files: Iterable[Path] | None = None) -> tuple[str, ...]:
    """The keys `--api-key`, `--api-key-file` and $TANDEM_API_KEY configure together,
    blanks dropped, each once. A key with whitespace or a comma inside is refused
    (ValueError): it could not be sent in a header, or would be split when passed
    through the environment."""
    keys: list[str] = []
    from_files = [key for path in key_files or () for key in read_api_key_file(path)]
    for key in [*(flag_keys or ()), *from_files, *environ.get(API_KEY_ENV, "").split(",")]:
        key = key.strip()
        if not key:
            continue
        if any(c.isspace() or c == "," for c in key) or not key.isprintable():
            raise ValueError(f"an API key (--api-key, --api-key-file or ${API_KEY_ENV}) "
                             "holds whitespace, a comma or an unprintable character: use "
                             "printable characters only, and commas only between keys in "
                             "the variable")
        if key not in keys:
            keys.append(key)
    return tuple(keys)


class ApiKeyMiddleware:
    """ASGI middleware: answers 401 to an HTTP request outside `OPEN_PATHS` that does not
    carry one of `keys` as a bearer token. A plain ASGI wrapper (not Starlette's
    BaseHTTPMiddleware), so streamed responses and disconnects pass through untouched."""

    def __init__(self, app: Any, keys: Iterable[str]) -> None:
        self.app = app
        try:
            self._keys = BearerTokens(keys)
        except ValueError:
            raise ValueError("ApiKeyMiddleware needs at least one key") from None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        message = self._refusal(bearer_token(scope["headers"]))
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
        if self._keys.accepts(presented):
            return None
        return ("incorrect API key provided: use one of the keys the router was started "
                f"with (tandem-router --api-key-file, --api-key, or ${API_KEY_ENV})")
