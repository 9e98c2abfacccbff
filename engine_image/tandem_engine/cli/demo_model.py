"""Deterministic demo checkpoints: a real HuggingFace-format folder with no hub access.

Tests, the quickstart and the benchmarks need a Llama-family checkpoint that
`transformers` can load as the correctness reference, but nothing can be
downloaded here. `write_demo_model` builds one offline: a byte-level BPE
tokenizer trained on the bundled corpus and random weights drawn from an
explicitly seeded generator, so the same (arch, seed, size) always gives
byte-identical files (for given torch, safetensors and tokenizers versions).

Standard random init gives nearly flat logits, and greedy decoding then flips
on rounding noise. `_INIT` uses larger scales instead: measured with
transformers in float32 (20+ prompts x 32 greedy tokens per arch), the top-two
logit gap is at least 1e-3 at 99.7-100% of steps, and continuations still
differ from prompt to prompt without collapsing into one repeated token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from tandem_engine.config import DEMO_MODEL_SIZES
from tandem_engine.model.families import DEMO_FAMILIES
from tandem_engine.model.family import DemoRecipe, DemoShape, ModelConfig
from tandem_engine.model.family import family_named as _family_named
from tandem_engine.model.mtp import random_heads
from tandem_engine.tokenizer import GGUF_PRE_TOKENIZERS

ARCHITECTURES = DEMO_FAMILIES  # the registry's families with a demo recipe
SIZES = DEMO_MODEL_SIZES
# Told each step of `write_demo_model` as it starts: (phase, detail), e.g.
# ("drawing the random weights", "tensor 3 of 21").
ProgressCallback = Callable[[str, str], None]

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
BOS_TOKEN = "<|begin_of_text|>"  # prepended by the demos whose recipe says so (llama)
# Trained first, so their ids are 0..3 in every demo tokenizer.
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END, BOS_TOKEN)
# The bundled corpus supports up to ~3,900 tokens (merging pairs seen once). A multiple
# of 64, so the model's vocabulary has no ids the tokenizer cannot decode.
TOKENIZER_VOCAB_SIZE = 2048


# ChatML. A BOS demo's template starts with the BOS token, so a rendered chat
# prompt must be encoded with add_special_tokens=False (as transformers does).
_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# head_dim: for families with an explicit one (qwen3), deliberately != hidden/heads in
# tiny; original_context: llama's rope_scaling.original_max_position_embeddings.
_SHAPES = {
    "tiny": DemoShape(64, 2, 4, 2, 192, 1024, head_dim=32, original_context=256),
    "small": DemoShape(768, 16, 12, 4, 2048, 2048, head_dim=64, original_context=512),
    "1b": DemoShape(2048, 16, 32, 8, 8192, 4096, head_dim=128, original_context=1024),
}


@dataclass(frozen=True)
class _InitScale:
    """Scales of the random weights; matrices are Gaussian, norm weights uniform."""

    embed: float  # embed_tokens std = embed / sqrt(hidden): rows have norm ~ embed
    lm_head: float  # lm_head std = lm_head / sqrt(hidden)
    proj: float  # q/k/v/gate/up std = proj / sqrt(fan_in); sets attention sharpness
    # o_proj/down_proj std = resid / sqrt(fan_in). They write the residual stream, and
    # must outweigh the token's own embedding: otherwise a tied model's logits favour
    # the input token and greedy decoding repeats it forever.
    resid: float
    final_norm: float  # model.norm weights = final_norm * (1 + jitter): logit std ~ 8
    norm_jitter: float  # every RMSNorm weight = 1 + uniform(-jitter, jitter)
    bias: float  # q/k/v bias std (qwen2)


_INIT = _InitScale(
    embed=4.0, lm_head=4.0, proj=2.0, resid=4.0, final_norm=2.0, norm_jitter=0.25, bias=0.1
)


def demo_hf_config(arch: str = "llama", size: str = "tiny") -> dict[str, Any]:
    """The config.json of a demo model, in the transformers 4.x spelling
    (`rope_theta`, `rope_scaling`, `torch_dtype`) that 5.x also reads."""
    _check_choice("arch", arch, ARCHITECTURES)
    _check_choice("size", size, SIZES)
    s = _SHAPES[size]
    eos_id = SPECIAL_TOKENS.index(EOS_TOKEN)
    common: dict[str, Any] = {
        "vocab_size": TOKENIZER_VOCAB_SIZE,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    config = _recipe(arch).config(s, common)
    if _recipe(arch).bos:
        config["bos_token_id"] = SPECIAL_TOKENS.index(BOS_TOKEN)
    return config


def train_demo_tokenizer(arch: str = "llama") -> Tokenizer:
    """Byte-level BPE trained on the bundled corpus; deterministic for a given
    `tokenizers` version; split by the family recipe's pre-tokenizer, and prepending BOS
    on encode where the recipe says so (llama)."""
    _check_choice("arch", arch, ARCHITECTURES)
    recipe = _recipe(arch)
    corpus = resources.files("tandem_engine").joinpath("data/corpus.txt").read_text("utf-8")
    tok = Tokenizer(models.BPE())
    # The pipeline Qwen2 tokenizer.json files declare. transformers 5 rebuilds every
    # model_type=qwen2 tokenizer with exactly this pipeline, ignoring tokenizer.json's,
    # so any other choice would make the reference tokenize differently from the engine.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZERS[recipe.pre_tokenizer]),
                             behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    if tok.get_vocab_size() != TOKENIZER_VOCAB_SIZE:
        raise RuntimeError(
            f"demo tokenizer: the corpus gave {tok.get_vocab_size()} tokens, expected "
            f"{TOKENIZER_VOCAB_SIZE}; the corpus in tandem_engine/data is too small"
        )
    if recipe.bos:
        bos_id = SPECIAL_TOKENS.index(BOS_TOKEN)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, bos_id)],
        )
    return tok


def demo_weights(config: ModelConfig, seed: int = 0,
                 progress: ProgressCallback | None = None) -> dict[str, torch.Tensor]:
    """Random float32 weights for every tensor of `config`, drawn in a fixed order
    from a generator seeded with `seed`."""
    gen = torch.Generator().manual_seed(seed)
    init = _INIT
    out: dict[str, torch.Tensor] = {}
    shapes = config.expected_tensors()
    for i, (name, shape) in enumerate(shapes.items()):
        if progress is not None:
            progress("drawing the random weights", f"tensor {i + 1} of {len(shapes)}")
        if name.endswith("norm.weight"):
            t = 1.0 + init.norm_jitter * (2.0 * torch.rand(shape, generator=gen) - 1.0)
            if name == "model.norm.weight":
                t = init.final_norm * t
        elif name.endswith(".bias"):
            t = init.bias * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            t = (init.embed / config.hidden_size**0.5) * torch.randn(shape, generator=gen)
        elif name == "lm_head.weight":
            t = (init.lm_head / config.hidden_size**0.5) * torch.randn(shape, generator=gen)
        else:
            gain = init.resid if name.endswith(("o_proj.weight", "down_proj.weight")) else init.proj
            t = (gain / shape[1] ** 0.5) * torch.randn(shape, generator=gen)
        out[name] = t.contiguous()
    return out


def write_demo_model(
    path: str | Path, arch: str = "llama", seed: int = 0, size: str = "tiny",
    progress: ProgressCallback | None = None, mtp_heads: int = 0,
) -> Path:
    """Write a demo checkpoint folder (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, generation_config.json) and return its path; `progress`, when
    given, is told each step as it starts. `mtp_heads` > 0 adds that many random
    multi-token-prediction heads (model/mtp.py; config.json's num_mtp_heads), drawn from a
    generator of their own (seed + 1), so the model's own weights are those of the same
    seed without heads.

    The same (arch, seed, size, mtp_heads) always gives byte-identical files."""
    def step(phase: str, detail: str = "") -> None:
        if progress is not None:
            progress(phase, detail)

    _check_choice("arch", arch, ARCHITECTURES)
    _check_choice("size", size, SIZES)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)

    hf_config = demo_hf_config(arch, size)
    config = ModelConfig.from_hf_dict(hf_config, source=f"demo {arch}/{size}")
    step("training the tokenizer", f"{TOKENIZER_VOCAB_SIZE} tokens")
    tokenizer = train_demo_tokenizer(arch)

    if mtp_heads < 0:
        raise ValueError(f"demo model mtp_heads={mtp_heads} must be 0 or more")
    if mtp_heads:
        hf_config["num_mtp_heads"] = mtp_heads
    _write_json(folder / "config.json", hf_config)
    weights = demo_weights(config, seed, progress)
    if mtp_heads:
        gen = torch.Generator().manual_seed(seed + 1)
        weights.update(random_heads(config.hidden_size, mtp_heads, gen).tensors())
    size_mb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e6
    step("writing model.safetensors", f"{size_mb:.1f} MB")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    step("writing the tokenizer and configs")
    tokenizer.save(str(folder / "tokenizer.json"), pretty=True)
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(arch, hf_config))
    _write_json(folder / "generation_config.json", _generation_config(hf_config))
    return folder


def _tokenizer_config(arch: str, hf_config: dict[str, Any]) -> dict[str, Any]:
    bos = _recipe(arch).bos
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN if bos else None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "model_max_length": hf_config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        "chat_template": ("{{- bos_token }}" if bos else "") + _CHATML,
    }


def _generation_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    # A chat turn ends with <|im_end|>, plain text with <|endoftext|>: stop on both.
    out: dict[str, Any] = {
        "eos_token_id": [SPECIAL_TOKENS.index(EOS_TOKEN), SPECIAL_TOKENS.index(IM_END)],
        "pad_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
    }
    if "bos_token_id" in hf_config:
        out["bos_token_id"] = hf_config["bos_token_id"]
    return out


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _recipe(arch: str) -> DemoRecipe:
    recipe = _family_named(arch).demo
    assert recipe is not None, f"{arch} is in ARCHITECTURES only with a demo recipe"
    return recipe


def _check_choice(what: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"demo model {what} {value!r} is not supported; use one of "
                         f"{', '.join(allowed)}")
