"""CURVE authentication of the engines' ZMQ socket: who may talk to an engine at all.

An engine's ROUTER socket is a CURVE server whose ZAP handler admits only the client
public keys on its allow-list (the pool's routers' key), so a process that merely
reaches the port can neither HELLO nor SUBMIT: its handshake fails before any frame
is read. The keys come from the environment (a Kubernetes Secret, or `tandem serve`,
which makes fresh ones per stack), never from argv, where `ps` would show them:

    engine  TANDEM_ZMQ_SERVER_SECRET_KEY, TANDEM_ZMQ_CLIENT_PUBLIC_KEY
    router  TANDEM_ZMQ_SERVER_PUBLIC_KEY, TANDEM_ZMQ_CLIENT_SECRET_KEY

Keys are Z85 text (40 characters), as `zmq.curve_keypair()` makes them; the client
public key may list several, comma-separated (a key rotation). All of a side's
variables unset: plaintext, as before (the caller logs a warning). Partly set or
malformed: `ZmqAuthError`, naming the variable and the fix, at start-up.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.z85 import Z85CHARS

log = logging.getLogger(__name__)

SERVER_SECRET_KEY = "TANDEM_ZMQ_SERVER_SECRET_KEY"
CLIENT_PUBLIC_KEY = "TANDEM_ZMQ_CLIENT_PUBLIC_KEY"
SERVER_PUBLIC_KEY = "TANDEM_ZMQ_SERVER_PUBLIC_KEY"
CLIENT_SECRET_KEY = "TANDEM_ZMQ_CLIENT_SECRET_KEY"
ALL_VARIABLES = (SERVER_SECRET_KEY, CLIENT_PUBLIC_KEY, SERVER_PUBLIC_KEY, CLIENT_SECRET_KEY)
_ZAP_DOMAIN = "tandem"
_KEY_CHARS = 40  # a 32-byte key in Z85


class ZmqAuthError(ValueError):
    """The CURVE keys in the environment are incomplete or malformed."""


def _key(name: str, value: str) -> bytes:
    value = value.strip()
    if len(value) != _KEY_CHARS or not set(value.encode()) <= set(Z85CHARS):
        raise ZmqAuthError(f"${name} is not a CURVE key: give the {_KEY_CHARS}-character "
                           "Z85 text that zmq.curve_keypair() makes (python -c 'import "
                           "zmq; print(zmq.curve_keypair())'), or unset every "
                           "TANDEM_ZMQ_* variable for an unauthenticated socket")
    return value.encode()


def _both_or_neither(environ: Mapping[str, str], names: tuple[str, str], side: str
                     ) -> bool:
    """Whether both variables are set (False: neither); ZmqAuthError for one alone."""
    present = [n for n in names if environ.get(n, "").strip()]
    if not present:
        return False
    if len(present) != len(names):
        (missing,) = set(names) - set(present)
        raise ZmqAuthError(f"${missing} is not set but ${present[0]} is: {side} needs both "
                           f"{' and '.join('$' + n for n in names)} for CURVE "
                           "authentication, or neither for an unauthenticated socket")
    return True


@dataclass(frozen=True)
class CurveServer:
    """An engine's side: its secret key and the client public keys it admits."""

    secret_key: bytes = field(repr=False)
    client_keys: frozenset[bytes]

    def secure(self, socket: zmq.Socket) -> ThreadAuthenticator:
        """Make `socket` (before it binds) a CURVE server admitting only `client_keys`.
        Starts the context's ZAP handler (one per context); the caller stops it after
        closing the socket."""
        auth = ThreadAuthenticator(socket.context, log=log)
        auth.start()
        auth.configure_curve_callback(_ZAP_DOMAIN, _AllowList(self.client_keys))
        socket.zap_domain = _ZAP_DOMAIN.encode()
        socket.curve_secretkey = self.secret_key
        socket.curve_publickey = zmq.curve_public(self.secret_key)
        socket.curve_server = True
        return auth


@dataclass(frozen=True)
class CurveClient:
    """A router's side: the engines' public key and the router's own secret key."""

    server_key: bytes
    secret_key: bytes = field(repr=False)

    def secure(self, socket: zmq.Socket) -> None:
        """Make `socket` (before it connects) a CURVE client of the engines."""
        socket.curve_serverkey = self.server_key
        socket.curve_secretkey = self.secret_key
        socket.curve_publickey = zmq.curve_public(self.secret_key)


class _AllowList:
    """pyzmq's ZAP credentials provider: admits the listed client keys, logs the rest
    (a few in full, then a count, so a flood of handshakes cannot flood the log)."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys
        self.refused = 0

    def callback(self, _domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.refused += 1
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.warning("refused a ZMQ client whose CURVE key %s is not the pool's "
                        "routers' key (%d refused so far)", key.decode(errors="replace"),
                        self.refused)
        return False


def engine_curve(environ: Mapping[str, str] | None = None) -> CurveServer | None:
    """The engine's CURVE keys from the environment, None when none is set."""
    environ = os.environ if environ is None else environ
    if not _both_or_neither(environ, (SERVER_SECRET_KEY, CLIENT_PUBLIC_KEY), "an engine"):
        return None
    secret = _key(SERVER_SECRET_KEY, environ[SERVER_SECRET_KEY])
    listed = [k for k in environ[CLIENT_PUBLIC_KEY].split(",") if k.strip()] or [""]
    clients = frozenset(_key(CLIENT_PUBLIC_KEY, k) for k in listed)
    _check_secret(secret, SERVER_SECRET_KEY)
    return CurveServer(secret, clients)


def router_curve(environ: Mapping[str, str] | None = None) -> CurveClient | None:
    """The router's CURVE keys from the environment, None when none is set."""
    environ = os.environ if environ is None else environ
    if not _both_or_neither(environ, (SERVER_PUBLIC_KEY, CLIENT_SECRET_KEY), "a router"):
        return None
    server = _key(SERVER_PUBLIC_KEY, environ[SERVER_PUBLIC_KEY])
    secret = _key(CLIENT_SECRET_KEY, environ[CLIENT_SECRET_KEY])
    _check_secret(secret, CLIENT_SECRET_KEY)
    return CurveClient(server, secret)


def _check_secret(secret: bytes, name: str) -> None:
    try:
        zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError) as exc:
        raise ZmqAuthError(f"${name} is not a usable CURVE secret key ({exc}): give the "
                           "secret half of zmq.curve_keypair()") from exc


def unauthenticated_warning(port: int | str) -> str:
    """The one line an engine logs when it runs without CURVE."""
    return (f"ZMQ unauthenticated: any process that reaches port {port} can submit; set "
            f"${SERVER_SECRET_KEY} and ${CLIENT_PUBLIC_KEY} (the pool's routers' key) to "
            "allow only the pool's routers")


def stack_environments() -> tuple[dict[str, str], dict[str, str]]:
    """Fresh keys for one stack: (the engines' variables, the routers' variables)."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return ({SERVER_SECRET_KEY: server_secret.decode(),
             CLIENT_PUBLIC_KEY: client_public.decode()},
            {SERVER_PUBLIC_KEY: server_public.decode(),
             CLIENT_SECRET_KEY: client_secret.decode()})
