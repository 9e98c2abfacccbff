"""Paged attention backends agree with plain dense attention over the same tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tandem_engine.model.attention import GatherBuffers, build_metadata, paged_attention, write_kv
from tandem_engine.model.native import paged_decode_kernel

BLOCK = 4


def _dense_reference(q, keys, values, scale):
    """Causal attention for the last len(q) positions of one sequence, no paging."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    n, ctx = q.shape[0], keys.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask,
                                          scale=scale).transpose(0, 1)


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_equals_dense_attention(backend: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, num_blocks = 6, 2, 16, 64
    k_cache = torch.zeros(num_blocks, BLOCK, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    # Three decodes with ragged contexts, then two prefill chunks (one with a cached prefix).
    contexts = [(9, 1), (1, 1), (22, 1), (7, 7), (13, 5)]  # (context length, new tokens)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, seqs = [], []
    for ctx, _ in contexts:
        tables.append([free.pop() for _ in range(-(-ctx // BLOCK))])
        seqs.append((torch.randn(ctx, kv_heads, dim, generator=g).to(dtype),
                     torch.randn(ctx, kv_heads, dim, generator=g).to(dtype)))
    for table, (keys, values) in zip(tables, seqs, strict=True):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(keys))])
        write_kv(k_cache, v_cache, keys, values, slots)
    native = paged_decode_kernel() if backend == "native" else None
    meta = build_metadata(
        decode_tables=tables[:3], decode_ctx_lens=[c for c, _ in contexts[:3]],
        prefill_specs=[(c - n, n, t) for (c, n), t in zip(contexts[3:], tables[3:], strict=True)],
        slot_mapping=[0], block_size=BLOCK, device=torch.device("cpu"),
        buffers=GatherBuffers(), native=native)
    q_parts = [torch.randn(n, heads, dim, generator=g).to(dtype) for _, n in contexts]
    out = paged_attention(torch.cat(q_parts), k_cache, v_cache, meta, scale=0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    row = 0
    for q, (keys, values) in zip(q_parts, seqs, strict=True):
        expected = _dense_reference(q.float(), keys.float(), values.float(), 0.3)
        got = out[row:row + len(q)].float()
        assert torch.allclose(got, expected, atol=tol), (got - expected).abs().max()
        row += len(q)


def test_a_build_lock_left_by_a_killed_build_does_not_block_the_next_load() -> None:
    """torch's build lock survives a build killed midway; the next engine must not wait
    on it forever (it did: engines never became ready)."""
    import fcntl
    import subprocess
    import sys
    from pathlib import Path

    from tandem_engine.model import native

    paged_decode_kernel()  # built (or loaded) once, so the folder exists
    build_dir = next(Path(m.__file__).parent for m in [native._module])
    with open(build_dir / "tandem-build.flock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # nobody builds while the stale lock is made
        (build_dir / "lock").write_text("")
        fcntl.flock(guard, fcntl.LOCK_UN)
    done = subprocess.run(
        [sys.executable, "-c", "from tandem_engine.model.native import paged_decode_kernel;"
                               "paged_decode_kernel(); print('loaded')"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr
    assert not (build_dir / "lock").exists()


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block"), [
    (9, 3, 64, 16),   # SmolLM2's shape
    (8, 2, 128, 4),
    (4, 4, 64, 5),    # no GQA, a block size that splits the 16-query tiles
])
def test_native_prefill_chunks_equal_dense_attention(heads, kv_heads, dim, block) -> None:
    """The native prefill kernel (float32, head size 64 or 128): chunks from the start of
    a prompt and after a cached prefix, of lengths that end mid-tile and mid-block."""
    g = torch.Generator().manual_seed(1)
    num_blocks = 160
    k_cache = torch.zeros(num_blocks, block, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    contexts = [(70, 37), (33, 33), (130, 1), (300, 45)]
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, seqs = [], []
    for ctx, _ in contexts:
        tables.append([free.pop() for _ in range(-(-ctx // block))])
        keys, values = torch.randn(2, ctx, kv_heads, dim, generator=g)
        seqs.append((keys, values))
        slots = torch.tensor([tables[-1][p // block] * block + p % block for p in range(ctx)])
        write_kv(k_cache, v_cache, keys, values, slots)
    meta = build_metadata(
        decode_tables=[], decode_ctx_lens=[],
        prefill_specs=[(c - n, n, t) for (c, n), t in zip(contexts, tables, strict=True)],
        slot_mapping=[0], block_size=block, device=torch.device("cpu"),
        buffers=GatherBuffers(), native=paged_decode_kernel())
    q_parts = [torch.randn(n, heads, dim, generator=g) for _, n in contexts]
    out = paged_attention(torch.cat(q_parts), k_cache, v_cache, meta, scale=dim ** -0.5)
    row = 0
    for q, (keys, values), (ctx, n), table in zip(q_parts, seqs, contexts, tables, strict=True):
        expected = _dense_reference(q, keys, values, dim ** -0.5)
        # The kernel itself (paged_attention takes it where its build has wide vectors).
        direct = paged_decode_kernel().paged_prefill_attention(
            q, k_cache, v_cache, torch.tensor(table), ctx - n, dim ** -0.5)
        for got in (out[row:row + len(q)], direct):
            assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
        row += len(q)


def test_native_prefill_refuses_a_block_table_shorter_than_the_context() -> None:
    k_cache = torch.zeros(4, 16, 1, 64)
    with pytest.raises(RuntimeError, match="block table must cover 40 positions"):
        paged_decode_kernel().paged_prefill_attention(
            torch.zeros(8, 1, 64), k_cache, k_cache.clone(), torch.tensor([0, 1]), 32, 0.125)
