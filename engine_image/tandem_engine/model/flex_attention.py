"""Paged attention with torch's `flex_attention`: reads the KV pool in place, no gather.

The attention backend for CUDA (`kernels="flex"`, and what `auto` picks there); it runs
on CPU too (compiled to inductor's C++ template), which is how it is tested here.

Each layer's pool `[num_blocks, block_size, kv_heads, head_dim]` is viewed, without a
copy, as one long key sequence of `num_blocks * block_size` tokens. A step's sequences
are a batch: the decodes (one query each) in one call, the prefill chunks (queries padded
to the longest chunk) in another. The block mask's KV tile is one KV block, so each
tile's list of KV tiles *is* the request's block table: the kernel reads exactly those
blocks. Tiles wholly before a query tile's first position are "full" (no mask evaluated);
the rest are partial, and `mask_mod` keeps a key when its block is really this
sequence's block at that logical index and its position is not after the query's.

A physical block shared by several requests (a prefix-cache hit) always sits at the same
logical index in each of them: its hash chains from the sequence's first token. So
`block_logical` (physical block -> logical index) is one table for the whole step;
`FlexPagedAttention.prepare` checks it and refuses a step that breaks it.

The mask's tensors are persistent buffers written in place each step, so one `mask_mod`
serves every step (no recompilation for a new closure) and their addresses are stable
(CUDA graphs can replay over them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_TILE = 128  # query rows per block-mask tile (flex's default sparse block size)


@dataclass
class FlexBatch:
    """One flex_attention call of a step: the block mask and where its queries sit."""

    block_mask: BlockMask
    rows: list[tuple[int, int]]  # (first row in the step's token layout, q_len) per sequence
    q_len: int  # padded query length of the batch


class MaskBlocks(NamedTuple):
    """A block mask's tile lists, [batch, 1, query tiles(, width)] int32 each."""

    kv_num: torch.Tensor  # partial KV tiles per query tile
    kv_idx: torch.Tensor  # their block ids
    full_num: torch.Tensor  # full KV tiles per query tile
    full_idx: torch.Tensor


@dataclass
class FlexStep:
    """The flex calls of one step: decodes (queries 1 each), then prefill chunks."""

    decodes: FlexBatch | None
    prefills: FlexBatch | None
    attend: Callable[..., torch.Tensor]  # flex_attention, compiled
    options: dict[str, int]  # its kernel options (`kernel_options`)


def kernel_options(block_size: int, device: torch.device) -> dict[str, int]:
    """flex_attention's kernel options for a pool of `block_size`-token blocks.

    On CUDA, Triton's key tile (BLOCK_N) must divide the block mask's KV tile (one KV
    block), and Triton's matrix products want it a multiple of 16: the largest of 128,
    64, 32, 16 that divides the block size. The CPU template needs nothing."""
    if device.type != "cuda":
        return {}
    tile = next((t for t in (128, 64, 32, 16) if block_size % t == 0), None)
    if tile is None:
        raise ValueError(f"kernels='flex' on CUDA needs block_size to be a multiple of 16, "
                         f"not {block_size}: use --block-size 16 (or 32, 64, ...), or "
                         "kernels='torch'")
    return {"BLOCK_N": tile}


def plan_tiles(start: int, q_len: int, block_size: int, num_tiles: int,
               q_tile: int) -> list[tuple[int, int, int]]:
    """(full blocks, first partial block, partial blocks) for each query tile of one
    sequence whose queries are positions start .. start + q_len - 1.

    Blocks whose every key is at or before the tile's first query position are full;
    the blocks up to the tile's last query position are partial. A tile past the
    sequence's queries reads nothing."""
    tiles = []
    for t in range(num_tiles):
        if t * q_tile >= q_len:
            tiles.append((0, 0, 0))
            continue
        first = start + t * q_tile
        last = start + min((t + 1) * q_tile, q_len) - 1
        full = (first + 1) // block_size
        tiles.append((full, full, last // block_size - full + 1))
    return tiles


class _MaskTables:
    """The per-step tables `mask_mod` reads, preallocated for the largest batch."""

    def __init__(self, max_seqs: int, width: int, num_blocks: int, block_size: int,
                 device: torch.device) -> None:
        self.tables = torch.zeros(max_seqs, width, dtype=torch.int32, device=device)
        self.q_start = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.block_logical = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        tables, q_start, block_logical = self.tables, self.q_start, self.block_logical

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                     kv_idx: torch.Tensor) -> torch.Tensor:
            block = kv_idx // block_size
            logical = block_logical[block]
            index = logical.clamp(min=0)
            mine = (logical >= 0) & (tables[b, index] == block)
            return mine & (index * block_size + kv_idx % block_size <= q_start[b] + q_idx)

        self.mask_mod = mask_mod


class FlexPagedAttention:
    """The flex backend of one runner: its compiled kernel and its mask buffers."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, max_seqs: int,
                 device: torch.device, compile: bool = True) -> None:
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        self.options = kernel_options(block_size, device)
        # Every row of the block mask lists at most one sequence's blocks. Inductor's CPU
        # template also wants the rows to span the whole key sequence (the pool).
        self.width = -(-max_model_len // block_size)
        if device.type == "cpu":
            self.width = max(self.width, num_blocks)
        self._decode = _MaskTables(max_seqs, self.width, num_blocks, block_size, device)
        self._prefill = _MaskTables(max_seqs, self.width, num_blocks, block_size, device)
        self._attend = torch.compile(flex_attention) if compile else flex_attention

    def prepare(self, decode_tables: list[list[int]], decode_ctx_lens: list[int],
                prefill_specs: list[tuple[int, int, list[int]]]) -> FlexStep:
        """Block masks for a step laid out decodes first, then prefill chunks
        ((start position, q_len, block table) each)."""
        decodes = [(n - 1, 1, t) for t, n in zip(decode_tables, decode_ctx_lens, strict=True)]
        block_logical = self._block_logical(decodes + prefill_specs)
        self._decode.block_logical.copy_(block_logical)
        self._prefill.block_logical.copy_(block_logical)
        first_prefill_row = len(decodes)
        return FlexStep(
            decodes=self._batch(self._decode, decodes, 0) if decodes else None,
            prefills=(self._batch(self._prefill, prefill_specs, first_prefill_row)
                      if prefill_specs else None),
            attend=self._attend, options=self.options)

    def _block_logical(self, seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        table = np.full(self.num_blocks, -1, dtype=np.int32)
        for start, q_len, blocks in seqs:
            ids = np.asarray(blocks[:-(-(start + q_len) // self.block_size)], dtype=np.int64)
            logical = np.arange(len(ids), dtype=np.int32)
            known = table[ids]
            clash = (known != -1) & (known != logical)
            if clash.any():
                j = int(np.argmax(clash))
                raise RuntimeError(
                    f"KV block {ids[j]} is logical block {known[j]} of one request and {j} "
                    "of another in the same step; flex attention needs a shared block at "
                    "one position (use kernels='torch')")
            table[ids] = logical
        return torch.from_numpy(table)

    def _batch(self, mask: _MaskTables, seqs: list[tuple[int, int, list[int]]],
               first_row: int, into: MaskBlocks | None = None) -> FlexBatch:
        """The block mask of one call over `seqs`; with `into` (a CUDA graph's static
        tensors, sized for exactly these sequences) the mask's tensors are written there."""
        bs, width = self.block_size, self.width
        q_len = max(n for _, n, _ in seqs)
        if q_len > 1:  # prefill queries: pad to whole tiles
            q_len = -(-q_len // Q_TILE) * Q_TILE
        num_tiles = -(-q_len // Q_TILE)
        b = len(seqs)
        tables = torch.zeros(b, width, dtype=torch.int32)
        host = MaskBlocks(*(torch.zeros(b, 1, num_tiles, *extra, dtype=torch.int32)
                            for extra in ((), (width,), (), (width,))))
        rows = []
        for i, (start, n, blocks) in enumerate(seqs):
            used = blocks[:-(-(start + n) // bs)]
            if len(used) > width:
                raise ValueError(f"a sequence of {start + n} tokens needs {len(used)} KV "
                                 f"blocks; the flex backend was sized for {width}")
            row = torch.tensor(used, dtype=torch.int32)
            tables[i, :len(used)] = row
            for t, (full, first, partial) in enumerate(
                    plan_tiles(start, n, bs, num_tiles, Q_TILE)):
                host.full_num[i, 0, t] = full
                host.full_idx[i, 0, t, :full] = row[:full]
                host.kv_num[i, 0, t] = partial
                host.kv_idx[i, 0, t, :partial] = row[first:first + partial]
            rows.append((first_row, n))
            first_row += n
        mask.tables[:b].copy_(tables)
        mask.q_start[:b].copy_(torch.tensor([s for s, _, _ in seqs], dtype=torch.int32))
        if into is None:
            blocks = MaskBlocks(*(t.to(self.device) for t in host))
        else:
            for dst, src in zip(into, host, strict=True):
                dst.copy_(src)
            blocks = into
        block_mask = BlockMask.from_kv_blocks(
            blocks.kv_num, blocks.kv_idx, blocks.full_num, blocks.full_idx,
            BLOCK_SIZE=(Q_TILE, bs), mask_mod=mask.mask_mod,
            seq_lengths=(q_len, self.num_blocks * bs), compute_q_blocks=False)
        return FlexBatch(block_mask, rows, q_len)

    def static_decodes(self, batch_size: int) -> MaskBlocks:
        """Device tensors for the block mask of `batch_size` decodes, for a CUDA graph to
        read at fixed addresses (`prepare_decodes_into` fills them)."""
        return MaskBlocks(*(torch.zeros(batch_size, 1, 1, *extra, dtype=torch.int32,
                                        device=self.device)
                            for extra in ((), (self.width,), (), (self.width,))))

    def prepare_decodes_into(self, into: MaskBlocks, decode_tables: list[list[int]],
                             decode_ctx_lens: list[int]) -> FlexStep:
        """`prepare` for a step of decodes only, its mask written into `into`."""
        decodes = [(n - 1, 1, t) for t, n in zip(decode_tables, decode_ctx_lens, strict=True)]
        self._decode.block_logical.copy_(self._block_logical(decodes))
        return FlexStep(self._batch(self._decode, decodes, 0, into), None, self._attend,
                        self.options)


def flex_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         step: FlexStep, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] laid out decodes first -> [T, heads, head_dim]."""
    out = torch.empty_like(q)
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    # [1, kv_heads, num_blocks * block_size, head_dim]: a strided view of the pool.
    k = k_cache.view(1, num_blocks * block_size, kv_heads, head_dim).transpose(1, 2)
    v = v_cache.view(1, num_blocks * block_size, kv_heads, head_dim).transpose(1, 2)
    gqa = q.shape[1] != kv_heads
    if step.decodes is not None:
        b = len(step.decodes.rows)
        o = step.attend(q[:b].unsqueeze(2), k, v, block_mask=step.decodes.block_mask,
                        scale=scale, enable_gqa=gqa, kernel_options=step.options or None)
        out[:b] = o[:, :, 0]
    if step.prefills is not None:
        batch = step.prefills
        qp = q.new_zeros(len(batch.rows), batch.q_len, q.shape[1], head_dim)
        for i, (row, n) in enumerate(batch.rows):
            qp[i, :n] = q[row:row + n]
        o = step.attend(qp.transpose(1, 2), k, v, block_mask=batch.block_mask, scale=scale,
                        enable_gqa=gqa, kernel_options=step.options or None)
        for i, (row, n) in enumerate(batch.rows):
            out[row:row + n] = o[i, :, :n].transpose(0, 1)
    return out
