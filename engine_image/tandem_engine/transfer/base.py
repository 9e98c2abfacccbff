"""The KV handoff contract every transfer backend keeps, and the geometry both sides must share.

A decode engine pulls the KV blocks of a prompt that a prefill engine in another process
computed (docs/architecture.md, "KV handoff"). What moves is decided by block ids alone, so both
engines' KV pools must agree on everything but their number of blocks; `KVGeometry`
says what that is and refuses a peer whose pool differs, naming the field, before any
byte moves. Backends are chosen explicitly by the caller, never from the environment.

This module is torch-free apart from type hints, so wire code can carry geometries.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from tandem_engine.errors import TandemError

if TYPE_CHECKING:
    import torch

TransferState = Literal["DONE", "PROC"]

# Bytes per element of the dtypes a KV pool may hold, by torch's name without "torch.".
_ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
# Where a KV pool may live: host memory (NIXL "DRAM") or a GPU's (NIXL "VRAM").
DEVICE_TYPES = ("cpu", "cuda")


class TransferError(TandemError):
    """A KV transfer cannot start or did not complete: a bad or stale peer, a dead peer, a
    transport failure. The destination blocks of a failed READ hold unknown bytes."""


class GeometryMismatch(TransferError):
    """The peer's KV pool is laid out differently (model, dtype, block size, layers,
    heads): detected from its descriptor before any byte moves."""


class TransferTimeout(TransferError):
    """A KV transfer did not complete within its deadline (a frozen or overloaded peer).

    The destination blocks may still be written by the transport: quarantine them."""


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one engine's KV pool `[num_layers, 2, num_blocks, block_size, heads, dim]`,
    and the kind of memory it lives in (`device_type`: "cpu" or "cuda"; which GPU is the
    transfer agent's business, not a compatibility question).

    Two engines can exchange blocks when every field but `num_blocks` matches.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    device_type: str = "cpu"  # torch device type of the pool: "cpu" or "cuda"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVGeometry.{name}={value!r} must be a positive int")
        if self.dtype not in _ITEMSIZE:
            raise ValueError(
                f"KVGeometry.dtype={self.dtype!r} is not a KV dtype; use one of {sorted(_ITEMSIZE)}"
            )
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"KVGeometry.device_type={self.device_type!r} is not a KV pool "
                             f"device; use one of {list(DEVICE_TYPES)}")

    @classmethod
    def of_tensor(cls, kv_cache: torch.Tensor) -> KVGeometry:
        """The geometry of a KV pool tensor laid out as the engine allocates it."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(
                f"KV pool of shape {tuple(kv_cache.shape)} is not "
                "[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]"
            )
        layers, _, blocks, block_size, heads, dim = (int(s) for s in kv_cache.shape)
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        return cls(layers, blocks, block_size, heads, dim, dtype, kv_cache.device.type)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one block of one layer's K or V: the unit a transfer descriptor covers."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def chunks_per_block(self) -> int:
        """Separate contiguous chunks one block is made of: one per (layer, K/V)."""
        return 2 * self.num_layers

    @property
    def block_bytes(self) -> int:
        """Bytes one block holds across all layers, K and V."""
        return self.chunks_per_block * self.chunk_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def describe(self) -> str:
        return (f"{self.num_layers} layers x {self.num_blocks} blocks of {self.block_size} "
                f"tokens x {self.num_kv_heads} kv heads x head_dim {self.head_dim}, {self.dtype} "
                f"on {self.device_type}")

    def incompatibility(self, peer: KVGeometry) -> str | None:
        """Why blocks cannot move between this pool and `peer`'s, or None when they can.

        `num_blocks` may differ; every mismatched field is named with both values."""
        diffs = [
            f"{f.name} is {getattr(self, f.name)!r} here but {getattr(peer, f.name)!r} on the peer"
            for f in dataclasses.fields(self)
            if f.name != "num_blocks" and getattr(self, f.name) != getattr(peer, f.name)
        ]
        if not diffs:
            return None
        return ("; ".join(diffs) + ". Both engines must serve the same model with the same KV "
                "settings (block size, KV dtype) on the same kind of device to hand off KV "
                "blocks")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVGeometry:
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ValueError(f"KV geometry needs exactly the fields {sorted(names)}, "
                             f"got {sorted(data)}")
        return cls(**data)


@dataclass(eq=False)
class TransferHandle:
    """One posted transfer. Owned by the backend that made it; release it exactly once
    (`wait` does) so the transport frees its request."""

    peer: str
    num_blocks: int
    nbytes: int
    started_at: float = field(default_factory=time.monotonic)
    released: bool = False
    native: Any = field(default=None, repr=False)  # the backend's own request object


class KVTransferBackend(abc.ABC):
    """Moves KV blocks between engines' pools by block id; one instance per engine.

    Usage on both sides: `register` the pool once, publish `agent_metadata()`.
    The pulling (decode) side: `add_peer`, `start_read`, then `wait` (or `poll` and
    `release`). The passive (prefill) side must call `new_notifications()` regularly:
    it learns there which pulls finished, and some transports only make progress then.
    Not thread-safe unless an implementation says so.
    """

    @abc.abstractmethod
    def register(self, kv_cache: torch.Tensor, geometry: KVGeometry) -> None:
        """Make the whole pool transferable, as one region. Once per backend."""

    @abc.abstractmethod
    def deregister(self) -> None:
        """Let go of the pool (its tensor is about to be replaced: an offload or recompute
        suspend), releasing transfers in flight. `register` the new pool afterwards; its
        `agent_metadata()` changes, and peers re-add it under the same name."""

    @abc.abstractmethod
    def agent_metadata(self) -> bytes:
        """What a peer passes to `add_peer` to reach this pool (opaque, a few hundred bytes)."""

    @abc.abstractmethod
    def add_peer(self, name: str, metadata: bytes, geometry: KVGeometry) -> None:
        """Get ready to read from `name`'s pool; `geometry` is the peer's pool.

        Raises TransferError naming the field when the geometries are incompatible. Adding
        the same metadata again is a no-op; new metadata under a known name (a restarted
        peer) replaces the old peer."""

    @abc.abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget `name`; its in-flight transfers are released. Unknown names are ignored."""

    @abc.abstractmethod
    def start_read(self, peer: str, remote_blocks: list[int], local_blocks: list[int],
                   notif: bytes | None = None) -> TransferHandle:
        """Post a one-sided READ of `peer`'s `remote_blocks[i]` into `local_blocks[i]`.

        `notif`, when given, is delivered to the peer's `new_notifications()` once the
        data has moved. May copy synchronously: call it off an event loop."""

    @abc.abstractmethod
    def poll(self, handle: TransferHandle) -> TransferState:
        """"DONE" or "PROC"; raises TransferError when the transfer failed."""

    @abc.abstractmethod
    def release(self, handle: TransferHandle) -> None:
        """Free the transfer's resources, cancelling it if still in flight. Idempotent."""

    @abc.abstractmethod
    def notify(self, peer: str, message: bytes) -> None:
        """Send `message` to `peer`'s `new_notifications()` without moving data (e.g. to
        unpin blocks when nothing needed pulling)."""

    @abc.abstractmethod
    def new_notifications(self) -> dict[str, list[bytes]]:
        """Messages received since the last call, by sending peer's name."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every transfer, peer and registration. Idempotent."""

    def wait(self, handle: TransferHandle, timeout_s: float, *,
             keep_on_timeout: bool = False) -> None:
        """Block until the transfer is done; raise TransferTimeout after `timeout_s` seconds
        or TransferError when it fails. Releases the handle in every case but a timeout
        with `keep_on_timeout` (the caller then polls it on, to learn when the transfer
        really ended, and releases it)."""
        deadline = time.monotonic() + timeout_s
        pause = 0.0
        release = True
        try:
            while self.poll(handle) == "PROC":
                now = time.monotonic()
                if now >= deadline:
                    release = not keep_on_timeout
                    raise TransferTimeout(
                        f"KV read of {handle.num_blocks} blocks ({handle.nbytes} bytes) from "
                        f"peer {handle.peer!r} not done after {timeout_s:.3g} s; the peer may "
                        "be frozen or overloaded. Treat its destination blocks as unknown")
                # Spin briefly (most reads finish within microseconds of posting), then
                # back off to 1 ms so a stuck transfer does not burn a core.
                if pause:
                    time.sleep(min(pause, deadline - now))
                pause = min(max(pause * 2, 50e-6), 1e-3)
        finally:
            if release:
                self.release(handle)

    def __enter__(self) -> KVTransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
