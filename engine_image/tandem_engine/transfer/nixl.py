"""KV handoff over NIXL (UCX): one-sided READs of whole KV blocks between engine processes.

Why it is built this way (measured facts, see ENVIRONMENT.md "NIXL (KV transfer)"):

* The agent runs without NIXL's progress thread, which busy-spins a core per agent. So
  progress is ours: the reader polls `check_xfer_state` (`poll`/`wait`) and the passive
  side must call `new_notifications()` often. A passive side that does not poll delays
  the reader: a READ stays "PROC" until the peer next polls when a notification of an
  earlier READ is still undelivered, and it never finishes while the peer is frozen.
* The whole pool is registered once as one region (metadata stays ~0.5 KB) and transfers
  are described by index into prepared descriptor lists, one descriptor per
  (layer, K/V, block) chunk, on both sides: making a 256-block request costs ~0.3 ms.
* `transfer()` copies synchronously over the default transports (cma/tcp); it releases
  the GIL, so run `start_read` off the event loop (a worker thread). All agent calls are
  serialised by one lock, which makes the backend safe to share between threads.
* Every transfer needs its own deadline (`wait`): a frozen peer leaves a READ in "PROC"
  for 90 s or more, while a dead peer fails within a millisecond.
* A restarted peer keeps its name but has new metadata; NIXL refuses to load a name that
  is still loaded, so the old peer is removed first.

Environment, set here only when unset and before NIXL is imported: `UCX_NET_DEVICES=lo`
(single-host; a multi-host deployment must set its real devices) and `NIXL_LOG_LEVEL=WARN`
(NIXL's INFO lines go to stdout). `UCX_TLS` is left alone on purpose.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tandem_engine.transfer.base import (
    GeometryMismatch,
    KVGeometry,
    KVTransferBackend,
    TransferError,
    TransferHandle,
    TransferState,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# agent_metadata() = magic, u32 header length, JSON header, NIXL's own agent metadata.
# NIXL's metadata names the agent and its registered memory but not where our pool
# starts or how it is laid out; the header carries that.
_MAGIC = b"TNDMNIXL"
_HEADER_LEN = struct.Struct("<I")
_FORMAT_VERSION = 2  # 2: the geometry carries the pool's device type


def _prepare_environment() -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def nixl_packages(cuda_version: str | None) -> tuple[str, ...]:
    """NIXL's wheels to try, best first: the one built for torch's CUDA major version
    (`torch.version.cuda`, None for a CPU torch), then the other."""
    order = ["nixl_cu12", "nixl_cu13"]
    if cuda_version is not None and cuda_version.split(".")[0] == "13":
        order.reverse()
    return tuple(order)


def _import_nixl() -> tuple[Any, Any, tuple[type[BaseException], ...]]:
    _prepare_environment()
    import importlib

    import torch

    failures = []
    for package in nixl_packages(torch.version.cuda):
        try:
            _bindings = importlib.import_module(f"{package}._bindings")
            api = importlib.import_module(f"{package}._api")
            nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
            break
        except ImportError as exc:
            failures.append(f"{package}: {exc}")
    else:
        wheel = nixl_packages(torch.version.cuda)[0].replace("_", "-")
        raise TransferError(
            f"the NIXL KV transfer backend needs the {wheel} package (pip install "
            f"{wheel}==1.5.1 after torch; the wheel of torch's CUDA major version): "
            + "; ".join(failures))
    errors = tuple(
        obj for name, obj in vars(_bindings).items()
        if name.startswith("nixl") and name.endswith("Error") and isinstance(obj, type)
        and issubclass(obj, BaseException))
    return nixl_agent, nixl_agent_config, errors


def _chunk_table(base: int, geometry: KVGeometry, device: int) -> np.ndarray:
    """One (address, length, device) row per chunk, in pool order: row
    `(layer * 2 + kv) * num_blocks + block` is chunk (layer, kv, block)."""
    count = geometry.chunks_per_block * geometry.num_blocks
    table = np.empty((count, 3), dtype=np.uint64)
    table[:, 0] = base + np.arange(count, dtype=np.uint64) * np.uint64(geometry.chunk_bytes)
    table[:, 1] = geometry.chunk_bytes
    table[:, 2] = device
    return table


def _chunk_indices(geometry: KVGeometry, blocks: np.ndarray) -> np.ndarray:
    """Rows of `_chunk_table` holding `blocks`, all chunks of blocks[0] layer by layer
    first in the same order for any geometry, so two lists pair up element-wise."""
    planes = np.arange(geometry.chunks_per_block, dtype=np.int64)[:, None] * geometry.num_blocks
    return (planes + blocks[None, :]).ravel().astype(np.int32)


def _block_ids(what: str, blocks: list[int], num_blocks: int) -> np.ndarray:
    ids = np.asarray(blocks, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"{what} must be a flat list of block ids, got shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
        raise ValueError(f"{what} holds block id {bad}, outside the pool's 0..{num_blocks - 1}")
    return ids


@dataclass(frozen=True)
class _PeerCard:
    """The decoded agent_metadata() of a peer."""

    agent: str
    mem_type: str  # "DRAM" or "VRAM"
    device: int
    base: int
    geometry: KVGeometry
    nixl_metadata: bytes

    def encode(self) -> bytes:
        header = json.dumps({
            "version": _FORMAT_VERSION, "agent": self.agent, "mem_type": self.mem_type,
            "device": self.device, "base": self.base, "geometry": self.geometry.to_dict(),
        }).encode()
        return _MAGIC + _HEADER_LEN.pack(len(header)) + header + self.nixl_metadata

    @classmethod
    def decode(cls, data: bytes, peer: str) -> _PeerCard:
        start = len(_MAGIC) + _HEADER_LEN.size
        try:
            if not data.startswith(_MAGIC):
                raise ValueError("it does not start with the Tandem NIXL marker")
            (length,) = _HEADER_LEN.unpack_from(data, len(_MAGIC))
            header = json.loads(data[start:start + length])
            if header.get("version") != _FORMAT_VERSION:
                raise ValueError(f"format version {header.get('version')!r}, "
                                 f"this engine reads {_FORMAT_VERSION}")
            return cls(str(header["agent"]), str(header["mem_type"]), int(header["device"]),
                       int(header["base"]), KVGeometry.from_dict(header["geometry"]),
                       bytes(data[start + length:]))
        except (ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
            raise TransferError(
                f"metadata given for peer {peer!r} is not a NixlBackend.agent_metadata() of "
                f"this Tandem version ({exc}); pass the bytes the peer published") from exc


@dataclass(eq=False)
class _Peer:
    card: _PeerCard
    metadata: bytes
    dlist: Any  # prepared remote descriptor list over all of the peer's chunks
    handles: set[TransferHandle] = field(default_factory=set)


class NixlBackend(KVTransferBackend):
    """KV block READs through one NIXL agent named `agent_name` (unique among peers: the
    engine id). Creating it costs ~0.45 s (UCX start-up)."""

    def __init__(self, agent_name: str) -> None:
        nixl_agent, nixl_agent_config, self._nixl_errors = _import_nixl()
        self.name = agent_name
        self._lock = threading.RLock()
        with self._translate(f"creating NIXL agent {agent_name!r}"):
            self._agent = nixl_agent(
                agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise TransferError("NIXL has no UCX plugin in this installation; reinstall "
                                "nixl-cu12==1.5.1")
        self._geometry: KVGeometry | None = None
        self._kv_cache: torch.Tensor | None = None  # keeps the registered memory alive
        self._registration: Any = None
        self._local_dlist: Any = None
        self._card: _PeerCard | None = None
        self._peers: dict[str, _Peer] = {}
        self._closed = False

    @contextmanager
    def _translate(self, what: str, peer: str | None = None) -> Iterator[None]:
        """Turn NIXL's exceptions into TransferError saying what failed and what to do."""
        try:
            yield
        except self._nixl_errors as exc:
            kind = type(exc).__name__
            if peer is not None and kind == "nixlRemoteDisconnectError":
                raise TransferError(
                    f"{what}: peer {peer!r} disconnected (its process died or restarted). "
                    "Recompute locally, or add_peer it again with its new metadata") from exc
            raise TransferError(f"{what} failed: {kind}: {exc}") from exc

    def _live_agent(self) -> Any:
        if self._closed:
            raise TransferError(f"NIXL backend {self.name!r} is closed")
        return self._agent

    def _registered(self) -> KVGeometry:
        if self._geometry is None:
            raise TransferError(f"NIXL backend {self.name!r} has no KV pool; register it first")
        return self._geometry

    def register(self, kv_cache: torch.Tensor, geometry: KVGeometry) -> None:
        if self._geometry is not None:
            raise TransferError(f"NIXL backend {self.name!r} already has its KV pool; "
                                "register exactly once per backend")
        actual = KVGeometry.of_tensor(kv_cache)
        if actual != geometry:
            raise ValueError(f"KV pool tensor is {actual.describe()} but the geometry given "
                             f"is {geometry.describe()}")
        if not kv_cache.is_contiguous():
            raise ValueError("KV pool tensor must be contiguous to register as one region")
        # A pool on a GPU is registered as that GPU's memory (VRAM): peers READ it
        # device to device (UCX's cuda_ipc on one host, GPUDirect RDMA across hosts).
        mem_type = "DRAM" if kv_cache.device.type == "cpu" else "VRAM"
        device = kv_cache.device.index or 0
        base = kv_cache.data_ptr()
        with self._lock, self._translate("registering the KV pool with NIXL"):
            agent = self._live_agent()
            registration = agent.register_memory(
                [(base, geometry.pool_bytes, device, "")], mem_type)
            try:
                self._local_dlist = agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", _chunk_table(base, geometry, device), mem_type)
            except BaseException:
                agent.deregister_memory(registration)
                raise
            self._registration = registration
            self._kv_cache = kv_cache
            self._geometry = geometry
            self._card = _PeerCard(self.name, mem_type, device, base, geometry,
                                   agent.get_agent_metadata())

    def deregister(self) -> None:
        with self._lock:
            if self._closed or self._registration is None:
                return
            for peer in self._peers.values():
                for handle in list(peer.handles):
                    self.release(handle)
            self._local_dlist.release()
            self._local_dlist = None
            with self._translate("deregistering the KV pool"):
                self._agent.deregister_memory(self._registration)
            self._registration = None
            self._kv_cache = None
            self._geometry = None
            self._card = None

    def agent_metadata(self) -> bytes:
        self._registered()
        assert self._card is not None
        return self._card.encode()

    def add_peer(self, name: str, metadata: bytes, geometry: KVGeometry) -> None:
        local = self._registered()
        # The geometry first: an incompatible pool is refused before its metadata is read.
        why = local.incompatibility(geometry)
        if why is not None:
            raise GeometryMismatch(f"cannot read KV blocks from peer {name!r}: {why}")
        card = _PeerCard.decode(metadata, name)
        if card.agent != name:
            raise TransferError(f"metadata given for peer {name!r} belongs to agent "
                                f"{card.agent!r}; pass the metadata that {name!r} published")
        if name == self.name:
            raise TransferError(f"peer name {name!r} is this backend's own agent name; "
                                "every engine needs a unique agent name")
        if card.geometry != geometry:
            raise GeometryMismatch(
                f"peer {name!r} registered a KV pool of {card.geometry.describe()} but was "
                f"described as {geometry.describe()}; its metadata and geometry must come "
                "from the same engine start")
        with self._lock:
            agent = self._live_agent()
            known = self._peers.get(name)
            if known is not None:
                if known.metadata == metadata:
                    return
                log.info("peer %r restarted (new metadata): replacing it", name)
                self.remove_peer(name)
            with self._translate(f"loading the NIXL metadata of peer {name!r} (is that "
                                 "process still running?)", name):
                loaded = agent.add_remote_agent(card.nixl_metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            try:
                if loaded != name:
                    raise TransferError(f"NIXL metadata given for peer {name!r} is agent "
                                        f"{loaded!r}'s")
                with self._translate(f"describing peer {name!r}'s KV pool", name):
                    dlist = agent.prep_xfer_dlist(
                        name, _chunk_table(card.base, geometry, card.device), card.mem_type)
            except BaseException:
                self._forget_remote_agent(loaded)
                raise
            self._peers[name] = _Peer(card, bytes(metadata), dlist)

    def remove_peer(self, name: str) -> None:
        with self._lock:
            peer = self._peers.pop(name, None)
            if peer is None or self._closed:
                return
            for handle in list(peer.handles):
                self.release(handle)
            peer.dlist.release()
            self._forget_remote_agent(name)

    def _forget_remote_agent(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except self._nixl_errors as exc:  # already gone: nothing left to undo
            log.warning("removing NIXL peer %r: %s: %s", name, type(exc).__name__, exc)

    def _peer(self, name: str) -> _Peer:
        peer = self._peers.get(name)
        if peer is None:
            raise TransferError(f"unknown peer {name!r}; add_peer it with its metadata first")
        return peer

    def start_read(self, peer: str, remote_blocks: list[int], local_blocks: list[int],
                   notif: bytes | None = None) -> TransferHandle:
        local = self._registered()
        with self._lock:
            agent = self._live_agent()
            source = self._peer(peer)
            remote_ids = _block_ids("remote_blocks", remote_blocks, source.card.geometry.num_blocks)
            local_ids = _block_ids("local_blocks", local_blocks, local.num_blocks)
            if remote_ids.size != local_ids.size:
                raise ValueError(f"{remote_ids.size} remote blocks but {local_ids.size} local "
                                 "blocks; pair every remote block with one local block")
            if local_ids.size == 0:
                raise ValueError("no blocks to read; use notify() when nothing needs pulling")
            if np.unique(local_ids).size != local_ids.size:
                raise ValueError("local_blocks lists a block twice; each destination once")
            what = f"KV read of {local_ids.size} blocks from peer {peer!r}"
            with self._translate(what, peer):
                xfer = agent.make_prepped_xfer(
                    "READ", self._local_dlist, _chunk_indices(local, local_ids),
                    source.dlist, _chunk_indices(source.card.geometry, remote_ids),
                    notif or b"")
            handle = TransferHandle(peer, int(local_ids.size),
                                    int(local_ids.size) * local.block_bytes, native=xfer)
            source.handles.add(handle)
            try:
                with self._translate(what, peer):
                    status = agent.transfer(xfer)
                if status == "ERR":
                    raise TransferError(f"{what}: NIXL could not post it (state ERR)")
            except BaseException:
                self.release(handle)
                raise
            return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        what = f"KV read of {handle.num_blocks} blocks from peer {handle.peer!r}"
        with self._lock:
            if handle.released:
                raise TransferError(f"{what} was already released (or its peer removed)")
            agent = self._live_agent()
            with self._translate(what, handle.peer):
                state = agent.check_xfer_state(handle.native)
        if state == "ERR":
            raise TransferError(f"{what} failed in the transport (NIXL state ERR); recompute "
                                "locally and treat its destination blocks as unknown")
        return "DONE" if state == "DONE" else "PROC"

    def release(self, handle: TransferHandle) -> None:
        with self._lock:
            if handle.released:
                return
            handle.released = True
            peer = self._peers.get(handle.peer)
            if peer is not None:
                peer.handles.discard(handle)
            if self._closed:
                return
            try:
                handle.native.release()
            except self._nixl_errors as exc:
                # NIXL could not cancel it; the wrapper retries when garbage collected.
                log.warning("releasing a KV read from peer %r: %s: %s", handle.peer,
                            type(exc).__name__, exc)

    def notify(self, peer: str, message: bytes) -> None:
        with self._lock:
            agent = self._live_agent()
            self._peer(peer)
            with self._translate(f"notifying peer {peer!r}", peer):
                agent.send_notif(peer, message)

    def new_notifications(self) -> dict[str, list[bytes]]:
        with self._lock:
            agent = self._live_agent()
            with self._translate("reading NIXL notifications"):
                return {str(k): list(v) for k, v in agent.get_new_notifs().items()}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            # Order matters: transfers, then peers' lists, then ours, then the memory.
            for name in list(self._peers):
                self.remove_peer(name)
            if self._local_dlist is not None:
                self._local_dlist.release()
                self._local_dlist = None
            if self._registration is not None:
                with self._translate("deregistering the KV pool"):
                    self._agent.deregister_memory(self._registration)
                self._registration = None
            self._kv_cache = None
            self._closed = True
            self._agent = None
