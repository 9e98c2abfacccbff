"""The engine process's event loop: ZMQ to routers, a stepping thread, streamed outputs.

The engine steps in its own thread so socket I/O never waits for a forward pass and a
forward pass never waits for I/O. The asyncio side owns the ZMQ ROUTER socket (zmq
sockets are not thread-safe): it decodes frames (a bad frame is logged and dropped),
hands requests to the engine (thread-safe: the engine has its own lock), and sends
whatever the stepping thread queues. Every router that said HELLO gets heartbeats and
immediate state announcements.

Streaming holds back text that could be the start of a stop string, so a stop string
is never half-sent: the engine trims it at the end, and what was held back is either
sent with the final output or dropped with the stop string.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from tandem_engine import protocol as p
from tandem_engine.engine.llm_engine import LLMEngine
from tandem_engine.engine.outputs import RequestOutput
from tandem_engine.errors import RequestRejected
from tandem_engine.lifecycle import EngineState, EngineStateError, KVMode
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.transfer import (
    GeometryMismatch,
    KVGeometry,
    KVTransferBackend,
    TransferError,
    TransferTimeout,
)

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """What one request has sent so far, and to whom."""

    router: bytes
    client_id: str
    hold_back: int  # characters that may be the start of a stop string
    logprobs: int | None
    sent_tokens: int = 0
    sent_chars: int = 0


@dataclass
class HandoffStats:
    """KV handoff numbers for /v1/state and /metrics (decode side pulls, prefill side pins)."""

    pulled_blocks: int = 0
    reused_blocks: int = 0
    bytes: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # by cause
    seconds: list[float] = field(default_factory=list)  # pull latencies, drained by /metrics

    def failed(self, cause: str) -> None:
        self.failures[cause] = self.failures.get(cause, 0) + 1

    def as_dict(self) -> dict[str, int]:
        return {"pulled_blocks": self.pulled_blocks, "reused_blocks": self.reused_blocks,
                "bytes": self.bytes, "failed": sum(self.failures.values()),
                **{f"failed_{cause}": n for cause, n in sorted(self.failures.items())}}


def failure_cause(exc: Exception) -> str:
    """A pull failure's label: geometry, timeout or peer (dead, restarted, refused)."""
    if isinstance(exc, GeometryMismatch):
        return "geometry"
    if isinstance(exc, TransferTimeout):
        return "timeout"
    return "peer"


@dataclass
class WorkerStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)  # drained by /metrics


def stream_delta(stream: _Stream, out: RequestOutput) -> p.Output:
    """The part of `out` not yet sent, with stop-string hold-back while unfinished."""
    completion = out.outputs[0]
    new_ids = completion.token_ids[stream.sent_tokens:]
    text = completion.text
    safe = len(text) if out.finished else max(stream.sent_chars, len(text) - stream.hold_back)
    logprobs = None
    if stream.logprobs is not None and completion.logprobs is not None:
        logprobs = []
        for tid, entry in zip(new_ids, completion.logprobs[stream.sent_tokens:], strict=True):
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:stream.logprobs]
            logprobs.append(p.TokenLogprobs(entry[tid].logprob,
                                            [(t, lp.logprob) for t, lp in ranked]))
    delta = p.Output(
        request_id=stream.client_id, token_ids=list(new_ids),
        text=text[stream.sent_chars:safe], logprobs=logprobs, finished=out.finished,
        finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
        num_prompt_tokens=len(out.prompt_token_ids),
        pin_id=out.request_id if out.pinned_blocks is not None else None,
        pinned_blocks=out.pinned_blocks)
    stream.sent_tokens += len(new_ids)
    stream.sent_chars = max(stream.sent_chars, safe)
    return delta


class EngineWorker:
    def __init__(self, engine: LLMEngine, *, engine_id: str, model_name: str,
                 role: str = "mixed", heartbeat_interval: float = 0.5,
                 transfer: KVTransferBackend | None = None,
                 pull_timeout: float = 10.0) -> None:
        self.engine = engine
        self.engine_id = engine_id
        self.incarnation = uuid.uuid4().hex
        self.model_name = model_name
        self.role = role
        self.heartbeat_interval = heartbeat_interval
        self.stats = WorkerStats()
        self.draining = False  # no new requests: a drain, a refit, or SIGTERM
        self.shutting_down = False  # SIGTERM: draining for good
        self._canaries: dict[str, tuple[threading.Event, list[RequestOutput]]] = {}
        self._unpins: collections.deque[str] = collections.deque()  # pins to release
        # Work for the stepping thread from the socket loop (admissions, aborts).
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._routers: set[bytes] = set()
        self._streams: dict[str, _Stream] = {}  # engine request id -> stream
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: asyncio.Queue[tuple[bytes, bytes]] | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._drops = p.DropLog(log, f"engine {engine_id}")
        # KV handoff (prefill/decode roles): the transfer agent, and one thread that runs
        # the blocking pulls so neither the socket loop nor the stepping waits on them.
        self.transfer = transfer
        self.pull_timeout = pull_timeout
        self._kv_info: p.KVTransferInfo | None = None
        self._pulls = ThreadPoolExecutor(1, thread_name_prefix="kv-pull") if transfer else None
        self.handoff = HandoffStats()
        if transfer is not None:
            self._register_kv()

    def _register_kv(self) -> None:
        assert self.transfer is not None
        kv_cache = self.engine.runner.kv_cache
        geometry = KVGeometry.of_tensor(kv_cache)
        self.transfer.register(kv_cache, geometry)
        self._kv_info = p.KVTransferInfo(self.transfer.name, self.transfer.agent_metadata(),
                                         geometry.to_dict())

    # ---- lifecycle that moves the KV pool ---------------------------------------------------

    def suspend(self, mode: KVMode | str) -> int:
        """Suspend the engine; when the pool tensor goes (offload, recompute), NIXL lets go
        of it first. Pulls run on the pull thread, so the deregistration queues behind the
        one in progress (bounded by its deadline)."""
        released = self.engine.suspend(mode)
        if self.transfer is not None and KVMode(mode) is not KVMode.PERSIST:
            self._on_pull_thread(self.transfer.deregister)
            self._kv_info = None
        return released

    def resume(self) -> None:
        """Resume the engine and register its (new) pool; routers get a fresh WELCOME with
        the new NIXL metadata, so decode engines re-add this peer."""
        self.engine.resume()
        if self.transfer is not None and self._kv_info is None:
            self._on_pull_thread(self._register_kv)
            welcome = p.encode(self._welcome())
            for router in list(self._routers):
                self._send_threadsafe(router, welcome)

    def _on_pull_thread(self, fn) -> None:
        assert self._pulls is not None
        self._pulls.submit(fn).result(timeout=self.pull_timeout + 10)

    # ---- load and state ------------------------------------------------------------------

    def load(self) -> p.Load:
        e = self.engine
        return p.Load(state=str(e.state), num_running=e.num_running, num_waiting=e.num_waiting,
                      kv_usage=e.kv.usage, weight_version=e.weight_version,
                      weight_epoch=e.weight_epoch, draining=self.draining)

    def announce_state(self) -> None:
        """Tell every router about a lifecycle change now (thread-safe)."""
        self._wake.set()
        msg = p.encode(p.StateChange(self.engine_id, self.incarnation, self.load()))
        for router in list(self._routers):
            self._send_threadsafe(router, msg)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- serving --------------------------------------------------------------------------

    async def serve(self, address: str, shutdown: asyncio.Event) -> None:
        """Bind `address` (tcp://host:port) and serve until `shutdown` is set and every
        in-flight request is done (or the grace period ran out, see `drain`)."""
        self._loop = asyncio.get_running_loop()
        self._outbox = asyncio.Queue()
        ctx = zmq.asyncio.Context.instance()
        self._socket = ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._socket.bind(address)
        self._thread = threading.Thread(target=self._step_loop, name="engine-steps",
                                        daemon=True)
        self._thread.start()
        progress = None
        if self.transfer is not None:
            progress = threading.Thread(target=self._progress_loop, name="kv-progress",
                                        daemon=True)
            progress.start()
        tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._send()),
                 asyncio.create_task(self._heartbeat())]
        try:
            await shutdown.wait()
        finally:
            self._closing.set()
            self._wake.set()
            self._thread.join(timeout=10)
            if progress is not None:
                progress.join(timeout=10)
            if self._pulls is not None:
                self._pulls.shutdown(wait=True, cancel_futures=True)
            if self.transfer is not None:
                self.transfer.close()
            await asyncio.sleep(0.05)  # let the last outputs leave
            for t in tasks:
                t.cancel()
            self._socket.close(linger=200)

    def drain(self, grace_seconds: float) -> None:
        """Stop admitting; let in-flight requests finish for up to `grace_seconds`, then
        abort the rest (their routers get final `abort` outputs). Blocking."""
        self.draining = self.shutting_down = True
        deadline = time.monotonic() + grace_seconds
        while ((self._inbox or self.engine.has_unfinished_requests())
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
                log.warning("dropped a message of %d frames (expected identity + 1)",
                            len(frames))
                continue
            router, frame = frames
            try:
                msg = p.decode(frame)
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
            self._routers.add(router)
            self._queue(router, self._welcome())
        elif isinstance(msg, p.Submit):
            self._submit(router, msg)
        elif isinstance(msg, p.Abort):
            self._inbox.append(functools.partial(self._abort, self._engine_id(
                router, msg.request_id)))
            self._wake.set()
        else:
            log.warning("dropped a %s: engines do not accept it", type(msg).__name__)

    def _abort(self, rid: str) -> None:
        self.engine.abort(rid)
        self.engine.unpin(rid)  # a finished prefill whose KV no decode engine will pull

    def _welcome(self) -> p.Welcome:
        e = self.engine
        return p.Welcome(p.PROTOCOL_VERSION, self.engine_id, self.incarnation, self.role,
                         self.model_name, e.kv.block_size, e.max_model_len, self.load(),
                         self._kv_info)

    @staticmethod
    def _engine_id(router: bytes, client_id: str) -> str:
        return f"{router.hex()}/{client_id}"

    def _submit(self, router: bytes, msg: p.Submit) -> None:
        def reject(status: int, message: str) -> None:
            self._queue(router, p.Reject(msg.request_id, status, message))

        if self.draining:
            why = "shutting down" if self.shutting_down else "draining (refusing new requests)"
            return reject(503, f"engine {self.engine_id} is {why}")
        try:
            params = SamplingParams(**msg.sampling)
        except TypeError as exc:
            return reject(400, f"unknown sampling parameter: {exc}")
        except RequestRejected as exc:
            return reject(400, str(exc))
        # The engine is changed only on the stepping thread, between steps: a long step
        # holds the engine's lock, and the socket loop must never wait for it (heartbeats
        # and outputs would stop).
        self._inbox.append(lambda: self._admit(router, msg, params))
        self._wake.set()

    def _admit(self, router: bytes, msg: p.Submit, params: SamplingParams) -> None:
        """On the stepping thread: hand a validated SUBMIT to the engine."""
        def reject(status: int, message: str) -> None:
            self._send_threadsafe(router, p.encode(p.Reject(msg.request_id, status, message)))

        rid = self._engine_id(router, msg.request_id)
        hold = max((len(s) for s in params.stop), default=1) - 1
        if params.include_stop_str_in_output:
            hold = max(hold, 0)
        self._streams[rid] = _Stream(router, msg.request_id, hold, params.logprobs)
        try:
            if msg.pull is not None:
                self._start_pull(rid, msg, params)
            else:
                self.engine.add_request(rid, msg.prompt_token_ids, params,
                                        cache_salt=msg.cache_salt,
                                        pin_for_handoff=msg.pin_for_handoff)
        except RequestRejected as exc:
            del self._streams[rid]
            return reject(400, str(exc))
        except EngineStateError as exc:
            del self._streams[rid]
            return reject(503, str(exc))
        self.stats.prompt_tokens += len(msg.prompt_token_ids)
        self._wake.set()

    # ---- KV handoff -------------------------------------------------------------------------

    def _start_pull(self, rid: str, msg: p.Submit, params: SamplingParams) -> None:
        if self.transfer is None or self._pulls is None:
            raise RequestRejected(f"engine {self.engine_id} (role {self.role}) cannot pull "
                                  "KV: start it with --role decode")
        source = msg.pull
        plan = self.engine.add_pulled_request(rid, msg.prompt_token_ids, source.first_token,
                                              params, cache_salt=msg.cache_salt)
        # The router already streamed the first token (from the prefill engine): start
        # this stream after it.
        stream = self._streams[rid]
        stream.sent_tokens = 1
        request = self.engine.requests.get(rid)
        stream.sent_chars = len(request.output_text) if request is not None else 0
        self._pulls.submit(self._pull, rid, source, plan)

    def _pull(self, rid: str, source: p.PullSource, plan) -> None:
        """Runs on the pull thread: READ the missing blocks, then tell the prefill engine
        to unpin. Any failure (geometry, dead or frozen peer, deadline) makes the request
        recompute its prompt here instead; it still completes."""
        peer = source.agent.agent_name
        ok = False
        started = time.monotonic()
        try:
            try:
                geometry = KVGeometry.from_dict(source.agent.geometry)
            except (ValueError, TypeError, KeyError) as exc:
                raise GeometryMismatch(f"peer {peer!r} sent an unreadable KV geometry "
                                       f"{source.agent.geometry!r}: {exc}") from exc
            self.transfer.add_peer(peer, source.agent.agent_metadata, geometry)
            if plan.local_blocks:
                remote = [source.block_ids[i] for i in plan.block_indices]
                handle = self.transfer.start_read(peer, remote, plan.local_blocks,
                                                  notif=source.pin_id.encode())
                self.transfer.wait(handle, self.pull_timeout)
                self.handoff.bytes += handle.nbytes
            else:
                self.transfer.notify(peer, source.pin_id.encode())
            ok = True
        except (TransferError, ValueError) as exc:
            cause = failure_cause(exc)
            log.warning("pull of %s from %s failed (%s), recomputing the prompt here: %s",
                        rid, peer, cause, exc)
            self.handoff.failed(cause)
        if ok:
            self.handoff.pulled_blocks += len(plan.local_blocks)
            self.handoff.seconds.append(time.monotonic() - started)
            del self.handoff.seconds[:-10_000]
        self.handoff.reused_blocks += plan.reused_blocks
        self.engine.complete_pull(rid, ok)
        self._wake.set()

    def _progress_loop(self) -> None:
        """The passive side of transfers must make progress, or pulls from it stall — also
        while a long prefill step runs. While pins exist (pulls may be under way) this
        thread polls NIXL every millisecond (it sleeps in between: no busy spin), else
        every 20 ms; the pin ids of finished pulls go to the stepping thread, which
        unpins them between steps."""
        assert self.transfer is not None
        while not self._closing.is_set():
            try:
                notes = self.transfer.new_notifications()
            except TransferError as exc:
                log.warning("polling KV transfer notifications failed: %s", exc)
                notes = {}
            for messages in notes.values():
                self._unpins.extend(m.decode(errors="replace") for m in messages)
            if self._unpins:
                self._wake.set()
            time.sleep(0.001 if self.engine.kv.num_pinned_blocks else 0.02)

    def _unpin_notified(self) -> None:
        """Prefill side: every decode engine that finished a pull named the pin."""
        while self._unpins:
            self.engine.unpin(self._unpins.popleft())

    # ---- verification ---------------------------------------------------------------------------

    def canary(self, prompt_token_ids: list[int], max_tokens: int, timeout: float) -> list[int]:
        """A short greedy generation outside any router's traffic (it runs while the engine
        refuses new requests): a refit is verified with it before the engine serves. Raises
        TimeoutError, or RuntimeError when the engine is not RUNNING."""
        if self.engine.state is not EngineState.RUNNING:
            raise RuntimeError(f"a canary needs a RUNNING engine; this one is "
                               f"{self.engine.state} (unpause it first)")
        rid = f"canary-{uuid.uuid4().hex}"
        done, result = threading.Event(), []
        self._canaries[rid] = (done, result)
        try:
            self.engine.add_request(rid, prompt_token_ids, SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            self._wake.set()
            if not done.wait(timeout):
                self.engine.abort(rid)
                raise TimeoutError(f"canary of {max_tokens} tokens not done in {timeout} s")
        finally:
            del self._canaries[rid]
        out = result[0].outputs[0]
        if out.finish_reason != "length" or len(out.token_ids) != max_tokens:
            raise RuntimeError(f"canary ended with {out.finish_reason!r} after "
                               f"{len(out.token_ids)} of {max_tokens} tokens")
        return list(out.token_ids)

    # ---- the stepping thread ----------------------------------------------------------------

    def _step_loop(self) -> None:
        engine = self.engine
        while not self._closing.is_set():
            while self._inbox:
                try:
                    self._inbox.popleft()()
                except Exception:  # one bad message must not stop the engine
                    log.exception("failed to admit a message")
            busy = engine.has_unfinished_requests() and engine.state is EngineState.RUNNING
            if self.transfer is not None:
                self._unpin_notified()
            if not busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
            try:
                outputs = engine.step()
            except Exception:
                log.exception("engine step failed")
                time.sleep(0.1)
                continue
            if engine.step_timings:
                self.stats.step_seconds.extend(t.total_s for t in engine.step_timings)
                del self.stats.step_seconds[:-10_000]
                engine.step_timings.clear()
            for out in outputs:
                self._emit(out)

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
        if out.finished:
            del self._streams[out.request_id]
            reason = delta.finish_reason or "unknown"
            self.stats.requests_finished[reason] = self.stats.requests_finished.get(reason, 0) + 1
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
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            msg = p.Heartbeat(self.engine_id, self.incarnation, self.load())
            for router in list(self._routers):
                self._queue(router, msg)
