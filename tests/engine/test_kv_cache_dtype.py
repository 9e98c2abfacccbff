"""`--kv-cache-dtype`: the KV pool's elements apart from the weights' dtype. Which one
`auto` takes, what a 16-bit pool holds in the same bytes, that generation over it keeps
the float32 pool's greedy text (or first differs at a near tie), and the refusal of a
dtype the engine does not have."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tandem_engine import LLM, SamplingParams
from tandem_engine.bench.quality import greedy_agreement
from tandem_engine.engine_flags import EngineOptionError

MAX_NEW = 24
PROMPTS = [[1, 5, 9, 20, 33], [7, 7, 100, 3], list(range(4, 60))]


@pytest.mark.parametrize("options,want", [
    ({"dtype": "float32"}, torch.float32),                             # dense: the dtype's
    ({"dtype": "bfloat16"}, torch.bfloat16),
    ({"dtype": "float32", "quantization": "int4"}, torch.float16),     # quantized on a CPU
    ({"dtype": "float32", "quantization": "int8"}, torch.float16),
    ({"dtype": "float32", "quantization": "int4", "kv_cache_dtype": "float32"}, torch.float32),
    ({"dtype": "float32", "kv_cache_dtype": "bfloat16"}, torch.bfloat16),
])
def test_auto_and_explicit_kv_cache_dtypes(tiny_llama: Path, options: dict,
                                           want: torch.dtype) -> None:
    llm = LLM(tiny_llama, **options)
    assert llm.engine.runner.kv_cache.dtype == want
    stats = llm.engine.stats
    assert stats.kv_cache_dtype == str(want).removeprefix("torch.")
    assert stats.kv_cache_bytes == llm.engine.runner.kv_cache.numel() * want.itemsize


def test_a_16_bit_pool_holds_twice_the_tokens_in_the_same_bytes(tiny_llama: Path) -> None:
    budget = 4 << 20
    wide = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=budget)
    half = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=budget,
               kv_cache_dtype="float16")
    assert half.engine.kv.num_blocks == 2 * wide.engine.kv.num_blocks
    for llm in (wide, half):
        assert budget * 0.95 < llm.engine.stats.kv_cache_bytes <= budget


@pytest.mark.parametrize("quantization", ["none", "int4"])  # eager steps; fused decode steps
def test_greedy_text_over_a_float16_pool_is_the_float32_pool_s(
        tiny_model: Path, quantization: str) -> None:
    """float16, auto's choice (bfloat16's 8-bit mantissa moves the random tiny models'
    logits past the near-tie rule: the real model's test in test_quantized_model.py
    measures both)."""
    wide = LLM(tiny_model, dtype="float32", quantization=quantization,
               kv_cache_dtype="float32")
    half = LLM(tiny_model, dtype="float32", quantization=quantization,
               kv_cache_dtype="float16")
    for prompt, c in zip(PROMPTS, greedy_agreement(wide, half, PROMPTS, MAX_NEW),
                         strict=True):
        assert c.near_tie, f"{prompt}: first differs at token {c.first_difference}"
    # prefix caching: a prompt again reads its cached 16-bit blocks to the same text
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    first = half.generate([PROMPTS[2]], params)[0].outputs[0].token_ids
    again = half.generate([PROMPTS[2]], params)[0].outputs[0].token_ids
    assert half.engine.prefix_cache_stats()["hit_tokens"] > 0
    assert again == first


def test_a_kv_cache_dtype_the_engine_lacks_is_refused_by_name(tiny_llama: Path) -> None:
    with pytest.raises(EngineOptionError, match=r"kv_cache_dtype.*'fp8'.*use one of auto, "
                                                r"float32, bfloat16, float16"):
        LLM(tiny_llama, kv_cache_dtype="fp8")
