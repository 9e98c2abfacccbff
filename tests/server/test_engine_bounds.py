"""An engine's socket and router table stay bounded whatever peers do: an oversized frame
costs a connection, not memory; fake or dead routers are forgotten (no heartbeats, CPU
back to idle) and their requests aborted; a live router keeps its requests."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import zmq
import zmq.asyncio
from tandem_engine import protocol as p
from test_engine_process import Client, EngineProcess
from zmq.utils.monitor import parse_monitor_message

pytestmark = pytest.mark.slow

LONG = {"max_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
ROUTER_TIMEOUT = 1.0
MAX_ROUTERS = 64  # small, so a flood overfills the table on any machine's speed
ROUTERS = 'tandem_routers{engine_id="e0"}'
ABORTED = 'tandem_requests_finished_total{engine_id="e0",reason="abort"}'


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    proc = EngineProcess(tiny_llama, tmp_path_factory.mktemp("engine"), "--heartbeat-interval",
                         "0.25", "--router-timeout", str(ROUTER_TIMEOUT),
                         "--max-routers", str(MAX_ROUTERS))
    yield proc
    proc.close()


def metric(engine: EngineProcess, name: str) -> float:
    """One sample of the engine's /metrics, 0 when absent (`name` includes labels)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{engine.admin_port}/metrics",
                                  timeout=5).read().decode()
    text = re.sub(r',(model_name|role)="[^"]*"', "", text)  # on every engine series
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def peak_rss(pid: int) -> int:
    """The process's high-water RSS in bytes (VmHWM): a frame buffered and freed shows."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) * 1024


def test_an_oversized_frame_costs_its_connection_not_memory(engine: EngineProcess) -> None:
    proc = psutil.Process(engine.proc.pid)
    Client(engine.port).run("warm", [5, 6, 7], max_tokens=2)
    rss, peak = proc.memory_info().rss, peak_rss(proc.pid)
    size = 4 * p.MAX_FRAME_BYTES  # 256 MiB
    sock = zmq.Context.instance().socket(zmq.DEALER)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(f"tcp://127.0.0.1:{engine.port}")
    sock.send(memoryview(bytearray(size)), copy=False)
    events = []
    while zmq.EVENT_DISCONNECTED not in events:  # libzmq drops us after the size field
        assert monitor.poll(10_000), f"still connected after the frame ({events})"
        events.append(parse_monitor_message(monitor.recv_multipart())["event"])
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)
    outs = Client(engine.port).run("after", [5, 6, 7, 8], max_tokens=3, temperature=0.0)
    assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 3
    assert proc.memory_info().rss - rss < size // 8
    assert peak_rss(proc.pid) - peak < size // 8, "the frame was buffered"


def test_a_flood_of_hellos_is_bounded_then_forgotten(engine: EngineProcess) -> None:
    proc = psutil.Process(engine.proc.pid)
    ctx = zmq.Context()
    ctx.max_sockets = 1000
    hello = p.encode(p.Hello(p.PROTOCOL_VERSION, "fake"))
    for batch in range(3):  # 600 routers that say HELLO, get WELCOME and vanish
        socks = []
        for i in range(200):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, f"fake-{batch}-{i}".encode())
            sock.connect(f"tcp://127.0.0.1:{engine.port}")
            sock.send(hello)
            socks.append(sock)
        for sock in socks:
            assert sock.poll(10_000), "no WELCOME"
            sock.close(linger=0)
        assert metric(engine, ROUTERS) <= MAX_ROUTERS
    ctx.term()
    assert f"forgotten: more than {MAX_ROUTERS} routers" in engine.log.read_text()
    deadline = time.monotonic() + ROUTER_TIMEOUT + 10
    while metric(engine, ROUTERS) > 0:
        assert time.monotonic() < deadline, "the fake routers are never forgotten"
        time.sleep(0.2)
    time.sleep(0.5)
    before = proc.cpu_times()
    time.sleep(2.0)
    after = proc.cpu_times()
    busy = (after.user + after.system) - (before.user + before.system)
    assert busy < 0.3, f"an idle engine used {busy:.2f} s of CPU in 2 s"
    outs = Client(engine.port).run("after", [5, 6, 7], max_tokens=2)  # routers still welcome
    assert outs[-1].finished


def test_an_orphaned_request_is_aborted_and_a_live_routers_runs_on(
        engine: EngineProcess) -> None:
    aborted = metric(engine, ABORTED)
    live, orphan = Client(engine.port), Client(engine.port, ping=False)
    started = time.monotonic()
    live.sock.send(p.encode(p.Submit("kept", [5, 6, 7], LONG)))
    orphan.sock.send(p.encode(p.Submit("orphan", [5, 6, 8], LONG)))
    orphan.next(p.Output)  # it is running
    orphan.sock.close(linger=0)  # the router dies without an ABORT
    tokens, last = 0, None
    while metric(engine, ABORTED) < aborted + 1 or not (last and last.finished):
        assert time.monotonic() - started < ROUTER_TIMEOUT + 20, "the orphan still runs"
        last = live.next(p.Output)  # pings while it waits, as a router does
        tokens += len(last.token_ids)
    assert last.finish_reason == "length" and tokens == 1000
    assert time.monotonic() - started > 2 * ROUTER_TIMEOUT, \
        "1000 tokens took less than the router timeout: this cannot show the live one kept"
    assert metric(engine, ABORTED) == aborted + 1
    assert engine.http("GET", "/v1/state")[1]["num_running"] == 0


def test_a_router_pings_its_engines_while_connected() -> None:
    """The router's side of liveness: after WELCOME, a PING every `ping_interval`."""
    from tandem_engine.router.engines import EngineClient

    async def scenario() -> list[object]:
        ctx = zmq.asyncio.Context()
        engine = ctx.socket(zmq.ROUTER)
        port = engine.bind_to_random_port("tcp://127.0.0.1")
        client = EngineClient(f"127.0.0.1:{port}", router_id="r1", context=ctx,
                              ping_interval=0.1)
        await client.start()
        try:
            seen = []
            identity, frame = await asyncio.wait_for(engine.recv_multipart(), 5)
            seen.append(p.decode(frame))
            load = p.Load("RUNNING", 0, 0, 0.0, "v1", 0)
            await engine.send_multipart([identity, p.encode(p.Welcome(
                p.PROTOCOL_VERSION, "e0", "inc", "mixed", "tiny", 16, 1024, load))])
            while sum(isinstance(m, p.Ping) for m in seen) < 3:
                seen.append(p.decode((await asyncio.wait_for(engine.recv_multipart(),
                                                             5))[1]))
            return seen
        finally:
            await client.close()
            engine.close(linger=0)
            ctx.term()

    seen = asyncio.run(scenario())
    assert isinstance(seen[0], p.Hello) and p.Ping("r1") in seen
