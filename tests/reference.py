"""HuggingFace `transformers` as the correctness reference, and how to compare against it.

Greedy decoding on random weights can flip between two tokens whose logits differ by
float noise (about 1e-6 in fp32 between batch layouts, see ENVIRONMENT.md). So a
comparison requires identical tokens up to the first step where the reference's
top-two logit gap is below GAP_TIE, and reports how many tokens it checked, so a test
can insist that most of them were.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

# Steps whose top-two gap is below this may flip on float noise (measured ~1e-6).
GAP_TIE = 1e-3
# Teacher-forced logprobs: measured fp32 differences across batch layouts reach ~2e-6;
# 1e-4 leaves 50x headroom yet catches any wrong position, mask or KV block.
LOGPROB_TOL = 1e-4


@dataclass(frozen=True)
class Reference:
    tokens: tuple[int, ...]
    gaps: tuple[float, ...]  # top-two logit gap at each step
    logprobs: tuple[float, ...]  # logprob of each greedy token

    def comparable_prefix(self) -> int:
        """How many leading tokens are decided by a clear margin."""
        for i, gap in enumerate(self.gaps):
            if gap < GAP_TIE:
                return i
        return len(self.tokens)


@cache
def _model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


@cache
def hf_greedy(path: Path, prompt: tuple[int, ...], max_new_tokens: int) -> Reference:
    model = _model(str(path))
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack(out.logits)[:, 0].float()
    top2 = logits.topk(2, dim=-1).values
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return Reference(tuple(tokens), tuple((top2[:, 0] - top2[:, 1]).tolist()),
                     tuple(logprobs.tolist()))


def assert_matches(reference: Reference, tokens: list[int],
                   logprobs: list[float] | None = None) -> int:
    """Assert tokens (and logprobs) agree with the reference; return tokens compared."""
    n = reference.comparable_prefix()
    assert list(tokens[:n]) == list(reference.tokens[:n]), (
        f"greedy tokens differ from transformers within the first {n} decisive steps:\n"
        f"  tandem: {tokens[:n]}\n  hf:     {list(reference.tokens[:n])}")
    if logprobs is not None:
        for i in range(n):
            assert abs(logprobs[i] - reference.logprobs[i]) < LOGPROB_TOL, (
                f"step {i}: logprob {logprobs[i]} vs transformers {reference.logprobs[i]}")
    return n


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids 0..3 are the demo tokenizer's special tokens; prompts are ordinary text tokens.
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_prompt_logprobs(path: Path, prompt: tuple[int, ...], gguf_file: str | None = None
                       ) -> list[float]:
    """Teacher-forced logprob of every prompt token after the first (transformers)."""
    model = _model(str(path)) if gguf_file is None else _gguf_model(str(path), gguf_file)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], -1)
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


@cache
def _gguf_model(folder: str, gguf_file: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file,
                                                 dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()
