"""The engine process's event loop: ZMQ to routers, a stepping thread, streamed outputs.

The engine steps in its own thread so socket I/O never waits for a forward pass and a
forward pass never waits for I/O. The asyncio side owns the ZMQ ROUTER socket (zmq
sockets are not thread-safe): it decodes frames (a bad frame is logged and dropped)
and queues admissions and aborts for the stepping thread, which hands them to the
engine between steps (a long step holds the engine's lock, and the socket loop must
never wait for it: heartbeats and outputs would stop). With `--max-queued-requests N`, a
SUBMIT that finds N requests waiting is refused with a 429 REJECT (a resumed or
handed-over one is always taken). Every router that said HELLO
gets heartbeats and immediate state announcements, built from the engine's published
snapshot (`LLMEngine.stats`), never from its fields.

The router table is bounded in time and size: a router is known while it keeps talking
(HELLO, PING, SUBMIT, ABORT), at most `max_routers` of them. One not heard from within
`router_timeout`, or the least recently heard when a new one would exceed the bound, is
forgotten, gets no more heartbeats, and its in-flight requests are aborted: nobody reads
their outputs any more.

Text is the engine's (`tandem_engine.text`): an output's text is already safe to show,
so a stream only sends what it has not sent yet.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from tandem_engine import protocol as p
from tandem_engine.core.kv.events import KVEventBatch
from tandem_engine.engine.llm_engine import LLMEngine
from tandem_engine.engine.outputs import PromptScore, RequestOutput, mean_top1_mass
from tandem_engine.engine.stats import SpecDecodeStats, StepTiming
from tandem_engine.errors import RequestRejected
from tandem_engine.lifecycle import EngineState, EngineStateError
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.server.adapters import EngineAdapters
from tandem_engine.server.handoff import KVHandoff
from tandem_engine.server.metric_families import (
    REQUEST_BUCKETS,
    TOKEN_GAP_BUCKETS,
    LatencyHistogram,
)
from tandem_engine.transfer import KVTransferBackend
from tandem_engine.zmq_auth import CurveServer

log = logging.getLogger(__name__)

# Steps that raise with no request to blame (the engine fails a culprit request by
# itself): after this many in a row the engine is unhealthy for good (liveness 503,
# refusing requests) and wants a restart.
UNHEALTHY_AFTER_STEP_FAILURES = 3


@dataclass(frozen=True)
class Canary:
    """A canary's greedy tokens, and how well the weights predict its prompt: the mean
    negative log-likelihood per token in nats (the log of the perplexity; it stays a
    finite number where the perplexity itself would overflow), and how sure they are: the
    mean probability of the most likely next token over the prompt's positions (from the
    float32 log_softmax; 1.0 for weights whose logits were scaled up until every other
    token's probability underflows)."""

    token_ids: list[int]
    mean_nll: float
    top1_mass: float
    lora: str = ""  # the adapter identity it ran under (name@version); "" the base model


@dataclass
class _Stream:
    """What one request has sent so far, and to whom."""

    router: bytes
    client_id: str
    logprobs: int | None
    sent_tokens: int = 0
    sent_chars: int = 0
    arrival: float = 0.0  # monotonic time its SUBMIT came off the socket
    last_token_at: float | None = None  # when its last token went out (None: none yet)


@dataclass
class WorkerStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)  # drained by /metrics
    step_failures: int = 0  # steps that raised with no request to blame
    kv_event_batches: int = 0  # prefix-cache change batches published to the routers
    kv_snapshots: int = 0  # full prefix-cache snapshots sent (a router started or lost some)
    # Latencies at the engine, from a request's arrival (written by the stepping thread).
    time_to_first_token: LatencyHistogram = field(
        default_factory=lambda: LatencyHistogram(REQUEST_BUCKETS))
    token_gap: LatencyHistogram = field(
        default_factory=lambda: LatencyHistogram(TOKEN_GAP_BUCKETS))
    e2e_latency: LatencyHistogram = field(
        default_factory=lambda: LatencyHistogram(REQUEST_BUCKETS))
    # Speculative decoding's cost: decode steps that verified proposals ("verify") and
    # those that verified none ("plain"), counted and timed (written by the stepping
    # thread; steps without decode tokens are in neither).
    spec_steps: dict[str, int] = field(default_factory=lambda: {"verify": 0, "plain": 0})
    spec_step_seconds: dict[str, float] = field(
        default_factory=lambda: {"verify": 0.0, "plain": 0.0})
    # Structured outputs: steps that computed token masks, and the seconds they took.
    grammar_steps: int = 0
    grammar_seconds: float = 0.0

    def observe_spec_steps(self, timings: list[StepTiming], verified: bool) -> None:
        """Count the decode steps in `timings` (one engine step's, as a rule) as steps
        that verified proposals or not."""
        kind = "verify" if verified else "plain"
        for t in timings:
            if t.num_decode_tokens:
                self.spec_steps[kind] += 1
                self.spec_step_seconds[kind] += t.total_s

    def observe_output(self, stream: _Stream, num_tokens: int, finish_reason: str | None,
                       now: float) -> None:
        """An output of `num_tokens` new tokens goes out for `stream` at `now`: its first
        token, the gap since its last (per token), its end (a handoff is no end)."""
        if num_tokens:
            if stream.last_token_at is None:
                self.time_to_first_token.observe(now - stream.arrival)
            else:
                self.token_gap.observe((now - stream.last_token_at) / num_tokens, num_tokens)
            stream.last_token_at = now
        if finish_reason is not None and finish_reason != "handoff":
            self.e2e_latency.observe(now - stream.arrival)


def stream_delta(stream: _Stream, out: RequestOutput) -> p.Output:
    """The part of `out` not yet sent (the engine's text is already safe to show)."""
    completion = out.outputs[0]
    new_ids = completion.token_ids[stream.sent_tokens:]
    logprobs = None
    if stream.logprobs is not None and completion.logprobs is not None:
        logprobs = []
        for tid, entry in zip(new_ids, completion.logprobs[stream.sent_tokens:], strict=True):
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:stream.logprobs]
            logprobs.append(p.TokenLogprobs(entry[tid].logprob,
                                            [(t, lp.logprob) for t, lp in ranked]))
    handoff = None
    reason = completion.finish_reason
    if reason == "handoff":
        handoff = p.Handoff(out.request_id, list(out.pinned_blocks or ()),
                            list(out.handoff_proposals))
        reason = None
    delta = p.Output(
        request_id=stream.client_id, token_ids=list(new_ids),
        text=completion.text[stream.sent_chars:], logprobs=logprobs, finished=out.finished,
        finish_reason=reason, stop_reason=completion.stop_reason,
        num_prompt_tokens=len(out.prompt_token_ids), handoff=handoff, error=completion.error,
        num_cached_tokens=out.num_cached_tokens,
        prompt_logprobs=_prompt_logprobs(out) if stream.sent_tokens == 0 and new_ids
        else None,
        # The request's totals here, once: the router logs them when the request ends.
        num_spec_proposed=out.num_spec_proposed if out.finished else 0,
        num_spec_accepted=out.num_spec_accepted if out.finished else 0)
    stream.sent_tokens += len(new_ids)
    stream.sent_chars = max(stream.sent_chars, len(completion.text))
    return delta


def _verified(before: SpecDecodeStats, after: SpecDecodeStats | None) -> bool:
    """Whether a step between the two snapshots verified proposals."""
    return after is not None and after.num_drafts > before.num_drafts


def _prompt_logprobs(out: RequestOutput) -> list[p.TokenLogprobs] | None:
    """The prompt's logprobs on the wire, once all are computed (a decode engine that
    pulled the prompt's KV computes none: the prefill engine sent them)."""
    entries = out.prompt_logprobs
    if entries is None or len(entries) != len(out.prompt_token_ids):
        return None
    wire = []
    for tid, entry in zip(out.prompt_token_ids[1:], entries[1:], strict=True):
        assert entry is not None
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
        wire.append(p.TokenLogprobs(entry[tid].logprob, [(t, lp.logprob) for t, lp in ranked],
                                    entry[tid].rank))
    return wire


class EngineWorker:
    def __init__(self, engine: LLMEngine, *, engine_id: str, model_name: str,
                 role: str = p.EngineRole.MIXED, heartbeat_interval: float = 0.5,
                 transfer: KVTransferBackend | None = None,
                 pull_timeout: float = 10.0, router_timeout: float = 10.0,
                 max_routers: int = 1024, adapters: EngineAdapters | None = None) -> None:
        """`adapters`: how routers' LoRA calls are done (default: loads read anywhere,
        for in-process use; the engine process passes its weights roots)."""
        if router_timeout <= heartbeat_interval:
            raise ValueError(f"router timeout {router_timeout} s must exceed the heartbeat "
                             f"interval {heartbeat_interval} s (e.g. --router-timeout 10)")
        if max_routers < 1:
            raise ValueError(f"max routers {max_routers} must be >= 1 (e.g. --max-routers 1024)")
        self.engine = engine
        self.engine_id = engine_id
        self.incarnation = uuid.uuid4().hex
        self.model_name = model_name
        self.role = p.EngineRole(role)
        self.heartbeat_interval = heartbeat_interval
        self.router_timeout = router_timeout
        self.max_routers = max_routers
        self.stats = WorkerStats()
        self.draining = False  # no new requests: a drain, a refit, or SIGTERM
        self.shutting_down = False  # SIGTERM: draining for good
        self.unhealthy: str | None = None  # why steps keep failing; draining for good
        self._step_failures_in_a_row = 0
        self._canaries: dict[str, tuple[threading.Event, list[RequestOutput]]] = {}
        # Work for the stepping thread from the socket loop (admissions, aborts).
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        # Router identity -> monotonic time last heard from, least recently heard first.
        # The socket loop's alone to change; other threads only iterate over a copy.
        self._routers: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._evictions = 0  # routers forgotten because the table was full
        self._streams: dict[str, _Stream] = {}  # engine request id -> stream
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: asyncio.Queue[tuple[bytes, bytes]] | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._drops = p.DropLog(log, f"engine {engine_id}")
        # KV handoff (prefill/decode roles): pulls, the passive side's progress, pins.
        self.handoff = (KVHandoff(engine, transfer, pull_timeout=pull_timeout,
                                  wake=self._wake.set) if transfer is not None else None)
        self.adapters = adapters or EngineAdapters(engine)
        self._lora_calls: set[asyncio.Task] = set()  # routers' LoRA calls being done

    # ---- load, state and admission -----------------------------------------------------------

    def load(self) -> p.Load:
        s = self.engine.stats
        lora = s.lora
        return p.Load(state=str(s.state), num_running=s.num_running,
                      num_waiting=s.num_waiting, kv_usage=s.kv_usage,
                      weight_version=s.weights.version, weight_epoch=s.weights.epoch,
                      draining=self.draining,
                      loras=list(lora.served) if lora is not None else [],
                      resident_loras=list(lora.resident) if lora is not None else [])

    def announce_state(self) -> None:
        """Tell every router about a lifecycle change now (thread-safe)."""
        self._wake.set()
        msg = p.encode(p.StateChange(self.engine_id, self.incarnation, self.load()))
        for router in list(self._routers):
            self._send_threadsafe(router, msg)

    def welcome_routers(self) -> None:
        """Send every router a fresh WELCOME (the KV transfer metadata changed)."""
        welcome = p.encode(self._welcome())
        for router in list(self._routers):
            self._send_threadsafe(router, welcome)

    def set_draining(self, draining: bool) -> None:
        self.draining = draining
        self.announce_state()

    @property
    def num_routers(self) -> int:
        """Routers heard from within the router timeout (each gets heartbeats)."""
        return len(self._routers)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- serving --------------------------------------------------------------------------

    async def serve(self, address: str, shutdown: asyncio.Event,
                    curve: CurveServer | None = None) -> None:
        """Bind `address` (tcp://host:port) and serve until `shutdown` is set and every
        in-flight request is done (or the grace period ran out, see `drain`). With
        `curve`, only routers holding an admitted CURVE key can connect."""
        self._loop = asyncio.get_running_loop()
        self._outbox = asyncio.Queue()
        ctx = zmq.asyncio.Context.instance()
        self._socket = ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)  # never buffer a huge one
        authenticator = curve.secure(self._socket) if curve is not None else None
        try:
            self._socket.bind(address)
        except zmq.ZMQError as exc:  # one line from main, not a traceback
            self._socket.close(0)
            raise OSError(exc.errno, f"cannot listen on {address}: {exc.strerror}; "
                          "another process may hold that port: give another --port") from exc
        self._thread = threading.Thread(target=self._step_loop, name="engine-steps",
                                        daemon=True)
        self._thread.start()
        if self.handoff is not None:
            self.handoff.start()
        tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._send()),
                 asyncio.create_task(self._heartbeat())]
        try:
            await shutdown.wait()
        finally:
            self._closing.set()
            self._wake.set()
            self._thread.join(timeout=10)
            if self.handoff is not None:
                self.handoff.close()
            await asyncio.sleep(0.05)  # let the last outputs leave
            for t in tasks:
                t.cancel()
            self._socket.close(linger=200)
            if authenticator is not None:
                authenticator.stop()

    def drain(self, grace_seconds: float) -> None:
        """Stop admitting; let in-flight requests finish for up to `grace_seconds`, then
        abort the rest (their routers get final `abort` outputs). Blocking."""
        self.draining = self.shutting_down = True
        deadline = time.monotonic() + grace_seconds
        while ((self._inbox or self.engine.stats.has_unfinished_requests)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        for request_id in list(self._streams):
            self.engine.abort(request_id)
        self._wake.set()
        time.sleep(0.1)

    async def _receive(self) -> None:
        assert self._socket is not None
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 2:
                self._drops.dropped(f"a message of {len(frames)} frames (expected "
                                    "identity + 1)")
                continue
            router, frame = frames
            try:
                msg = p.decode(frame)
            except p.InvalidSubmit as exc:
                self._queue(router, p.Reject(exc.request_id, 400, str(exc)))
                continue
            except p.ProtocolError as exc:
                self._drops.dropped(f"{exc} (from router {router.hex()})")
                continue
            try:
                self._handle(router, msg)
            except Exception:  # a handler bug must not take the engine down
                log.exception("failed to handle %s", type(msg).__name__)

    def _handle(self, router: bytes, msg: object) -> None:
        if isinstance(msg, p.Hello):
            if msg.protocol_version != p.PROTOCOL_VERSION:
                log.warning("router %s speaks protocol %d, not %d: ignored", msg.router_id,
                            msg.protocol_version, p.PROTOCOL_VERSION)
                return
            self._heard_from(router)
            self._queue(router, self._welcome())
            self._kv_snapshot_later(router)  # after the WELCOME: where its index starts
        elif isinstance(msg, p.KVSnapshotRequest):
            self._heard_from(router)
            self._kv_snapshot_later(router)
        elif isinstance(msg, p.Ping):
            self._heard_from(router)
        elif isinstance(msg, p.Submit):
            self._heard_from(router)
            self._submit(router, msg)
        elif isinstance(msg, p.Abort):
            self._heard_from(router)
            self._inbox.append(functools.partial(self._abort, self._engine_id(
                router, msg.request_id)))
            self._wake.set()
        elif isinstance(msg, p.LoadLoRA | p.UnloadLoRA):
            self._heard_from(router)
            task = asyncio.create_task(self._lora_call(router, msg))
            self._lora_calls.add(task)
            task.add_done_callback(self._lora_calls.discard)
        else:
            log.warning("dropped a %s: engines do not accept it", type(msg).__name__)

    async def _lora_call(self, router: bytes, call: p.LoadLoRA | p.UnloadLoRA) -> None:
        """A router's LoRA call, done off the socket loop (it waits for the engine lock
        and reads the adapter); every router hears of a change, the caller gets the
        engine's load after it in the reply."""
        status, message = await asyncio.to_thread(self.adapters.reply, call)
        if status == 200:
            self.announce_state()
        self._queue(router, p.LoRAReply(call.call_id, status, message, self.load()))

    def _serves(self, lora: p.LoRARef) -> bool:
        """Whether this engine serves `lora` at its version now (published snapshot)."""
        served = self.engine.stats.lora
        return served is not None and lora.identity in served.served

    def _not_served(self, lora: p.LoRARef) -> str:
        served = self.engine.stats.lora
        names = ", ".join(served.served) if served is not None and served.served else "none"
        return (f"engine {self.engine_id} does not serve LoRA adapter {lora.identity} "
                f"(it serves: {names})")

    def _abort(self, rid: str) -> None:
        self.engine.abort(rid)
        self.engine.unpin(rid)  # a finished prefill whose KV no decode engine will pull

    # ---- the router table (socket loop) ---------------------------------------------------

    def _heard_from(self, router: bytes) -> None:
        """Record that `router` is alive; a new one beyond `max_routers` evicts the least
        recently heard."""
        self._routers[router] = time.monotonic()
        self._routers.move_to_end(router)
        while len(self._routers) > self.max_routers:
            evicted, _ = self._routers.popitem(last=False)
            self._evictions += 1
            if self._evictions == 1 or self._evictions % 1000 == 0:  # a flood: not every one
                log.warning("router %s forgotten: more than %d routers (%d so far)",
                            evicted.hex(), self.max_routers, self._evictions)
            self._forget([evicted])

    def _prune_routers(self) -> None:
        """Forget the routers not heard from within the router timeout."""
        stale = time.monotonic() - self.router_timeout
        gone = []
        while self._routers and next(iter(self._routers.values())) < stale:
            gone.append(self._routers.popitem(last=False)[0])
        if gone:
            log.warning("%d router(s) silent for %.0f s forgotten (e.g. %s)", len(gone),
                        self.router_timeout, gone[0].hex())
            self._forget(gone)

    def _forget(self, routers: list[bytes]) -> None:
        self._inbox.append(functools.partial(self._abort_routers, frozenset(routers)))
        self._wake.set()

    def _abort_routers(self, routers: frozenset[bytes]) -> None:
        """On the stepping thread: abort every in-flight request of `routers`."""
        for rid, stream in list(self._streams.items()):
            if stream.router in routers:
                log.info("aborting %s: its router is gone", rid)
                self._abort(rid)

    def _welcome(self) -> p.Welcome:
        s = self.engine.stats
        info = self.handoff.info if self.handoff is not None else None
        return p.Welcome(p.PROTOCOL_VERSION, self.engine_id, self.incarnation, self.role,
                         self.model_name, s.block_size, s.max_model_len, self.load(), info,
                         num_kv_blocks=self.engine.kv.num_blocks)

    # ---- KV events: the prefix cache's changes, for the routers' exact index -----------------

    def _publish_kv_events(self, batch: KVEventBatch | None) -> None:
        """Send one batch of prefix-cache changes to every router (stepping thread)."""
        if batch is None:
            return
        frame = p.encode(p.KVEvents(self.engine_id, self.incarnation, batch.seq, batch.cleared,
                                    batch.stored, batch.removed, batch.at))
        self.stats.kv_event_batches += 1
        for router in list(self._routers):
            self._send_threadsafe(router, frame)

    def _send_kv_snapshot(self, router: bytes) -> None:
        """Every hash the prefix cache holds, to one router (stepping thread): the
        pending changes go to every router first, so the snapshot's seq covers them."""
        batch, seq, hashes = self.engine.kv_snapshot()
        self._publish_kv_events(batch)
        self._send_threadsafe(router, p.encode(p.KVSnapshot(
            self.engine_id, self.incarnation, seq, hashes, time.time())))
        self.stats.kv_snapshots += 1

    def _kv_snapshot_later(self, router: bytes) -> None:
        self._inbox.append(functools.partial(self._send_kv_snapshot, router))
        self._wake.set()

    @staticmethod
    def _engine_id(router: bytes, client_id: str) -> str:
        return f"{router.hex()}/{client_id}"

    def _submit(self, router: bytes, msg: p.Submit) -> None:
        if self.draining:
            why = (f"unhealthy ({self.unhealthy})" if self.unhealthy else "shutting down"
                   if self.shutting_down else "draining (refusing new requests)")
            self._queue(router, p.Reject(msg.request_id, 503,
                                         f"engine {self.engine_id} is {why}"))
            return
        self._inbox.append(functools.partial(self._admit, router, msg, time.monotonic()))
        self._wake.set()

    def _admit(self, router: bytes, msg: p.Submit, arrival: float) -> None:
        """On the stepping thread: hand a SUBMIT to the engine (its sampling parameters
        were validated when the frame was decoded)."""
        rid = self._engine_id(router, msg.request_id)
        resumed = msg.resume.token_ids if msg.resume is not None else []
        sent_chars = msg.resume.sent_chars if msg.resume is not None else 0
        if rid in self._streams:  # refused before its stream would replace the running one's
            self._send_threadsafe(router, p.encode(p.Reject(
                msg.request_id, 400, f"request id {msg.request_id!r} is already in use by "
                "a running request of this router; give each request its own id")))
            return
        lora = msg.lora
        if lora is not None and not self._serves(lora):
            # Not the request's fault: another engine may serve it (503: the router fails
            # over). Never run it under another version's weights, nor the base's.
            self._send_threadsafe(router, p.encode(p.Reject(msg.request_id, 503,
                                                            self._not_served(lora))))
            return
        full = self._queue_full(msg)
        if full is not None:  # 429: the router tries later or another engine
            self._send_threadsafe(router, p.encode(p.Reject(msg.request_id, 429, full)))
            return
        # The client already has the resumed tokens and `sent_chars` of their text.
        self._streams[rid] = _Stream(router, msg.request_id, msg.sampling.logprobs,
                                     sent_tokens=len(resumed), sent_chars=sent_chars,
                                     arrival=arrival)
        try:
            if msg.pull is not None:
                if self.handoff is None:
                    raise RequestRejected(f"engine {self.engine_id} (role {self.role}) "
                                          "cannot pull KV: start it with --role decode")
                plan = self.engine.add_pulled_request(
                    rid, msg.prompt_token_ids, msg.sampling, resumed, sent_chars,
                    cache_salt=msg.cache_salt, proposals=msg.pull.proposals,
                    lora_name=lora.name if lora else None,
                    lora_version=lora.version if lora else None, priority=msg.priority)
                self.handoff.start_pull(rid, msg.pull, plan)
            else:
                self.engine.add_request(rid, msg.prompt_token_ids, msg.sampling,
                                        cache_salt=msg.cache_salt,
                                        pin_for_handoff=msg.pin_for_handoff,
                                        resumed_token_ids=resumed, sent_chars=sent_chars,
                                        lora_name=lora.name if lora else None,
                                        lora_version=lora.version if lora else None,
                                        priority=msg.priority)
        except (RequestRejected, EngineStateError) as exc:
            del self._streams[rid]
            # An adapter unloaded or replaced since the check above: the engine's, 503.
            gone = lora is not None and not self._serves(lora)
            status = 400 if isinstance(exc, RequestRejected) and not gone else 503
            self._send_threadsafe(router, p.encode(p.Reject(msg.request_id, status, str(exc))))
            return
        self.stats.prompt_tokens += len(msg.prompt_token_ids)
        self._wake.set()

    def _queue_full(self, msg: p.Submit) -> str | None:
        """Why a new SUBMIT is refused (None: it is not): `--max-queued-requests` are
        waiting already. A resumed or handed-over request is work a router already placed,
        and is always taken. On the stepping thread, where the count is exact."""
        bound = self.engine.config.max_queued_requests
        if bound is None or msg.resume is not None or msg.pull is not None:
            return None
        waiting = self.engine.stats.num_waiting
        if waiting < bound:
            return None
        return (f"engine {self.engine_id} has {waiting} requests waiting "
                f"(--max-queued-requests {bound}): retry later or on another engine")

    # ---- verification ---------------------------------------------------------------------------

    def canary(self, prompt_token_ids: list[int], max_tokens: int, timeout: float,
               lora_name: str | None = None, lora_version: str | None = None) -> Canary:
        """A short greedy generation outside any router's traffic (it runs while the engine
        refuses new requests), with the prompt scored too: a refit is verified with it
        before the engine serves, an adapter change with one under the adapter
        (`lora_name`, at `lora_version` when given). Raises TimeoutError, RequestRejected
        (an adapter not served at that version), or RuntimeError when the engine is not
        RUNNING or the weights produce non-finite logits."""
        state = self.engine.stats.state
        if state is not EngineState.RUNNING:
            raise RuntimeError(f"a canary needs a RUNNING engine; this one is {state} "
                               "(unpause it first)")
        vocab = self.engine.stats.vocab_size
        if max(prompt_token_ids) >= vocab or min(prompt_token_ids) < 0:
            raise RequestRejected(f"canary prompt token ids must be in [0, {vocab})")
        if len(prompt_token_ids) < 2:
            raise RequestRejected("a canary prompt needs at least 2 tokens (it is scored)")
        rid = f"canary-{uuid.uuid4().hex}"
        done, result = threading.Event(), []
        self._canaries[rid] = (done, result)
        try:
            request = self.engine.add_request(rid, prompt_token_ids, SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
                lora_name=lora_name, lora_version=lora_version)
            self._wake.set()
            if not done.wait(timeout):
                self.engine.abort(rid)
                raise TimeoutError(f"canary of {max_tokens} tokens not done in {timeout} s")
        finally:
            del self._canaries[rid]
        out = result[0].outputs[0]
        if out.finish_reason == "error":
            raise RuntimeError(f"canary failed: {out.error}")
        if out.finish_reason != "length" or len(out.token_ids) != max_tokens:
            raise RuntimeError(f"canary ended with {out.finish_reason!r} after "
                               f"{len(out.token_ids)} of {max_tokens} tokens")
        score = PromptScore.of(result[0])
        if not all(math.isfinite(lp) for lp in score.logprobs):
            raise RuntimeError("canary failed: the prompt's logprobs are not finite (the "
                               "weights produce NaN or Inf logits)")
        return Canary(list(out.token_ids), -score.total_logprob / len(score.logprobs),
                      mean_top1_mass(result[0]),
                      request.lora.identity if request.lora is not None else "")

    # ---- the stepping thread ----------------------------------------------------------------

    def _step_loop(self) -> None:
        engine = self.engine
        while not self._closing.is_set():
            while self._inbox:
                try:
                    self._inbox.popleft()()
                except Exception:  # one bad message must not stop the engine
                    log.exception("failed to admit a message")
            if self.handoff is not None:
                self.handoff.unpin_notified()
            s = engine.stats
            if not (s.has_unfinished_requests and s.state is EngineState.RUNNING):
                self._wake.wait(timeout=0.05)
                self._wake.clear()
            spec_before = engine.stats.speculative
            try:
                outputs = engine.step()
            except Exception as exc:
                log.exception("engine step failed")
                self._step_failed(exc)
                time.sleep(0.1)
                continue
            self._step_failures_in_a_row = 0
            timings = engine.drain_step_timings()
            if timings:
                self.stats.step_seconds.extend(t.total_s for t in timings)
                del self.stats.step_seconds[:-10_000]
                masked = [t.grammar_s for t in timings if t.grammar_s > 0]
                self.stats.grammar_steps += len(masked)
                self.stats.grammar_seconds += sum(masked)
                if spec_before is not None:
                    self.stats.observe_spec_steps(
                        timings, _verified(spec_before, engine.stats.speculative))
            for out in outputs:
                self._emit(out)
            self._publish_kv_events(engine.drain_kv_events())

    def _step_failed(self, exc: Exception) -> None:
        """A step raised and no request was to blame (the engine fails culprits itself):
        after a few in a row, the engine is unhealthy and refuses requests for good."""
        self.stats.step_failures += 1
        self._step_failures_in_a_row += 1
        if self.unhealthy is None and \
                self._step_failures_in_a_row >= UNHEALTHY_AFTER_STEP_FAILURES:
            self.unhealthy = (f"{self._step_failures_in_a_row} engine steps in a row failed, "
                              f"last with {type(exc).__name__}: {exc}")
            log.error("engine %s is unhealthy, refusing new requests until restarted: %s",
                      self.engine_id, self.unhealthy)
            self.set_draining(True)

    def _emit(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            canary = self._canaries.get(out.request_id)
            if canary is not None and out.finished:
                canary[1].append(out)
                canary[0].set()
            return
        delta = stream_delta(stream, out)
        self.stats.generation_tokens += len(delta.token_ids)
        reason = None
        if out.finished:
            del self._streams[out.request_id]
            reason = delta.finish_reason or ("handoff" if delta.handoff else "unknown")
            self.stats.requests_finished[reason] = self.stats.requests_finished.get(reason, 0) + 1
        self.stats.observe_output(stream, len(delta.token_ids), reason, time.monotonic())
        if delta.token_ids or delta.text or delta.finished:
            self._send_threadsafe(stream.router, p.encode(delta))

    # ---- sending ------------------------------------------------------------------------------

    def _queue(self, router: bytes, msg) -> None:
        assert self._outbox is not None
        self._outbox.put_nowait((router, p.encode(msg)))

    def _send_threadsafe(self, router: bytes, frame: bytes) -> None:
        if self._loop is None or self._outbox is None:
            return
        self._loop.call_soon_threadsafe(self._outbox.put_nowait, (router, frame))

    async def _send(self) -> None:
        assert self._socket is not None and self._outbox is not None
        while True:
            router, frame = await self._outbox.get()
            try:
                await self._socket.send_multipart([router, frame])
            except zmq.ZMQError as exc:
                log.warning("send to router %s failed: %s", router.hex(), exc)

    async def _heartbeat(self) -> None:
        assert self._outbox is not None
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            self._prune_routers()
            frame = p.encode(p.Heartbeat(self.engine_id, self.incarnation, self.load()))
            for router in list(self._routers):
                self._outbox.put_nowait((router, frame))
