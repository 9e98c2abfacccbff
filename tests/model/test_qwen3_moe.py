"""Qwen3-MoE through the model-family seam: greedy tokens and logprobs equal transformers'
on tiny random checkpoints (4 experts, 2 per token, q/k norms) through `LLM` with chunked
prefill and preemption, through the router and the disaggregated path; checkpoints as
transformers' save_pretrained writes them (experts one by one, `num_local_experts`, a
dense layer by `mlp_only_layers`); the stacked experts and an in-place refit through
them; and GGUF files as llama.cpp's converter writes them (`qwen3moe`, experts stacked
into `ffn_*_exps`)."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as QType
from reference import (
    LOGPROB_TOL,
    assert_matches,
    assert_outputs_match,
    hf_greedy,
    hf_prompt_logprobs,
    random_prompts,
)
from safetensors.torch import load_file
from tandem_engine import LLM, SamplingParams
from tandem_engine.cli.main import build_parser
from tandem_engine.errors import CheckpointError
from tandem_engine.model.checkpoint import load_checkpoint
from tandem_engine.model.family import ModelConfig, family_named
from tandem_engine.model.qwen3_moe import SparseMoE, _grouped_linear
from tandem_engine.model.runner import uses_flex

transformers = pytest.importorskip("transformers")

MAX_NEW = 24
LENGTHS = [3, 17, 40, 70]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem_engine.cli.demo_model import write_demo_model

    torch.set_num_threads(1)
    return write_demo_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), arch="qwen3_moe")


# ---- LLM against transformers --------------------------------------------------------------

@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_chunked_prefill_matches_transformers(tiny_moe: Path, kernels: str) -> None:
    prompts = random_prompts(2048, LENGTHS, seed=1)
    llm = LLM(tiny_moe, max_num_batched_tokens=8, kernels=kernels)
    assert llm.engine.runner.kernels == kernels
    assert_outputs_match(tiny_moe, prompts, llm.generate(prompts, GREEDY), MAX_NEW)


def test_preemption_by_recompute_matches_transformers(tiny_moe: Path) -> None:
    prompts = random_prompts(2048, LENGTHS, seed=2)
    # 12 blocks x 16 = 192 token slots for ~230 tokens of prompts + outputs.
    llm = LLM(tiny_moe, num_blocks=12, max_num_batched_tokens=32)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.num_preemptions > 0
    assert_outputs_match(tiny_moe, prompts, outputs, MAX_NEW)


def test_every_expert_is_used_and_routing_matters(tiny_moe: Path, tmp_path: Path) -> None:
    # The comparisons above exercise the routing: the tokens spread over all experts,
    # and the same weights with only the top-1 expert give other tokens.
    config = ModelConfig.from_dir(tiny_moe)
    _, tensors = load_checkpoint(tiny_moe)
    x = torch.randn(200, config.hidden_size, generator=torch.Generator().manual_seed(0))
    router = tensors["model.layers.0.mlp.gate.weight"]
    assert set(torch.topk(x @ router.T, 2).indices.flatten().tolist()) == {0, 1, 2, 3}
    folder = tmp_path / "top-1"
    shutil.copytree(tiny_moe, folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "num_experts_per_tok": 1}))
    prompt = random_prompts(2048, [40], seed=3)[0]
    ours = LLM(folder).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert_matches(hf_greedy(folder, tuple(prompt), MAX_NEW), ours)
    assert ours != list(hf_greedy(tiny_moe, tuple(prompt), MAX_NEW).tokens)


# ---- the stacked experts ----------------------------------------------------------------

def test_experts_are_stacked_and_a_low_memory_refit_writes_through(
        tiny_moe: Path, tmp_path: Path) -> None:
    from tandem_engine.cli.demo_model import write_demo_model

    llm = LLM(tiny_moe, max_num_batched_tokens=64)
    moe = llm.engine.runner.model.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and moe.gate_up is not None and moe.down is not None
    assert moe.gate_up.shape == (4, 2 * 48, 64) and moe.down.shape == (4, 64, 48)
    # Each expert's parameters are views into the stacks, under the checkpoint's names.
    expert = moe.experts[2]
    assert expert.up_proj.weight.data_ptr() == moe.gate_up[2, 48:].data_ptr()
    assert expert.down_proj.weight.data_ptr() == moe.down[2].data_ptr()
    stacks = (moe.gate_up.data_ptr(), moe.down.data_ptr())
    # A refit that streams the tensors in place writes through the views.
    other = write_demo_model(tmp_path / "seed1", arch="qwen3_moe", seed=1)
    llm.pause()
    llm.engine.refit(other, low_memory=True)
    llm.unpause()
    assert (moe.gate_up.data_ptr(), moe.down.data_ptr()) == stacks
    assert torch.equal(moe.down[2], load_file(other / "model.safetensors")[
        "model.layers.0.mlp.experts.2.down_proj.weight"])
    prompts = random_prompts(2048, [17, 40], seed=4)
    assert_outputs_match(other, prompts, llm.generate(prompts, GREEDY), MAX_NEW)


def test_grouped_matmul_equals_one_matmul_per_expert() -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 12, 8, generator=g)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 8, generator=g)
    want = torch.cat([x[:3] @ weight[0].T, x[3:8] @ weight[2].T, x[8:] @ weight[3].T])
    assert torch.equal(_grouped_linear(x, weight, counts), want)
    # rows of 7 floats (28 bytes) are not aligned for the grouped kernel: the loop runs
    odd = torch.randn(4, 12, 7, generator=g)
    y = torch.randn(10, 7, generator=g)
    want = torch.cat([y[:3] @ odd[0].T, y[3:8] @ odd[2].T, y[8:] @ odd[3].T])
    assert torch.equal(_grouped_linear(y, odd, counts), want)


# ---- checkpoints as transformers saves them ------------------------------------------------

def _hf_saved(folder: Path, tokenizer_from: Path, **overrides) -> Path:
    """A random Qwen3-MoE written by transformers' save_pretrained (larger weights than
    its init, so logits and routing are not flat), with the demo tokenizer."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=512,
        **overrides)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.75, 1.25)
            else:
                p.normal_(0.0, 3.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


def test_a_save_pretrained_checkpoint_with_a_dense_layer(tiny_moe: Path, tmp_path: Path) -> None:
    folder = _hf_saved(tmp_path / "hf", tiny_moe, mlp_only_layers=[1], norm_topk_prob=False)
    saved = json.loads((folder / "config.json").read_text())
    assert "num_local_experts" in saved and saved["mlp_only_layers"] == [1]
    config = ModelConfig.from_dir(folder)
    assert config.moe is not None and config.moe.dense_layers == (1,)
    assert not config.moe.normalize_top_k
    names = set(load_file(folder / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names
    llm = LLM(folder)
    prompts = random_prompts(2048, [30, 9], seed=5)
    for prompt, score in zip(prompts, llm.score(prompts), strict=True):
        teacher = hf_prompt_logprobs(folder, tuple(prompt))
        assert all(math.isclose(a, b, abs_tol=LOGPROB_TOL)
                   for a, b in zip(score.logprobs, teacher, strict=True))
    assert_outputs_match(folder, prompts, llm.generate(prompts, GREEDY), MAX_NEW)


@pytest.mark.parametrize(("edit", "message"), [
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({"mlp_only_layers": [5]}, r"mlp_only_layers must list layer indices from 0 to 1"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 is more than num_experts=4"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
    ({"moe_intermediate_size": None}, "field 'moe_intermediate_size' is required"),
    ({"num_experts": None}, r"field 'num_experts' \(or 'num_local_experts'\) is required"),
])
def test_config_refusals_name_the_key(tiny_moe: Path, edit: dict, message: str) -> None:
    hf = {**json.loads((tiny_moe / "config.json").read_text()), **edit}
    hf = {k: v for k, v in hf.items() if v is not None}
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_hf_dict(hf)


def test_registry_offers_it_to_demo_model() -> None:
    demo = build_parser().parse_args(["demo-model", "out", "--arch", "qwen3_moe"])
    assert demo.arch == "qwen3_moe"
    family = family_named("qwen3_moe")
    assert family.gguf is not None and family.gguf.architecture == "qwen3moe"
    assert not uses_flex("auto", torch.device("cuda"), 16, family=family)


# ---- GGUF as llama.cpp's converter writes it -------------------------------------------------

def _moe_gguf(folder: Path, path: Path, qtype: QType = QType.F32,
              **meta_edits: object) -> Path:
    """What convert_hf_to_gguf.py's Qwen3MoeModel writes: qwen3moe metadata with the
    expert counts, q/k rows as they are (no permutation for Qwen), each layer's experts
    stacked per projection into model.layers.N.mlp.experts.<proj>.weight, named by
    gguf-py's own tensor map."""
    from test_gguf import gguf_metadata, write_gguf

    hf = json.loads((folder / "config.json").read_text())
    layers = hf["num_hidden_layers"]
    meta = {("qwen3moe." + k[len("llama."):] if k.startswith("llama.") else k): v
            for k, v in gguf_metadata(folder).items()}
    meta.update({
        "general.architecture": "qwen3moe",
        "qwen3moe.rope.dimension_count": None,
        "qwen3moe.attention.key_length": hf["head_dim"],
        "qwen3moe.attention.value_length": hf["head_dim"],
        "qwen3moe.expert_count": hf["num_experts"],
        "qwen3moe.expert_used_count": hf["num_experts_per_tok"],
        "qwen3moe.expert_feed_forward_length": hf["moe_intermediate_size"],
    })
    meta.update(meta_edits)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, layers)
    hf_tensors = load_file(folder / "model.safetensors")
    for i in range(layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            experts = [hf_tensors.pop(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight")
                       for e in range(hf["num_experts"])]
            hf_tensors[f"model.layers.{i}.mlp.experts.{proj}.weight"] = torch.stack(experts)
    tensors = {names.get_name(name, try_suffixes=(".weight",)): t.numpy()
               for name, t in hf_tensors.items()}
    assert "blk.1.ffn_down_exps.weight" in tensors and "blk.0.ffn_gate_inp.weight" in tensors
    raw = None
    if qtype != QType.F32:  # the stacked experts quantized too (write_gguf keeps 3-D in
        # F32), where their rows are whole blocks (down_proj's 48 are not: F32, as
        # llama.cpp's quantizer falls back for such rows)
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        raw = {n: (qtype, gguf.quants.quantize(a.astype(np.float32), qtype))
               for n, a in tensors.items() if a.ndim == 3 and a.shape[-1] % block == 0}
    return write_gguf(path, meta, tensors, qtype, raw=raw)


@pytest.fixture(scope="module")
def moe_gguf(tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _moe_gguf(tiny_moe, tmp_path_factory.mktemp("moe-gguf") / "tiny-moe-f32.gguf")


def test_an_f32_gguf_holds_and_generates_the_folder_model(tiny_moe: Path,
                                                          moe_gguf: Path) -> None:
    folder_config, folder_tensors = load_checkpoint(tiny_moe)
    config, tensors = load_checkpoint(moe_gguf)
    assert config.shape_fields() == folder_config.shape_fields()
    assert config.moe == folder_config.moe and config.moe.normalize_top_k
    assert tensors.keys() == folder_tensors.keys()
    for name, tensor in folder_tensors.items():
        assert torch.equal(tensors[name], tensor), name
    prompts = random_prompts(2048, [17, 40], seed=6)
    assert_outputs_match(tiny_moe, prompts, LLM(moe_gguf).generate(prompts, GREEDY), MAX_NEW)


def test_a_q8_0_gguf_dequantizes_its_stacked_experts(tiny_moe: Path, tmp_path: Path) -> None:
    path = _moe_gguf(tiny_moe, tmp_path / "tiny-moe-q8.gguf", QType.Q8_0)
    _, folder_tensors = load_checkpoint(tiny_moe)
    _, tensors = load_checkpoint(path)
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"
    assert not torch.equal(tensors[name], folder_tensors[name])
    assert torch.allclose(tensors[name], folder_tensors[name], atol=0.02)


def test_a_gguf_with_the_wrong_expert_count_is_refused(tiny_moe: Path, tmp_path: Path) -> None:
    bad = _moe_gguf(tiny_moe, tmp_path / "bad.gguf", **{"qwen3moe.expert_count": 8})
    with pytest.raises(CheckpointError, match=r"ffn_gate_exps.*shape \(4, 48, 64\), expected "
                                              r"\(8, 48, 64\)"):
        load_checkpoint(bad)
    missing = _moe_gguf(tiny_moe, tmp_path / "missing.gguf",
                        **{"qwen3moe.expert_used_count": None})
    with pytest.raises(CheckpointError, match=r"qwen3moe\.expert_used_count"):
        load_checkpoint(missing)


# ---- the router and the disaggregated path ---------------------------------------------------

def _router_completions_match_transformers(cluster, folder: Path, max_tokens: int = 16) -> None:
    from tandem_engine.tokenizer import Tokenizer
    from test_router_e2e import MODEL

    tokenizer = Tokenizer.from_dir(folder)
    client = cluster.client()
    compared = 0
    texts = ["Once upon a time in a land far away", "The engine"]
    for text in texts:
        ref = hf_greedy(folder, tuple(tokenizer.encode(text)), max_tokens)
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens,
                                      temperature=0, extra_body={"return_token_ids": True,
                                                                 "ignore_eos": True})
        compared += assert_matches(ref, r.choices[0].model_extra["token_ids"])
        chunks = list(client.completions.create(
            model=MODEL, prompt=text, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True}))
        assert [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]] \
            == r.choices[0].model_extra["token_ids"]
    assert compared >= 0.9 * max_tokens * len(texts)


@pytest.mark.slow
def test_router_completions_match_transformers(tiny_moe: Path,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    from test_router_e2e import run_cluster

    cluster = run_cluster(tiny_moe, tmp_path_factory.mktemp("moe-router"), ("mixed",))
    try:
        _router_completions_match_transformers(next(cluster), tiny_moe)
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def moe_disagg_cluster(tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    pytest.importorskip("nixl_cu12")
    from test_router_e2e import run_cluster

    yield from run_cluster(tiny_moe, tmp_path_factory.mktemp("moe-disagg"),
                           ("prefill", "decode"))


@pytest.mark.slow
def test_disaggregated_completions_match_transformers(moe_disagg_cluster,
                                                      tiny_moe: Path) -> None:
    import httpx

    c = moe_disagg_cluster
    _router_completions_match_transformers(c, tiny_moe)
    pulls = httpx.get(f"{c.admin_urls[1]}/v1/state", timeout=5).json()["kv_pulls"]
    assert pulls["pulled_blocks"] > 0 and pulls["failed"] == 0
    assert c.metric("tandem_router_disaggregated_requests_total", outcome="handoff") == 4
