"""Fuzzing a live router: garbage from an "engine" socket and garbage HTTP bodies.

One real engine serves next to a hostile peer — a ZMQ ROUTER socket the router also
connects to, which answers HELLO correctly and then sprays malformed, truncated,
wrong-version and out-of-place frames. The router must drop them all, keep serving the
real engine's requests correctly, and answer every malformed HTTP body with a 4xx in
the OpenAI error shape, never a 5xx or a crash.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from tandem_engine import LLM, SamplingParams
from tandem_engine import protocol as p
from test_router_e2e import _engine_cmd, _free_port, _router_cmd, _spawn, _stop, _wait_ready

pytestmark = pytest.mark.slow


def _hostile_peer(port: int, stop: threading.Event, sent: list[int]) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    rng = random.Random(7)
    load = p.Load("PAUSED", 0, 0, 0.0, "initial", 0)  # never offered work
    valid = [p.encode(p.Output("nobody", [1, 2], "xy", finished=True, finish_reason="stop")),
             p.encode(p.Reject("nobody", 400, "no")),
             p.encode(p.Heartbeat("hostile", "inc", load)),
             p.encode(p.Submit("backwards", [1], SamplingParams()))]
    routers: set[bytes] = set()
    while not stop.is_set():
        if sock.poll(20):
            frames = sock.recv_multipart()
            routers.add(frames[0])
            try:
                if isinstance(p.decode(frames[-1]), p.Hello):
                    # A believable engine, but PAUSED: the router must not send it work.
                    sock.send_multipart([frames[0], p.encode(p.Welcome(
                        p.PROTOCOL_VERSION, "hostile", "inc", "mixed", "tiny", 16, 1024,
                        p.Load("PAUSED", 0, 0, 0.0, "initial", 0)))])
            except p.ProtocolError:
                pass
        for router, _ in ((r, i) for r in routers for i in range(10)):
            choice = rng.randrange(5)
            if choice == 0:
                frame = rng.randbytes(rng.randrange(0, 80))
            elif choice == 1:
                v = rng.choice(valid)
                frame = v[: rng.randrange(0, len(v))]
            elif choice == 2:
                frame = bytes([rng.randrange(2, 256)]) + rng.choice(valid)[1:]
            elif choice == 3:
                frame = bytes([p.PROTOCOL_VERSION, rng.choice(list(p.Kind))]) + \
                    msgspec.msgpack.encode({"load": rng.random(), "x": [1, "a"]})
            else:
                frame = rng.choice(valid)
            sock.send_multipart([router, frame])
            sent[0] += 1
    sock.close()


def test_router_survives_a_hostile_engine_and_garbage_http(tiny_llama: Path,
                                                           tmp_path: Path) -> None:
    zp, ap, hostile_port, router_port = (_free_port() for _ in range(4))
    stop, sent = threading.Event(), [0]
    peer = threading.Thread(target=_hostile_peer, args=(hostile_port, stop, sent),
                            daemon=True)
    peer.start()
    engine = _spawn(_engine_cmd(tiny_llama, zp, ap), tmp_path / "engine.log")
    router = _spawn(_router_cmd(tiny_llama, [f"127.0.0.1:{zp}", f"127.0.0.1:{hostile_port}"],
                                router_port), tmp_path / "router.log")
    url = f"http://127.0.0.1:{router_port}"
    try:
        _wait_ready(f"http://127.0.0.1:{ap}/readyz", engine, tmp_path / "engine.log")
        _wait_ready(f"{url}/readyz", router, tmp_path / "router.log")
        expected = LLM(tiny_llama).generate(["The hostile peer"], SamplingParams(
            max_tokens=12, temperature=0.0))[0].outputs[0].text
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(5):
                r = http.post("/v1/completions", json={
                    "model": "tiny", "prompt": "The hostile peer", "max_tokens": 12,
                    "temperature": 0})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == expected
            rng = random.Random(3)
            bodies = [b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe",
                      json.dumps({"model": "tiny"}).encode(),
                      json.dumps({"model": "tiny", "prompt": {"a": 1}}).encode(),
                      json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "many"}).encode(),
                      json.dumps({"model": "tiny", "prompt": [1.5, None]}).encode(),
                      json.dumps({"model": "tiny", "prompt": "x", "n": -3}).encode(),
                      json.dumps({"model": "tiny", "messages": "hi"}).encode()]
            bodies += [rng.randbytes(rng.randrange(1, 200)) for _ in range(40)]
            for body in bodies:
                for path in ("/v1/completions", "/v1/chat/completions"):
                    r = http.post(path, content=body,
                                  headers={"Content-Type": "application/json"})
                    assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
                    assert "message" in r.json()["error"]
            deadline = time.monotonic() + 20
            while sent[0] < 500 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sent[0] >= 500, "the hostile peer never got going"
            assert http.get("/healthz").status_code == 200
            r = http.post("/v1/completions", json={
                "model": "tiny", "prompt": "The hostile peer", "max_tokens": 12,
                "temperature": 0})
            assert r.json()["choices"][0]["text"] == expected
        assert router.poll() is None and engine.poll() is None
    finally:
        stop.set()
        _stop([router, engine])
        peer.join(timeout=5)
