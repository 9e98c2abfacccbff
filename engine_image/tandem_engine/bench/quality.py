"""How far a quantized (or otherwise approximate) engine is from its reference on the same
checkpoint: perplexity on the packaged text and greedy text, the measures of
docs/benchmarks.md's quantization table and of tests/model/test_quantized_model.py.

* `perplexity`: exp of the mean negative logprob of every token of `data/corpus.txt`
  (text no model here was trained on), cut into windows of `window` tokens, each scored
  teacher-forced from its own first token (`LLM.score`).
* `greedy_agreement`: each prompt's greedy tokens under both engines; where they first
  differ, the reference's gap between its top two logprobs at that step. A flip where
  the reference itself was nearly undecided (a gap below the rounding noise of the
  approximation) is a near tie, not an error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from tandem_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem_engine.engine.llm import LLM
    from tandem_engine.lora_request import LoRARequest

# The quantized kernels' rounded activations (int8 in groups of 32 natively, bfloat16 in
# torch's) and int8's per-row scales move a token's logprob on the default model by
# 0.04-0.07 (median) and 0.19-0.40 (p99) against the dequantized float32 model
# (docs/benchmarks.md); two logprobs this far apart swap only when each moves by a
# quarter or more, so a smaller reference gap at the first differing token is a near tie.
QUANTIZED_TIE_GAP = 0.5


def corpus_windows(llm: LLM, window: int = 256, limit: int | None = None) -> list[list[int]]:
    """The packaged corpus's token ids, cut into windows of `window` tokens (at most
    `limit` of them)."""
    text = (resources.files("tandem_engine") / "data" / "corpus.txt").read_text("utf-8")
    ids = llm.engine.tokenizer.encode(text)
    windows = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    return windows[:limit]


def perplexity(llm: LLM, windows: Sequence[list[int]]) -> float:
    logprobs = [lp for score in llm.score(list(windows)) for lp in score.logprobs]
    return math.exp(-sum(logprobs) / len(logprobs))


@dataclass(frozen=True)
class GreedyComparison:
    """One prompt's greedy tokens under the reference and the engine checked."""

    reference: list[int]
    tokens: list[int]
    first_difference: int | None  # index of the first differing token; None: all equal
    reference_gap: float | None  # the reference's top-two logprob gap there

    @property
    def near_tie(self) -> bool:
        """Equal, or first different where the reference was nearly undecided."""
        return self.first_difference is None or (
            self.reference_gap is not None and self.reference_gap < QUANTIZED_TIE_GAP)


def greedy_agreement(reference: LLM, llm: LLM, prompts: Sequence[list[int] | str],
                     max_tokens: int, lora_request: LoRARequest | None = None
                     ) -> list[GreedyComparison]:
    """Each prompt's greedy tokens under `reference` and `llm` (both with the LoRA adapter
    `lora_request`, if given)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=2)
    want = reference.generate(list(prompts), params, lora_request=lora_request)
    got = llm.generate(list(prompts), params, lora_request=lora_request)
    out = []
    for ref, mine in zip(want, got, strict=True):
        a, b = ref.outputs[0], mine.outputs[0]
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids,
                                                         strict=True)) if x != y), None)
        gap = None
        if first is not None and a.logprobs is not None:
            top = sorted((entry.logprob for entry in a.logprobs[first].values()),
                         reverse=True)
            gap = top[0] - top[1] if len(top) > 1 else math.inf
        out.append(GreedyComparison(list(a.token_ids), list(b.token_ids), first, gap))
    return out
