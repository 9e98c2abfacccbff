"""The wire protocol: round trips, and every kind of bad frame refused the same way."""

from __future__ import annotations

import contextlib
import logging

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tandem_engine import protocol as p
from tandem_engine.sampling_params import SamplingParams

LOAD = p.Load("RUNNING", 2, 1, 0.25, "v1", 3)
MESSAGES = [
    p.Hello(p.PROTOCOL_VERSION, "router-a"),
    p.Welcome(p.PROTOCOL_VERSION, "e0", "inc", "mixed", "tiny", 16, 1024, LOAD),
    p.Heartbeat("e0", "inc", LOAD),
    p.StateChange("e0", "inc", LOAD),
    p.Submit("r1", [1, 2, 3], SamplingParams(max_tokens=4, stop=["x"]), cache_salt="t",
             resume=p.Resume([5, 6], 3)),
    p.Submit("r2", [1], SamplingParams(min_p=0.1, repetition_penalty=1.3,
                                       presence_penalty=-0.5, frequency_penalty=2.0)),
    p.Submit("r3", [1, 2], SamplingParams(), priority=-(2**31)),
    p.Output("r1", [7], "hi", [p.TokenLogprobs(-0.5, [(7, -0.5), (8, -1.0)])], True,
             "stop", "x", 3),
    p.Output("r2", [9], "", finished=True, handoff=p.Handoff("r2", [4, 5])),
    p.Abort("r1"),
    p.Reject("r1", 400, "too long"),
    p.Ping("router-a"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message) -> None:
    frame = p.encode(message)
    assert frame[0] == p.PROTOCOL_VERSION and frame[1] == p.KIND_OF[type(message)]
    assert p.decode(frame) == message


def test_kinds_live_in_disjoint_ranges() -> None:
    for kind in p.Kind:
        assert sum(kind.value in r for r in p.RANGES.values()) == 1


@pytest.mark.parametrize(("frame", "needle"), [
    (b"", "shorter than its 2-byte header"),
    (b"\x01", "shorter than its 2-byte header"),
    (bytes([9, p.Kind.ABORT]) + msgspec.msgpack.encode({"request_id": "x"}),
     "protocol version 9"),
    (bytes([p.PROTOCOL_VERSION, 250]), "unknown message kind 250"),
    (bytes([p.PROTOCOL_VERSION, p.Kind.SUBMIT]) + msgspec.msgpack.encode({"request_id": 1}),
     "malformed SUBMIT"),
    (p.encode(MESSAGES[4])[:-3], "malformed SUBMIT"),
])
def test_bad_frames_raise_protocol_error_naming_the_problem(frame: bytes, needle: str) -> None:
    with pytest.raises(p.ProtocolError, match=needle):
        p.decode(frame)


@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_raise_anything_but_protocol_error(frame: bytes) -> None:
    with contextlib.suppress(p.ProtocolError):
        p.decode(frame)


def test_submit_priority_defaults_to_0_and_is_a_32_bit_int() -> None:
    """A SUBMIT without `priority` is scheduled at 0 (vLLM's default); one beyond a signed
    32-bit int is refused with a REJECT naming the field, not dropped."""
    body = {"request_id": "r", "prompt_token_ids": [1], "sampling": {}}
    frame = bytes([p.PROTOCOL_VERSION, p.Kind.SUBMIT]) + msgspec.msgpack.encode(body)
    assert p.decode(frame).priority == 0
    for priority in (2**31, -(2**31) - 1):
        frame = bytes([p.PROTOCOL_VERSION, p.Kind.SUBMIT]) + msgspec.msgpack.encode(
            {**body, "priority": priority})
        with pytest.raises(p.InvalidSubmit, match=r"priority") as info:
            p.decode(frame)
        assert info.value.request_id == "r"


def test_drop_log_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    drops = p.DropLog(logging.getLogger("drops"), "engine e0", burst=3, every=100)
    with caplog.at_level(logging.WARNING, logger="drops"):
        for i in range(250):
            drops.dropped(f"bad {i}")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5  # three in full, then at 100 and 200
    assert lines[0] == "engine e0: dropped a bad frame: bad 0"
    assert lines[-1].startswith("engine e0: 200 bad frames dropped so far")


def test_output_spec_totals_are_optional_both_ways() -> None:
    """`num_spec_proposed` / `num_spec_accepted` are additive: an engine that does not send
    them reads as 0, and a router that does not know them ignores them."""
    new = p.Output("r1", [7], "hi", finished=True, finish_reason="length",
                   num_spec_proposed=12, num_spec_accepted=9)
    assert p.decode(p.encode(new)) == new
    body = msgspec.msgpack.encode({"request_id": "r1", "token_ids": [7], "text": "hi"})
    old = p.decode(bytes([p.PROTOCOL_VERSION, p.Kind.OUTPUT]) + body)
    assert (old.num_spec_proposed, old.num_spec_accepted) == (0, 0)

    class OldOutput(msgspec.Struct):  # an Output as a router without the fields knows it
        request_id: str
        token_ids: list[int]
        text: str

    assert msgspec.msgpack.decode(p.encode(new)[2:], type=OldOutput).token_ids == [7]


def test_only_the_final_output_carries_the_spec_totals() -> None:
    from tandem_engine.engine.outputs import CompletionOutput, RequestOutput
    from tandem_engine.server.worker import _Stream, stream_delta

    stream = _Stream(b"router", "r1", None)

    def out(tokens: list[int], finished: bool) -> RequestOutput:
        return RequestOutput("e/r1", None, [1, 2], [CompletionOutput(
            0, "x" * len(tokens), tokens, None, None, "length" if finished else None)],
            finished, num_spec_proposed=4 * len(tokens), num_spec_accepted=len(tokens))

    first = stream_delta(stream, out([5, 6], finished=False))
    assert (first.num_spec_proposed, first.num_spec_accepted) == (0, 0)
    last = stream_delta(stream, out([5, 6, 7], finished=True))
    assert last.token_ids == [7] and last.finished
    assert (last.num_spec_proposed, last.num_spec_accepted) == (12, 3)  # the request's totals
