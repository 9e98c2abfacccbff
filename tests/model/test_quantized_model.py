"""Engines whose projections stay quantized (--quantization, model/quant.py), against the
dequantized float32 model on the same checkpoint: the real model's GGUF kept as int4
(perplexity, greedy text, memory), an HF checkpoint quantized at load, and refit and
speculative decoding over quantized weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from tandem_engine import LLM, SamplingParams
from tandem_engine.bench.quality import corpus_windows, greedy_agreement, perplexity
from tandem_engine.config import EngineConfig, SpeculativeConfig
from tandem_engine.engine_flags import EngineOptionError
from tandem_engine.errors import CheckpointError
from tandem_engine.model.quant import QuantEmbedding, QuantLinear
from test_gguf import QType, gguf_of

PROMPTS = [  # test_real_model.py's
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
]
MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _projections(llm: LLM) -> list[QuantLinear | QuantEmbedding]:
    return [m for m in llm.engine.runner.model.modules()
            if isinstance(m, QuantLinear | QuantEmbedding)]


def _assert_near_ties(reference: LLM, llm: LLM, prompts: list[str] | list[list[int]]) -> None:
    for prompt, c in zip(prompts, greedy_agreement(reference, llm, prompts, MAX_NEW),
                         strict=True):
        assert c.near_tie, (f"{prompt!r}: first differs at token {c.first_difference}, where "
                            f"the reference's top-two gap was {c.reference_gap:.3f}: "
                            f"{c.reference} vs {c.tokens}")


@pytest.fixture(scope="module")
def dense(smollm2_gguf: Path) -> LLM:
    return LLM(smollm2_gguf, quantization="none", dtype="float32")


@pytest.fixture(scope="module")
def quantized(smollm2_gguf: Path) -> LLM:
    return LLM(smollm2_gguf, dtype="float32")  # --quantization auto: as the file holds it


@pytest.mark.slow
class TestTheRealModelKeptQuantized:
    def test_the_gguf_stays_int4_in_a_fifth_of_the_memory(self, dense: LLM, quantized: LLM,
                                                          smollm2_gguf: Path) -> None:
        kinds = {m.scheme.describe() for m in _projections(quantized)}
        assert str(quantized.engine.runner.kv_cache.dtype) == "torch.float16"  # auto
        # Q4_1 projections held as they are; the Q8_0 (tied) embedding as int8 rows
        assert kinds == {"int4, groups of 32 (from Q4_1)", "int8 (from Q8_0)"}
        assert not _projections(dense)
        held = quantized.engine.runner.weight_bytes
        assert held < smollm2_gguf.stat().st_size * 1.1
        assert held < dense.engine.runner.weight_bytes / 5

    def test_perplexity_stays_within_one_percent(self, dense: LLM, quantized: LLM,
                                                 smollm2_gguf: Path) -> None:
        windows = corpus_windows(dense, window=256, limit=6)
        want = perplexity(dense, windows)
        assert perplexity(quantized, windows) == pytest.approx(want, rel=0.01)
        # int8 rows quantized at load from the dequantized floats (as an HF checkpoint is)
        requantized = LLM(smollm2_gguf, dtype="float32", quantization="int8")
        assert perplexity(requantized, windows) == pytest.approx(want, rel=0.01)
        _assert_near_ties(dense, requantized, PROMPTS)

    def test_greedy_text_is_equal_or_first_differs_at_a_near_tie(self, dense: LLM,
                                                                 quantized: LLM) -> None:
        _assert_near_ties(dense, quantized, PROMPTS)
        reply = quantized.generate(
            ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
             "<|im_start|>assistant\n"], SamplingParams(max_tokens=16, temperature=0.0))
        assert "Paris" in reply[0].outputs[0].text

    @pytest.mark.parametrize("low_memory", [False, True])
    def test_a_refit_to_the_same_file_keeps_the_weights_quantized(
            self, quantized: LLM, smollm2_gguf: Path, low_memory: bool) -> None:
        before = quantized.generate(PROMPTS[:2], GREEDY)
        quantized.pause()
        try:
            quantized.engine.refit(smollm2_gguf, "again", low_memory=low_memory)
        finally:
            quantized.unpause()
        assert {m.scheme.kind for m in _projections(quantized)} == {"int4", "int8"}
        after = quantized.generate(PROMPTS[:2], GREEDY)
        assert [o.outputs[0].token_ids for o in after] == \
            [o.outputs[0].token_ids for o in before]


@pytest.mark.slow
def test_a_bfloat16_kv_cache_keeps_perplexity_and_greedy_text(dense: LLM,
                                                              smollm2_gguf: Path) -> None:
    """--kv-cache-dtype bfloat16 on the dense float32 model, only its pool changed. (The
    quantized engine above keeps float16, auto's choice, and is held to the same bounds
    against this float32 pool.)"""
    half = LLM(smollm2_gguf, quantization="none", dtype="float32", kv_cache_dtype="bfloat16")
    windows = corpus_windows(dense, window=256, limit=6)
    assert perplexity(half, windows) == pytest.approx(perplexity(dense, windows), rel=0.01)
    _assert_near_ties(dense, half, PROMPTS)


def test_an_hf_checkpoint_is_quantized_at_load(tiny_llama: Path) -> None:
    dense = LLM(tiny_llama, dtype="float32")
    prompts = [[1, 5, 9, 20, 33], [7, 7, 100, 3]]
    texts = [[*p, *o.outputs[0].token_ids] for p, o in
             zip(prompts, dense.generate(prompts, GREEDY), strict=True)]
    for kind in ("int8", "int4"):
        llm = LLM(tiny_llama, dtype="float32", quantization=kind)
        layers = _projections(llm)
        assert {m.scheme.kind for m in layers if isinstance(m, QuantLinear)} == {kind}
        # int8: a byte a weight, int4: half, plus a scale per row or group of 32
        held = sum(m.weight_nbytes() for m in layers)
        floats = sum(4 * m.packed_shape[0] * m.packed_shape[1] for m in layers)
        assert held < floats * (0.3 if kind == "int8" else 0.2)
        assert llm.engine.runner.weight_bytes < dense.engine.runner.weight_bytes
        # The 64-wide random model is far more sensitive than a trained one (its greedy
        # tokens part within 10): here its likelihood of the dense model's own text, and
        # the greedy text on the real model (TestTheRealModelKeptQuantized).
        assert all(len(o.outputs[0].token_ids) == MAX_NEW
                   for o in llm.generate(prompts, GREEDY))
        want, got = perplexity(dense, texts), perplexity(llm, texts)
        print(kind, want, got)
        assert got == pytest.approx(want, rel=9), (kind, want)
    # auto leaves an HF checkpoint dense
    assert not _projections(LLM(tiny_llama))


def test_an_int8_engine_refits_an_hf_checkpoint_and_serves_speculatively(
        tiny_llama: Path) -> None:
    plain = LLM(tiny_llama, dtype="float32", quantization="int8")
    llm = LLM(tiny_llama, dtype="float32", quantization="int8",
              speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                            prompt_lookup_min=1))
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6]]
    _assert_near_ties(plain, llm, prompts)
    llm.pause()
    llm.engine.refit(tiny_llama, "v2", low_memory=True)  # quantized as the engine runs
    llm.unpause()
    _assert_near_ties(plain, llm, prompts)


def test_a_refit_that_would_dequantize_a_gguf_engine_is_refused(
        tiny_llama: Path, tmp_path: Path) -> None:
    gguf = gguf_of(tiny_llama, tmp_path / "tiny-q4_0.gguf", QType.Q4_0)
    llm = LLM(gguf)
    before = llm.generate([[1, 5, 9]], GREEDY)[0].outputs[0].token_ids
    llm.pause()
    with pytest.raises(CheckpointError, match=r"running int4, groups of 32 \(from Q4_0\), "
                       r"new checkpoint dense.*--quantization"):
        llm.engine.refit(tiny_llama, "dense")  # an HF folder stays dense under auto
    llm.unpause()
    assert llm.generate([[1, 5, 9]], GREEDY)[0].outputs[0].token_ids == before


def test_an_unknown_quantization_is_refused_naming_the_choices() -> None:
    with pytest.raises(EngineOptionError, match=r"quantization='int3'.*auto, none, int8, int4"):
        EngineConfig(quantization="int3").validate()
