"""Gemma 3 (text) through the model-family seam: greedy tokens and logprobs equal
transformers' on a tiny random checkpoint (scaled embeddings, GELU-tanh MLP, pre and post
norms, q/k norms, alternating sliding-window and global layers with their own RoPE bases,
soft-capped logits), whatever the batching: chunked prefill, preemption, both CPU kernels;
loaded from a GGUF file written as llama.cpp's converter writes one (norm weights + 1, q/k
rows in HF order, the layer pattern and local RoPE base left to the reader); and served
disaggregated (a prefill and a decode engine behind the router, KV over NIXL)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from reference import assert_matches, assert_outputs_match, hf_greedy, random_prompts
from tandem_engine import LLM, SamplingParams
from tandem_engine.cli.main import build_parser
from tandem_engine.errors import CheckpointError
from tandem_engine.model.family import ModelConfig, family_named
from tandem_engine.model.runner import uses_flex

transformers = pytest.importorskip("transformers")

MAX_NEW = 24
# The tiny demo's window is 25 tokens: most prompts (and every generation) outgrow it.
LENGTHS = [3, 17, 40, 70]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem_engine.cli.demo_model import write_demo_model

    torch.set_num_threads(1)
    return write_demo_model(tmp_path_factory.mktemp("tiny-gemma3"), arch="gemma3")


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_chunked_prefill_matches_transformers(tiny_gemma3: Path, kernels: str) -> None:
    prompts = random_prompts(2048, LENGTHS, seed=1)
    llm = LLM(tiny_gemma3, max_num_batched_tokens=8, kernels=kernels)
    assert llm.engine.runner.kernels == kernels
    assert_outputs_match(tiny_gemma3, prompts, llm.generate(prompts, GREEDY), MAX_NEW)


def test_preemption_by_recompute_matches_transformers(tiny_gemma3: Path) -> None:
    prompts = random_prompts(2048, LENGTHS, seed=2)
    # 12 blocks x 16 = 192 token slots for ~230 tokens of prompts + outputs.
    llm = LLM(tiny_gemma3, num_blocks=12, max_num_batched_tokens=32)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.num_preemptions > 0
    assert_outputs_match(tiny_gemma3, prompts, outputs, MAX_NEW)


def test_the_window_and_local_rope_are_exercised(tiny_gemma3: Path, tmp_path: Path) -> None:
    # The same weights with every layer global give other tokens on a prompt longer than
    # the window: the comparisons above do test the sliding layers.
    folder = tmp_path / "all-global"
    shutil.copytree(tiny_gemma3, folder)
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    prompt = random_prompts(2048, [70], seed=1)[0]
    ours = LLM(folder).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert_matches(hf_greedy(folder, tuple(prompt), MAX_NEW), ours)
    assert ours != list(hf_greedy(tiny_gemma3, tuple(prompt), MAX_NEW).tokens)


def test_config_reads_both_transformers_spellings(tiny_gemma3: Path) -> None:
    ours = ModelConfig.from_dir(tiny_gemma3)
    assert ours.layer_types == ("sliding_attention", "full_attention")
    assert ours.sliding_window == 25 and ours.final_logit_softcapping == 30.0
    assert (ours.rope.theta, ours.rope.kind, ours.rope.factor) == (1e6, "linear", 2.0)
    assert ours.local_rope is not None and ours.local_rope.theta == 1e4
    assert ours.attention_scale == (ours.head_dim // 2) ** -0.5
    # transformers 5.x writes rope_parameters per layer type instead of rope_theta,
    # rope_local_base_freq and rope_scaling.
    v5 = transformers.AutoConfig.from_pretrained(tiny_gemma3).to_dict()
    assert "rope_local_base_freq" not in v5 and "full_attention" in v5["rope_parameters"]
    assert ModelConfig.from_hf_dict(v5) == ours


def test_registry_offers_it_to_demo_model_and_keeps_it_off_flex() -> None:
    demo = build_parser().parse_args(["demo-model", "out", "--arch", "gemma3"])
    assert demo.arch == "gemma3"
    gemma3 = family_named("gemma3")
    assert not uses_flex("auto", torch.device("cuda"), 16, family=gemma3)
    with pytest.raises(ValueError, match="cannot run gemma3 models"):
        uses_flex("flex", torch.device("cpu"), 16, family=gemma3)


# ---- GGUF, as llama.cpp's converter writes a Gemma 3 checkpoint ---------------------------

# llama.cpp's reader fixes five sliding-window layers to every global one and
# query_pre_attn_scalar = head_dim, so a GGUF can hold only a checkpoint of that form: six
# layers (one global), the demo's other choices kept (window 25, linear RoPE scaling on
# the global layer, soft cap 30, untied head).
GGUF_LAYERS = 6


@pytest.fixture(scope="session")
def gemma3_for_gguf(tiny_gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import save_file
    from tandem_engine.cli.demo_model import demo_weights

    folder = tmp_path_factory.mktemp("gemma3-six-layers")
    config = json.loads((tiny_gemma3 / "config.json").read_text())
    config.update(num_hidden_layers=GGUF_LAYERS, query_pre_attn_scalar=config["head_dim"],
                  layer_types=["sliding_attention"] * (GGUF_LAYERS - 1) + ["full_attention"])
    (folder / "config.json").write_text(json.dumps(config))
    weights = demo_weights(ModelConfig.from_hf_dict(config), seed=3)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_gemma3 / name, folder / name)
    return folder


def gemma3_gguf_metadata(folder: Path) -> dict:
    """What convert_hf_to_gguf.py's Gemma3Model writes for this folder: the shape, the
    global layers' RoPE (base and linear scaling), the window, the soft cap; no q/k
    permutation, no layer pattern or local base (llama.cpp fixes those)."""
    from test_gguf import gguf_metadata

    hf = json.loads((folder / "config.json").read_text())
    p = "gemma3."
    tokenizer = {k: v for k, v in gguf_metadata(folder).items() if k.startswith("tokenizer.")}
    return {
        "general.architecture": "gemma3",
        p + "block_count": hf["num_hidden_layers"],
        p + "context_length": hf["max_position_embeddings"],
        p + "embedding_length": hf["hidden_size"],
        p + "feed_forward_length": hf["intermediate_size"],
        p + "attention.head_count": hf["num_attention_heads"],
        p + "attention.head_count_kv": hf["num_key_value_heads"],
        p + "attention.key_length": hf["head_dim"],
        p + "attention.value_length": hf["head_dim"],
        p + "attention.layer_norm_rms_epsilon": hf["rms_norm_eps"],
        p + "attention.sliding_window": hf["sliding_window"],
        p + "rope.freq_base": hf["rope_theta"],
        p + "rope.scaling.type": hf["rope_scaling"]["rope_type"],
        p + "rope.scaling.factor": hf["rope_scaling"]["factor"],
        p + "final_logit_softcapping": hf["final_logit_softcapping"],
        **tokenizer,
    }


def gemma3_gguf_tensors(folder: Path) -> dict:
    """The folder's tensors under the names gguf-py's tensor map gives Gemma 3 (the map
    llama.cpp's converter uses), with 1 added to every norm weight, as the converter does
    (Gemma's RMSNorm scales by 1 + w, llama.cpp's by w)."""
    import gguf
    from safetensors.torch import load_file

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, GGUF_LAYERS)
    out = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        w = tensor.numpy()
        if name.endswith("norm.weight"):
            w = w + 1
        out[names.get_name(name, try_suffixes=(".weight",))] = w
    return out


@pytest.fixture(scope="session")
def gemma3_gguf(gemma3_for_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_gguf import write_gguf

    path = tmp_path_factory.mktemp("gemma3-gguf") / "gemma3-f32.gguf"
    return write_gguf(path, gemma3_gguf_metadata(gemma3_for_gguf),
                      gemma3_gguf_tensors(gemma3_for_gguf))


def test_gguf_holds_the_folder_model(gemma3_for_gguf: Path, gemma3_gguf: Path) -> None:
    from tandem_engine.model.checkpoint import load_checkpoint

    config, tensors = load_checkpoint(gemma3_gguf)
    folder_config, expected = load_checkpoint(gemma3_for_gguf)
    # The GGUF also names <|im_end|> as end-of-turn.
    assert config == dataclasses.replace(folder_config, eos_token_ids=config.eos_token_ids)
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        # (1 + w) - 1 in float32: the converter's rounding of 1 + w, nothing more
        tol = 1.2e-7 if name.endswith("norm.weight") else 0.0
        assert (tensors[name] - tensor).abs().max() <= tol, name


def test_gguf_generates_transformers_tokens(gemma3_for_gguf: Path, gemma3_gguf: Path,
                                            tmp_path: Path) -> None:
    from tandem_engine.model.gguf import export_hf_folder
    from tandem_engine.tokenizer import Tokenizer

    prompts = random_prompts(2048, [5, 40], seed=3)
    llm = LLM(gemma3_gguf, max_num_batched_tokens=16)
    assert_outputs_match(gemma3_for_gguf, prompts, llm.generate(prompts, GREEDY), MAX_NEW)
    text = "Once upon a time <|im_start|>user\nhi<|im_end|>\n"
    assert llm.tokenizer.encode(text) == Tokenizer.from_path(gemma3_for_gguf).encode(text)
    # Exported back to an HF folder, it is a Gemma 3 checkpoint transformers runs the same.
    exported = export_hf_folder(gemma3_gguf, tmp_path / "exported")
    assert ModelConfig.from_dir(exported) == llm.engine.model_config
    assert_matches(hf_greedy(gemma3_for_gguf, tuple(prompts[1]), MAX_NEW),
                   list(hf_greedy(exported, tuple(prompts[1]), MAX_NEW).tokens))


def test_gguf_metadata_is_read_as_llama_cpp_reads_it(gemma3_for_gguf: Path,
                                                     tmp_path: Path) -> None:
    from tandem_engine.gguf_file import open_gguf
    from tandem_engine.model.gguf import gguf_hf_config
    from test_gguf import write_gguf

    def config_of(**edits) -> ModelConfig:
        meta = {**gemma3_gguf_metadata(gemma3_for_gguf), **edits}
        path = write_gguf(tmp_path / "meta.gguf", meta, {})
        return ModelConfig.from_hf_dict(gguf_hf_config(open_gguf(path)))

    p = "gemma3."
    base = config_of()
    assert base.local_rope is not None and base.local_rope.theta == 10000.0
    assert base.attention_scale == base.head_dim ** -0.5
    # Without a window every layer is global; a converter that writes the local base
    # (rope_parameters' sliding_attention) is followed.
    assert config_of(**{p + "attention.sliding_window": None}).layer_types == (
        ("full_attention",) * GGUF_LAYERS)
    assert config_of(**{p + "rope.freq_base_swa": 5000.0}).local_rope.theta == 5000.0
    assert config_of(**{p + "final_logit_softcapping": None}).final_logit_softcapping is None
    # The 27B's scalar is hidden / heads (168 there), which llama.cpp knows by its 62 layers.
    big = config_of(**{p + "block_count": 62, p + "embedding_length": 256})
    assert big.attention_scale == (256 // big.num_heads) ** -0.5 != base.attention_scale
    assert big.layer_types.count("full_attention") == 10
    with pytest.raises(CheckpointError, match="attn_logit_softcapping"):
        config_of(**{p + "attn_logit_softcapping": 50.0})


# ---- the disaggregated path: real processes ------------------------------------------------

@pytest.mark.slow
def test_disaggregated_completions_match_the_offline_engine(tiny_gemma3: Path,
                                                           tmp_path: Path) -> None:
    """A prefill and a decode engine behind the router, the prompt's KV pulled over NIXL:
    the same greedy completions as the offline engine, on a prompt longer than the window
    (the decode engine's sliding layers mask the pulled blocks) and a short one."""
    import contextlib

    import httpx
    pytest.importorskip("nixl_cu12")
    from test_router_e2e import MODEL, run_cluster

    prompts = ["Once upon a time in a land far away there lived a king who had three "
               "daughters, and the youngest of them was so fair that", "Hello there"]
    llm = LLM(tiny_gemma3)
    assert len(llm.tokenizer.encode(prompts[0])) > ModelConfig.from_dir(tiny_gemma3).sliding_window
    refs = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))]
    cluster = contextlib.contextmanager(run_cluster)
    with cluster(tiny_gemma3, tmp_path, ("prefill", "decode")) as c:
        client = c.client()
        extra = {"return_token_ids": True, "ignore_eos": True}
        for prompt, ref in zip(prompts, refs, strict=True):
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW,
                                          temperature=0, extra_body=extra)
            assert r.choices[0].model_extra["token_ids"] == ref.token_ids
            assert r.choices[0].text == ref.text
        chunks = list(client.completions.create(model=MODEL, prompt=prompts[0],
                                                max_tokens=MAX_NEW, temperature=0,
                                                stream=True, extra_body=extra))
        assert [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]] \
            == refs[0].token_ids
        pulls = httpx.get(f"{c.admin_urls[1]}/v1/state", timeout=5).json()["kv_pulls"]
        assert pulls["pulled_blocks"] > 0 and pulls["failed"] == 0
        # The streamed repeat finds the prompt's KV on the decode engine: it runs there
        # alone (P/D bypass), its sliding layers over blocks it pulled.
        assert c.metric("tandem_router_disaggregated_requests_total", outcome="handoff") == 2
        assert c.metric("tandem_router_disaggregated_requests_total", outcome="bypassed") == 1
