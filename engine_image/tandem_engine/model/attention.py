"""Attention over the paged KV cache: the one kernel a fused GPU kernel would replace.

Tokens of a step are laid out decodes first (one query token each), then prefill
chunks. The KV of every request lives in fixed-size blocks scattered through one
preallocated pool; `AttentionMetadata` says where each request's keys live (slot
indices = block_id * block_size + offset). On CPU we gather whole blocks (contiguous
runs of memory, far faster than gathering slot by slot) and call
`scaled_dot_product_attention`: decodes as one padded batch, each prefill chunk on
its own with a causal mask offset by the context already cached. With the native
backend (`native.py`), decodes instead read their keys and values in place, and so do
float32 prefill chunks of head size 64 or 128 where the kernel was built for 256-bit
vectors or wider (csrc/paged_prefill_attention.cpp: 2.7x torch's flash attention on a
500-token SmolLM2 prompt); with the flex backend (`flex_attention.py`, for CUDA) every
query reads its blocks in place.

A sliding-window layer (`window`: each query sees its own and the window - 1 keys
before it, as transformers' sliding_window_overlay) masks the rest on the gather path;
the blocks outside the window stay allocated (no block is freed early). Its families
keep off the flex backend (`Family.flex_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from tandem_engine.model.flex_attention import FlexStep, flex_paged_attention

# The native prefill kernel's least vector width: on a build for 128-bit vectors (SSE, NEON)
# it is several times slower than torch's attention (14 against 3.9 ms on a 500-token
# SmolLM2 prompt), which dispatches to the CPU's own vectors.
NATIVE_PREFILL_BITS = 256


@dataclass
class PrefillSpan:
    q_start: int  # first row in the step's token layout
    q_len: int
    ctx_len: int  # tokens of KV the queries see, including their own
    blocks: torch.Tensor  # [ceil(ctx_len / block_size)] the request's blocks, in order
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when plain causal (no cached prefix)


class GatherBuffers:
    """Reusable destinations for gathered KV blocks.

    A decode batch gathers tens of MB of keys and values per layer; allocating that
    afresh each time costs more in page faults than the copy itself, so the runner
    keeps one pair of buffers for the engine's lifetime and grows them on demand."""

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def get(self, num_blocks: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        row = like[0].numel()
        if self._k is None or self._k.shape[0] < num_blocks or self._k.dtype != like.dtype:
            rows = max(num_blocks, 2 * (0 if self._k is None else self._k.shape[0]))
            self._k = torch.empty(rows, row, dtype=like.dtype, device=like.device)
            self._v = torch.empty(rows, row, dtype=like.dtype, device=like.device)
        return self._k[:num_blocks], self._v[:num_blocks]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int
    decode_blocks: torch.Tensor | None  # [B, W] block ids, each row padded to W blocks
    decode_lens: torch.Tensor | None  # [B] context length of each decode
    decode_mask: torch.Tensor | None  # [B, 1, 1, W * block_size] bool (torch backend only)
    prefills: list[PrefillSpan]
    buffers: GatherBuffers
    native: ModuleType | None = None  # the compiled decode kernel, when that backend is on
    flex: FlexStep | None = None  # the step's block masks, when the flex backend is on


def build_metadata(
    decode_tables: list[list[int]],
    decode_ctx_lens: list[int],
    prefill_specs: list[tuple[int, int, list[int]]],
    slot_mapping: list[int],
    block_size: int,
    device: torch.device,
    buffers: GatherBuffers,
    native: ModuleType | None = None,
) -> AttentionMetadata:
    """Turn block tables into slot indices with a handful of tensor ops.

    prefill_specs: (start position, q_len, block table) per prefill chunk."""
    num_decodes = len(decode_tables)
    decode_blocks = decode_lens = decode_mask = None
    if num_decodes:
        width = -(-max(decode_ctx_lens) // block_size)
        decode_blocks = torch.tensor(
            [t[:width] + [0] * (width - len(t)) for t in decode_tables],
            dtype=torch.long, device=device)
        decode_lens = torch.tensor(decode_ctx_lens, dtype=torch.long, device=device)
        if native is None:
            pos = torch.arange(width * block_size, device=device)
            decode_mask = (pos[None, :] < decode_lens[:, None])[:, None, None, :]
    prefills = []
    q_start = num_decodes
    for start, q_len, blocks in prefill_specs:
        ctx_len = start + q_len
        table = torch.tensor(blocks[:-(-ctx_len // block_size)], dtype=torch.long, device=device)
        mask = None
        if start:
            pos = torch.arange(ctx_len, device=device)
            q_pos = torch.arange(start, ctx_len, device=device)
            mask = pos[None, :] <= q_pos[:, None]
        prefills.append(PrefillSpan(q_start, q_len, ctx_len, table, mask))
        q_start += q_len
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        num_decodes=num_decodes,
        decode_blocks=decode_blocks,
        decode_lens=decode_lens,
        decode_mask=decode_mask,
        prefills=prefills,
        buffers=buffers,
        native=native,
    )


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values ([T, kv_heads, head_dim]) in their slots, rounded
    to the cache's dtype (`--kv-cache-dtype`). Caches are [num_blocks, block_size,
    kv_heads, head_dim]."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, H, D] -> the listed blocks' tokens, [n * block_size, H, D].

    Selecting rows of a 2-D view copies each block as one run (10x faster than 4-D)."""
    num_blocks, _, heads, dim = cache.shape
    torch.index_select(cache.view(num_blocks, -1), 0, blocks, out=out)
    return out.view(-1, heads, dim)


def _window_mask(q_pos: torch.Tensor, kv_len: int, window: int) -> torch.Tensor:
    """[..., kv_len] bool: key position p is seen from query position q when
    q - window < p <= q."""
    pos = torch.arange(kv_len, device=q_pos.device)
    q = q_pos.unsqueeze(-1)
    return (pos <= q) & (pos > q - window)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim], attending over the paged caches
    (only the last `window` positions, a query's own included, when given). A cache of
    another dtype than q (`--kv-cache-dtype`) is read as q's: the native kernels widen
    each row as they read it, the gather path converts what it gathered."""
    if meta.flex is not None:
        if window is not None:
            raise ValueError("the flex attention backend has no sliding-window mask; "
                             "this model's family runs on kernels 'torch' or 'native'")
        return flex_paged_attention(q.to(k_cache.dtype), k_cache, v_cache, meta.flex,
                                    scale).to(q.dtype)
    out = torch.empty_like(q)
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    b = meta.num_decodes
    decode_mask = meta.decode_mask
    if b and window is not None:
        # The native kernel reads every key up to the context length: a windowed layer's
        # decodes take the gather path with the window in the mask.
        width = meta.decode_blocks.shape[1] * k_cache.shape[1]
        decode_mask = _window_mask(meta.decode_lens - 1, width, window)[:, None, None, :]
    if b and meta.native is not None and window is None:
        out[:b] = meta.native.paged_decode_attention(
            q[:b], k_cache, v_cache, meta.decode_blocks, meta.decode_lens, scale)
    elif b:
        # One padded batch. The query heads sharing a KV head are laid out as that head's
        # `group` query rows, which is exact for a single query token and avoids GQA copies.
        blocks = meta.decode_blocks.view(-1)
        kb, vb = meta.buffers.get(blocks.shape[0], k_cache)
        k = _gather(k_cache, blocks, kb).view(b, -1, kv_heads, head_dim).transpose(1, 2)
        v = _gather(v_cache, blocks, vb).view(b, -1, kv_heads, head_dim).transpose(1, 2)
        k, v = k.to(q.dtype), v.to(q.dtype)
        qd = q[:b].view(b, kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=decode_mask, scale=scale)
        out[:b] = o.reshape(b, kv_heads * group, head_dim)
    native_prefill = (meta.native is not None and window is None and head_dim in (64, 128)
                      and q.dtype == torch.float32
                      and getattr(meta.native, "vector_bits", 0) >= NATIVE_PREFILL_BITS)
    for span in meta.prefills:
        if native_prefill:
            out[span.q_start:span.q_start + span.q_len] = meta.native.paged_prefill_attention(
                q[span.q_start:span.q_start + span.q_len], k_cache, v_cache, span.blocks,
                span.ctx_len - span.q_len, scale)
            continue
        kb, vb = meta.buffers.get(span.blocks.shape[0], k_cache)
        k = _gather(k_cache, span.blocks, kb)[:span.ctx_len].transpose(0, 1).unsqueeze(0)
        v = _gather(v_cache, span.blocks, vb)[:span.ctx_len].transpose(0, 1).unsqueeze(0)
        k, v = k.to(q.dtype), v.to(q.dtype)
        qp = q[span.q_start:span.q_start + span.q_len].transpose(0, 1).unsqueeze(0)
        mask = span.mask
        if window is not None and span.ctx_len > window:
            q_pos = torch.arange(span.ctx_len - span.q_len, span.ctx_len, device=q.device)
            mask = _window_mask(q_pos, span.ctx_len, window)
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask,
                                           is_causal=mask is None, scale=scale,
                                           enable_gqa=group > 1)
        out[span.q_start:span.q_start + span.q_len] = o[0].transpose(0, 1)
    return out
