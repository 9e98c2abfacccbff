"""The engine process's side of the KV handoff between prefill and decode engines.

Decode side: a handed-over request's prompt KV is pulled from the prefill engine with a
one-sided READ on a dedicated thread (neither the socket loop nor the stepping waits
on a transfer), under a deadline; any failure (geometry, dead or frozen peer, deadline)
makes the request recompute its prompt here instead, so it still completes. When the
failed READ's state is unknown (a timeout; a peer that vanished mid-READ) its destination
blocks are quarantined in the engine (a late write from the peer could land in them) and
the handle is polled on (`_poll_quarantine`, queued on the pull thread by the progress
thread) until the transport says it ended (DONE, ERR, the peer removed or replaced) or
the quarantine TTL passes; only then are the blocks released. A geometry mismatch moves
no byte and quarantines nothing.

Prefill side: the passive end of a transfer must make progress or pulls from it
stall, also while a long prefill step runs, so a progress thread polls the transfer
agent (every millisecond while pins exist, every 20 ms otherwise; it sleeps in between,
no busy spin) and hands the pin ids that decode engines report as pulled to the
stepping thread, which unpins them between steps.

The pool is registered with the transfer agent once, and deregistered / registered
again around a suspend that moves it (offload, recompute).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tandem_engine import protocol as p
from tandem_engine.engine.llm_engine import LLMEngine
from tandem_engine.engine.outputs import PullPlan
from tandem_engine.transfer import (
    GeometryMismatch,
    KVGeometry,
    KVTransferBackend,
    TransferError,
    TransferHandle,
    TransferTimeout,
)

log = logging.getLogger(__name__)


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


class KVHandoff:
    def __init__(self, engine: LLMEngine, transfer: KVTransferBackend, *,
                 pull_timeout: float, wake: Callable[[], None]) -> None:
        self.engine = engine
        self.transfer = transfer
        self.pull_timeout = pull_timeout
        self.stats = HandoffStats()
        self._wake = wake  # tells the stepping thread there is work
        self._info: p.KVTransferInfo | None = None
        self._pulls = ThreadPoolExecutor(1, thread_name_prefix="kv-pull")
        self._unpins: collections.deque[str] = collections.deque()  # pins to release
        self._closing = threading.Event()
        self._progress: threading.Thread | None = None
        # Failed pulls' handles whose state is unknown: (quarantine id, handle, deadline).
        # Touched on the pull thread only; the progress thread queues the polls.
        self._quarantined: list[tuple[int, TransferHandle, float]] = []
        self._quarantine_poll_queued = threading.Event()
        self.quarantine_ttl = engine.config.kv_quarantine_ttl_s
        self._register()

    @property
    def info(self) -> p.KVTransferInfo | None:
        """How other engines reach this pool (None while the pool is away)."""
        return self._info

    def start(self) -> None:
        self._progress = threading.Thread(target=self._progress_loop, name="kv-progress",
                                          daemon=True)
        self._progress.start()

    def close(self) -> None:
        self._closing.set()
        if self._progress is not None:
            self._progress.join(timeout=10)
        self._pulls.shutdown(wait=True, cancel_futures=True)
        self.transfer.close()

    # ---- the pool's registration ---------------------------------------------------------------

    def _register(self) -> None:
        kv_cache = self.engine.kv_pool()
        if kv_cache is None:
            raise RuntimeError("the engine's KV pool is released: resume it first")
        geometry = KVGeometry.of_tensor(kv_cache)
        self.transfer.register(kv_cache, geometry)
        self._info = p.KVTransferInfo(self.transfer.name, self.transfer.agent_metadata(),
                                      geometry)

    def pool_released(self) -> None:
        """The pool tensor went away (an offload or recompute suspend): let go of it. Runs
        on the pull thread, so it queues behind the pull in progress (bounded by its
        deadline)."""
        self._on_pull_thread(self.transfer.deregister)
        self._info = None

    def pool_restored(self) -> bool:
        """After a resume: register the (new) pool. True when the registration changed, so
        routers need a fresh WELCOME with the new metadata."""
        if self._info is not None:
            return False
        self._on_pull_thread(self._register)
        return True

    def _on_pull_thread(self, fn: Callable[[], None]) -> None:
        self._pulls.submit(fn).result(timeout=self.pull_timeout + 10)

    # ---- decode side: pulls ------------------------------------------------------------------

    def start_pull(self, rid: str, source: p.PullSource, plan: PullPlan) -> None:
        self._pulls.submit(self._pull, rid, source, plan)

    def _pull(self, rid: str, source: p.PullSource, plan: PullPlan) -> None:
        """On the pull thread: READ the missing blocks, then tell the prefill engine to
        unpin. A failure makes the request recompute its prompt here (it completes)."""
        peer = source.agent.agent_name
        ok = False
        started = time.monotonic()
        handle: TransferHandle | None = None
        try:
            self.transfer.add_peer(peer, source.agent.agent_metadata, source.agent.geometry)
            if plan.local_blocks:
                remote = [source.block_ids[i] for i in plan.block_indices]
                handle = self.transfer.start_read(peer, remote, plan.local_blocks,
                                                  notif=source.pin_id.encode())
                self.transfer.wait(handle, self.pull_timeout, keep_on_timeout=True)
                self.stats.bytes += handle.nbytes
            else:
                self.transfer.notify(peer, source.pin_id.encode())
            ok = True
        except (TransferError, ValueError) as exc:
            cause = failure_cause(exc)
            log.warning("pull of %s from %s failed (%s), recomputing the prompt here: %s",
                        rid, peer, cause, exc)
            self.stats.failed(cause)
            if handle is not None and cause != "geometry":
                self._quarantine(rid, handle, plan.local_blocks)
        if ok:
            self.stats.pulled_blocks += len(plan.local_blocks)
            self.stats.seconds.append(time.monotonic() - started)
            del self.stats.seconds[:-10_000]
        self.stats.reused_blocks += plan.reused_blocks
        self.engine.complete_pull(rid, ok)
        self._wake()

    def _quarantine(self, rid: str, handle: TransferHandle, blocks: list[int]) -> None:
        """On the pull thread, before `complete_pull`: keep the failed READ's blocks out
        of use until its transfer is known to have ended."""
        qid = self.engine.quarantine(rid, blocks)
        if qid is None:  # aborted meanwhile: nothing left to keep
            self.transfer.release(handle)
            return
        log.warning("quarantined %d KV blocks of %s until the READ from %s is known ended",
                    len(blocks), rid, handle.peer)
        self._quarantined.append((qid, handle, time.monotonic() + self.quarantine_ttl))

    def _poll_quarantine(self) -> None:
        """On the pull thread: release the quarantines whose transfer ended (DONE, ERR,
        released with its peer) or whose TTL passed."""
        self._quarantine_poll_queued.clear()
        now, kept = time.monotonic(), []
        for qid, handle, deadline in self._quarantined:
            try:
                ended = self.transfer.poll(handle) == "DONE"
                why = "finished late"
            except TransferError as exc:  # failed, or released with its removed peer
                ended, why = True, f"ended ({exc})"
            if not ended and now >= deadline:
                ended, why = True, "still unknown after the quarantine TTL"
            if not ended:
                kept.append((qid, handle, deadline))
                continue
            self.transfer.release(handle)
            self.engine.release_quarantine(qid)
            log.info("released quarantined KV blocks: the READ from %s %s", handle.peer, why)
        self._quarantined = kept

    # ---- prefill side: progress and unpins -------------------------------------------------

    def _progress_loop(self) -> None:
        while not self._closing.is_set():
            try:
                notes = self.transfer.new_notifications()
            except TransferError as exc:
                log.warning("polling KV transfer notifications failed: %s", exc)
                notes = {}
            for messages in notes.values():
                self._unpins.extend(m.decode(errors="replace") for m in messages)
            if self._unpins:
                self._wake()
            if self._quarantined and not self._quarantine_poll_queued.is_set():
                self._quarantine_poll_queued.set()
                with contextlib.suppress(RuntimeError):  # the pull thread is shut down
                    self._pulls.submit(self._poll_quarantine)
            time.sleep(0.001 if self.engine.num_pinned_blocks else 0.02)

    def unpin_notified(self) -> None:
        """On the stepping thread: release every pin a decode engine finished pulling."""
        while self._unpins:
            self.engine.unpin(self._unpins.popleft())
