"""HuggingFace `transformers` as the correctness reference, and how to compare against it.

Greedy decoding on random weights can flip between two tokens whose logits differ by
float noise (about 1e-6 in fp32 between batch layouts, see ENVIRONMENT.md). So a
comparison requires identical tokens up to the first step where the reference's
top-two logit gap is below GAP_TIE, and reports how many tokens it checked, so a test
can insist that most of them were.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
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
    return hf_model_from_gguf(Path(folder) / gguf_file)


def _reference_cache(gguf: Path) -> Path:
    """Where transformers' conversion of this GGUF file is kept: keyed by the file's
    bytes and the transformers version, so a new file or a new converter converts again."""
    import transformers

    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    digest.update(transformers.__version__.encode())
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "tandem" / "test-reference" / digest.hexdigest()[:24]


def _convert(gguf: Path, folder: Path) -> None:
    """transformers' own GGUF conversion (dequantize, un-permute), saved as safetensors.
    transformers refuses save_pretrained on a model loaded from GGUF, so the state dict
    and the config are written by hand; loading them back gives the same tensors."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".converting-"))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        model.config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _converted(gguf: Path) -> Path:
    folder = _reference_cache(gguf)
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            _convert(gguf, folder)
        except OSError:
            if not folder.is_dir():  # not merely another run converting it first
                raise
    return folder


def hf_tokenizer_from_gguf(gguf: Path):
    """transformers' tokenizer of a GGUF checkpoint (converted once per machine, as the
    model is)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_converted(gguf))


def hf_model_from_gguf(gguf: Path):
    """transformers' model of a GGUF checkpoint, in fp32. The conversion (about 50 s for
    SmolLM2's Q8_0 file, with its tokenizer) runs once per machine; later runs load the
    saved tensors."""
    from transformers import AutoModelForCausalLM

    folder = _converted(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model.eval()
