"""Prompt logprobs (`SamplingParams.prompt_logprobs`, `LLM.score`): teacher-forced
logprobs equal transformers', whatever the chunking, the prefix cache or preemption."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from reference import LOGPROB_TOL, hf_prompt_logprobs, random_prompts
from tandem_engine import LLM, RequestRejected, SamplingParams


def _prompts(model_dir: Path) -> list[list[int]]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return random_prompts(vocab, [2, 9, 40, 130], seed=7)


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16},
                                     {"num_blocks": 12, "max_num_batched_tokens": 32}],
                         ids=["whole", "chunked", "small-kv"])
def test_scores_equal_transformers(tiny_llama: Path, options: dict) -> None:
    llm = LLM(tiny_llama, **options)
    prompts = _prompts(tiny_llama)
    if "num_blocks" in options:  # 12 blocks of 16 tokens: the 130-token prompt must fit
        prompts = [p[:100] for p in prompts]
    # Twice: the second time every prompt is in the prefix cache, and is scored anyway.
    for _ in range(2):
        for prompt, score in zip(prompts, llm.score(prompts), strict=True):
            want = hf_prompt_logprobs(tiny_llama, tuple(prompt))
            assert score.token_ids == prompt and len(score.logprobs) == len(prompt) - 1
            assert max(abs(a - b) for a, b in zip(score.logprobs, want, strict=True)) \
                < LOGPROB_TOL
            assert score.perplexity == pytest.approx(
                math.exp(-sum(want) / len(want)), rel=1e-4)


def test_prompt_logprobs_with_top_alternatives(tiny_llama: Path) -> None:
    llm = LLM(tiny_llama)
    prompt = _prompts(tiny_llama)[2]
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0,
                                                prompt_logprobs=3))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    want = hf_prompt_logprobs(tiny_llama, tuple(prompt))
    for token, entry, lp in zip(prompt[1:], out.prompt_logprobs[1:], want, strict=True):
        assert abs(entry[token].logprob - lp) < LOGPROB_TOL
        ranked = sorted((e for t, e in entry.items() if t != token or e.rank <= 3),
                        key=lambda e: e.rank)
        assert [e.rank for e in ranked][:3] == [1, 2, 3]
        assert ranked[0].logprob >= ranked[1].logprob >= ranked[2].logprob


def test_score_refuses_what_it_cannot_score(tiny_llama: Path) -> None:
    llm = LLM(tiny_llama)
    with pytest.raises(ValueError, match="at least 2"):
        llm.score([[5]])
    with pytest.raises(RequestRejected, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
