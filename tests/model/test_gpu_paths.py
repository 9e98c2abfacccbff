"""The GPU execution path's device-agnostic parts, run on the CPU.

* flex attention (`model/flex_attention.py`, the CUDA attention backend) against the
  torch gather path and transformers;
* suspend offload / resume and the streaming (low-memory) refit;
* the KV handoff's geometry covering the device type;
* CUDA-graph batch buckets: choice, padding and slicing.

What only CUDA can run (Triton kernels, graph capture, pinned memory, VRAM
registration) is not exercised here; these tests pin down the logic around it.
"""

from __future__ import annotations

import pytest
import torch
from reference import assert_matches, hf_greedy, random_prompts
from tandem_engine import LLM, SamplingParams
from tandem_engine.model.attention import GatherBuffers, build_metadata, paged_attention, write_kv
from tandem_engine.model.flex_attention import FlexPagedAttention, plan_tiles

BLOCK = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


# ---- flex attention --------------------------------------------------------------------------


def test_plan_tiles_splits_full_and_partial_blocks() -> None:
    # Queries at positions 10..13 with 4-token blocks: blocks 0-1 (keys 0..7) are wholly
    # before position 10, blocks 2-3 hold the rest up to the last query.
    assert plan_tiles(10, 4, 4, 1, 128) == [(2, 2, 2)]
    # A decode at position 7 sees both of its blocks whole; at position 8 the third
    # block (keys 8..11) is partial.
    assert plan_tiles(7, 1, 4, 1, 128) == [(2, 2, 0)]
    assert plan_tiles(8, 1, 4, 1, 128) == [(2, 2, 1)]
    # Two query tiles of 4 rows for 6 queries at 0..5, a third tile past them reads nothing.
    assert plan_tiles(0, 6, 4, 3, 4) == [(0, 0, 1), (1, 1, 1), (0, 0, 0)]


def _paged_step(dtype: torch.dtype, shared_prefix: bool):
    """A pool holding 3 decodes with ragged contexts and 3 prefill chunks (two with a
    cached prefix); with `shared_prefix` the first two requests share their first block."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, num_blocks = 6, 2, 16, 80
    k_cache = torch.zeros(num_blocks, BLOCK, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    # (context length, new tokens); the last chunk spans two query tiles of the mask.
    contexts = [(9, 1), (6, 1), (22, 1), (7, 7), (13, 5), (160, 150)]
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-ctx // BLOCK))] for ctx, _ in contexts]
    keys = [torch.randn(ctx, kv_heads, dim, generator=g).to(dtype) for ctx, _ in contexts]
    values = [torch.randn(ctx, kv_heads, dim, generator=g).to(dtype) for ctx, _ in contexts]
    if shared_prefix:
        tables[1][0] = tables[0][0]
        keys[1][:BLOCK], values[1][:BLOCK] = keys[0][:BLOCK], values[0][:BLOCK]
    for table, k, v in zip(tables, keys, values, strict=True):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(k))])
        write_kv(k_cache, v_cache, k, v, slots)
    q = torch.randn(sum(n for _, n in contexts), heads, dim, generator=g).to(dtype)
    decodes = (tables[:3], [c for c, _ in contexts[:3]])
    prefills = [(c - n, n, t) for (c, n), t in zip(contexts[3:], tables[3:], strict=True)]
    return q, k_cache, v_cache, decodes, prefills, num_blocks


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared_prefix", [False, True])
def test_flex_attention_equals_the_gather_path(dtype: torch.dtype, shared_prefix: bool) -> None:
    q, k_cache, v_cache, (d_tables, d_lens), prefills, num_blocks = _paged_step(
        dtype, shared_prefix)
    meta = build_metadata(d_tables, d_lens, prefills, slot_mapping=[0], block_size=BLOCK,
                          device=torch.device("cpu"), buffers=GatherBuffers())
    expected = paged_attention(q, k_cache, v_cache, meta, scale=0.3)
    flex = FlexPagedAttention(num_blocks, BLOCK, max_model_len=64, max_seqs=8,
                              device=torch.device("cpu"), compile=False)
    meta.flex = flex.prepare(d_tables, d_lens, prefills)
    # Each decode's mask lists exactly its blocks, in order: full ones, then the partial.
    mask = meta.flex.decodes.block_mask
    for i, (table, ctx) in enumerate(zip(d_tables, d_lens, strict=True)):
        full, part = int(mask.full_kv_num_blocks[i, 0, 0]), int(mask.kv_num_blocks[i, 0, 0])
        listed = (mask.full_kv_indices[i, 0, 0, :full].tolist()
                  + mask.kv_indices[i, 0, 0, :part].tolist())
        assert listed == table[:-(-ctx // BLOCK)]
    got = paged_attention(q, k_cache, v_cache, meta, scale=0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), expected.float(), atol=tol), (
        got.float() - expected.float()).abs().max()


def test_flex_refuses_a_block_at_two_logical_positions() -> None:
    flex = FlexPagedAttention(16, BLOCK, max_model_len=64, max_seqs=4,
                              device=torch.device("cpu"), compile=False)
    with pytest.raises(RuntimeError, match="KV block 3 is logical block 0 of one request"):
        flex.prepare([[3, 5], [7, 3]], [6, 8], [])


@pytest.mark.slow
def test_flex_engine_matches_transformers_and_the_torch_path(tiny_llama) -> None:
    """The compiled kernel (inductor's CPU template here, Triton on CUDA) through the
    whole engine: chunked prefill over the chunks already cached, then decodes. Slow: the
    first compile of each shape costs ~20 s of inductor on CPU (cached afterwards)."""
    prompts = random_prompts(2048, [37], seed=3)
    flex = LLM(tiny_llama, kernels="flex", max_num_batched_tokens=32)
    assert flex.engine.runner.kernels == "flex"
    outs = flex.generate(prompts, GREEDY)
    torch_outs = LLM(tiny_llama, kernels="torch", max_num_batched_tokens=32).generate(
        prompts, GREEDY)
    for prompt, out, ref in zip(prompts, outs, torch_outs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert_matches(hf_greedy(tiny_llama, tuple(prompt), GREEDY.max_tokens),
                       out.outputs[0].token_ids)


# ---- suspend offload and the streaming refit ------------------------------------------------


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory: pytest.TempPathFactory):
    """Same architecture and shape as tiny_llama, different weights (seed 1)."""
    from tandem_engine.cli.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("llama-seed1"), arch="llama", seed=1)


def _refit(llm: LLM, weights, low_memory: bool) -> None:
    llm.engine.pause()
    assert llm.engine.refit(weights, version="v2", low_memory=low_memory) == 1
    llm.engine.unpause()


def _greedy_tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_streamed_refit_equals_the_refit_built_beside(tiny_llama, new_weights) -> None:
    prompts = random_prompts(2048, [9, 30], seed=5)
    beside, streamed = LLM(tiny_llama, kernels="torch"), LLM(tiny_llama, kernels="torch")
    weight_bytes = beside.engine.runner.last_refit_peak_bytes  # the start's load: 1x
    params = {n: p.data_ptr() for n, p in streamed.engine.runner.model.named_parameters()}
    _refit(beside, new_weights, low_memory=False)
    _refit(streamed, new_weights, low_memory=True)
    assert beside.engine.runner.last_refit_peak_bytes == 2 * weight_bytes
    assert streamed.engine.runner.last_refit_peak_bytes == weight_bytes
    # Streamed in place: the same tensors (captured CUDA graphs stay valid), new values.
    assert {n: p.data_ptr() for n, p in streamed.engine.runner.model.named_parameters()
            } == params
    for (name, a), (_, b) in zip(beside.engine.runner.model.state_dict().items(),
                                 streamed.engine.runner.model.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    fresh = _greedy_tokens(LLM(new_weights, kernels="torch"), prompts)
    assert _greedy_tokens(beside, prompts) == fresh == _greedy_tokens(streamed, prompts)


def test_streamed_refit_repacks_packed_projections(tiny_llama, new_weights) -> None:
    """The CPU engine's oneDNN-packed projections (kernels auto/native) are repacked one
    at a time from the new weights."""
    from tandem_engine.model.layers import pack_linears, packing_supported

    if not packing_supported(torch.float32, torch.device("cpu")):
        pytest.skip("oneDNN weight packing is not available in this torch build")
    prompts = random_prompts(2048, [9, 30], seed=5)
    streamed, fresh = LLM(tiny_llama, kernels="torch"), LLM(new_weights, kernels="torch")
    for llm in (streamed, fresh):
        pack_linears(llm.engine.runner.model)
    _refit(streamed, new_weights, low_memory=True)
    assert _greedy_tokens(streamed, prompts) == _greedy_tokens(fresh, prompts)


def test_streamed_refit_checks_every_tensor_before_the_first_copy(tiny_llama) -> None:
    from tandem_engine.model.layers import stream_weights

    runner = LLM(tiny_llama, kernels="torch").engine.runner
    before = {n: t.clone() for n, t in runner.model.state_dict().items()}
    new = {n: torch.zeros_like(t) for n, t in before.items()}
    name = next(iter(new))
    new[name] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=f"checkpoint tensor '{name}' is"):
        stream_weights(runner.model, new, runner.dtype)
    assert all(torch.equal(before[n], t) for n, t in runner.model.state_dict().items())


def test_offload_and_restore_keep_the_pool_bytes(tiny_llama) -> None:
    runner = LLM(tiny_llama, kernels="torch", num_blocks=64).engine.runner
    assert runner.kv_cache is not None
    runner.kv_cache.normal_()
    saved = runner.kv_cache.clone()
    assert runner.offload_kv() == runner.kv_bytes and runner.kv_cache is None
    with pytest.raises(RuntimeError, match="already released"):
        runner.offload_kv()
    runner.restore_kv()
    assert torch.equal(runner.kv_cache, saved)
    with pytest.raises(RuntimeError, match="restore_kv without offload_kv"):
        runner.restore_kv()


# ---- the KV handoff's geometry covers the device type -----------------------------------------


def test_geometry_has_the_pool_device_type() -> None:
    from tandem_engine.transfer import KVGeometry

    pool = torch.zeros(2, 2, 5, 16, 2, 8)
    cpu = KVGeometry.of_tensor(pool)
    assert cpu.device_type == "cpu" and "on cpu" in cpu.describe()
    gpu = KVGeometry(2, 9, 16, 2, 8, "float32", "cuda")
    why = cpu.incompatibility(gpu)
    assert why is not None and "device_type is 'cpu' here but 'cuda' on the peer" in why
    assert gpu.incompatibility(KVGeometry(2, 3, 16, 2, 8, "float32", "cuda")) is None
    assert KVGeometry.from_dict(gpu.to_dict()) == gpu
    with pytest.raises(ValueError, match="device_type='tpu' is not a KV pool device"):
        KVGeometry(2, 9, 16, 2, 8, "float32", "tpu")


def test_nixl_wheel_follows_torch_cuda_major() -> None:
    from tandem_engine.transfer.nixl import nixl_packages

    assert nixl_packages("13.0")[0] == "nixl_cu13"
    assert nixl_packages("12.8")[0] == "nixl_cu12"
    assert nixl_packages(None)[0] == "nixl_cu12"


def test_a_pull_from_a_pool_on_another_device_type_recomputes(tiny_llama, caplog) -> None:
    """A decode engine's pool in host memory cannot READ a GPU pool's blocks as laid out:
    the pull falls back, moves no byte, and says why in the geometry log line."""
    import dataclasses
    import logging

    pytest.importorskip("nixl_cu12")
    from tandem_engine import protocol as p
    from tandem_engine.server.handoff import KVHandoff
    from tandem_engine.transfer import KVGeometry, NixlBackend

    prompt = random_prompts(2048, [37], seed=63)[0]
    expected = LLM(tiny_llama, kernels="torch").generate([prompt], GREEDY)[0].outputs[0].token_ids
    engine = LLM(tiny_llama, kernels="torch", num_blocks=64).engine
    handoff = KVHandoff(engine, NixlBackend("dec-cpu"), pull_timeout=5, wake=lambda: None)
    gpu_pool = dataclasses.replace(KVGeometry.of_tensor(engine.kv_pool()), device_type="cuda")
    source = p.PullSource(p.KVTransferInfo("pre-gpu", b"never read", gpu_pool), "pin-1",
                          list(range(3)))
    plan = engine.add_pulled_request("r", prompt, GREEDY, [expected[0]])
    with caplog.at_level(logging.WARNING, logger="tandem_engine.server.handoff"):
        handoff.start_pull("r", source, plan)
        handoff.close()  # waits for the pull thread
    assert handoff.stats.failures == {"geometry": 1} and handoff.stats.bytes == 0
    line = next(r.getMessage() for r in caplog.records if "pull of" in r.getMessage())
    assert "(geometry)" in line and "device_type is 'cpu' here but 'cuda' on the peer" in line
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["r"] == expected


# ---- CUDA graphs: buckets, padding, slicing ----------------------------------------------------


def test_capture_sizes_and_bucket_choice() -> None:
    from tandem_engine.model.cuda_graphs import bucket_for, capture_sizes

    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    assert capture_sizes(1000)[-1] == 256
    sizes = capture_sizes(40)
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 33, 40)] == [1, 4, 8, 16, 40, 40]
    assert bucket_for(41, sizes) is None  # runs eagerly; admission never looks at buckets
    with pytest.raises(ValueError, match="at least one row"):
        bucket_for(0, sizes)


def test_padding_repeats_the_first_decode_and_slicing_drops_it() -> None:
    from tandem_engine.model.cuda_graphs import DecodeInputs

    step = DecodeInputs(input_ids=[11, 12, 13], positions=[4, 9, 2], slots=[36, 73, 2],
                        tables=[[9, 1], [3, 18, 7], [0]], ctx_lens=[5, 10, 3])
    padded = step.padded(5)
    assert len(padded) == 5
    assert padded.input_ids == [11, 12, 13, 11, 11] and padded.slots == [36, 73, 2, 36, 36]
    assert padded.tables[3:] == [[9, 1], [9, 1]] and padded.ctx_lens[3:] == [5, 5]
    assert step.padded(3) == step
    with pytest.raises(ValueError, match="cannot pad 3 rows to 2"):
        step.padded(2)


def test_graphs_are_off_on_cpu(tiny_llama) -> None:
    runner = LLM(tiny_llama, kernels="flex").engine.runner
    assert runner.kernels == "flex" and runner.graphs is None


def test_flex_kernel_options_fit_the_block_size() -> None:
    from tandem_engine.model.flex_attention import kernel_options

    cuda = torch.device("cuda")
    assert kernel_options(16, torch.device("cpu")) == {}
    assert [kernel_options(b, cuda)["BLOCK_N"] for b in (16, 48, 64, 256)] == [16, 16, 64, 128]
    with pytest.raises(ValueError, match="block_size to be a multiple of 16, not 8"):
        kernel_options(8, cuda)
    # `auto` is flex on CUDA when the block size suits it, the gather path otherwise.
    from tandem_engine.model.runner import uses_flex

    cpu = torch.device("cpu")
    assert uses_flex("auto", cuda, 16) and not uses_flex("auto", cuda, 8)
    assert not uses_flex("auto", cpu, 16) and not uses_flex("torch", cuda, 16)
    assert uses_flex("flex", cpu, 8)  # the CPU template takes any block size
