"""The engine process's queue: `--max-queued-requests` refuses a SUBMIT with 429 while the
queue is full (resumed work is always taken), and a SUBMIT's `priority` orders it."""

from __future__ import annotations

from pathlib import Path

import pytest
from tandem_engine import protocol as p
from test_engine_process import Client, EngineProcess

pytestmark = pytest.mark.slow

SHORT = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    proc = EngineProcess(tiny_llama, tmp_path_factory.mktemp("engine"),
                         "--max-queued-requests", "2", "--max-num-seqs", "1")
    yield proc
    proc.close()


def first_tokens_until_finished(client: Client, rids: set[str]) -> list[str]:
    """The requests in the order their first tokens came, once all of `rids` finished
    (a REJECT of one of them fails the test)."""
    order: list[str] = []
    pending = set(rids)
    while pending:
        msg = client.next((p.Output, p.Reject), timeout=30)
        assert not isinstance(msg, p.Reject), msg
        if msg.token_ids and msg.request_id not in order:
            order.append(msg.request_id)
        if msg.finished:
            pending.discard(msg.request_id)
    return order


def wait_for_waiting(client: Client, count: int) -> None:
    """Until the engine's heartbeat says `count` requests wait (all SUBMITs admitted)."""
    while client.next(p.Heartbeat, timeout=10).load.num_waiting != count:
        pass


def test_a_full_queue_refuses_new_requests_with_429_and_takes_resumed_ones(
        engine: EngineProcess) -> None:
    client = engine.client()
    assert engine.http("POST", "/v1/pause")[0] == 200  # nothing runs: every one waits
    try:
        for rid in ("q0", "q1", "q2"):
            client.sock.send(p.encode(p.Submit(rid, [5, 6, 7], SHORT)))
        reject = client.next(p.Reject, timeout=10)
        assert (reject.request_id, reject.status) == ("q2", 429)
        assert reject.message == ("engine e0 has 2 requests waiting (--max-queued-requests "
                                  "2): retry later or on another engine")
        # A generation begun on another engine is work a router already placed: taken.
        client.sock.send(p.encode(p.Submit("resumed", [5, 6, 7], SHORT,
                                           resume=p.Resume([8], 0))))
        wait_for_waiting(client, 3)
    finally:
        assert engine.http("POST", "/v1/unpause")[0] == 200
    assert set(first_tokens_until_finished(client, {"q0", "q1", "resumed"})) == {
        "q0", "q1", "resumed"}
    outs = client.run("after", [5, 6, 7], **SHORT)  # the queue drained: taken again
    assert outs[-1].finished and outs[-1].finish_reason == "length"


def test_a_submits_priority_orders_the_queue(engine: EngineProcess) -> None:
    client = engine.client()
    assert engine.http("POST", "/v1/pause")[0] == 200
    try:
        client.sock.send(p.encode(p.Submit("normal", [5, 6, 7], SHORT)))
        client.sock.send(p.encode(p.Submit("urgent", [5, 6, 8], SHORT, priority=-1)))
        wait_for_waiting(client, 2)
    finally:
        assert engine.http("POST", "/v1/unpause")[0] == 200
    # One seat (--max-num-seqs 1): the later, better priority runs first.
    assert first_tokens_until_finished(client, {"normal", "urgent"}) == ["urgent", "normal"]
