"""A header-read timeout for the router's HTTP server: slow clients (slowloris) are cut.

uvicorn waits for a request's headers forever: a client that opens connections and
sends a byte now and then holds each one open, and enough of them exhaust the server's
file descriptors. `HeaderTimeoutProtocol` is uvicorn's h11 protocol with one rule added:
from the moment a connection opens, or the first byte of its next request arrives, the
client has `header_timeout` seconds to finish the request line and headers, else the
connection is closed (without an answer: there is no request to answer yet, as nginx's
client_header_timeout does). Time spent on the body or on the response is not bounded
here; an idle kept-alive connection is closed by uvicorn's own keep-alive timeout.

`protocol_class(header_timeout)` gives the class to hand to `uvicorn.Config(http=...)`.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT = 10.0  # seconds; tandem-router --header-timeout


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers take longer
    than `header_timeout` seconds to arrive."""

    header_timeout = DEFAULT_HEADER_TIMEOUT
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # part of a request line or headers so far
            if self._header_timer is None and data and not self.transport.is_closing():
                self._arm_header_timer()
        else:  # the headers are in (or the connection failed): the rule is done
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request may already be waiting in the buffer, or be partial.
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        log.info("closing the connection from %s: its request headers took more than %g s "
                 "(--header-timeout)", _peer(self.client), self.header_timeout)
        self.transport.close()


def protocol_class(header_timeout: float) -> type[HeaderTimeoutProtocol]:
    """The uvicorn HTTP protocol class (`uvicorn.Config(http=...)`) enforcing this
    header-read timeout."""
    if not header_timeout > 0:
        raise ValueError(f"--header-timeout {header_timeout}: it must be > 0 seconds")
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                {"header_timeout": float(header_timeout)})


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
