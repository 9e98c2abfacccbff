"""The router's connections to its engines: one ZMQ DEALER per engine address.

An `EngineClient` owns everything the router knows about one engine: the handshake
(HELLO until a WELCOME arrives, retried every `handshake_timeout`), liveness (an engine
whose last message is older than `heartbeat_deadline`, or whose TCP connection the
socket monitor reports closed, is dead at once), its latest `Load`, and one asyncio
queue per in-flight request. When an engine dies, or comes back as a new incarnation
(a restarted process knows none of our requests), every in-flight queue receives an
`EngineLost`, which is how an attempt (`attempts`) knows to fail over.

Liveness goes both ways: while connected the router PINGs every `ping_interval`, and an
engine that stops hearing from it (the router died, or lost its network) forgets it and
aborts its requests, so no orphan runs to max_tokens.

Sends never block: the socket only queues to a live connection (ZMQ_IMMEDIATE), and a
send that cannot be queued fails at once (`EngineUnavailable`), never waits. A LoRA call
(`lora_call`: LORA_LOAD or LORA_UNLOAD) waits for its LORA_REPLY within a deadline; the
reply's load is taken at once, so the next request routes by the adapters it lists. An
`Output` for a request this router no longer tracks (it failed over, or the client
left) is answered with an `Abort`, so an engine never computes for nobody for long.

`EnginePool` holds the engines: a static list, or a changing set when Kubernetes
discovery (`discovery.DiscoveredEnginePool`) adds and removes them while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from tandem_engine import protocol as p
from tandem_engine.router.kv_index import KVIndex
from tandem_engine.router.routing import EngineView
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.zmq_auth import CurveClient

log = logging.getLogger(__name__)

# How often a router PINGs each connected engine: the engines' default heartbeat interval,
# well inside their default router timeout (10 s).
PING_INTERVAL = 0.5
# An engine's index before its WELCOME says its KV pool's size (then: that size).
DEFAULT_KV_INDEX_CAPACITY = 1 << 20
# How long a router waits for a snapshot it asked for before asking again.
SNAPSHOT_RETRY_S = 1.0
# How long a LoRA call may take on an engine: it waits for the step in progress and reads
# the adapter from disk.
LORA_CALL_TIMEOUT = 60.0


class EngineUnavailable(Exception):
    """A message could not be handed to an engine (not connected, or its queue is full)."""


@dataclass(frozen=True)
class EngineLost:
    """Put in a request's queue when its engine died or restarted: the request is gone
    there and must be resubmitted."""

    reason: str


# What a request's queue holds: (monotonic time the message arrived, the message).
QueueItem = tuple[float, p.Output | p.Reject | EngineLost]


def parse_address(address: str) -> str:
    """'HOST:PORT' or 'tcp://HOST:PORT' -> 'tcp://HOST:PORT' (ValueError if malformed)."""
    raw = address.removeprefix("tcp://")
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"engine address {address!r} must be HOST:PORT with a port in "
                         "1..65535, e.g. 127.0.0.1:5555")
    return f"tcp://{host}:{int(port)}"


class EngineClient:
    def __init__(self, address: str, *, router_id: str, context: zmq.asyncio.Context,
                 heartbeat_deadline: float = 2.0, handshake_timeout: float = 1.0,
                 ping_interval: float = PING_INTERVAL, curve: CurveClient | None = None
                 ) -> None:
        self.address = parse_address(address)
        self.curve = curve
        self.key = self.address.removeprefix("tcp://")
        self._drops = p.DropLog(log, f"engine {self.key}")
        self.router_id = router_id
        self.heartbeat_deadline = heartbeat_deadline
        self.handshake_timeout = handshake_timeout
        self.ping_interval = ping_interval
        self.welcome: p.Welcome | None = None
        self.load: p.Load | None = None
        self.connected = False  # WELCOME received and messages arriving on time
        self.last_seen = 0.0  # monotonic time of the last message from the engine
        self.epoch_changes = 0  # bumped whenever its prefix cache is known to be invalid
        # Its prefix cache, exactly, from its KV events (kv_index.py); sized at WELCOME.
        self.kv_index = KVIndex(DEFAULT_KV_INDEX_CAPACITY)
        self._snapshot_asked_at = float("-inf")
        self._context = context
        self._socket: zmq.asyncio.Socket | None = None
        self._queues: dict[str, asyncio.Queue[QueueItem]] = {}
        self._lora_calls: dict[str, asyncio.Future[p.LoRAReply]] = {}  # call id -> reply
        self._hello_sent_at = float("-inf")
        self._pinged_at = float("-inf")  # when this router last told the engine it lives
        self._received_at = 0.0  # when the message being handled came off the socket
        self._tasks: list[asyncio.Task[Any]] = []

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        # A fixed identity per (router, engine): after a reconnect the engine still maps
        # our request ids to the same requests, so aborts keep working.
        sock.setsockopt(zmq.ROUTING_ID, f"{self.router_id}/{self.key}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a live connection
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)  # never buffer a huge frame
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self.curve is not None:
            self.curve.secure(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        self._socket = sock
        self._tasks = [asyncio.create_task(self._receive(), name=f"recv {self.key}"),
                       asyncio.create_task(self._watch(), name=f"watch {self.key}"),
                       asyncio.create_task(self._monitor(monitor), name=f"mon {self.key}")]

    async def close(self, reason: str = "the router is shutting down") -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.connected = False
        self._fail_all(reason)
        if self._socket is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._socket.close(linger=0)
            self._socket = None

    # ---- requests -------------------------------------------------------------------------

    @property
    def inflight(self) -> int:
        return len(self._queues)

    def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
               cache_salt: str | None = None, *, pin_for_handoff: bool = False,
               resume: p.Resume | None = None, pull: p.PullSource | None = None,
               lora: p.LoRARef | None = None, priority: int = 0
               ) -> asyncio.Queue[QueueItem]:
        """Hand a request to the engine; its outputs arrive on the returned queue.

        `pin_for_handoff` (prefill) stops after the first token and keeps the prompt's KV
        pinned for a decode engine; `resume` continues tokens generated elsewhere;
        `pull` (decode) pulls the prompt's KV from a prefill engine instead of computing
        it; `lora` is the adapter it runs under (the engine refuses a version it does
        not serve)."""
        if not self.connected:
            raise EngineUnavailable(f"engine {self.key} is not connected")
        queue: asyncio.Queue[QueueItem] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            self._send(p.Submit(request_id, prompt_token_ids, sampling, cache_salt,
                                pin_for_handoff=pin_for_handoff, resume=resume, pull=pull,
                                lora=lora, priority=priority))
        except BaseException:  # unsendable (an id msgpack cannot encode, say): not in flight
            self._queues.pop(request_id, None)
            raise
        return queue

    def abort(self, request_id: str) -> None:
        """Cancel a request (best effort, never blocks) and forget its queue."""
        log.debug("abort %s (tracked: %s)", request_id, request_id in self._queues)
        if self._queues.pop(request_id, None) is not None:
            with contextlib.suppress(EngineUnavailable):
                self._send(p.Abort(request_id))

    def unpin(self, request_id: str) -> None:
        """Release the KV a finished prefill request pinned for a decode engine that will
        not pull it (best effort, never blocks): an `Abort`, which the engine also takes
        to mean that its pin is no longer needed. An engine that is gone took its pins
        with it."""
        log.debug("unpin %s", request_id)
        self._queues.pop(request_id, None)
        with contextlib.suppress(EngineUnavailable):
            self._send(p.Abort(request_id))

    def release(self, request_id: str) -> None:
        """Forget a finished request's queue."""
        self._queues.pop(request_id, None)

    async def lora_call(self, call: p.LoadLoRA | p.UnloadLoRA,
                        timeout: float = LORA_CALL_TIMEOUT) -> p.LoRAReply:
        """Send a LoRA call and wait for its reply; EngineUnavailable when the engine is
        not connected, is lost meanwhile, or does not answer within `timeout`."""
        if not self.connected:
            raise EngineUnavailable(f"engine {self.key} is not connected")
        reply: asyncio.Future[p.LoRAReply] = asyncio.get_running_loop().create_future()
        self._lora_calls[call.call_id] = reply
        try:
            self._send(call)
            return await asyncio.wait_for(reply, timeout)
        except TimeoutError:
            raise EngineUnavailable(f"engine {self.key} did not answer the LoRA call "
                                    f"within {timeout:.0f} s") from None
        finally:
            self._lora_calls.pop(call.call_id, None)

    @property
    def role(self) -> str:
        """mixed | prefill | decode, as the engine announced (mixed until it did)."""
        return self.welcome.role if self.welcome is not None else p.EngineRole.MIXED

    @property
    def can_hand_over(self) -> bool:
        """Whether the engine has a KV transfer agent (can pin for, or pull from, another)."""
        return self.welcome is not None and self.welcome.kv_transfer is not None

    def view(self) -> EngineView:
        load, welcome = self.load, self.welcome
        return EngineView(
            key=self.key, alive=self.connected,
            state=load.state if load else "UNKNOWN",
            weight_version=load.weight_version if load else "",
            weight_epoch=load.weight_epoch if load else 0,
            num_running=load.num_running if load else 0,
            num_waiting=load.num_waiting if load else 0,
            kv_usage=load.kv_usage if load else 0.0,
            inflight=self.inflight,
            block_size=welcome.block_size if welcome else 16,
            max_model_len=welcome.max_model_len if welcome else 0,
            draining=load.draining if load else False,
            loras=frozenset(load.loras) if load else frozenset(),
            resident_loras=frozenset(load.resident_loras) if load else frozenset(),
            kv_index_blocks=len(self.kv_index), kv_synced=self.kv_index.synced,
            kv_lag=self.kv_index.last_lag,
            kv_resyncs=tuple(sorted(self.kv_index.resyncs.items())))

    def describe(self) -> dict[str, Any]:
        """What `GET /v1/engines` shows of this engine."""
        v = self.view()
        w = self.welcome
        return {"address": self.key, "engine_id": w.engine_id if w else None,
                "incarnation": w.incarnation if w else None, "role": w.role if w else None,
                "model": w.model if w else None, "alive": v.alive, "state": v.state,
                "draining": v.draining,
                "weight_version": v.weight_version, "weight_epoch": v.weight_epoch,
                "num_running": v.num_running, "num_waiting": v.num_waiting,
                "kv_usage": v.kv_usage, "inflight": v.inflight,
                "block_size": v.block_size, "max_model_len": v.max_model_len,
                "loras": sorted(v.loras), "resident_loras": sorted(v.resident_loras),
                "kv_index": {"blocks": v.kv_index_blocks, "synced": v.kv_synced,
                             "seq": self.kv_index.seq, "lag_seconds": round(v.kv_lag, 4),
                             "resyncs": dict(v.kv_resyncs)},
                "seconds_since_seen": round(time.monotonic() - self.last_seen, 3)
                if self.last_seen else None}

    # ---- internals ------------------------------------------------------------------------

    def _send(self, message: Any) -> None:
        if self._socket is None:
            raise EngineUnavailable(f"engine {self.key}: the router's socket is closed")
        # With DONTWAIT (and no pending sends) pyzmq tries the send at once and hands back
        # a finished future: this call is synchronous and never waits.
        sent = self._socket.send(p.encode(message), zmq.DONTWAIT)
        exc = sent.exception() if sent.done() else None
        if exc is not None:
            raise EngineUnavailable(f"engine {self.key}: cannot queue a message ({exc})")

    def _say_hello(self) -> None:
        self._hello_sent_at = self._pinged_at = time.monotonic()
        with contextlib.suppress(EngineUnavailable):
            self._send(p.Hello(p.PROTOCOL_VERSION, self.router_id))

    def _ping(self) -> None:
        self._pinged_at = time.monotonic()
        with contextlib.suppress(EngineUnavailable):
            self._send(p.Ping(self.router_id))

    def _mark_dead(self, reason: str) -> None:
        if self.connected:
            log.warning("engine %s lost: %s", self.key, reason)
        self.connected = False
        self._hello_sent_at = float("-inf")  # say hello again at once
        self._fail_all(f"engine {self.key} lost: {reason}")

    def _fail_all(self, reason: str) -> None:
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            queue.put_nowait((time.monotonic(), EngineLost(reason)))
        calls, self._lora_calls = self._lora_calls, {}
        for call in calls.values():
            if not call.done():
                call.set_exception(EngineUnavailable(reason))

    async def _watch(self) -> None:
        """Handshake retries, the heartbeat deadline and this router's PINGs."""
        tick = min(0.1, self.heartbeat_deadline / 4)
        while True:
            now = time.monotonic()
            if self.connected and now - self.last_seen > self.heartbeat_deadline:
                self._mark_dead(f"no message for {now - self.last_seen:.1f} s "
                                f"(deadline {self.heartbeat_deadline} s)")
            if not self.connected and now - self._hello_sent_at > self.handshake_timeout:
                self._say_hello()
            if self.connected and now - self._pinged_at >= self.ping_interval:
                self._ping()
            if self.connected and not self.kv_index.synced:
                self._ask_snapshot()  # the one after the WELCOME was lost, or a gap
            await asyncio.sleep(tick)

    async def _monitor(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._mark_dead("connection closed")
                elif event["event"] == zmq.EVENT_CONNECTED:
                    self._say_hello()
        finally:
            monitor.close(linger=0)

    async def _receive(self) -> None:
        assert self._socket is not None
        while True:
            frame = await self._socket.recv()
            self._received_at = time.monotonic()
            try:
                message = p.decode(frame)
            except p.ProtocolError as exc:
                self._drops.dropped(exc)
                continue
            try:
                self._handle(message)
            except Exception:  # a bug here must not stop the receive loop
                log.exception("engine %s: failed to handle %s", self.key,
                              type(message).__name__)

    def _handle(self, message: Any) -> None:
        if isinstance(message, p.Welcome):
            self._on_welcome(message)
            return
        if isinstance(message, p.KVEvents | p.KVSnapshot):
            self._on_kv(message)
            return
        if isinstance(message, p.Heartbeat | p.StateChange):
            if self.welcome is None or message.incarnation != self.welcome.incarnation:
                if self.connected:  # a restarted engine knows none of our requests
                    self._mark_dead(f"restarted as incarnation {message.incarnation}")
                return
            self.last_seen = time.monotonic()
            self._set_load(message.load)
            return
        if self.connected:
            self.last_seen = time.monotonic()
        if isinstance(message, p.LoRAReply):
            if message.load is not None and self.connected:
                self._set_load(message.load)
            call = self._lora_calls.get(message.call_id)
            if call is not None and not call.done():
                call.set_result(message)
            return
        if isinstance(message, p.Output | p.Reject):
            queue = self._queues.get(message.request_id)
            if queue is None:
                if isinstance(message, p.Output) and not message.finished:
                    with contextlib.suppress(EngineUnavailable):
                        self._send(p.Abort(message.request_id))
                return
            if isinstance(message, p.Reject) or message.finished:
                del self._queues[message.request_id]
            queue.put_nowait((self._received_at, message))
        else:
            log.warning("engine %s: unexpected %s dropped", self.key, type(message).__name__)

    def _on_kv(self, message: p.KVEvents | p.KVSnapshot) -> None:
        """Apply the engine's prefix-cache changes to its index; ask for a snapshot after a
        gap. Messages of another incarnation (one that just restarted) are dropped."""
        if self.welcome is None or message.incarnation != self.welcome.incarnation:
            return
        if self.connected:
            self.last_seen = time.monotonic()
        now = time.time()
        if isinstance(message, p.KVSnapshot):
            self.kv_index.load(message, now)
            self._snapshot_asked_at = float("-inf")
        elif not self.kv_index.apply(message, now):
            self._ask_snapshot()

    def _ask_snapshot(self) -> None:
        """Ask the engine for every hash it holds (at most once per SNAPSHOT_RETRY_S)."""
        now = time.monotonic()
        if now - self._snapshot_asked_at < SNAPSHOT_RETRY_S:
            return
        self._snapshot_asked_at = now
        with contextlib.suppress(EngineUnavailable):
            self._send(p.KVSnapshotRequest(self.router_id))

    def _on_welcome(self, welcome: p.Welcome) -> None:
        if welcome.protocol_version != p.PROTOCOL_VERSION:
            log.error("engine %s speaks protocol %d, this router %d: not using it", self.key,
                      welcome.protocol_version, p.PROTOCOL_VERSION)
            return
        previous = self.welcome
        if previous is None or previous.incarnation != welcome.incarnation:
            # A new process: its cache starts empty, and its snapshot follows the WELCOME.
            self.kv_index = KVIndex(welcome.num_kv_blocks or DEFAULT_KV_INDEX_CAPACITY)
            self._snapshot_asked_at = time.monotonic()
        if previous is not None and previous.incarnation != welcome.incarnation:
            self._fail_all(f"engine {self.key} restarted")
            self.epoch_changes += 1
        if not self.connected:
            log.info("engine %s connected: id %s, %s, model %s, version %s (epoch %d), %s",
                     self.key, welcome.engine_id, welcome.role, welcome.model,
                     welcome.load.weight_version, welcome.load.weight_epoch,
                     welcome.load.state)
        self.welcome = welcome
        self.connected = True
        self.last_seen = time.monotonic()
        self._set_load(welcome.load)

    def _set_load(self, load: p.Load) -> None:
        if self.load is not None and (load.weight_epoch != self.load.weight_epoch
                                      or load.weight_version != self.load.weight_version):
            self.epoch_changes += 1
        if self.load is not None and load.state != self.load.state:
            log.info("engine %s: %s -> %s", self.key, self.load.state, load.state)
        self.load = load


class EnginePool:
    """The router's engines: a static list of addresses, or (`allow_empty`, then `add` and
    `remove`) a set that changes while the router runs. With `curve`, every connection
    authenticates with the pool's CURVE keys (`tandem_engine.zmq_auth`)."""

    def __init__(self, addresses: Sequence[str], *, router_id: str | None = None,
                 heartbeat_deadline: float = 2.0, handshake_timeout: float = 1.0,
                 allow_empty: bool = False, curve: CurveClient | None = None) -> None:
        if not addresses and not allow_empty:
            raise ValueError("the router needs at least one engine address (--engine)")
        keys = [parse_address(a) for a in addresses]
        if len(set(keys)) != len(keys):
            raise ValueError(f"engine addresses must be distinct, got {list(addresses)}")
        if heartbeat_deadline <= 0:
            raise ValueError(f"heartbeat deadline {heartbeat_deadline} must be > 0 s")
        self.router_id = router_id or f"router-{uuid.uuid4().hex[:12]}"
        self.heartbeat_deadline = heartbeat_deadline
        self.handshake_timeout = handshake_timeout
        self.curve = curve
        self._context = zmq.asyncio.Context()
        self._started = False
        self.clients = [self._client(a) for a in addresses]
        self.by_key = {c.key: c for c in self.clients}

    def _client(self, address: str) -> EngineClient:
        return EngineClient(address, router_id=self.router_id, context=self._context,
                            heartbeat_deadline=self.heartbeat_deadline,
                            handshake_timeout=self.handshake_timeout, curve=self.curve)

    async def start(self) -> None:
        self._started = True
        for client in self.clients:
            await client.start()

    async def close(self) -> None:
        self._started = False
        for client in list(self.clients):
            await client.close()
        self._context.destroy(linger=0)

    async def add(self, address: str) -> EngineClient:
        """Connect to one more engine (the existing client if its address is known)."""
        key = parse_address(address).removeprefix("tcp://")
        if key in self.by_key:
            return self.by_key[key]
        client = self._client(address)
        self.clients.append(client)
        self.by_key[client.key] = client
        if self._started:
            await client.start()
        return client

    async def remove(self, key: str) -> None:
        """Drop an engine ('HOST:PORT'); its in-flight requests get `EngineLost`."""
        client = self.by_key.pop(key, None)
        if client is None:
            return
        self.clients.remove(client)
        await client.close(f"engine {key} left the pool")

    def views(self) -> list[EngineView]:
        return [c.view() for c in self.clients]
