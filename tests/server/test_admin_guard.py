"""`AdminGuard`, the gate in front of the engine's admin API, over real HTTP (uvicorn, raw
sockets): the token is checked before any byte of the body is read, every body is bounded
(a declared length at once, a chunked one as it streams), and a body within the bounds
reaches the route intact (its deadline is the HTTP protocol's, `http_guard.py`). The engine
process itself is tested in test_engine_auth.py; `stream_post` is shared with it."""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from tandem_engine.cli.serve import free_port
from tandem_engine.server.admin_guard import (
    MAX_ADMIN_BODY_BYTES,
    UNAUTHORIZED,
    AdminGuard,
    guard_admin_app,
)

TOKEN = "adm1n-t0ken"
MiB = 1 << 20
HUGE = 50 * MiB


def stream_post(port: int, path: str, *, token: str | None = None,
                declared: int | None = HUGE, total: int = HUGE,
                deadline: float = 60.0) -> tuple[int, dict, dict[str, str], int]:
    """POST `total` body bytes to 127.0.0.1:`port` (`Content-Length: declared`, or chunked
    when None) over a raw socket, reading while sending, and stop sending once the answer
    is in. Returns (status, JSON body, headers, body bytes sent by then): an answer that
    came before the body was sent whole is one given before it was read."""
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if token is not None:
        head.append(f"Authorization: Bearer {token}")
    head.append("Transfer-Encoding: chunked" if declared is None
                else f"Content-Length: {declared}")
    piece = b"1" * (64 * 1024)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    sock.setblocking(False)
    out, sent, answer, sending = b"", 0, b"", True
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    end = time.monotonic() + deadline
    try:
        while time.monotonic() < end and not _complete(answer):
            for _, events in selector.select(0.5):
                if events & selectors.EVENT_READ:
                    try:
                        data = sock.recv(65536)
                    except ConnectionResetError:
                        data = b""
                    if not data:
                        return _parse(answer, sent)
                    answer += data
                if events & selectors.EVENT_WRITE and sending:
                    if not out:
                        if sent >= total:
                            out = b"0\r\n\r\n" if declared is None else b""
                            sending = False
                            selector.modify(sock, selectors.EVENT_READ)
                        else:
                            n = min(len(piece), total - sent)
                            out = (f"{n:x}\r\n".encode() + piece[:n] + b"\r\n"
                                   if declared is None else piece[:n])
                            sent += n
                    try:
                        out = out[sock.send(out):]
                    except BlockingIOError:
                        pass
                    except (BrokenPipeError, ConnectionResetError):
                        sending = False
                        selector.modify(sock, selectors.EVENT_READ)
        assert _complete(answer), f"no answer within {deadline:.0f} s ({sent} bytes sent)"
        return _parse(answer, sent)
    finally:
        selector.close()
        sock.close()


def _complete(answer: bytes) -> bool:
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), 0)
    return len(body) >= length


def _parse(answer: bytes, sent: int) -> tuple[int, dict, dict[str, str], int]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines and lines[0].startswith("HTTP/1.1 "), answer[:300]
    headers = {k.strip().lower(): v.strip()
               for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), json.loads(body or b"{}"), headers, sent


class Note(BaseModel):
    text: str


def _app() -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(AdminGuard, token=TOKEN)

    @app.post("/note")
    def note(body: Note) -> dict:
        return {"length": len(body.text), "head": body.text[:8]}

    @app.get("/state")
    def state() -> dict:
        return {"state": "RUNNING"}

    return app


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_app(), host="127.0.0.1",
                                           port=port, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def test_writes_need_the_token_and_reads_do_not(port: int) -> None:
    url = f"http://127.0.0.1:{port}"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": "Bearer"}):
        r = httpx.post(f"{url}/note", json={"text": "hi"}, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.text)
        assert r.json() == {"error": {"message": UNAUTHORIZED, "code": 401}}
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.headers["connection"] == "close"
    # Every non-read method on any path, routes that do not exist included.
    for method in ("PUT", "DELETE", "PATCH"):
        assert httpx.request(method, f"{url}/nowhere", timeout=10).status_code == 401
    assert httpx.get(f"{url}/state", timeout=10).json() == {"state": "RUNNING"}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{url}/note", json={"text": "hello there"}, headers=auth, timeout=10)
    assert r.status_code == 200 and r.json() == {"length": 11, "head": "hello th"}


def test_the_token_is_checked_before_any_body_is_read(port: int) -> None:
    for declared in (HUGE, None):  # declared, and chunked
        status, body, headers, sent = stream_post(port, "/note", declared=declared)
        assert status == 401 and body["error"]["message"] == UNAUTHORIZED
        assert headers["connection"] == "close"
        assert sent < HUGE // 2, sent  # answered while the client was still sending


def test_every_body_is_bounded(port: int) -> None:
    status, body, headers, sent = stream_post(port, "/note", token=TOKEN)
    assert status == 413 and f"limit of {MAX_ADMIN_BODY_BYTES} bytes" in body["error"]["message"]
    assert f"({HUGE} bytes)" in body["error"]["message"] and sent < HUGE // 2
    assert headers["connection"] == "close"
    # Chunked: counted as it streams, cut just past the limit.
    status, body, _, sent = stream_post(port, "/note", token=TOKEN, declared=None)
    assert status == 413 and f"limit of {MAX_ADMIN_BODY_BYTES} bytes" in body["error"]["message"]
    assert sent < HUGE // 2, sent
    # A read with a body is bounded too (no route reads it, but nothing buffers it either).
    r = httpx.request("GET", f"http://127.0.0.1:{port}/state", content=b"x" * (2 * MiB),
                      timeout=10)
    assert r.status_code == 413


def test_a_body_within_the_bound_reaches_the_route_whole(port: int) -> None:
    text = "ab" * ((MAX_ADMIN_BODY_BYTES - 100) // 2)  # just under the limit, as JSON
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer
        data = json.dumps({"text": text}).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=auth, timeout=10) as http:
        for content in (json.dumps({"text": text}).encode(), chunks()):
            r = http.post("/note", content=content,
                          headers={"Content-Type": "application/json"})
            assert r.status_code == 200 and r.json() == {"length": len(text), "head": "abababab"}
        assert http.get("/state").status_code == 200  # the connection is kept alive


def test_guard_admin_app_puts_the_guard_in_front() -> None:
    from fastapi.testclient import TestClient

    app = guard_admin_app(FastAPI(openapi_url=None), TOKEN)

    @app.post("/x")
    def x() -> dict:
        return {}

    client = TestClient(app)
    assert client.post("/x").status_code == 401
    assert client.post("/x", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    open_app = guard_admin_app(FastAPI(openapi_url=None), None)  # no token: bounds only
    assert TestClient(open_app).post("/x", content=b"1" * (MAX_ADMIN_BODY_BYTES + 1)
                                     ).status_code == 413
