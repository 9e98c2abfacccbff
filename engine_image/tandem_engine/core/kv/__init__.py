"""KV cache memory: the block pool and the per-request block tables. No tensors here."""

from __future__ import annotations

from tandem_engine.core.kv.block_pool import BlockPool, OutOfBlocks
from tandem_engine.core.kv.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager", "OutOfBlocks"]
