"""Attention over the paged KV cache: the one kernel a fused GPU kernel would replace.

Tokens of a step are laid out decodes first (one query token each), then prefill
chunks. The KV of every request lives in fixed-size blocks scattered through one
preallocated pool; `AttentionMetadata` says where each request's keys live (slot
indices = block_id * block_size + offset). On CPU we gather those slots and call
`scaled_dot_product_attention`: decodes as one padded batch, each prefill chunk on
its own with a causal mask offset by the context already cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    q_start: int  # first row in the step's token layout
    q_len: int
    ctx_len: int  # tokens of KV the queries see, including their own
    slots: torch.Tensor  # [ctx_len] slot indices of the request's KV, in position order
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when plain causal (no cached prefix)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int
    decode_slots: torch.Tensor | None  # [B, L] slot indices, padded
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] bool, True = attend
    prefills: list[PrefillSpan]


def build_metadata(
    decode_tables: list[list[int]],
    decode_ctx_lens: list[int],
    prefill_specs: list[tuple[int, int, list[int]]],
    slot_mapping: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Turn block tables into slot indices with a handful of tensor ops.

    prefill_specs: (start position, q_len, block table) per prefill chunk."""
    num_decodes = len(decode_tables)
    decode_slots = decode_mask = None
    if num_decodes:
        width = max(len(t) for t in decode_tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables],
                             dtype=torch.long, device=device)
        lens = torch.tensor(decode_ctx_lens, dtype=torch.long, device=device)
        pos = torch.arange(int(max(decode_ctx_lens)), device=device)
        decode_slots = table[:, pos // block_size] * block_size + pos % block_size
        decode_mask = (pos[None, :] < lens[:, None])[:, None, None, :]
    prefills = []
    q_start = num_decodes
    for start, q_len, blocks in prefill_specs:
        ctx_len = start + q_len
        pos = torch.arange(ctx_len, device=device)
        table = torch.tensor(blocks, dtype=torch.long, device=device)
        slots = table[pos // block_size] * block_size + pos % block_size
        mask = None
        if start:
            q_pos = torch.arange(start, ctx_len, device=device)
            mask = pos[None, :] <= q_pos[:, None]
        prefills.append(PrefillSpan(q_start, q_len, ctx_len, slots, mask))
        q_start += q_len
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        num_decodes=num_decodes,
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        prefills=prefills,
    )


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values ([T, kv_heads, head_dim]) in their slots."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim]; caches: [slots, kv_heads, head_dim] -> [T, heads, head_dim]."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[1]
    b = meta.num_decodes
    if b:
        slots = meta.decode_slots
        k = k_cache[slots].transpose(1, 2)  # [B, kv_heads, L, D]
        v = v_cache[slots].transpose(1, 2)
        qd = q[:b].unsqueeze(2)  # [B, heads, 1, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale,
                                           enable_gqa=gqa)
        out[:b] = o.squeeze(2)
    for span in meta.prefills:
        k = k_cache[span.slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, D]
        v = v_cache[span.slots].transpose(0, 1).unsqueeze(0)
        qp = q[span.q_start:span.q_start + span.q_len].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=span.mask,
                                           is_causal=span.mask is None, scale=scale,
                                           enable_gqa=gqa)
        out[span.q_start:span.q_start + span.q_len] = o[0].transpose(0, 1)
    return out
