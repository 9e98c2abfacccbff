"""Chained block hashes for prefix caching, salted by weight epoch, tenant and adapter.

Block i's hash covers block i-1's hash, block i's tokens and the salt, so equal hashes
mean an equal whole prefix under the same salt. The salt carries the engine's weight
epoch (KV computed by old weights is never matched after a refit) and an optional
per-request `cache_salt` (tenants never share KV). Epoch 0 with no cache salt is the
empty salt, which hashes exactly as an unsalted chain.

Pure functions over token ids: the router computes the same hashes for its
prefix-aware routing without an engine. blake2b keeps them identical across
processes and machines (Python's own hash() of strings is randomised per process).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0  # the parent of a chain's first block


def block_salt(weight_epoch: int = 0, cache_salt: str | None = None,
               adapter: str | None = None) -> bytes:
    """The salt of a request's chain; empty for epoch 0, no cache salt and the base model.
    `adapter`: the LoRA adapter's identity (name@version), so KV never crosses adapters."""
    if weight_epoch == 0 and not cache_salt and not adapter:
        return b""
    salt = f"epoch={weight_epoch};cache_salt={cache_salt or ''}"
    return (salt + f";lora={adapter}" if adapter else salt).encode()


def hash_block(parent: int, tokens: Sequence[int], salt: bytes = b"") -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    h.update(salt)
    return int.from_bytes(h.digest(), "little")


def chain_root(salt: bytes = b"") -> int:
    """The parent hash of a chain's first block: fixed when unsalted, else from the salt."""
    if not salt:
        return ROOT_HASH
    return int.from_bytes(hashlib.blake2b(salt, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"",
                 start: Sequence[int] = ()) -> list[int]:
    """Hashes of every full block of `token_ids`. `start` are hashes already known for
    the leading blocks (they are extended, not recomputed)."""
    out = list(start)
    parent = out[-1] if out else chain_root(salt)
    for i in range(len(out) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[i:i + block_size], salt)
        out.append(parent)
    return out
