"""The engine's closed surface, against real processes: CURVE on the ZMQ socket (only the
pool's routers' key gets in, frames from anyone else never reach the engine), the
read-only metrics port, the admin token checked before any body is read and every admin
body bounded (the engine's memory untouched, no admin input ending it), refits confined
to `--weights-root` with one refusal text for every refused path (a NUL byte included),
and `tandem serve` stacks authenticated by default."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import zmq
from tandem_engine import protocol as p
from tandem_engine import zmq_auth
from tandem_engine.cli.demo_model import write_demo_model
from tandem_engine.cli.serve import free_port
from tandem_engine.server.admin_guard import MAX_ADMIN_BODY_BYTES, UNAUTHORIZED
from tandem_engine.server.weights_roots import REFUSED
from test_admin_guard import HUGE, stream_post
from test_engine_process import Client, EngineProcess
from test_frame_fuzz import VALID

pytestmark = pytest.mark.slow

PROBE = [5, 6, 7, 8]
PROBE_SAMPLING = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
SILENCE = 1.5  # seconds a refused peer waits to be sure no reply comes
TOKEN = "engine-admin-t0ken"
RSS_SLACK = 10 << 20  # bytes an engine may grow answering requests it does not read


@pytest.fixture(scope="module")
def keys() -> tuple[dict[str, str], dict[str, str]]:
    return zmq_auth.stack_environments()


@pytest.fixture(scope="module")
def pool_key(keys) -> zmq_auth.CurveClient:
    curve = zmq_auth.router_curve(keys[1])
    assert curve is not None
    return curve


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("auth-weights")
    allowed, outside = base / "allowed", base / "outside"
    write_demo_model(allowed / "v2", seed=3)
    write_demo_model(outside / "v9", seed=4)
    (allowed / "escape").symlink_to(outside / "v9", target_is_directory=True)
    (allowed / "a-file").write_text("not a checkpoint")
    return {"allowed": allowed, "outside": outside}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, keys, roots):
    metrics_port = free_port()
    folder = tmp_path_factory.mktemp("auth-engine")
    (folder / "token").write_text(TOKEN + "\n")
    with pytest.MonkeyPatch.context() as env:
        for name, value in keys[0].items():
            env.setenv(name, value)
        proc = EngineProcess(tiny_llama, folder, "--metrics-port", str(metrics_port),
                             "--weights-root", str(roots["allowed"]),
                             "--admin-token-file", str(folder / "token"))
    proc.metrics_port = metrics_port
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def baseline(engine: EngineProcess, pool_key) -> list[int]:
    outs = Client(engine.port, curve=pool_key).run("baseline", PROBE, **PROBE_SAMPLING)
    tokens = [t for o in outs for t in o.token_ids]
    assert len(tokens) == PROBE_SAMPLING["max_tokens"], outs
    return tokens


def _stranger(port: int, curve: zmq_auth.CurveClient | None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.secure(sock)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _strangers(port: int, pool_key: zmq_auth.CurveClient) -> dict[str, zmq.Socket]:
    """Sockets without the pool's routers' key: none, a wrong one, and the right server
    key with a client key the engine does not admit."""
    wrong_server = zmq.curve_keypair()[0]
    return {"no keys": _stranger(port, None),
            "wrong client key": _stranger(port, zmq_auth.CurveClient(
                pool_key.server_key, zmq.curve_keypair()[1])),
            "wrong server key": _stranger(port, zmq_auth.CurveClient(
                wrong_server, pool_key.secret_key))}


def _still_serving(engine: EngineProcess, pool_key, tokens: list[int], tag: str) -> None:
    assert engine.proc.poll() is None, engine.log.read_text()[-3000:]
    outs = Client(engine.port, curve=pool_key).run(f"probe-{tag}", PROBE, **PROBE_SAMPLING)
    assert [t for o in outs for t in o.token_ids] == tokens, outs
    assert engine.http("GET", "/healthz")[0] == 200


def test_the_pool_key_submits_and_strangers_get_nothing(engine: EngineProcess, pool_key,
                                                        baseline: list[int]) -> None:
    strangers = _strangers(engine.port, pool_key)
    for sock in strangers.values():
        sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, "stranger")))
        sock.send(p.encode(p.Submit("stolen", PROBE, dict(PROBE_SAMPLING))))
    deadline = time.monotonic() + SILENCE
    for name, sock in strangers.items():
        assert not sock.poll(max(1, int(1000 * (deadline - time.monotonic())))), \
            f"an engine answered a DEALER with {name}"
        sock.close()
    _still_serving(engine, pool_key, baseline, "after-strangers")
    assert engine.http("GET", "/v1/state")[1]["num_running"] == 0  # nothing stolen ran
    assert "refused a ZMQ client" in engine.log.read_text()


def test_fuzzed_frames_with_and_without_credentials(engine: EngineProcess, pool_key,
                                                    baseline: list[int]) -> None:
    rng = random.Random(14)

    def fuzz() -> list[bytes]:
        frame = bytearray(rng.choice(VALID))
        how = rng.randrange(3)
        if how == 0:
            return [rng.randbytes(rng.randrange(0, 200))]
        if how == 1:
            for _ in range(rng.randrange(1, 6)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
            return [bytes(frame)]
        return [bytes(frame[:rng.randrange(len(frame))]), rng.randbytes(8)]

    strangers = _strangers(engine.port, pool_key)
    for sock in strangers.values():
        for _ in range(30):
            sock.send_multipart(fuzz())
    insider = _stranger(engine.port, pool_key)
    for _ in range(60):
        insider.send_multipart(fuzz())
    time.sleep(0.5)
    for name, sock in strangers.items():
        assert not sock.poll(200), f"an engine answered fuzz from a DEALER with {name}"
        sock.close()
    insider.close()
    _still_serving(engine, pool_key, baseline, "after-fuzz")


def test_the_metrics_port_is_read_only(engine: EngineProcess, baseline: list[int]) -> None:
    url = f"http://127.0.0.1:{engine.metrics_port}"
    metrics = httpx.get(f"{url}/metrics", timeout=5)
    assert metrics.status_code == 200 and "vllm:generation_tokens_total" in metrics.text
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    for method, path in (("POST", "/v1/pause"), ("POST", "/v1/refit"), ("POST", "/v1/drain"),
                         ("GET", "/v1/state"), ("POST", "/metrics"), ("GET", "/docs"),
                         ("GET", "/openapi.json")):
        code = httpx.request(method, f"{url}{path}", json={}, timeout=5).status_code
        assert code in (404, 405), (method, path, code)
    assert engine.http("GET", "/v1/state")[1]["state"] == "RUNNING"  # nothing paused it
    admin = httpx.get(f"http://127.0.0.1:{engine.admin_port}/metrics", timeout=5)
    assert admin.status_code == 200  # the admin port keeps everything it had


def test_refit_paths_outside_the_roots_all_get_one_answer(engine: EngineProcess,
                                                          roots: dict[str, Path]) -> None:
    allowed, outside = roots["allowed"], roots["outside"]
    refused = {
        "outside the root": f"file://{outside / 'v9'}",
        "a symlink out of the root": f"file://{allowed / 'escape'}",
        "'..' out of the root": f"file://{allowed}/../outside/v9",
        "missing": f"file://{allowed / 'missing'}",
        "a file": f"file://{allowed / 'a-file'}",
        "no config.json": f"file://{allowed}",
        "the root's parent": f"file://{allowed.parent}",
        "a NUL byte (%00)": f"file://{allowed / 'v2'}%00",
        "a NUL byte inside": f"file://{allowed}/v2\x00/../v2",
    }
    assert engine.http("POST", "/v1/pause", token=TOKEN)[0] == 200
    try:
        answers = {}
        for why, uri in refused.items():
            for field in ("uri", "draft_uri"):
                body = {"uri": (allowed / "v2").as_uri(), field: uri}
                code, body = engine.http("POST", "/v1/refit", body, token=TOKEN)
                answers[why, field] = (code, body["error"]["message"])
        assert set(answers.values()) == {(400, REFUSED)}, answers
        code, body = engine.http("POST", "/v1/refit", {"uri": (allowed / "v2").as_uri(),
                                                       "version": "v2"}, token=TOKEN)
        assert code == 200 and body["weight_version"] == "v2", body
    finally:
        assert engine.http("POST", "/v1/unpause", token=TOKEN)[0] == 200
    log = engine.log.read_text()
    assert "is outside the weights roots" in log and "does not exist" in log
    assert "holds a NUL byte" in log


def _generates(engine: EngineProcess, pool_key, tag: str) -> None:
    """The same engine process still generates (on whichever weights a refit left)."""
    assert engine.proc.poll() is None, engine.log.read_text()[-3000:]
    outs = Client(engine.port, curve=pool_key).run(f"probe-{tag}", PROBE, **PROBE_SAMPLING)
    assert len([t for o in outs for t in o.token_ids]) == PROBE_SAMPLING["max_tokens"], outs
    assert engine.http("GET", "/healthz")[0] == 200


def _rss(pid: int) -> int:
    """The process's resident memory (VmRSS of /proc/PID/status), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_an_unauthenticated_huge_refit_is_refused_before_its_body_is_read(
        engine: EngineProcess, pool_key) -> None:
    rss = _rss(engine.proc.pid)
    for declared in (HUGE, None):  # a declared length, and a chunked stream
        status, body, headers, sent = stream_post(engine.admin_port, "/v1/refit",
                                                  declared=declared)
        assert status == 401 and body["error"]["message"] == UNAUTHORIZED, body
        assert headers["connection"] == "close"
        assert sent < HUGE // 2, sent  # answered while the client was still sending
    grown = _rss(engine.proc.pid) - rss
    assert grown < RSS_SLACK, f"the engine grew {grown / 2**20:.1f} MiB"
    _generates(engine, pool_key, "after-huge-unauthenticated")


def test_an_authenticated_oversize_body_gets_413_unread(engine: EngineProcess,
                                                       pool_key) -> None:
    rss = _rss(engine.proc.pid)
    for path in ("/v1/refit", "/v1/canary", "/v1/pause"):
        for declared in (HUGE, None):
            status, body, _, sent = stream_post(engine.admin_port, path, token=TOKEN,
                                                declared=declared)
            assert status == 413, (path, declared, body)
            assert f"limit of {MAX_ADMIN_BODY_BYTES} bytes" in body["error"]["message"]
            assert sent < HUGE // 2, (path, declared, sent)
    grown = _rss(engine.proc.pid) - rss
    assert grown < RSS_SLACK, f"the engine grew {grown / 2**20:.1f} MiB"
    assert engine.http("GET", "/v1/state")[1]["state"] == "RUNNING"  # nothing reached it
    _generates(engine, pool_key, "after-oversize")


def test_reads_stay_open_writes_need_the_token_and_no_schema_is_served(
        engine: EngineProcess) -> None:
    url = f"http://127.0.0.1:{engine.admin_port}"
    for path in ("/v1/state", "/healthz", "/readyz", "/metrics"):
        assert httpx.get(f"{url}{path}", timeout=5).status_code == 200, path
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(f"{url}{path}", timeout=5).status_code == 404, path
    for method, path in (("POST", "/v1/pause"), ("POST", "/v1/drain"), ("POST", "/v1/nowhere"),
                         ("PUT", "/v1/state"), ("DELETE", "/v1/refit")):
        r = httpx.request(method, f"{url}{path}", json={}, timeout=5)
        assert r.status_code == 401 and r.json()["error"]["message"] == UNAUTHORIZED, path
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{url}/v1/nowhere", headers=auth, timeout=5).status_code == 404
    assert engine.http("GET", "/v1/state")[1]["state"] == "RUNNING"


def test_no_admin_input_ends_the_engine(engine: EngineProcess, pool_key) -> None:
    """What a client with the token, or without, can send: each answered 4xx, never a
    500, and the same process serves on (`tandem serve` restarts nothing)."""
    pid, url = engine.proc.pid, f"http://127.0.0.1:{engine.admin_port}"
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    deep = b"[" * (MAX_ADMIN_BODY_BYTES - 1)
    malformed = [b"{", b"\xff\xfe{}", deep, b"[]", b'"text"']
    refits = [b'{"uri": 5}', b'{"uri": ""}', b"null",
              json.dumps({"uri": "file:///" + "a" * 5000}).encode(),
              json.dumps({"uri": "file:///x", "epoch": 2**80}).encode(),
              json.dumps({"uri": "file:///%00"}).encode()]
    calls = [(path, body) for path in ("/v1/refit", "/v1/suspend", "/v1/canary")
             for body in malformed] + [("/v1/refit", body) for body in refits] + [
        ("/v1/suspend", b'{"mode": "nope"}'),
        ("/v1/canary", b'{"prompt_token_ids": [-1, 99999999999999999999]}'),
        ("/v1/canary", b'{"prompt_token_ids": [1, 2], "max_tokens": 100000}')]
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, body in calls:
            for headers in (auth, {"Content-Type": "application/json"}):
                r = http.post(path, content=body, headers=headers)
                assert 400 <= r.status_code < 500, (path, body[:40], r.status_code, r.text)
    for raw in (b"POST /v1/refit HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
                b"POST /v1/refit HTTP/1.1\r\nHost: x\r\nContent-Length: 1e9\r\n\r\n",
                b"POST /v1/refit HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"zz\r\n"):
        with socket.create_connection(("127.0.0.1", engine.admin_port), timeout=10) as s:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
            answer = s.recv(4096)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 4"), answer
    assert engine.proc.pid == pid and engine.proc.poll() is None
    assert engine.http("GET", "/v1/state")[1]["state"] == "RUNNING"
    _generates(engine, pool_key, "after-hostile-admin-input")


def _start_error(module: str, model: Path, env: dict[str, str], *args: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in zmq_auth.ALL_VARIABLES}
    run = subprocess.run([sys.executable, "-m", module, "--model", str(model), *args],
                         env={**clean, **env}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    return run.stderr


def test_partial_or_malformed_keys_stop_the_start(tiny_llama: Path, keys) -> None:
    engine_env, router_env = keys
    engine_args = ("--port", str(free_port()), "--admin-port", str(free_port()))
    err = _start_error("tandem_engine.server.main", tiny_llama,
                       {zmq_auth.SERVER_SECRET_KEY: engine_env[zmq_auth.SERVER_SECRET_KEY]},
                       *engine_args)
    assert f"${zmq_auth.CLIENT_PUBLIC_KEY} is not set" in err
    err = _start_error("tandem_engine.server.main", tiny_llama,
                       {**engine_env, zmq_auth.CLIENT_PUBLIC_KEY: "not-a-key"}, *engine_args)
    assert f"${zmq_auth.CLIENT_PUBLIC_KEY} is not a CURVE key" in err and "not-a-key" not in err
    err = _start_error("tandem_engine.router.main", tiny_llama,
                       {zmq_auth.CLIENT_SECRET_KEY: router_env[zmq_auth.CLIENT_SECRET_KEY]},
                       "--engine", "127.0.0.1:1", "--port", str(free_port()))
    assert f"${zmq_auth.SERVER_PUBLIC_KEY} is not set" in err


def test_serve_stacks_are_authenticated_by_default(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in zmq_auth.ALL_VARIABLES}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem_engine.cli.main", "serve", "--model", str(tiny_llama),
         "--port", str(port), "--threads", "1"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**env, "TMPDIR": str(tmp_path)})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not any("Tandem is serving" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        stack_json = tmp_path / f"tandem-{port}" / "stack.json"
        assert stack_json.stat().st_mode & 0o777 == 0o600
        stack = json.loads(stack_json.read_text())
        token, admin = stack["admin_token"], stack["engines"][0]["admin_url"]
        assert httpx.post(f"{admin}/v1/pause", timeout=5).status_code == 401
        # A hostile client's huge unauthenticated refits end no engine: no restart spent.
        pid = stack["children"]["engine-0"]["pid"]
        for declared in (HUGE, None):
            assert stream_post(int(admin.rpartition(":")[2]), "/v1/refit",
                               declared=declared)[0] == 401
        # Keys and token reach the children in their environment, never in argv.
        for child in psutil.Process(proc.pid).children():
            assert not any(token in a or "TANDEM_ZMQ" in a for a in child.cmdline())
        router = f"http://127.0.0.1:{port}"
        (engine,) = httpx.get(f"{router}/v1/engines", timeout=5).json()["engines"]
        sock = _stranger(int(engine["address"].rpartition(":")[2]), None)
        sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, "stranger")))
        assert not sock.poll(int(1000 * SILENCE)), "the engine answered a keyless DEALER"
        sock.close()
        model = httpx.get(f"{router}/v1/models", timeout=5).json()["data"][0]["id"]
        reply = httpx.post(f"{router}/v1/completions", timeout=30, json={
            "model": model, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        logs = (tmp_path / f"tandem-{port}" / "engine-0.log").read_text()
        assert "ZMQ unauthenticated" not in logs and "(CURVE)" in logs
        child = json.loads(stack_json.read_text())["children"]["engine-0"]
        assert (child["pid"], child["restarts"]) == (pid, 0) and psutil.pid_exists(pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
