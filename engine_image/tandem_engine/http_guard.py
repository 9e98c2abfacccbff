"""Request-read deadlines and clean refusals for Tandem's HTTP servers (router and engine).

uvicorn's h11 protocol trusts its clients: it waits forever for a request's headers and
body, answers a malformed request in text/plain, and closes a connection whose body it
did not read with those bytes still unread, which the kernel turns into a reset that
destroys the answer before the client reads it. `GuardedH11Protocol` is that protocol
with the rules an exposed server needs, one deadline at a time on one timer:

* headers: from the moment a connection opens, or the first byte of its next request
  arrives, the client has `header_timeout` seconds to finish the request line and
  headers, else the connection is closed without an answer: there is no request to
  answer yet (nginx's client_header_timeout; slowloris).
* body: once the headers are in, the body has `body_timeout` seconds to arrive (a total,
  not a gap: a client sending a byte a second is cut too), else the client gets 408 and
  the connection is closed (nginx's client_body_timeout).
* malformed requests (a request line or headers over h11's 16 KiB, a NUL byte in a
  header, ...) get 431 or 400 in the server's JSON error shape, naming what was wrong.
* lingering close: when the server closes a connection while the client may still be
  sending (a 413 before the body was read, a malformed request), it half-closes instead,
  keeps reading and discarding for at most `LINGERING_TIME` seconds and `LINGERING_BYTES`
  bytes (`LINGERING_TIMEOUT` without a byte ends it sooner), and closes once the client
  has (nginx's lingering_close). The client finishes sending and reads the answer. The
  lingering never outlasts the header or body deadline in force: a slow client holds a
  connection no longer than those two allow, answered or not.

An idle kept-alive connection is closed by uvicorn's own keep-alive timeout.

`protocol_class(header_timeout, body_timeout, error_body)` gives the class to hand to
`uvicorn.Config(http=...)`; `error_body(status, message)` is the server's error JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from typing import Any

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

log = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT = 10.0  # seconds; --header-timeout
DEFAULT_BODY_TIMEOUT = 30.0  # seconds; --body-timeout (4 MiB in 30 s: 140 KB/s at least)
LINGERING_TIME = 30.0  # seconds a lingering close reads at most (nginx's lingering_time)
LINGERING_TIMEOUT = 5.0  # seconds without a byte that end it sooner (nginx's lingering_timeout)
LINGERING_BYTES = 64 * 1024 * 1024  # bytes it discards at most, then closes anyway

ErrorBody = Callable[[int, str], dict[str, Any]]  # (status, message) -> the JSON to send


def _minimal_error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "code": status}}


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines, JSON answers to malformed
    requests and a lingering close (the module docstring says why)."""

    header_timeout = DEFAULT_HEADER_TIMEOUT
    body_timeout = DEFAULT_BODY_TIMEOUT
    error_body: ErrorBody = staticmethod(_minimal_error_body)  # protocol_class sets the server's

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_header_bytes = (self.config.h11_max_incomplete_event_size
                                 or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)
        self.conn = _Connection(h11.SERVER, self.max_header_bytes)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # what the deadline is for: headers, body, linger
        self._deadline_at = 0.0  # the loop time it fires at
        self.raw_transport: asyncio.Transport = None  # type: ignore[assignment]
        self._linger_end = 0.0
        self._lingered_bytes = 0

    # ---- the asyncio protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.raw_transport = transport
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        self._arm("headers", self.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._phase == "linger":
            self._discard(len(data))
            return
        super().data_received(data)
        self._follow(arrived=bool(data))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request may already be waiting in the buffer, or be partial.
        self._follow(arrived=bool(self.conn.trailing_data[0]))

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 could not parse, in JSON, saying why."""
        status, message = _describe(self.conn.protocol_error, self.max_header_bytes)
        log.info("refusing a malformed request from %s with %d: %s", _peer(self.client),
                 status, message)
        self._answer(status, message)
        self.transport.close()  # lingers: the client may still be sending its headers

    # ---- the deadlines ------------------------------------------------------------------------

    def _follow(self, arrived: bool) -> None:
        """Arm the deadline that fits how far the client's request has come."""
        if self._phase == "linger":  # the connection is closing: that deadline stays
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # part of a request line or headers so far, or nothing
            if self._phase != "headers" and arrived and not self.raw_transport.is_closing():
                self._arm("headers", self.header_timeout)
        elif state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body", self.body_timeout)
        else:  # the request is in, or the connection failed: no rule applies
            self._disarm()

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._deadline_at = self.loop.time() + seconds
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, None

    def _expired(self) -> None:
        phase = self._phase
        self._deadline, self._phase = None, None
        if self.raw_transport.is_closing():
            return
        if phase == "headers" and self.conn.their_state is h11.IDLE:
            log.info("closing the connection from %s: its request headers took more than %g s "
                     "(--header-timeout)", _peer(self.client), self.header_timeout)
            self.raw_transport.close()
        elif phase == "body" and self.conn.their_state is h11.SEND_BODY:
            log.info("closing the connection from %s: its request body took more than %g s "
                     "(--body-timeout)", _peer(self.client), self.body_timeout)
            self._answer(408, f"the request body did not arrive within {self.body_timeout:g} s "
                              "of its headers (the server's --body-timeout): send the body "
                              "at once, or ask for a longer --body-timeout")
            self.raw_transport.close()  # no lingering: the slow client is what is cut
        elif phase == "linger":
            self.raw_transport.close()

    # ---- answers and the lingering close ------------------------------------------------------

    def _answer(self, status: int, message: str) -> None:
        """Send `status` with the server's JSON error body and Connection: close, if no
        response has started on this connection; the request's handler, if one runs, is
        told its client is gone (its own answer would come second)."""
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # IDLE: no request parsed
            body = json.dumps(self.error_body(status, message)).encode()
            headers = [(b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=status, headers=headers,
                                       reason=STATUS_PHRASES[status]),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.raw_transport.write(self.conn.send(event))
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()

    def close_transport(self) -> None:
        """Close the connection, lingering if the client may still be sending (its body
        after an early answer, or the rest of a malformed request)."""
        raw = self.raw_transport
        if self._phase == "linger" or raw.is_closing() or self.conn.their_state not in (
                h11.SEND_BODY, h11.ERROR):
            raw.close()
            return
        self._linger_end = self.loop.time() + LINGERING_TIME
        if self._phase in ("headers", "body"):
            self._linger_end = min(self._linger_end, self._deadline_at)
        self._arm("linger", max(0.0, min(LINGERING_TIMEOUT,
                                         self._linger_end - self.loop.time())))
        if raw.can_write_eof():
            raw.write_eof()  # after the answer: the client reads it, then our end of stream
        raw.resume_reading()

    def _discard(self, size: int) -> None:
        self._lingered_bytes += size
        left = self._linger_end - self.loop.time()
        if self._lingered_bytes > LINGERING_BYTES or left <= 0:
            self._disarm()
            self.raw_transport.close()
        else:
            self._arm("linger", min(LINGERING_TIMEOUT, left))


class _LingeringTransport:
    """The transport as uvicorn's protocol and request cycles see it: `close()` asks the
    protocol, which may linger first; while it lingers the connection reads as closing,
    and writes or read pauses from uvicorn are dropped."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def _lingering(self) -> bool:
        return self._protocol._phase == "linger"

    def close(self) -> None:
        self._protocol.close_transport()

    def is_closing(self) -> bool:
        return self._lingering() or self._transport.is_closing()

    def write(self, data: bytes) -> None:
        if not self._lingering():
            self._transport.write(data)

    def pause_reading(self) -> None:
        if not self._lingering():
            self._transport.pause_reading()


class _Connection(h11.Connection):
    """h11's server connection, keeping the error that ended a request's parse (uvicorn's
    handle_events swallows it, and the answer should say what was wrong)."""

    protocol_error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.protocol_error = exc
            raise


def _describe(error: h11.RemoteProtocolError | None, max_header_bytes: int) -> tuple[int, str]:
    """The status and message for a request h11 refused to parse. h11's own words are
    kept, cut before any quoted bytes of the request (a header's value may be a secret)."""
    text = str(error) if error is not None else "unparseable request"
    if getattr(error, "error_status_hint", 400) == 431:
        return 431, (f"the request line and headers are over the limit of {max_header_bytes} "
                     f"bytes ({max_header_bytes // 1024} KiB, h11's max incomplete event "
                     "size): send smaller headers, and put large data in the body")
    reason = _QUOTED.split(text, maxsplit=1)[0]
    if reason in ("illegal header line", "Illegal header value"):
        return 400, (f"invalid byte in a header ({reason}): a header line is 'Name: value', "
                     "and a value may hold visible ASCII, spaces and tabs only, never a "
                     "control character such as NUL; encode anything else (percent- or "
                     "base64-encoding)")
    if reason == "Illegal header name":
        return 400, ("invalid byte in a header name: names are letters, digits and "
                     "!#$%&'*+-.^_`|~ only")
    return 400, f"malformed HTTP/1.1 request ({reason}): send a valid HTTP/1.1 request"


# Where h11's message starts quoting the request's bytes: `: b'...'`, ` bytearray(b'...')`.
_QUOTED = re.compile(r":? (?:bytearray\()?b['\"]")


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def add_deadline_flags(parser: Any, clients: str = "a client") -> None:
    """`--header-timeout` and `--body-timeout` on a server's argparse `parser` (the router,
    the engine's admin and metrics ports), `clients` naming who is cut."""
    parser.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                        help=f"seconds {clients} gets to send a request's line and headers "
                             "before its connection is closed (slowloris; default "
                             "%(default)s)")
    parser.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                        help=f"seconds {clients} gets, once its headers are in, to send the "
                             "whole request body; a later one gets 408 and its connection "
                             "is closed (slow bodies; default %(default)s)")


def protocol_class(header_timeout: float, body_timeout: float,
                   error_body: ErrorBody) -> type[GuardedH11Protocol]:
    """The uvicorn HTTP protocol class (`uvicorn.Config(http=...)`) enforcing these
    deadlines and answering with `error_body`'s JSON."""
    for flag, seconds in (("--header-timeout", header_timeout),
                          ("--body-timeout", body_timeout)):
        if not seconds > 0:
            raise ValueError(f"{flag} {seconds}: it must be > 0 seconds")
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": float(header_timeout), "body_timeout": float(body_timeout),
                 "error_body": staticmethod(error_body)})
