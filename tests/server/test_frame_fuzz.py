"""Frame fuzzing over ZMQ against a real engine process: the engine drops what it cannot
decode, tells a SUBMIT's sender why it refused it, keeps serving, and holds no memory
for the garbage.

`test_engine_process` already sends a few hundred random and re-typed frames from one
socket, and `test_engine_bounds` one frame over MAX_FRAME_BYTES and a HELLO flood. Here:
hypothesis-generated frames (random bytes, truncated and bit-flipped valid frames,
every kind's fields with wrong-typed values, msgpack headers that declare gigabytes,
deep nesting, extra multipart frames) from many identities; every malformed or
unservable SUBMIT answered with a REJECT naming the problem; and frames just under the
size limit, which are buffered and decoded, leaving the engine's RSS where it was.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tandem_engine import protocol as p
from test_engine_process import Client, EngineProcess

pytestmark = pytest.mark.slow

VOCAB = 2048  # the tiny demo checkpoint's vocabulary
PROBE = [5, 6, 7, 8]  # the well-formed request sent after each batch
PROBE_SAMPLING = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
MiB = 1024 * 1024
# The engine's RSS may grow by this much over its post-warm-up value from small frames:
# allocator slack and a few cached buffers, not a leak of the hundreds of fuzz frames.
RSS_SLACK = 64 * MiB
# Frames of 48 MiB and a 2M-token SUBMIT (16 MB as a list, copied again on admission)
# raise glibc's dynamic mmap threshold, and its per-thread arenas then keep freed blocks
# for reuse: measured, RSS climbs for three to five rounds and then stays flat ~160 MiB
# above the warm engine for as many more rounds as sent. So: after WARMUP_ROUNDS, some
# three consecutive rounds (by MAX_ROUNDS) must add less than ROUND_SLACK (a leak of a
# frame or a token list adds 16-48 MiB every round, so it never does), and the plateau
# must stay under BIG_SLACK.
WARMUP_ROUNDS = 5
MAX_ROUNDS = 12  # a clean-clone CI run once climbed past 8 rounds before it flattened
ROUND_SLACK = 32 * MiB
BIG_SLACK = 256 * MiB
REJECT_TIMEOUT = 10.0  # a malformed SUBMIT's sender never waits longer for its REJECT
SETTINGS = settings(max_examples=300, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])

ENC = msgspec.msgpack.encode


def _header(kind: int, version: int = p.PROTOCOL_VERSION) -> bytes:
    return bytes((version, kind))


LOAD = p.Load("RUNNING", 0, 0, 0.0, "v", 0)
VALID = [p.encode(m) for m in (
    p.Hello(p.PROTOCOL_VERSION, "fuzz"), p.Ping("fuzz"), p.Abort("nobody"),
    p.Submit("fuzz-valid", [5, 6], {"max_tokens": 2}),
    p.Output("x", [1, 2], "ab", finished=True, finish_reason="stop"),
    p.Reject("x", 400, "no"), p.Heartbeat("e", "i", LOAD), p.StateChange("e", "i", LOAD),
    p.Welcome(p.PROTOCOL_VERSION, "e", "i", "mixed", "m", 16, 1024, LOAD))]
FIELDS = {kind: body.__struct_fields__ for kind, body in p.BODIES.items()}
# msgpack containers and strings whose length prefix declares ~4 GiB that never comes.
HUGE_HEADERS = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\xdc\xff\xff",
                b"\xde\xff\xff"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


@st.composite
def frames(draw) -> bytes:
    how = draw(st.sampled_from(["random", "truncated", "flipped", "any body", "wrong fields",
                                "huge length", "deep", "wrong version"]))
    valid = draw(st.sampled_from(VALID))
    kind = draw(st.sampled_from(list(p.Kind)))
    if how == "random":
        return draw(st.binary(max_size=300))
    if how == "truncated":
        return valid[:draw(st.integers(0, len(valid) - 1))]
    if how == "flipped":
        i = draw(st.integers(0, len(valid) - 1))
        return valid[:i] + bytes([valid[i] ^ (1 << draw(st.integers(0, 7)))]) + valid[i + 1:]
    if how == "any body":
        return _header(kind) + ENC(draw(json_values))
    if how == "wrong fields":  # the kind's own field names, values of any type
        names = FIELDS[kind]
        body = {name: draw(json_values) for name in names if draw(st.booleans())}
        return _header(kind) + ENC(body)
    if how == "huge length":  # a body that starts right and then declares gigabytes
        prefix = valid[2:][:draw(st.integers(0, len(valid) - 2))]
        return valid[:2] + prefix + draw(st.sampled_from(HUGE_HEADERS))
    if how == "deep":
        return _header(kind) + b"\x91" * draw(st.integers(1, 200_000)) + b"\x01"
    return _header(kind, draw(st.integers(0, 255).filter(lambda v: v != p.PROTOCOL_VERSION))) \
        + valid[2:]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    proc = EngineProcess(tiny_llama, tmp_path_factory.mktemp("frame-fuzz"))
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def baseline(engine: EngineProcess) -> tuple[list[int], int]:
    """The probe's greedy tokens and the engine's RSS once warm, before any fuzz."""
    outs = Client(engine.port).run("baseline", PROBE, **PROBE_SAMPLING)
    tokens = [t for o in outs for t in o.token_ids]
    assert len(tokens) == 8 and outs[-1].finish_reason == "length"
    return tokens, psutil.Process(engine.proc.pid).memory_info().rss


def _still_serving(engine: EngineProcess, baseline: tuple[list[int], int], tag: str,
                   slack: int = RSS_SLACK) -> None:
    """A fresh, well-formed client gets the probe's exact answer; a malformed SUBMIT gets
    its REJECT; the process is up, healthy and within its memory bound."""
    tokens, rss = baseline
    assert engine.proc.poll() is None, engine.log.read_text()[-3000:]
    client = Client(engine.port)
    outs = client.run(f"probe-{tag}", PROBE, **PROBE_SAMPLING)
    assert [t for o in outs for t in o.token_ids] == tokens, outs
    reject = _reject(client, f"bad-{tag}", {"top_p": 0.0})
    assert reject.status == 400 and "top_p" in reject.message
    assert engine.http("GET", "/healthz")[0] == 200
    grown = psutil.Process(engine.proc.pid).memory_info().rss - rss
    assert grown < slack, f"the engine's RSS grew by {grown / MiB:.0f} MiB"


DEFAULT_SAMPLING = {"max_tokens": 4}


def _submit_frame(rid: str, prompt: object = (5, 6, 7), sampling: object = DEFAULT_SAMPLING,
                  **fields: object) -> bytes:
    body = {"request_id": rid, "prompt_token_ids": list(prompt) if isinstance(prompt, tuple)
            else prompt, "sampling": sampling, **fields}
    return _header(p.Kind.SUBMIT) + ENC(body)


def _reject(client: Client, rid: str, sampling: object = DEFAULT_SAMPLING,
            **fields: object) -> p.Reject:
    """Send a SUBMIT `rid` and return its REJECT (fails on an Output, or no answer)."""
    client.sock.send(_submit_frame(rid, sampling=sampling, **fields))
    deadline = time.monotonic() + REJECT_TIMEOUT
    while True:
        msg = client.next((p.Output, p.Reject), timeout=max(0.1, deadline - time.monotonic()))
        if msg.request_id == rid:
            assert isinstance(msg, p.Reject), f"{rid} was served: {msg}"
            return msg


def test_fuzzed_frames_from_many_identities_are_dropped(engine: EngineProcess,
                                                        baseline) -> None:
    ctx = zmq.Context()
    pool = []
    for i in range(16):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, f"fuzz-{i}".encode())
        sock.connect(f"tcp://127.0.0.1:{engine.port}")
        pool.append(sock)
    sent = [0]
    try:
        @SETTINGS
        @given(parts=st.lists(frames(), min_size=1, max_size=3),
               who=st.integers(-1, len(pool) - 1))
        def send(parts: list[bytes], who: int) -> None:
            if who < 0:  # a fresh identity, gone right after its frames
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 500)
                sock.connect(f"tcp://127.0.0.1:{engine.port}")
                sock.send_multipart(parts)
                sock.close()
            else:
                pool[who].send_multipart(parts)
            sent[0] += 1

        send()
        for sock in pool:  # deliberately never read: the engine's replies just queue
            sock.send_multipart([b"extra", b"frames", b"here"])
    finally:
        for sock in pool:
            sock.close(linger=0)
        ctx.term()
    assert sent[0] >= 300
    _still_serving(engine, baseline, "fuzz")
    log = engine.log.read_text()
    # The first drops in full, then a summary line per 1000: a flood cannot flood the log.
    assert "dropped a bad frame" in log
    assert log.count("dropped a bad frame") <= 10


BAD_SAMPLING = [  # (sampling, what the REJECT must mention)
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1e-50}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64 - 1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": "x" * 257}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),  # checked against the vocabulary
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ([1, 2], "sampling"),
    ("greedy", "sampling"),
    (None, "sampling"),
]
BAD_FIELDS = [  # (other SUBMIT fields, what the REJECT must mention)
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": [-1]}, "outside the model's vocabulary"),
    ({"prompt_token_ids": [VOCAB]}, "outside the model's vocabulary"),
    ({"prompt_token_ids": [2**64 - 1]}, "outside the model's vocabulary"),
    ({"prompt_token_ids": ["a"]}, "prompt_token_ids"),
    ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
    ({"prompt_token_ids": [5] * 5000}, "limit of 1024"),
    ({"cache_salt": 7}, "cache_salt"),
    ({"resume": {"token_ids": [VOCAB]}}, "resumed token id"),
    ({"resume": "yes"}, "resume"),
    ({"pull": {"pin_id": "x"}}, "pull"),
    ({"pull": {"agent": {"agent_name": "a", "agent_metadata": b"", "geometry": {}},
               "pin_id": "x", "block_ids": [0]}}, "pull"),
]


def test_every_malformed_submit_is_rejected_naming_the_problem(engine: EngineProcess,
                                                               baseline) -> None:
    client = Client(engine.port)
    for i, (sampling, named) in enumerate(BAD_SAMPLING):
        reject = _reject(client, f"s{i}", sampling)
        assert reject.status == 400 and named in reject.message, (sampling, reject)
    for i, (fields, named) in enumerate(BAD_FIELDS):
        reject = _reject(client, f"f{i}", **fields)
        assert reject.status == 400 and named in reject.message, (fields, reject)
    # Unknown fields are not errors: a newer router's extra field is ignored.
    client.sock.send(_submit_frame("unknown-fields", sampling={
        "max_tokens": 2, "temperature": 0.0, "frobnicate": 1}, frobnicate=[1]))
    out = client.next(p.Output)
    while not out.finished:
        out = client.next(p.Output)
    assert out.request_id == "unknown-fields" and out.finish_reason in ("stop", "length")
    _still_serving(engine, baseline, "submits")


def test_a_reused_request_id_is_refused_and_the_first_request_runs_on(
        engine: EngineProcess, baseline) -> None:
    client = Client(engine.port)
    # The first request runs long enough that the second frame is surely admitted while
    # it runs (8 tokens could finish first, and the id would be free again).
    long = {**PROBE_SAMPLING, "max_tokens": 256}
    client.sock.send(_submit_frame("twice", PROBE, long))
    client.sock.send(_submit_frame("twice", PROBE, long))
    tokens, rejects = [], []
    while True:
        msg = client.next((p.Output, p.Reject), timeout=3.0)
        if isinstance(msg, p.Reject):
            rejects.append(msg)
            continue
        tokens += msg.token_ids
        if msg.finished:
            break
    assert tokens[:8] == baseline[0] and len(tokens) == 256  # greedy: the probe's first
    assert len(rejects) == 1 and "already in use" in rejects[0].message
    _still_serving(engine, baseline, "reused")


def test_big_frames_under_the_limit_leave_no_memory_behind(engine: EngineProcess,
                                                          baseline) -> None:
    client = Client(engine.port)
    proc = psutil.Process(engine.proc.pid)
    # Under MAX_FRAME_BYTES, so each is received in full, decoded and dropped.
    junk = bytearray(48 * MiB)
    two_million = _submit_frame("two-million", [5] * 2_000_000, {"max_tokens": 1})

    def one_round() -> int:
        for head in (_header(p.Kind.SUBMIT), b"\x00\x00"):
            junk[:2] = head
            client.sock.send(memoryview(junk), copy=False)
        # A well-formed SUBMIT of two million tokens: decoded in full, then refused.
        client.sock.send(two_million)
        msg = client.next(p.Reject, timeout=REJECT_TIMEOUT)
        assert msg.request_id == "two-million" and "limit of 1024" in msg.message
        time.sleep(0.2)
        return proc.memory_info().rss

    rss = [one_round() for _ in range(WARMUP_ROUNDS)]
    while rss[-1] - rss[-4] >= ROUND_SLACK:  # not flat yet: a leak never gets flat
        assert len(rss) < MAX_ROUNDS, (
            f"each round of big frames keeps memory: +{(rss[-1] - rss[-4]) / MiB:.0f} MiB "
            f"in the last 3 of {len(rss)} rounds")
        rss.append(one_round())
    _still_serving(engine, baseline, "big", slack=BIG_SLACK)
