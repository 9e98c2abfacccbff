"""The one engine admin client (`tandem_engine.fleet.admin`) against a real engine process and
against engines that do not answer: state, signals with the bearer token, errors that name the
engine, the call and the cause, deadlines, and the drain handshake."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
from tandem_engine import protocol as p
from tandem_engine.fleet import AdminError, EngineAdmin, admin_url
from test_engine_process import EngineProcess

pytestmark = pytest.mark.slow
TOKEN = "op3rator"


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("admin")
    (folder / "token").write_text(TOKEN)
    proc = EngineProcess(tiny_llama, folder, "--admin-token-file", str(folder / "token"),
                         "--role", "decode", "--weight-version", "v7")
    yield proc
    proc.close()


def run(coro, token: str | None = TOKEN):
    async def main():
        admin = EngineAdmin(token, timeout=2.0, poll_interval=0.05)
        try:
            return await coro(admin)
        finally:
            await admin.close()
    return asyncio.run(main())


def test_admin_url() -> None:
    assert admin_url("10.0.0.7", 8080) == "http://10.0.0.7:8080"
    assert admin_url("fd00::7", 9000) == "http://[fd00::7]:9000"


def test_state_pause_unpause_with_the_token(engine: EngineProcess) -> None:
    base = f"http://127.0.0.1:{engine.admin_port}"

    async def scenario(admin: EngineAdmin) -> None:
        state = await admin.state(base)
        assert (state.role, state.weight_version, state.state) == ("decode", "v7", "RUNNING")
        assert (await admin.call("e0", base, "/v1/pause"))["state"] == "PAUSED"
        with pytest.raises(AdminError) as twice:  # a signal the state refuses
            await admin.call("e0", base, "/v1/pause")
        assert twice.value.status == 409 and "PAUSED" in str(twice.value)
        assert (twice.value.engine, twice.value.call) == ("e0", "POST /v1/pause")
        assert (await admin.call("e0", base, "/v1/unpause"))["state"] == "RUNNING"

    run(scenario)

    async def without_token(admin: EngineAdmin) -> None:
        with pytest.raises(AdminError, match="401") as no_token:
            await admin.call("e0", base, "/v1/pause")
        assert no_token.value.status == 401
        assert str(no_token.value).startswith("engine e0: POST /v1/pause: HTTP 401")

    run(without_token, token=None)


def test_drain(engine: EngineProcess) -> None:
    base = f"http://127.0.0.1:{engine.admin_port}"
    first = run(lambda admin: admin.drain("e0", base, timeout=1.0))
    # An idle engine is drained at once (a busy one when it is done, below).
    assert first.supported and first.drained
    status, ready = engine.http("GET", "/readyz")
    assert status == 503 and ready["ready"] is False  # no new traffic from Services


def test_drain_waits_for_the_running_request(engine: EngineProcess, tiny_llama: Path,
                                             tmp_path: Path) -> None:
    proc = EngineProcess(tiny_llama, tmp_path)
    base = f"http://127.0.0.1:{proc.admin_port}"
    try:
        probe = run(lambda admin: admin.state(base), token=None)
        assert probe.num_running == 0
        client = proc.client()
        client.sock.send(p.encode(p.Submit("long", [5, 6, 7], {
            "max_tokens": 200, "temperature": 0.0, "ignore_eos": True})))
        client.next(p.Output)
        result = run(lambda admin: admin.drain("e1", base, timeout=60), token=None)
        assert result.supported and result.drained and result.seconds > 0
        assert run(lambda admin: admin.state(base), token=None).num_running == 0
    finally:
        proc.close()


def test_an_engine_that_is_not_there_fails_fast() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        base = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        with pytest.raises(AdminError, match=rf"engine {base}: GET /v1/state: ConnectError"
                           ) as refused:
            run(lambda admin: admin.state(base))
        assert refused.value.status is None
        assert run(lambda admin: admin.probe(base)) is None  # an observation: no answer
        assert time.monotonic() - started < 2


def test_an_engine_that_never_answers_times_out() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # accepts connections, never reads or writes
        port = s.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(AdminError, match="engine e0: POST /v1/pause: ReadTimeout"):
            run(lambda admin: admin.call("e0", f"http://127.0.0.1:{port}", "/v1/pause"))
        assert 1.5 < time.monotonic() - started < 5
