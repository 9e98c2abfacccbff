"""KV handoff between engines: one small backend interface, NIXL as the real backend.

The caller picks the backend explicitly (`NixlBackend(name)`); nothing here reads the
environment to choose one. `NixlBackend` is imported lazily so that importing this
package costs nothing and needs no NIXL installation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem_engine.transfer.base import (
    GeometryMismatch,
    KVGeometry,
    KVTransferBackend,
    TransferError,
    TransferHandle,
    TransferState,
    TransferTimeout,
)

if TYPE_CHECKING:
    from tandem_engine.transfer.nixl import NixlBackend

__all__ = [
    "GeometryMismatch",
    "KVGeometry",
    "KVTransferBackend",
    "NixlBackend",
    "TransferError",
    "TransferHandle",
    "TransferState",
    "TransferTimeout",
]


def __getattr__(name: str) -> Any:
    if name == "NixlBackend":
        from tandem_engine.transfer.nixl import NixlBackend

        return NixlBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
