"""Whether a server could listen on a port now: the one check the engine (its ZMQ port,
before the model loads) and `tandem serve` (its router port) make. Torch-free."""

from __future__ import annotations

import socket


def address_family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port now (another process does, or the
    address is not this machine's), or None. Binds as uvicorn and ZMQ do (SO_REUSEADDR),
    so a port that only has connections closing (TIME_WAIT) counts as free."""
    try:
        with socket.socket(address_family(host)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
