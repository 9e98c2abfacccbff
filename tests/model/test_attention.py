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
@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16)])  # --kv-cache-dtype
def test_paged_attention_equals_dense_attention(backend: str, dtype: torch.dtype,
                                                cache_dtype: torch.dtype) -> None:
    """Against attention over the cache's own values: a 16-bit cache under float32 queries
    loses only the rounding of what is stored (its reads are widened exactly)."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, num_blocks = 6, 2, 16, 64
    k_cache = torch.zeros(num_blocks, BLOCK, kv_heads, dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    # Three decodes with ragged contexts, then two prefill chunks (one with a cached prefix).
    contexts = [(9, 1), (1, 1), (22, 1), (7, 7), (13, 5)]  # (context length, new tokens)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, seqs = [], []
    for ctx, _ in contexts:
        tables.append([free.pop() for _ in range(-(-ctx // BLOCK))])
        seqs.append((torch.randn(ctx, kv_heads, dim, generator=g).to(cache_dtype),
                     torch.randn(ctx, kv_heads, dim, generator=g).to(cache_dtype)))
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
    assert out.dtype == dtype
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


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim,block", [
    (9, 3, 64, 16),   # SmolLM2's shape
    (8, 2, 128, 4),
    (4, 4, 64, 5),    # no GQA, a block size that splits the 16-query tiles
])
def test_native_prefill_chunks_equal_dense_attention(heads, kv_heads, dim, block,
                                                     cache_dtype) -> None:
    """The native prefill kernel (float32 queries, head size 64 or 128, a float32, bf16 or
    f16 cache): chunks from the start of a prompt and after a cached prefix, of lengths
    that end mid-tile and mid-block; and the decode kernel's row for each last position
    (its vector path: head size 64 or 128)."""
    g = torch.Generator().manual_seed(1)
    num_blocks = 160
    k_cache = torch.zeros(num_blocks, block, kv_heads, dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    contexts = [(70, 37), (33, 33), (130, 1), (300, 45)]
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, seqs = [], []
    for ctx, _ in contexts:
        tables.append([free.pop() for _ in range(-(-ctx // block))])
        keys, values = torch.randn(2, ctx, kv_heads, dim, generator=g).to(cache_dtype).float()
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
        decode = paged_decode_kernel().paged_decode_attention(
            q[-1:], k_cache, v_cache, torch.tensor([table]), torch.tensor([ctx]), dim ** -0.5)
        for got in (out[row:row + len(q)], direct, decode):
            want = expected[-len(got):]
            assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        row += len(q)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_cache_value_is_read_as_torch_widens_it(cache_dtype) -> None:
    """All 65,536 bit patterns as one-position contexts: attention over one position is
    its value, so the kernel's output is its widening of each pattern (vector and scalar
    paths: head sizes 64 and 24), equal to torch's (subnormals and infinities included;
    -0 comes out +0, the sum starting from it), NaNs read as NaNs."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = patterns.view(cache_dtype)
    native = paged_decode_kernel()
    for dim in (64, 24):
        rows = -(-values.numel() // dim)
        v_cache = torch.zeros(rows * dim, dtype=cache_dtype)
        v_cache[:values.numel()] = values
        v_cache = v_cache.view(rows, 1, 1, dim)
        k_cache = torch.zeros_like(v_cache)
        out = native.paged_decode_attention(
            torch.zeros(rows, 1, dim), k_cache, v_cache, torch.arange(rows).view(rows, 1),
            torch.ones(rows, dtype=torch.long), 1.0).reshape(-1)
        want = v_cache.reshape(-1).float()
        nan = want.isnan()
        assert torch.equal(out.isnan(), nan)
        assert torch.equal(out[~nan], want[~nan])


def test_native_prefill_refuses_a_block_table_shorter_than_the_context() -> None:
    k_cache = torch.zeros(4, 16, 1, 64)
    with pytest.raises(RuntimeError, match="block table must cover 40 positions"):
        paged_decode_kernel().paged_prefill_attention(
            torch.zeros(8, 1, 64), k_cache, k_cache.clone(), torch.tensor([0, 1]), 32, 0.125)
