"""HuggingFace `transformers` as the correctness reference, and the one near-tie rule for
every comparison of tokens, ranks and logprobs.

Two code paths (transformers and Tandem, or Tandem with and without speculation, or the
same code under another oneDNN ISA: AVX2, AVX-512, AMX) round differently, by about 1e-6
in fp32. Whatever that noise can flip is not compared; everything it cannot is, exactly:
* tokens: identical up to the first step where the reference's top-two logit gap is
  below GAP_TIE (`assert_matches` reports how many it checked, so a test can insist that
  most of them were);
* logprobs: within LOGPROB_TOL;
* ranks: equal only where they are decided by a margin, i.e. where the token's logprob
  is more than LOGPROB_TOL from every other listed entry's and the neighbours of its rank
  are listed. A sampled token outside the top-k (rank 120, say) has unlisted neighbours
  in the dense tail of the distribution, so only its logprob is compared (`same_logprobs`).
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
    return greedy_reference(_model(str(path)), prompt, max_new_tokens)


@cache
def hf_lora_greedy(path: Path, adapter: Path, prompt: tuple[int, ...],
                   max_new_tokens: int) -> Reference:
    """transformers + PEFT: the checkpoint at `path` with the PEFT adapter at `adapter`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    base.generation_config.eos_token_id = None
    base.generation_config.pad_token_id = 0
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    return greedy_reference(model, prompt, max_new_tokens)


def greedy_reference(model, prompt: tuple[int, ...], max_new_tokens: int) -> Reference:
    """A transformers model's greedy continuation of `prompt`, with each step's top-two
    gap and the chosen token's logprob."""
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


def assert_outputs_match(model_dir: Path, prompts: list[list[int]], outputs,
                         max_new_tokens: int) -> None:
    """Each greedy output (`max_new_tokens` tokens, finished by length, with its logprobs)
    against transformers on the same checkpoint, by the near-tie rule; at least 90 % of
    all tokens must be decisive, so the comparison covers the sequences and does not stop
    at an early near-tie."""
    compared = total = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        ref = hf_greedy(model_dir, tuple(prompt), max_new_tokens)
        logprobs = [next(iter(step.values())).logprob for step in completion.logprobs]
        compared += assert_matches(ref, completion.token_ids, logprobs)
        total += max_new_tokens
        assert len(completion.token_ids) == max_new_tokens
        assert completion.finish_reason == "length"
    assert compared >= 0.9 * total, f"only {compared}/{total} tokens were decisive"


def same_logprobs(want: dict, got: dict, tol: float = LOGPROB_TOL) -> list[str]:
    """The near-tie rule for one step's logprobs entries ({token: Logprob(logprob, rank)},
    the engine's form): what differs beyond noise, as messages (empty when they agree).

    Every token in both entries has logprobs within `tol`. A token listed in only one is
    allowed only where it sits at the top-k boundary within `tol` of an entry the other
    lists. A rank must match where it is decided by a margin: the token's rank-neighbours
    (rank - 1 and rank + 1, where they exist) are listed and more than `tol` away."""
    problems = []
    by_rank = {e.rank: e.logprob for e in want.values()}
    for token in want.keys() | got.keys():
        if token not in got or token not in want:
            mine = (want.get(token) or got.get(token)).logprob
            other = got if token in want else want
            if not any(abs(mine - e.logprob) <= tol for e in other.values()):
                problems.append(f"token {token} (logprob {mine}) listed on one side only")
            continue
        a, b = want[token], got[token]
        if abs(a.logprob - b.logprob) > tol:
            problems.append(f"token {token}: logprob {b.logprob} vs {a.logprob}")
            continue
        neighbours = [r for r in (a.rank - 1, a.rank + 1) if r >= 1]
        decided = all(r in by_rank and abs(by_rank[r] - a.logprob) > tol for r in neighbours)
        if decided and a.rank != b.rank:
            problems.append(f"token {token}: rank {b.rank} vs {a.rank} with logprob "
                            f"{b.logprob} vs {a.logprob}, decided by more than {tol}")
    return problems


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
