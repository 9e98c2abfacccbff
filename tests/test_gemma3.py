"""Gemma 3 (text) through the model-family seam: greedy tokens and logprobs equal
transformers' on a tiny random checkpoint (scaled embeddings, GELU-tanh MLP, pre and post
norms, q/k norms, alternating sliding-window and global layers with their own RoPE bases,
soft-capped logits), whatever the batching: chunked prefill, preemption, both CPU kernels."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from reference import assert_matches, hf_greedy, random_prompts
from tandem_engine import LLM, SamplingParams
from tandem_engine.cli.main import build_parser
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


def _check(folder: Path, prompts: list[list[int]], outputs) -> None:
    compared = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        logprobs = [next(iter(step.values())).logprob for step in completion.logprobs]
        compared += assert_matches(hf_greedy(folder, tuple(prompt), MAX_NEW),
                                   completion.token_ids, logprobs)
    assert compared >= 0.9 * MAX_NEW * len(prompts), f"only {compared} tokens were decisive"


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_chunked_prefill_matches_transformers(tiny_gemma3: Path, kernels: str) -> None:
    prompts = random_prompts(2048, LENGTHS, seed=1)
    llm = LLM(tiny_gemma3, max_num_batched_tokens=8, kernels=kernels)
    assert llm.engine.runner.kernels == kernels
    _check(tiny_gemma3, prompts, llm.generate(prompts, GREEDY))


def test_preemption_by_recompute_matches_transformers(tiny_gemma3: Path) -> None:
    prompts = random_prompts(2048, LENGTHS, seed=2)
    # 12 blocks x 16 = 192 token slots for ~230 tokens of prompts + outputs.
    llm = LLM(tiny_gemma3, num_blocks=12, max_num_batched_tokens=32)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.num_preemptions > 0
    _check(tiny_gemma3, prompts, outputs)


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
