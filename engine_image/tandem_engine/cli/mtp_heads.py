"""`tandem mtp-heads fit`: give a checkpoint multi-token-prediction heads that predict.

Self-distillation in closed form: the target generates greedily from prompts cut out of
the packaged corpus (data/corpus.txt), its final-normed hidden states over each prompt's
last position and the generated tokens are collected, and each head is fitted by ridge
least squares so that h_t + W_i h_t + U_i e(x_{t+1}) + b_i ≈ h_{t+1+i}
(`model.mtp.fit_heads`, a linear residual head reading the emitted token's embedding too:
config.json's mtp_hidden_act "identity", mtp_token_input true). The target's greedy tokens are
what the heads must guess for proposals to be accepted, so they are the training text.
A held-out eighth of the sequences measures how often head i's argmax equals the token
the target generated there. (Given a few prompts of its own and a tiny ridge, the fit
memorizes them: the tests use that to get heads whose proposals are accepted.)

The output is an HF checkpoint folder: a copy of the model's files (a GGUF target is
exported first, as `tandem models pull --format hf` does) with every tensor in one
model.safetensors, the heads added, and num_mtp_heads/mtp_hidden_act in config.json.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem_engine.config import (
    DEFAULT_MTP_FIT_PROMPTS as DEFAULT_PROMPTS,
)
from tandem_engine.config import (
    DEFAULT_MTP_FIT_RIDGE as DEFAULT_RIDGE,
)
from tandem_engine.config import (
    DEFAULT_MTP_FIT_TOKENS as DEFAULT_TOKENS,
)
from tandem_engine.model.attention import GatherBuffers, build_metadata
from tandem_engine.model.checkpoint import INDEX_NAME, WEIGHTS_NAME, load_checkpoint
from tandem_engine.model.family import ModelConfig
from tandem_engine.model.layers import DecoderModel, build_model
from tandem_engine.model.mtp import MtpHeads, fit_heads, take_mtp_heads
from tandem_engine.weights import is_gguf_path

DEFAULT_PROMPT_TOKENS = 16
_KV_BLOCK = 16


@dataclass(frozen=True)
class FitReport:
    path: Path
    num_heads: int
    num_positions: int  # training positions of head 0
    held_out_agreement: tuple[float, ...]  # per head: argmax == the target's token


def corpus_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens at evenly spaced offsets of the packaged corpus."""
    text = resources.files("tandem_engine").joinpath("data/corpus.txt").read_text("utf-8")
    ids = tokenizer.encode(text)
    if len(ids) < length + count:
        raise ValueError(f"the corpus has {len(ids)} tokens: too few for {count} prompts "
                         f"of {length}")
    stride = (len(ids) - length) // count
    return [ids[i * stride:i * stride + length] for i in range(count)]


@torch.inference_mode()
def hidden_states(model: DecoderModel, token_ids: list[int]) -> torch.Tensor:
    """[L, hidden] final-normed hidden states of every position of one sequence (one
    prefill into a scratch KV pool of its own)."""
    c = model.config
    weight = next(model.parameters())
    device = weight.device
    n = len(token_ids)
    blocks = math.ceil(n / _KV_BLOCK)
    kv = torch.zeros(c.num_layers, 2, blocks, _KV_BLOCK, c.num_kv_heads, c.head_dim,
                     dtype=weight.dtype, device=device)
    meta = build_metadata([], [], [(0, n, list(range(blocks)))], list(range(n)), _KV_BLOCK,
                          device, GatherBuffers())
    positions = torch.arange(n, device=device)
    return model(torch.tensor(token_ids, device=device), positions, kv, meta).float()


def fit_checkpoint(model_path: str | Path, out: str | Path, num_heads: int, *,
                   prompts: int | list[list[int]] = DEFAULT_PROMPTS,
                   tokens: int = DEFAULT_TOKENS, prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
                   ridge: float = DEFAULT_RIDGE, token_input: bool = True,
                   device: str = "cpu", log: Callable[[str], None] = print) -> FitReport:
    """Fit `num_heads` heads to the checkpoint at `model_path` and write the checkpoint
    with them to the folder `out` (module docstring). Existing heads are replaced.
    `token_input`: the heads also read the emitted token's embedding (mtp_token_input;
    on the real model it doubles head 0's agreement), else they read h alone (Medusa).
    `prompts`: how many corpus prompts of `prompt_tokens` tokens, or the prompts' token
    ids themselves. With 8 or more, an eighth of them is held out to measure agreement;
    with fewer, agreement is measured on the training sequences."""
    from tandem_engine.engine.llm import LLM
    from tandem_engine.sampling_params import SamplingParams

    if num_heads < 1:
        raise ValueError(f"--heads {num_heads}: fit at least one head")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty folder; give a new one")
    count = prompts if isinstance(prompts, int) else len(prompts)
    llm = LLM(model_path, device=device, max_num_seqs=count)
    starts = (corpus_prompts(llm.tokenizer, prompts, prompt_tokens)
              if isinstance(prompts, int) else [list(p) for p in prompts])
    log(f"generating {tokens} greedy tokens for {count} prompts")
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    generated = [list(o.outputs[0].token_ids) for o in llm.generate(starts, params)]
    del llm

    config, tensors = load_checkpoint(model_path, "float32")
    take_mtp_heads(config, tensors)
    model = build_model(config, dict(tensors), torch.device(device),
                        max(len(s) + len(g) for s, g in zip(starts, generated, strict=True)))
    log("collecting the hidden states")
    # From each prompt's last position on: the states whose next tokens the target chose
    # (states[j][t] produced generated[j][t]).
    states = [hidden_states(model, start + gen)[len(start) - 1:].cpu()
              for start, gen in zip(starts, generated, strict=True)]
    held = len(states) // 8
    train = states[held:]
    log(f"fitting {num_heads} heads on {len(train)} sequences")
    with torch.no_grad():
        embeds = ([model.embed(torch.tensor(g, device=device)).cpu().float()
                   for g in generated] if token_input else None)
    heads = fit_heads(train, num_heads, ridge, None if embeds is None else embeds[held:])
    agreement = _agreement(model, heads, states[:held] or train, generated[:held] or
                           generated, device)
    path = _write(model_path, out, config, tensors, heads)
    return FitReport(path, num_heads, sum(len(s) - 1 for s in train), agreement)


@torch.inference_mode()
def _agreement(model: DecoderModel, heads: MtpHeads, states: list[torch.Tensor],
               generated: list[list[int]], device: str) -> tuple[float, ...]:
    """Per head i: the fraction of held-out positions t where head i's argmax is the token
    the target generated at t + 2 + i. (states[j][t] is the state whose lm_head gives
    generated[j][t].)"""
    heads = heads.to(torch.device(device), torch.float32)
    rates = []
    for i in range(heads.num_heads):
        hits = total = 0
        for state, toks in zip(states, generated, strict=True):
            n = len(toks) - 1 - i
            if n <= 0:
                continue
            e = (None if heads.token_weight is None
                 else model.embed(torch.tensor(toks[:n], device=device)))
            guess = heads.propose(state[:n].to(device), i + 1, model.logits, e)
            hits += sum(g[i] == t for g, t in zip(guess, toks[1 + i:], strict=True))
            total += n
        rates.append(hits / max(total, 1))
    return tuple(rates)


def _write(model_path: str | Path, out: Path, config: ModelConfig,
           tensors: dict[str, torch.Tensor], heads: MtpHeads) -> Path:
    if is_gguf_path(model_path):
        from tandem_engine.model.gguf import export_hf_folder

        export_hf_folder(model_path, out, dtype="float32")
    else:
        out.mkdir(parents=True, exist_ok=True)
        for item in Path(model_path).iterdir():
            # Not the weights (rewritten below), nor dot files such as a pull's stamp
            # (this folder is no longer what it came from).
            if (item.is_file() and item.suffix != ".safetensors" and item.name != INDEX_NAME
                    and not item.name.startswith(".")):
                shutil.copy2(item, out / item.name)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[config.dtype]
    weights = {name: t.to(dtype).contiguous() for name, t in tensors.items()}
    weights.update({name: t.to(dtype) for name, t in heads.tensors().items()})
    save_file(weights, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    config_file = out / "config.json"
    raw = json.loads(config_file.read_text(encoding="utf-8"))
    raw.update(num_mtp_heads=heads.num_heads, mtp_hidden_act=heads.act,
               mtp_token_input=heads.token_weight is not None)
    config_file.write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n",
                           encoding="utf-8")
    return out
