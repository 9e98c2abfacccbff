"""Bearer tokens, as every Tandem HTTP server checks them: the router's API keys
(`router/auth.py`) and the engine's admin token (`server/admin_guard.py`).

One owner for the rule: the token is the `Authorization: Bearer TOKEN` header's value
(the header the OpenAI clients, httpx and the operator send), read from the raw ASGI
headers so a server can refuse a request before anything reads its body; and a
presented token is compared through its SHA-256 digest with `hmac.compare_digest`,
against every accepted token each time, so neither the time taken nor the answer tells
how much of a guess was right. Torch-free, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the request's `Authorization: Bearer TOKEN` header (ASGI headers), or
    None when there is none, or it is another scheme or empty."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            if scheme.lower() != b"bearer" or not token:
                return None
            return token
    return None


class BearerTokens:
    """The tokens a server accepts, kept as digests only."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self._digests = [_digest(t.encode()) for t in tokens]
        if not self._digests:
            raise ValueError("BearerTokens needs at least one token")

    def accepts(self, presented: bytes | None) -> bool:
        """Whether `presented` (None: no token sent) is one of the tokens."""
        if presented is None:
            return False
        digest = _digest(presented)
        matched = False
        for known in self._digests:  # no early exit: every token is compared every time
            matched |= hmac.compare_digest(digest, known)
        return matched


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()
