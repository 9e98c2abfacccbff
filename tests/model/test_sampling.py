"""Sampling: distributions on a controlled logit vector, and seeds that hold across batches."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from reference import random_prompts
from tandem_engine import LLM, RequestRejected, SamplingParams
from tandem_engine.model.sampler import Sampler, sample_row

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = PROBS.log() + 3.0  # any shift: softmax must undo it
DRAWS = 20_000
# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def _frequencies(params: SamplingParams, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(PROBS))
    for _ in range(DRAWS):
        counts[sample_row(LOGITS.clone(), params, g)] += 1
    return counts


def _assert_distribution(counts: torch.Tensor, expected: torch.Tensor) -> None:
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts.tolist()}"
    if int(support.sum()) == 1:
        return  # one token in the support: nothing left to compare
    exp = expected[support] * DRAWS
    chi2 = float(((counts[support] - exp) ** 2 / exp).sum())
    df = int(support.sum()) - 1
    assert chi2 < CHI2_CRIT[df], f"chi2={chi2:.1f} (df={df}) for {counts.tolist()}"


def test_temperature_one_samples_the_softmax() -> None:
    _assert_distribution(_frequencies(SamplingParams(temperature=1.0)), PROBS)


def test_temperature_sharpens_and_flattens() -> None:
    for t in (0.5, 2.0):
        expected = PROBS ** (1 / t) / (PROBS ** (1 / t)).sum()
        _assert_distribution(_frequencies(SamplingParams(temperature=t)), expected)


def test_top_k_keeps_the_k_most_likely() -> None:
    expected = torch.zeros_like(PROBS)
    expected[:2] = PROBS[:2] / PROBS[:2].sum()
    _assert_distribution(_frequencies(SamplingParams(top_k=2)), expected)


@pytest.mark.parametrize(("top_p", "kept"), [(0.65, 2), (0.66, 3), (0.3, 1), (1.0, 6)])
def test_top_p_keeps_the_smallest_nucleus(top_p: float, kept: int) -> None:
    # Cumulative mass: 0.4, 0.65, 0.8, ... A token stays while the mass before it < top_p.
    expected = torch.zeros_like(PROBS)
    expected[:kept] = PROBS[:kept] / PROBS[:kept].sum()
    _assert_distribution(_frequencies(SamplingParams(top_p=top_p)), expected)


def test_top_k_and_top_p_together() -> None:
    expected = torch.zeros_like(PROBS)
    expected[:2] = PROBS[:2] / PROBS[:2].sum()
    _assert_distribution(_frequencies(SamplingParams(top_k=3, top_p=0.6)), expected)


def test_greedy_is_argmax_and_logprobs_are_raw() -> None:
    sampler = Sampler(seed=0)
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.5, top_k=1, logprobs=0)]
    result = sampler.sample(logits, ["a", "b"], params, [(), ()])
    assert result.token_ids == [0, 5]
    assert result.ranks == [1, 1]
    assert result.logprobs[0] == pytest.approx(math.log(0.4), abs=1e-6)
    assert result.top_ids[0] == [0, 1, 2]
    assert result.top_logprobs[0] == pytest.approx([math.log(p) for p in (0.4, 0.25, 0.15)],
                                                   abs=1e-6)
    assert result.top_ids[1] == []


def test_banned_tokens_are_never_sampled() -> None:
    sampler = Sampler(seed=0)
    result = sampler.sample(LOGITS[None], ["a"], [SamplingParams(temperature=0.0)], [(0, 1)])
    assert result.token_ids == [2]


def test_seeded_requests_repeat_whatever_shares_the_batch(tiny_qwen2: Path) -> None:
    llm = LLM(tiny_qwen2, max_num_batched_tokens=64)
    prompts = random_prompts(2048, [12, 30, 7, 50, 21], seed=5)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=15, temperature=1.3, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0.7, seed=9, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.0),
              SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)]
    crowded = llm.generate([*prompts[1:3], prompts[0], *prompts[3:]],
                           [*others[:2], seeded, *others[2:]])
    assert crowded[2].outputs[0].token_ids == alone
    # And the seed matters: another seed gives another sequence.
    other_seed = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=99,
                                ignore_eos=True)
    assert llm.generate([prompts[0]], other_seed)[0].outputs[0].token_ids != alone


def test_seeded_sampling_survives_preemption(tiny_qwen3: Path) -> None:
    prompts = random_prompts(2048, [60, 70, 80, 90], seed=6)
    params = [SamplingParams(max_tokens=30, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(4)]
    roomy = LLM(tiny_qwen3).generate(prompts, params)
    tight_llm = LLM(tiny_qwen3, num_blocks=18, max_num_batched_tokens=32)
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.engine.num_preemptions > 0
    for a, b in zip(roomy, tight, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"temperature": -1}, "temperature=-1"),
    ({"top_p": 0}, "top_p=0"),
    ({"top_k": -5}, "top_k=-5"),
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens=5"),
    ({"logprobs": 50}, "logprobs=50"),
    ({"stop": [""]}, "stop"),
])
def test_bad_sampling_parameters_name_the_parameter(kwargs: dict, needle: str) -> None:
    with pytest.raises(RequestRejected, match=needle.replace("[", r"\[")):
        SamplingParams(**kwargs)
