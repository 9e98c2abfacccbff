"""Every message between the router and the engines, in one module.

A frame is `[version: u8][kind: u8]` followed by the msgpack body of the struct that
`kind` names. Kinds are IntEnums grouped in disjoint numeric ranges (connection,
request, control, transport) and checked for collisions at import. `decode` never
trusts a frame: a short, unknown, wrong-version or malformed one raises
`ProtocolError`, which receivers log and drop — a bad frame never takes a process down.
The protocol version is also exchanged in HELLO/WELCOME when a router connects.
libzmq enforces `MAX_FRAME_BYTES` on both sides' sockets (`ZMQ_MAXMSGSIZE`): a bigger
frame drops its connection before it is buffered.

Torch-free: the router imports it without the model stack.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import Meta

from tandem_engine.lifecycle import EngineRole
from tandem_engine.lora_request import ADAPTER_NAME
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.transfer.base import KVGeometry

# 2: typed SamplingParams in SUBMIT, RESUME of a generation begun elsewhere, HANDOFF in OUTPUT.
# 3: routers PING; an engine forgets a router it has not heard from in its router timeout
#    and aborts that router's requests. A version-2 router never pings, so a version-3
#    engine would drop it (and its long requests) every timeout: the two refuse each
#    other at HELLO/WELCOME instead.
# 4: SamplingParams carries min_p, repetition_penalty, presence_penalty and
#    frequency_penalty. A version-3 engine would decode them as unknown fields and
#    silently sample without them, so the versions refuse each other. Output also
#    carries num_cached_tokens, prompt_logprobs and num_spec_proposed /
#    num_spec_accepted (optional, additive: a peer without them decodes 0 / None, one
#    that does not know them ignores them).
# 5: SamplingParams carries structured_outputs. A version-4 engine would drop it and
#    sample unconstrained, so the versions refuse each other.
# 6: Submit carries `lora`, the LoRA adapter (name and version) a request runs under. A
#    version-5 engine would drop it and decode with the base weights alone, so the
#    versions refuse each other. Load also lists the adapters an engine serves and those
#    on its device, and the control kinds LORA_LOAD / LORA_UNLOAD / LORA_REPLY carry a
#    router's adapter calls.
# 7: engines publish their prefix cache's changes (KV_EVENTS) and answer KV_SNAPSHOT_REQUEST
#    with every hash they hold (KV_SNAPSHOT): routers route on an exact index of each
#    engine's cache. A version-6 engine sends none, and a version-7 router would route on
#    an empty index, so the versions refuse each other. WELCOME carries the engine's KV
#    pool size (what bounds that index). Submit carries `priority` (vLLM's: lower is
#    scheduled first), and an engine refuses a SUBMIT with a 429 REJECT while its
#    --max-queued-requests are waiting.
PROTOCOL_VERSION = 7


class ProtocolError(ValueError):
    """A frame that cannot be accepted; the message says why."""


class InvalidSubmit(ProtocolError):
    """A SUBMIT whose body does not validate (a bad sampling parameter, a wrong type):
    unlike other bad frames its sender is told, with a REJECT naming the problem."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class Kind(enum.IntEnum):
    # connection: 1..19
    HELLO = 1  # router -> engine
    WELCOME = 2  # engine -> router
    HEARTBEAT = 3  # engine -> router, every heartbeat interval
    PING = 4  # router -> engine, every ping interval: this router is alive
    # request: 20..49
    SUBMIT = 20  # router -> engine
    OUTPUT = 21  # engine -> router: new tokens / text, final when finished
    ABORT = 22  # router -> engine
    REJECT = 23  # engine -> router: the request could not be accepted
    # control: 50..69
    STATE = 50  # engine -> router: a lifecycle state change, sent at once
    LORA_LOAD = 51  # router -> engine: serve a LoRA adapter (answered by LORA_REPLY)
    LORA_UNLOAD = 52  # router -> engine: stop serving one (answered by LORA_REPLY)
    LORA_REPLY = 53  # engine -> router: how a LORA_LOAD or LORA_UNLOAD went
    KV_EVENTS = 54  # engine -> router: its prefix cache's changes since the last batch
    KV_SNAPSHOT_REQUEST = 55  # router -> engine: send every hash you hold (a gap, a start)
    KV_SNAPSHOT = 56  # engine -> router: every hash it holds, as of one batch
    # transport: 70..99 (KV handoff between prefill and decode engines)


RANGES = {
    "connection": range(1, 20),
    "request": range(20, 50),
    "control": range(50, 70),
    "transport": range(70, 100),
}


def _check_kinds() -> None:
    seen: dict[int, str] = {}
    for kind in Kind:
        owners = [name for name, r in RANGES.items() if kind.value in r]
        if len(owners) != 1:
            raise AssertionError(f"message kind {kind.name}={kind.value} is in {owners}")
        if kind.value in seen:
            raise AssertionError(f"{kind.name} collides with {seen[kind.value]}")
        seen[kind.value] = kind.name


_check_kinds()


class Hello(msgspec.Struct, frozen=True):
    protocol_version: int
    router_id: str


class Ping(msgspec.Struct, frozen=True):
    router_id: str


class Load(msgspec.Struct, frozen=True):
    """What routing needs to know of an engine right now."""

    state: str  # an EngineState name
    num_running: int
    num_waiting: int
    kv_usage: float  # 0..1 of the KV pool in use
    weight_version: str
    weight_epoch: int
    draining: bool = False  # refusing new requests (a drain, a refit's verification)
    # LoRA adapters as identities "name@version": those the engine serves (a request may
    # name them), and those of them on its device now (no load before the first step).
    loras: list[str] = []
    resident_loras: list[str] = []


_AdapterName = Annotated[str, Meta(pattern=ADAPTER_NAME.pattern)]  # lora_request's rule
_AdapterVersion = Annotated[str, Meta(min_length=1, max_length=64)]
_Priority = Annotated[int, Meta(ge=-2**31, le=2**31 - 1)]  # a signed 32-bit int


class LoRARef(msgspec.Struct, frozen=True):
    """A LoRA adapter as a request names it on the wire: an engine runs the request
    under it only where it serves this name at this version (else it REJECTs)."""

    name: _AdapterName
    version: _AdapterVersion

    @property
    def identity(self) -> str:
        """"name@version", as `Load.loras` lists it and the prefix cache is salted."""
        return f"{self.name}@{self.version}"


class KVTransferInfo(msgspec.Struct, frozen=True):
    """How another engine pulls this engine's KV blocks: its transfer agent."""

    agent_name: str
    agent_metadata: bytes
    geometry: KVGeometry  # validated when decoded: a bad one is a malformed frame


class PullSource(msgspec.Struct, frozen=True):
    """Where a decode engine finds a prompt's KV: computed and pinned by a prefill engine.
    The first token that engine sampled travels in the SUBMIT's `resume`."""

    agent: KVTransferInfo
    pin_id: str  # the prefill engine's name for the pin, sent back when the pull is done
    block_ids: list[int]  # the prompt's blocks there, in position order
    # The prefill engine's speculative proposals for the tokens after the first (method
    # mtp): the decode engine verifies them in its first step.
    proposals: list[int] = []


class Resume(msgspec.Struct, frozen=True):
    """A generation that began on another engine (a failover, or a decode engine after a
    handoff): `token_ids` are its first generated tokens (not prompt), and the client
    already has the first `sent_chars` characters of their text. The engine counts them
    against max_tokens / min_tokens, derives their text itself (so a stop string that
    spans the hand-over is found, and text held back there is not lost) and streams
    from the next character and token on."""

    token_ids: list[int]
    sent_chars: int = 0


class Handoff(msgspec.Struct, frozen=True):
    """A prefill engine's part of a request is done: the prompt's KV is pinned there for
    a decode engine to pull (sent in the final OUTPUT instead of a finish reason)."""

    pin_id: str  # name the pin in the decode engine's PullSource
    block_ids: list[int]  # the prompt's pinned blocks, in position order
    proposals: list[int] = []  # speculative proposals after the first token (PullSource)


class Welcome(msgspec.Struct, frozen=True):
    protocol_version: int
    engine_id: str
    incarnation: str  # new on every process start: a restart is a new engine
    role: EngineRole
    model: str  # the served model name
    block_size: int
    max_model_len: int
    load: Load
    kv_transfer: KVTransferInfo | None = None  # prefill/decode engines only
    num_kv_blocks: int = 0  # its KV pool: the most block hashes it can hold at once


class Heartbeat(msgspec.Struct, frozen=True):
    engine_id: str
    incarnation: str
    load: Load


class StateChange(msgspec.Struct, frozen=True):
    engine_id: str
    incarnation: str
    load: Load


class Submit(msgspec.Struct, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # validated at the router's edge; the whole generation's
    cache_salt: str | None = None
    # prefill: stop after the first token and keep the prompt's KV pinned for a decode
    # engine (unless that token ends the generation)
    pin_for_handoff: bool = False
    resume: Resume | None = None  # tokens generated elsewhere that this engine continues
    pull: PullSource | None = None  # decode: pull the prompt's KV instead of computing it
    lora: LoRARef | None = None  # the LoRA adapter it runs under (None: the base model)
    # vLLM's: lower is scheduled first, and preempts running requests of a larger one;
    # equal priorities go by arrival.
    priority: _Priority = 0


class TokenLogprobs(msgspec.Struct, frozen=True):
    """One generated token's logprob and the top alternatives (token id -> logprob)."""

    logprob: float
    top: list[tuple[int, float]] = []
    rank: int | None = None  # the token's own rank (1 = most likely); prompt tokens only


class Output(msgspec.Struct, frozen=True):
    request_id: str
    token_ids: list[int]  # new since the previous Output of this request
    text: str  # new text since the previous Output (stop strings are never half-sent)
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked
    finished: bool = False  # no more Outputs for this request from this engine
    finish_reason: str | None = None  # stop | length | abort | error; None with a handoff
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    handoff: Handoff | None = None  # a prefill engine's final output: continue elsewhere
    error: str | None = None  # finish reason "error": why this request failed (only it)
    # Prompt tokens this engine found in its prefix cache (not computed) at admission.
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: prompt tokens 1.. (the first has none), on
    # the request's first Output with tokens; `top` holds the alternatives by rank.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Speculative decoding on this engine, over the request's life here: proposed tokens
    # it verified and how many it accepted. Set on the final Output only (0 elsewhere,
    # and always 0 without speculation); the router logs them per request.
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0


class Abort(msgspec.Struct, frozen=True):
    request_id: str


class Reject(msgspec.Struct, frozen=True):
    request_id: str
    status: int  # HTTP status the router should answer with (400, 429, 503, ...)
    message: str


class LoadLoRA(msgspec.Struct, frozen=True):
    """Serve the PEFT adapter at `path` (a folder on the engine's machine, inside its
    weights roots) under `name` at `version` (vLLM's `POST /v1/load_lora_adapter`)."""

    call_id: str  # the reply's, chosen by the router
    name: _AdapterName
    path: Annotated[str, Meta(min_length=1, max_length=4096)]
    version: _AdapterVersion = "1"


class UnloadLoRA(msgspec.Struct, frozen=True):
    """Stop serving adapter `name`; requests already under it finish with it."""

    call_id: str
    name: _AdapterName


_BlockHash = int  # core/kv/hashing's 64-bit chained hashes (msgpack uint64)


class KVEvents(msgspec.Struct, frozen=True):
    """One numbered batch of an engine's prefix-cache changes (core/kv/events.py): apply
    `cleared`, then `removed`, then `stored`. `sent_at`: the engine's wall clock."""

    engine_id: str
    incarnation: str
    seq: int
    cleared: bool
    stored: list[_BlockHash]
    removed: list[_BlockHash]
    sent_at: float


class KVSnapshotRequest(msgspec.Struct, frozen=True):
    router_id: str


class KVSnapshot(msgspec.Struct, frozen=True):
    """Every block hash the engine's prefix cache holds, as of batch `seq` (later batches
    apply on top)."""

    engine_id: str
    incarnation: str
    seq: int
    hashes: list[_BlockHash]
    sent_at: float


class LoRAReply(msgspec.Struct, frozen=True):
    """How a LORA_LOAD or LORA_UNLOAD went: an HTTP status (200; 400 a bad adapter or
    LoRA off; 404 unloading a name not served) and a message naming the problem. `load`
    is the engine's load after the call, so the router routes by it at once."""

    call_id: str
    status: int
    message: str
    load: Load | None = None


BODIES: dict[Kind, type[msgspec.Struct]] = {
    Kind.HELLO: Hello,
    Kind.WELCOME: Welcome,
    Kind.HEARTBEAT: Heartbeat,
    Kind.PING: Ping,
    Kind.SUBMIT: Submit,
    Kind.OUTPUT: Output,
    Kind.ABORT: Abort,
    Kind.REJECT: Reject,
    Kind.STATE: StateChange,
    Kind.LORA_LOAD: LoadLoRA,
    Kind.LORA_UNLOAD: UnloadLoRA,
    Kind.LORA_REPLY: LoRAReply,
    Kind.KV_EVENTS: KVEvents,
    Kind.KV_SNAPSHOT_REQUEST: KVSnapshotRequest,
    Kind.KV_SNAPSHOT: KVSnapshot,
}
KIND_OF: dict[type[msgspec.Struct], Kind] = {body: kind for kind, body in BODIES.items()}
assert set(BODIES) == set(Kind), "every kind needs a body struct"

_encoder = msgspec.msgpack.Encoder()
_decoders = {kind: msgspec.msgpack.Decoder(body) for kind, body in BODIES.items()}


class _RequestIdOnly(msgspec.Struct):
    request_id: str


_request_id_decoder = msgspec.msgpack.Decoder(_RequestIdOnly)
# The largest frame, its 2-byte header included: `decode` refuses bigger ones, and the
# engine's ROUTER and the router's DEALERs set it as ZMQ_MAXMSGSIZE, so libzmq drops the
# connection of a peer that sends one after its size field, never buffering it.
MAX_FRAME_BYTES = 64 * 1024 * 1024


class DropLog:
    """Logs dropped frames without letting a flood of them flood the log: the first
    `burst` in full, then one summary line per `every` drops."""

    def __init__(self, logger, source: str, burst: int = 10, every: int = 1000) -> None:
        self.logger, self.source, self.burst, self.every = logger, source, burst, every
        self.count = 0

    def dropped(self, reason: object) -> None:
        self.count += 1
        if self.count <= self.burst:
            self.logger.warning("%s: dropped a bad frame: %s", self.source, reason)
        elif self.count % self.every == 0:
            self.logger.warning("%s: %d bad frames dropped so far (latest: %s)", self.source,
                                self.count, reason)


def encode(message: msgspec.Struct) -> bytes:
    kind = KIND_OF[type(message)]
    return bytes((PROTOCOL_VERSION, kind)) + _encoder.encode(message)


def decode(frame: bytes) -> msgspec.Struct:
    """Parse one frame; ProtocolError (never anything else) for a frame to drop."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(frame).__name__}")
    if len(frame) < 2:
        raise ProtocolError(f"frame of {len(frame)} bytes is shorter than its 2-byte header")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    version, kind_value = frame[0], frame[1]
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not {PROTOCOL_VERSION}")
    try:
        kind = Kind(kind_value)
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind_value}") from None
    body = bytes(frame[2:])
    try:
        return _decoders[kind].decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        if kind is Kind.SUBMIT:
            try:
                request_id = _request_id_decoder.decode(body).request_id
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
            else:
                raise InvalidSubmit(request_id, f"invalid request: {exc}") from None
        raise ProtocolError(f"malformed {kind.name} body: {exc}") from None
