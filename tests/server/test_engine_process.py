"""The engine process as routers and operators see it: real process, real ZMQ, real HTTP."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq
from reference import random_prompts
from tandem_engine import LLM, SamplingParams
from tandem_engine import protocol as p
from tandem_engine.cli.demo_model import write_demo_model
from tandem_engine.cli.serve import die_with_parent, free_port
from tandem_engine.zmq_auth import CurveClient

pytestmark = pytest.mark.slow


class EngineProcess:
    def __init__(self, model: Path, tmp: Path, *extra: str, port: int | None = None,
                 admin_port: int | None = None, env: dict[str, str] | None = None,
                 wait_ready: bool = True) -> None:
        """Start the engine and wait until /readyz is 200 (`wait_ready=False`: return at
        once; `env`: added to the environment). Ports picked here that another test worker
        took between the pick and the engine's bind (it binds ZMQ after the load) are
        picked again, twice at most."""
        for attempt in range(3):
            self._start(model, tmp, extra, port, admin_port, env)
            if not wait_ready:
                return
            if self.wait_ready(120, retry_ports=port is None and admin_port is None
                               and attempt < 2):
                return

    def _start(self, model: Path, tmp: Path, extra: tuple[str, ...], port: int | None,
               admin_port: int | None, env: dict[str, str] | None) -> None:
        self.port, self.admin_port = port or free_port(), admin_port or free_port()
        self.log = tmp / f"engine-{self.port}.log"
        if self.log.exists():  # a restart on the same port: keep the old log
            self.log.rename(self.log.with_suffix(f".{time.monotonic_ns()}.log"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem_engine.server.main", "--model", str(model),
             "--port", str(self.port), "--admin-port", str(self.admin_port),
             "--engine-id", "e0", "--heartbeat-interval", "0.2", "--shutdown-grace", "20",
             *extra], stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})}, preexec_fn=die_with_parent)

    def wait_ready(self, timeout: float, retry_ports: bool = False) -> bool:
        """Wait until /readyz is 200 (True); with `retry_ports`, False when the engine
        exited because one of its ports was taken (the caller picks new ones)."""
        deadline = time.monotonic() + timeout
        try:
            while self.http("GET", "/readyz")[0] != 200:
                if self.proc.poll() is not None:
                    log = self.log.read_text()
                    if retry_ports and ("cannot listen on" in log
                                        or "Address already in use" in log):
                        return False
                    raise AssertionError(log)
                assert time.monotonic() < deadline, f"engine not ready in {timeout:.0f} s"
                time.sleep(0.2)
        except BaseException:
            self.close()  # never leave an engine behind
            raise
        return True

    def http(self, method: str, path: str, body: dict | None = None,
             token: str | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.admin_port}{path}", method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json",
                     **({"Authorization": f"Bearer {token}"} if token else {})})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")
        except (urllib.error.URLError, OSError):
            return 0, {}

    def client(self) -> Client:
        return Client(self.port)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Client:
    """A router's side of the socket, synchronous, for tests: it PINGs while it waits
    (`ping=False`: a router that never does, which the engine forgets)."""

    def __init__(self, port: int, *, ping: bool = True, curve: CurveClient | None = None
                 ) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:  # the pool's routers' CURVE keys
            curve.secure(self.sock)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.ping, self.pinged_at = ping, time.monotonic()
        self.sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, "test-router")))
        self.welcome = self.next(p.Welcome)

    def next(self, kind, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ping and time.monotonic() - self.pinged_at > 0.5:
                self.pinged_at = time.monotonic()
                self.sock.send(p.encode(p.Ping("test-router")))
            if self.sock.poll(200):
                msg = p.decode(self.sock.recv())
                if isinstance(msg, kind):
                    return msg
        raise TimeoutError(f"no {kind} in {timeout} s")

    def run(self, rid: str, prompt: list[int], **sampling) -> list[p.Output]:
        self.sock.send(p.encode(p.Submit(rid, prompt, sampling)))
        outs = []
        while not outs or not outs[-1].finished:
            msg = self.next((p.Output, p.Reject))
            if msg.request_id != rid:
                continue  # another request's (e.g. one a fuzz frame happened to submit)
            if isinstance(msg, p.Reject):
                return [msg]
            outs.append(msg)
        return outs


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    # Refits load checkpoints that tests write into their own temp folders.
    proc = EngineProcess(tiny_llama, tmp_path_factory.mktemp("engine"),
                         "--weights-root", str(tmp_path_factory.getbasetemp()))
    yield proc
    proc.close()


def test_streamed_greedy_output_equals_llm_generate(engine: EngineProcess,
                                                    tiny_llama: Path) -> None:
    client = engine.client()
    assert client.welcome.engine_id == "e0" and client.welcome.block_size == 16
    prompts = random_prompts(2048, [9, 33], seed=21)
    expected = LLM(tiny_llama).generate(prompts, SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2))
    for i, (prompt, exp) in enumerate(zip(prompts, expected, strict=True)):
        outs = client.run(f"g{i}", prompt, max_tokens=16, temperature=0.0, ignore_eos=True,
                          logprobs=2)
        tokens = [t for o in outs for t in o.token_ids]
        assert tokens == exp.outputs[0].token_ids
        assert "".join(o.text for o in outs) == exp.outputs[0].text
        assert outs[-1].finish_reason == "length" and outs[-1].num_prompt_tokens == len(prompt)
        lps = [lp for o in outs for lp in o.logprobs]
        assert len(lps) == 16 and all(len(lp.top) == 2 for lp in lps)
        assert lps[0].logprob == pytest.approx(
            exp.outputs[0].logprobs[0][tokens[0]].logprob, abs=1e-5)


def test_a_stop_string_is_never_half_streamed(engine: EngineProcess, tiny_llama: Path) -> None:
    client = engine.client()
    prompt = random_prompts(2048, [12], seed=22)[0]
    full = "".join(o.text for o in client.run("full", prompt, max_tokens=40,
                                              temperature=0.0, ignore_eos=True))
    stop = full[14:20]
    assert full.find(stop) == 14
    outs = client.run("stopped", prompt, max_tokens=40, temperature=0.0, ignore_eos=True,
                      stop=[stop])
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    streamed = ""
    for o in outs:
        streamed += o.text
        assert full.startswith(streamed) and stop not in streamed
    assert streamed == full[:14]


def test_rejects_are_answered_and_bad_frames_dropped(engine: EngineProcess) -> None:
    client = engine.client()
    too_long = client.run("long", [5] * 5000, max_tokens=4)
    assert isinstance(too_long[0], p.Reject) and too_long[0].status == 400
    assert "limit of 1024" in too_long[0].message
    bad = client.run("bad", [5, 6], max_tokens=0)
    assert isinstance(bad[0], p.Reject) and "max_tokens=0" in bad[0].message
    # Fuzz: random bytes, truncated and re-typed valid frames, wrong versions.
    rng = random.Random(0)
    valid = p.encode(p.Submit("fuzz", [5, 6, 7], {"max_tokens": 2}))
    for _ in range(300):
        choice = rng.randrange(5)
        if choice == 0:
            frame = rng.randbytes(rng.randrange(0, 64))
        elif choice == 1:
            frame = valid[: rng.randrange(0, len(valid))]
        elif choice == 2:
            frame = bytes([p.PROTOCOL_VERSION, rng.choice(list(p.Kind))]) + valid[2:]
        elif choice == 3:
            frame = bytes([rng.randrange(2, 256)]) + valid[1:]
        else:
            frame = bytes([p.PROTOCOL_VERSION, p.Kind.SUBMIT]) + msgspec.msgpack.encode(
                {"request_id": rng.random(), "prompt_token_ids": "x", "sampling": []})
        client.sock.send(frame)
    client.sock.send_multipart([b"extra", b"frames"])
    outs = client.run("after-fuzz", [5, 6, 7, 8], max_tokens=3, temperature=0.0)
    assert outs[-1].finished and len([t for o in outs for t in o.token_ids]) == 3
    assert engine.http("GET", "/healthz")[0] == 200


def test_pause_queues_and_unpause_releases(engine: EngineProcess) -> None:
    client = engine.client()
    code, state = engine.http("POST", "/v1/pause")
    assert code == 200 and state["state"] == "PAUSED"
    change = client.next(p.StateChange, timeout=5)
    assert change.load.state == "PAUSED"
    assert engine.http("GET", "/readyz")[0] == 503
    client.sock.send(p.encode(p.Submit("queued", [5, 6, 7], {"max_tokens": 3})))
    time.sleep(0.5)
    assert not client.sock.poll(0) or not isinstance(p.decode(client.sock.recv()), p.Output)
    code, body = engine.http("POST", "/v1/pause")
    assert code == 409 and "not allowed in state PAUSED" in body["error"]["message"]
    assert engine.http("POST", "/v1/unpause")[0] == 200
    out = client.next(p.Output, timeout=10)
    assert out.request_id == "queued"
    metrics = urllib.request.urlopen(
        f"http://127.0.0.1:{engine.admin_port}/metrics", timeout=5).read().decode()
    assert 'vllm:generation_tokens_total{engine_id="e0",model_name=' in metrics
    assert "tandem_step_seconds_bucket" in metrics


def test_refit_over_the_admin_api(engine: EngineProcess, tmp_path: Path) -> None:
    new = write_demo_model(tmp_path / "v2", arch="llama", seed=5)
    assert engine.http("POST", "/v1/refit", {"uri": f"file://{new}"})[0] == 409  # running
    assert engine.http("POST", "/v1/pause")[0] == 200
    code, body = engine.http("POST", "/v1/refit", {"uri": "s3://bucket/model"})
    assert code == 400 and "scheme 's3'" in body["error"]["message"]
    code, body = engine.http("POST", "/v1/refit", {"uri": f"file://{tmp_path}/missing"})
    assert code == 400 and "refit path refused" in body["error"]["message"]
    code, body = engine.http("POST", "/v1/refit", {"uri": f"file://{new}", "version": "v2"})
    assert code == 200 and body["weight_epoch"] == 1 and body["weight_version"] == "v2"
    assert engine.http("POST", "/v1/unpause")[0] == 200


def test_admin_token_and_sigterm_drain(tiny_qwen2: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    proc = EngineProcess(tiny_qwen2, tmp_path, "--admin-token-file", str(token_file))
    try:
        code, body = proc.http("POST", "/v1/pause")
        assert code == 401 and "Bearer" in body["error"]["message"]
        assert proc.http("POST", "/v1/pause", token="wrong")[0] == 401
        assert proc.http("GET", "/v1/state")[0] == 200  # reads need no token
        assert proc.http("POST", "/v1/pause", token="s3cret")[0] == 200
        assert proc.http("POST", "/v1/unpause", token="s3cret")[0] == 200
        client = proc.client()
        client.sock.send(p.encode(p.Submit("long", [5, 6, 7], {
            "max_tokens": 1000, "temperature": 0.0, "ignore_eos": True})))
        client.next(p.Output)  # it is running
        os.kill(proc.proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        # Draining: new requests are refused, the running one finishes.
        client.sock.send(p.encode(p.Submit("late", [5, 6], {"max_tokens": 2})))
        tokens, rejected = 1, None
        while True:
            msg = client.next((p.Output, p.Reject))
            if isinstance(msg, p.Reject):
                rejected = msg
                continue
            tokens += len(msg.token_ids)
            if msg.finished:
                break
        assert rejected is not None and rejected.status == 503
        assert "shutting down" in rejected.message
        assert msg.finish_reason == "length" and tokens == 1000
        assert proc.proc.wait(timeout=30) == 0
    finally:
        proc.close()
