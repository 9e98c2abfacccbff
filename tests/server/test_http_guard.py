"""The HTTP guard (`tandem_engine.http_guard`) on every port a client can reach: a real
`tandem-router` and a real `tandem-engine` (admin and metrics ports), each with short
header and body deadlines, met by raw sockets, httpx and the async openai client.

* slow headers (slowloris) and slow bodies are cut at their deadline on all three ports,
  while normal requests keep working;
* a malformed request (a 2 MB header, a NUL byte in a header) is answered in the port's
  JSON error shape, naming what was wrong and the limit;
* a body over the router's limit gets its 413 read by every client (the async SDK and
  httpx.AsyncClient too), and the retrying SDK uploads it once.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from tandem_engine.cli.serve import free_port
from test_router_auth import _closed_after

pytestmark = pytest.mark.slow

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.5
SLACK = 3.0  # on top of a deadline, for a busy 2-core machine
TIMEOUT_FLAGS = ("--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT))
PORTS = ("router", "admin", "metrics")
MODEL = "tiny"


@dataclass
class Stack:
    urls: dict[str, str]  # router, admin, metrics
    logs: Path

    def address(self, port: str) -> tuple[str, int]:
        host, number = self.urls[port].removeprefix("http://").split(":")
        return host, int(number)


@pytest.fixture(scope="module")
def stack(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One engine (admin and metrics ports) and one router over it, all with the short
    deadlines."""
    from test_router_e2e import _engine_cmd, _router_cmd, _spawn, _stop, _wait_ready

    logs = tmp_path_factory.mktemp("http-guard")
    zmq, admin, metrics, router = (free_port() for _ in range(4))
    urls = {"router": f"http://127.0.0.1:{router}", "admin": f"http://127.0.0.1:{admin}",
            "metrics": f"http://127.0.0.1:{metrics}"}
    engine = _spawn([*_engine_cmd(tiny_llama, zmq, admin), "--metrics-port", str(metrics),
                     *TIMEOUT_FLAGS], logs / "engine.log")
    procs = [engine]
    try:
        procs.append(_spawn([*_router_cmd(tiny_llama, [f"127.0.0.1:{zmq}"], router),
                             *TIMEOUT_FLAGS], logs / "router.log"))
        _wait_ready(f"{urls['admin']}/readyz", engine, logs / "engine.log")
        _wait_ready(f"{urls['router']}/readyz", procs[1], logs / "router.log")
        yield Stack(urls, logs)
    finally:
        _stop(procs[::-1])


def _error_message(port: str, status: int, body: bytes, code: str | None = None) -> str:
    """The message of an error body, checking it has the port's shape: the OpenAI one on
    the router (with `code`), the admin API's on the engine (server/admin.py)."""
    error = json.loads(body)["error"]
    if port == "router":
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "invalid_request_error"
        assert error["param"] is None and error["code"] == code
    else:
        assert error == {"message": error["message"], "code": status}
    return error["message"]


def _raw_answer(sock: socket.socket) -> tuple[int, bytes, bytes]:
    """Read to the end of stream: (status, header block, body)."""
    data = b""
    sock.settimeout(10)
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head.lower(), body


# ---- slow clients ---------------------------------------------------------------------------




@pytest.mark.parametrize("port", PORTS)
def test_slow_headers_are_cut_at_the_header_timeout(stack: Stack, port: str) -> None:
    url, address = stack.urls[port], stack.address(port)
    slow = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "
            + b"a" * 200)  # never ends its headers
    bound = HEADER_TIMEOUT + SLACK
    # The clock starts when the connection opens.
    with socket.create_connection(address) as s1, socket.create_connection(address) as s2:
        opened = time.monotonic()
        # Meanwhile, normal requests keep working (on their own connections).
        with httpx.Client(base_url=url, timeout=10) as http:
            assert http.get("/healthz").status_code == 200
            took = _closed_after(s1, slow, bound, opened)
            assert HEADER_TIMEOUT * 0.9 <= took < bound, took
            assert http.get("/readyz").status_code == 200
        # A connection that never sends anything is cut too.
        s2.settimeout(bound)
        assert s2.recv(1) == b""
        assert time.monotonic() - opened < bound

    # A kept-alive connection: a prompt first request, then a slow second one.
    with socket.create_connection(address) as s3:
        s3.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        s3.settimeout(5)
        assert s3.recv(4096).startswith(b"HTTP/1.1 200")
        started = time.monotonic()  # the clock restarts with the next request's first byte
        took = _closed_after(s3, slow, bound, started)
        assert HEADER_TIMEOUT * 0.9 <= took < bound, took


# What reads a body on each port: the router's completions, the admin API's canary (its
# JSON body is read before the route runs). The metrics port has no route that takes a
# body: it answers 405 at once, and the unread rest is still cut at the deadline.
SLOW_BODY_PATHS = {"router": "/v1/completions", "admin": "/v1/canary", "metrics": "/metrics"}


def test_slow_bodies_are_cut_at_the_body_timeout_on_every_port(stack: Stack) -> None:
    """Ten connections per port send their headers, then a byte of body every 0.2 s:
    every one is closed about `BODY_TIMEOUT` after its headers, a body-reading route's
    with 408 in the port's error shape."""
    socks: list[tuple[str, socket.socket]] = []
    try:
        for port in PORTS:
            for _ in range(10):
                sock = socket.create_connection(stack.address(port))
                sock.sendall(f"POST {SLOW_BODY_PATHS[port]} HTTP/1.1\r\nHost: x\r\n"
                             "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                             .encode())
                socks.append((port, sock))
        answers, closed = _trickle_bodies([s for _, s in socks], BODY_TIMEOUT + SLACK)
        for (port, _), answer, took in zip(socks, answers, closed, strict=True):
            assert took >= BODY_TIMEOUT * 0.9, (port, took)
            if port == "metrics":  # 405 at once, or 408 if something read the body
                assert answer[:12] in (b"HTTP/1.1 405", b"HTTP/1.1 408"), answer[:200]
                continue
            # The 408 is read unless the close raced a byte of ours (a reset).
            if answer:
                head, _, body = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 408"), head
                assert b"connection: close" in head.lower()
                assert "--body-timeout" in _error_message(port, 408, body)
        assert sum(bool(a) for (p, _), a in zip(socks, answers, strict=True)
                   if p != "metrics") >= 10, "hardly any slow client read its 408"
        # Every port still serves.
        for port in PORTS:
            assert httpx.get(f"{stack.urls[port]}/healthz", timeout=10).status_code == 200
    finally:
        for _, sock in socks:
            sock.close()


def _trickle_bodies(socks: list[socket.socket], limit: float
                    ) -> tuple[list[bytes], list[float]]:
    """Send every socket a byte each 0.2 s until the server closed it (within `limit`
    seconds); return what each was answered and when (seconds from now) it was closed."""
    start = time.monotonic()
    deadline = start + limit
    answers = [b""] * len(socks)
    closed: list[float | None] = [None] * len(socks)
    for sock in socks:
        sock.setblocking(False)
    while None in closed:
        assert time.monotonic() < deadline, (
            f"{closed.count(None)} slow clients still connected after the body timeout")
        for i, sock in enumerate(socks):
            if closed[i] is not None:
                continue
            try:  # read first: the answer, then the end of stream
                while chunk := sock.recv(65536):
                    answers[i] += chunk
                closed[i] = time.monotonic() - start
                continue
            except BlockingIOError:
                pass
            except ConnectionResetError:
                closed[i] = time.monotonic() - start
                continue
            try:
                sock.send(b" ")
            except (BrokenPipeError, ConnectionResetError):
                closed[i] = time.monotonic() - start
            except BlockingIOError:
                pass
        time.sleep(0.2)
    return answers, [c for c in closed if c is not None]


# ---- malformed requests ---------------------------------------------------------------------


@pytest.mark.parametrize("port", PORTS)
def test_malformed_headers_are_answered_in_the_ports_json_shape(stack: Stack,
                                                               port: str) -> None:
    url = stack.urls[port]
    # A 2 MB header: refused at h11's 16 KiB, and the client (still sending) reads it.
    r = httpx.get(f"{url}/healthz", headers={"X-Big": "a" * 2_000_000}, timeout=30)
    assert r.status_code == 431, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.headers["connection"] == "close"
    message = _error_message(port, 431, r.content)
    assert "over the limit of 16384 bytes" in message and "smaller headers" in message

    # A NUL byte in a header's value (httpx refuses to send one: a raw socket).
    with socket.create_connection(stack.address(port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Token: sk-se\x00cret\r\n\r\n")
        status, head, body = _raw_answer(sock)
    assert status == 400 and b"content-type: application/json" in head
    message = _error_message(port, 400, body)
    assert "invalid byte in a header" in message and "NUL" in message
    assert b"sk-se" not in body  # the header's value is never echoed

    with socket.create_connection(stack.address(port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Name: x\r\n\r\n")
        status, _, body = _raw_answer(sock)
    assert status == 400 and "header" in _error_message(port, 400, body)
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200


# ---- a body over the router's limit ---------------------------------------------------------


def test_async_clients_read_the_413_of_a_body_over_the_limit(stack: Stack) -> None:
    """8 MB against the router's 4 MiB: the server answers 413 while the client is still
    sending, then reads and discards the rest (a lingering close), so the answer is not
    lost to a reset."""
    url = stack.urls["router"]
    big = "x" * (8 * 1024 * 1024)

    async def body_in_chunks() -> AsyncIterator[bytes]:
        for _ in range(128):
            yield b"x" * 65536

    def check_413(status: int, body: dict) -> None:
        assert status == 413, body
        message = _error_message("router", 413, json.dumps(body).encode(),
                                 body["error"]["code"])
        assert "--max-body-bytes" in message

    async def go() -> None:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                    timeout=60)
        for _ in range(3):
            with pytest.raises(openai.APIStatusError) as exc:
                await client.completions.create(model=MODEL, prompt=big, max_tokens=1)
            check_413(exc.value.status_code, {"error": exc.value.body})

        sent: list[httpx.Request] = []

        async def count(request: httpx.Request) -> None:
            sent.append(request)

        async with httpx.AsyncClient(timeout=60, event_hooks={"request": [count]}) as http:
            # With its default retries, the SDK takes the 413 as final: one upload.
            retrying = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", http_client=http)
            with pytest.raises(openai.APIStatusError) as exc:
                await retrying.completions.create(model=MODEL, prompt=big, max_tokens=1)
            check_413(exc.value.status_code, {"error": exc.value.body})
            assert len(sent) == 1
            for content in (json.dumps({"model": MODEL, "prompt": big}).encode(),
                            body_in_chunks()):
                r = await http.post(f"{url}/v1/completions", content=content)
                check_413(r.status_code, r.json())
                assert r.headers["connection"] == "close"
        # The router is as it was.
        done = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert done.usage.completion_tokens == 2

    asyncio.run(go())
    # And the sync SDK, retrying by default, uploads once too.
    sent: list[httpx.Request] = []
    with httpx.Client(timeout=60, event_hooks={"request": [sent.append]}) as http:
        sync = openai.OpenAI(base_url=f"{url}/v1", api_key="x", http_client=http)
        with pytest.raises(openai.APIStatusError) as exc:
            sync.completions.create(model=MODEL, prompt=big, max_tokens=1)
    assert exc.value.status_code == 413 and len(sent) == 1


def test_the_deadlines_are_flags_checked_at_start() -> None:
    from tandem_engine.http_guard import protocol_class
    from tandem_engine.router.main import build_parser as router_parser
    from tandem_engine.server.main import build_parser as engine_parser

    args = router_parser().parse_args(["--engine", "127.0.0.1:1", "--model", "m"])
    assert (args.header_timeout, args.body_timeout) == (10.0, 30.0)
    args = engine_parser().parse_args(["--model", "m", "--port", "1", "--admin-port", "2",
                                       "--body-timeout", "5"])
    assert (args.header_timeout, args.body_timeout) == (10.0, 5.0)
    for header, body, flag in ((0, 1, "--header-timeout 0"), (1, -1, "--body-timeout -1")):
        with pytest.raises(ValueError, match=f"{flag}: it must be > 0 seconds"):
            protocol_class(header, body, lambda status, message: {})
