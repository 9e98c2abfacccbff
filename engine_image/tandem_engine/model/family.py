"""Model families: one registry entry per architecture, and the config every family shares.

A `Family` says everything the rest of the engine needs to know about an architecture:
which HuggingFace `architectures` it serves and how it reads their config.json (its
HF-config rule), which tensors a checkpoint of a config holds and their shapes (the
tensor layout the loader, the refit check, the GGUF reader and the demo writer validate
against), the model class that runs it (imported on first use, so this module stays
torch-free), its GGUF layout (llama.cpp's architecture, metadata prefix, tensor names,
what the converter did to the tensors and the family's own metadata keys, when GGUF files
of it are read), and its demo checkpoint (`tandem demo-model
--arch`: the config.json at a demo shape, and the pre-tokenizer and BOS rule of the
demo tokenizer). `--arch`, the demo writer, the draft and mtp tools, the runner and the
CUDA graphs all read the registry (`model/families.py`: `FAMILIES`); a new family is a
model file and an entry there.

Torch-free on purpose: the `tandem` parser (its `--arch` choices) reads the registry
without paying for torch, and config parsing needs none. The pre-tokenizer regexes
themselves stay in `tokenizer.py`, keyed by the GGUF's `tokenizer.ggml.pre`: one
architecture ships with many of them (a Llama GGUF may be llama-bpe, smollm or
tekken), and the router, which never imports `model/`, builds GGUF tokenizers too.

A model class built from an entry is an `nn.Module` constructed as `cls(config)` (on
the meta device; the checkpoint's tensors are then assigned by name) and exposes:
`prepare_positions(max_positions)` (its RoPE tables, once the weights are on their
device), `forward(input_ids [T], positions [T], kv_cache, meta)` -> final-normed hidden
states [T, hidden], `embed(input_ids)` -> the input embedding, and
`logits(hidden)` -> float32 logits. Nothing outside the family reaches into its
modules (`model/layers.DecoderModel`).
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem_engine.config import MTP_HIDDEN_ACTS, normalize_dtype
from tandem_engine.errors import CheckpointError, path_problem

if TYPE_CHECKING:
    from tandem_engine.gguf_file import GGUFFile

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | llama3 | linear
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (Qwen3-MoE): a linear router picks `experts_per_token`
    of `num_experts` SiLU experts per token; the token's MLP output is their sum weighted
    by the router's softmax (renormalized over the chosen ones with `normalize_top_k`)."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int  # of one expert (moe_intermediate_size)
    normalize_top_k: bool  # norm_topk_prob
    # layers whose MLP is dense (ModelConfig.intermediate_size) instead: mlp_only_layers,
    # and those decoder_sparse_step skips
    dense_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """The shape and options of one checkpoint, as its family's HF-config rule read them.
    `qkv_bias`, `o_bias`, `mlp_bias` and `qk_norm` are options of the Llama decoder
    (model/llama.py); another family's own structure lives in its tensor layout."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, or Llama/Mistral with attention_bias
    o_bias: bool = False  # Llama/Mistral with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Multi-token-prediction heads stored beside the model (`mtp.{i}.weight`, optional
    # `mtp.{i}.bias`; model/mtp.py): config.json's "num_mtp_heads" (0: none) and
    # "mtp_hidden_act" (silu, Medusa's residual block; identity, a linear residual).
    num_mtp_heads: int = 0
    mtp_hidden_act: str = "silu"
    # "mtp_token_input": each head also reads the embedding of the token just emitted
    # (`mtp.{i}.token_weight`).
    mtp_token_input: bool = False
    # Sliding-window attention (Gemma 3): per layer "sliding_attention" or
    # "full_attention" (HF's layer_types; empty: every layer full), the window of the
    # sliding ones (a query sees its own and window - 1 earlier keys) and their RoPE.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    local_rope: RopeConfig | None = None
    attention_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    moe: MoEConfig | None = None  # the experts of a mixture-of-experts family (Qwen3-MoE)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if (problem := path_problem(file, "file")) == "does not exist":
            raise CheckpointError(
                f"{file}: missing; a checkpoint folder needs config.json "
                "(HuggingFace format: config.json + *.safetensors + tokenizer.json)"
            )
        if problem is not None:
            raise CheckpointError(f"{file} {problem}")
        try:
            raw = json.loads(file.read_text())
        except OSError as exc:
            raise CheckpointError(f"{file}: cannot read ({exc.strerror or exc})") from exc
        except ValueError as exc:
            raise CheckpointError(f"{file}: not valid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"{file}: expected a JSON object, got {type(raw).__name__}")
        return cls.from_hf_dict(raw, source=str(file))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """The config of an HF config.json, by the rule of the family of its first
        `architectures` entry."""
        archs = raw.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs else None
        family = _BY_ARCHITECTURE.get(arch) if isinstance(arch, str) else None
        if family is None:
            raise CheckpointError(
                f"{source}: architecture {arch!r} is not supported; "
                f"supported: {', '.join(_BY_ARCHITECTURE)}"
            )
        return family.config_from_hf(raw, source, arch)

    @property
    def family(self) -> Family:
        return _BY_ARCHITECTURE[self.architecture]

    def shape_fields(self) -> dict[str, Any]:
        """The fields that shape the parameters: two checkpoints are weight-compatible
        (a refit may swap one for the other) exactly when these agree."""
        return {
            "architecture": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "tie_word_embeddings": self.tie_word_embeddings,
            "qkv_bias": self.qkv_bias,
            "o_bias": self.o_bias,
            "mlp_bias": self.mlp_bias,
            "qk_norm": self.qk_norm,
            "moe": self.moe,
        }

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor name a checkpoint of this config holds, with its shape (the
        family's tensor layout)."""
        return self.family.tensors(self)

    def mtp_tensors(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """The multi-token-prediction heads' tensors (model/mtp.py): the required ones
        (`mtp.{i}.weight`, and `mtp.{i}.token_weight` with mtp_token_input) and the
        optional ones (`mtp.{i}.bias`), with their shapes. Kept out of
        `expected_tensors`: the heads are not part of the model."""
        h = self.hidden_size
        required = {f"mtp.{i}.weight": (h, h) for i in range(self.num_mtp_heads)}
        if self.mtp_token_input:
            required.update({f"mtp.{i}.token_weight": (h, h)
                             for i in range(self.num_mtp_heads)})
        optional = {f"mtp.{i}.bias": (h,) for i in range(self.num_mtp_heads)}
        return required, optional

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


# ---- a registry entry ------------------------------------------------------------------------

@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp stores a family: `general.architecture` (also the metadata keys'
    prefix), the tensor names (HF name -> GGUF name; per layer inside `blk.N.`), what its
    converter does to the tensors, and the family's own metadata."""

    architecture: str
    global_names: Mapping[str, str]
    layer_names: Mapping[str, str]  # HF module inside model.layers.N. -> GGUF inside blk.N.
    # llama.cpp's converter interleaves each head's q/k rows for this architecture (its
    # RoPE rotates adjacent pairs); loading undoes it.
    rotary_rows_permuted: bool = True
    # llama.cpp's converter adds this to every norm weight (the HF names ending in
    # "norm.weight"): Gemma's RMSNorms scale by (1 + w), llama.cpp's by w. Loading
    # subtracts it.
    norm_shift: float = 0.0
    # The family's config.json beyond the keys model/gguf.py reads for every family
    # (shape, RoPE base and scaling, norm epsilon, biases, vocabulary): (the file, that
    # config) -> the family's config. None: those keys are all of it.
    hf_config: Callable[[GGUFFile, dict[str, Any]], dict[str, Any]] | None = None
    # Experts stored one by one in HF checkpoints (`mlp.experts.{e}.<projection>.weight`)
    # and stacked into one [E, ...] tensor per projection in GGUF files: projection ->
    # GGUF name inside blk.N. (e.g. gate_proj -> ffn_gate_exps); empty: no experts.
    expert_names: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DemoShape:
    """A `tandem demo-model --size`: the dimensions every family's demo shares."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    head_dim: int  # for families with an explicit head_dim (deliberately != hidden/heads)
    original_context: int  # for RoPE scaling with a shorter "original" context


@dataclass(frozen=True)
class DemoRecipe:
    """A family's demo checkpoint (cli/demo_model.py)."""

    # config.json at a shape, given the keys every demo shares (vocabulary, sizes, EOS):
    # in the transformers 4.x spelling that 5.x also reads
    config: Callable[[DemoShape, dict[str, Any]], dict[str, Any]]
    # the demo tokenizer's split (a tokenizer.GGUF_PRE_TOKENIZERS name) and whether it
    # prepends BOS on encode (its chat template then starts with BOS too)
    pre_tokenizer: str = "qwen2"
    bos: bool = False


@dataclass(frozen=True)
class Family:
    name: str  # `tandem demo-model --arch`, logs
    architectures: tuple[str, ...]  # the HF `architectures` names it serves
    # "module:Class" of the nn.Module that runs it, imported by `model_class()` (torch)
    model_path: str
    # the HF-config rule: (config.json, where it came from, architecture) -> ModelConfig
    config_from_hf: Callable[[dict[str, Any], str, str], ModelConfig]
    tensors: Callable[[ModelConfig], dict[str, tuple[int, ...]]]  # the tensor layout
    gguf: GGUFLayout | None = None  # None: no GGUF files of this family are read
    demo: DemoRecipe | None = None  # None: `tandem demo-model` does not offer it
    # Whether every layer's attention runs on the flex backend's masks (and so in CUDA
    # graphs); False keeps the family on the gather path.
    flex_attention: bool = True
    layer_prefix: str = "model.layers."  # tensors of decoder layer N start with it + "N."

    def model_class(self) -> type:
        module, _, name = self.model_path.partition(":")
        return getattr(importlib.import_module(module), name)

    def layer_of(self, tensor_name: str) -> int | None:
        """The decoder layer a tensor belongs to; None for the embedding, final norm,
        head and anything else outside the layers."""
        if not tensor_name.startswith(self.layer_prefix):
            return None
        index, dot, _ = tensor_name[len(self.layer_prefix):].partition(".")
        return int(index) if dot and index.isdigit() else None


# ---- config.json fields every decoder-only family reads ------------------------------------

def decoder_fields(raw: dict[str, Any], source: str, arch: str) -> dict[str, Any]:
    """The ModelConfig fields every decoder-only family reads the same way from config.json
    (both transformers spellings); a family's rule adds or overrides its own."""

    def need(key: str) -> Any:
        if key not in raw:
            raise CheckpointError(f"{source}: field {key!r} is required for {arch}")
        return raw[key]

    hidden = positive_int(source, "hidden_size", need("hidden_size"))
    heads = positive_int(source, "num_attention_heads", need("num_attention_heads"))
    kv_heads = positive_int(source, "num_key_value_heads",
                            raw.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads}"
        )
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(
                f"{source}: hidden_size={hidden} is not divisible by "
                f"num_attention_heads={heads}; set head_dim"
            )
        head_dim = hidden // heads
    head_dim = positive_int(source, "head_dim", head_dim)
    if head_dim % 2:
        raise CheckpointError(f"{source}: head_dim={head_dim} must be even for RoPE")

    num_mtp_heads = raw.get("num_mtp_heads", 0)
    if not is_int(num_mtp_heads) or num_mtp_heads < 0:
        raise CheckpointError(f"{source}: num_mtp_heads must be a non-negative integer "
                              f"(the multi-token-prediction heads stored as mtp.{{i}}.weight),"
                              f" got {num_mtp_heads!r}")
    mtp_act = raw.get("mtp_hidden_act", "silu")
    if mtp_act not in MTP_HIDDEN_ACTS:
        raise CheckpointError(f"{source}: mtp_hidden_act {mtp_act!r} is not supported; "
                              f"use one of {', '.join(MTP_HIDDEN_ACTS)}")
    mtp_token_input = raw.get("mtp_token_input", False)
    if not isinstance(mtp_token_input, bool):
        raise CheckpointError(f"{source}: mtp_token_input must be true or false, got "
                              f"{mtp_token_input!r}")
    return {
        "architecture": arch,
        "vocab_size": positive_int(source, "vocab_size", need("vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": positive_int(source, "intermediate_size",
                                          need("intermediate_size")),
        "num_layers": positive_int(source, "num_hidden_layers", need("num_hidden_layers")),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": positive_int(source, "max_position_embeddings",
                                                raw.get("max_position_embeddings", 2048)),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope": parse_rope(raw, source),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "mlp_bias": bool(raw.get("mlp_bias", False)),
        "dtype": normalize_dtype(
            raw.get("dtype") or raw.get("torch_dtype") or "float32", source, "dtype"
        ),
        "eos_token_ids": _token_ids(raw.get("eos_token_id")),
        "bos_token_id": raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int)
        else None,
        "num_mtp_heads": num_mtp_heads,
        "mtp_hidden_act": mtp_act,
        "mtp_token_input": mtp_token_input,
    }


def family_named(name: str) -> Family:
    """The family registered under `name` (ValueError naming the registered ones)."""
    for family in _FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"model family {name!r} is not registered; known: "
                     f"{', '.join(f.name for f in _FAMILIES)}")


# Architecture -> family, and the families in order: filled once by `model/families.py`
# (`register`), which `model/__init__.py` imports, so any import of this module has them.
_BY_ARCHITECTURE: dict[str, Family] = {}
_FAMILIES: list[Family] = []


def register(families: tuple[Family, ...], by_architecture: dict[str, Family]) -> None:
    """Make the registry's entries (checked by `model/families.py`) the ones every lookup
    here answers from."""
    _FAMILIES[:] = families
    _BY_ARCHITECTURE.clear()
    _BY_ARCHITECTURE.update(by_architecture)


# ---- config.json pieces every family reads the same way ----------------------------------

def positive_int(source: str, key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()


def parse_rope(raw: dict[str, Any], source: str,
               params: Mapping[str, Any] | None = None) -> RopeConfig:
    """transformers 5.x: rope_parameters {rope_theta, rope_type, ...}; 4.x: top-level
    rope_theta and an optional rope_scaling {rope_type|type, ...}. `params`: one of a
    family's several parameter sets (Gemma 3's per layer type), read instead."""
    if params is None:
        merged = dict(raw.get("rope_scaling") or {})
        merged.update(raw.get("rope_parameters") or {})
    else:
        merged = dict(params)
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: rope type {kind!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = float(theta)
    if not math.isfinite(theta) or theta <= 0:
        raise CheckpointError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    if kind == "default":
        return RopeConfig(theta=theta)
    factor = float(merged.get("factor", 1.0))
    if kind == "linear":
        return RopeConfig(theta=theta, kind=kind, factor=factor)
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=factor,
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", 8192)
        ),
    )

