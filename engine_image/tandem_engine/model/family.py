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
CUDA graphs all read `FAMILIES`; a new family is a model file and an entry here.

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
from tandem_engine.tokenizer import GGUF_PRE_TOKENIZERS

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
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
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


# ---- the registry ----------------------------------------------------------------------------

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


# ---- the Llama decoder: Llama, Mistral, Qwen2, Qwen3 -----------------------------------------

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
    if not _is_int(num_mtp_heads) or num_mtp_heads < 0:
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


def _llama_config(raw: dict[str, Any], source: str, arch: str) -> ModelConfig:
    """Llama, Mistral, Qwen2 and Qwen3: SiLU MLPs; attention biases by `attention_bias`
    (always q/k/v biases for Qwen2); q/k norms for Qwen3."""
    fields = decoder_fields(raw, source, arch)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported; expected 'silu'")
    # Mistral's sliding window is exact attention when the context never exceeds it.
    window = raw.get("sliding_window")
    if window and raw.get("use_sliding_window", True) and arch == "MistralForCausalLM":
        fields["max_position_embeddings"] = min(
            fields["max_position_embeddings"], positive_int(source, "sliding_window", window))
    attention_bias = bool(raw.get("attention_bias", False))
    qwen2 = arch == "Qwen2ForCausalLM"
    return ModelConfig(**fields, qkv_bias=qwen2 or attention_bias,
                       o_bias=attention_bias and not qwen2,
                       qk_norm=arch == "Qwen3ForCausalLM")


def _llama_tensors(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    h = c.hidden_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    inter = c.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (q, h)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        if c.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (q,)
            out[p + "self_attn.k_proj.bias"] = (kv,)
            out[p + "self_attn.v_proj.bias"] = (kv,)
        if c.o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if c.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            out[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        out[p + "mlp.gate_proj.weight"] = (inter, h)
        out[p + "mlp.up_proj.weight"] = (inter, h)
        out[p + "mlp.down_proj.weight"] = (h, inter)
        if c.mlp_bias:
            out[p + "mlp.gate_proj.bias"] = (inter,)
            out[p + "mlp.up_proj.bias"] = (inter,)
            out[p + "mlp.down_proj.bias"] = (h,)
    out["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    return out


_LLAMA_GGUF = GGUFLayout(
    architecture="llama",  # Mistral models convert as "llama" too
    global_names={
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    },
    layer_names={
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    },
)


def _demo_llama(s: DemoShape, common: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **common,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rope_theta": 10000.0,
        # Llama 3 scaling with a short "original" context, so that the tiny
        # head_dim has frequencies on both sides of the smoothing band.
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": s.max_position_embeddings / s.original_context,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": s.original_context,
        },
    }


def _demo_qwen(model_type: str) -> Callable[[DemoShape, dict[str, Any]], dict[str, Any]]:
    def config(s: DemoShape, common: dict[str, Any]) -> dict[str, Any]:
        qwen: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2"
                              else "Qwen3ForCausalLM"],
            "model_type": model_type,
            **common,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": s.num_layers,
        }
        if model_type == "qwen2":
            qwen["tie_word_embeddings"] = True
        else:
            qwen.update(tie_word_embeddings=False, head_dim=s.head_dim, attention_bias=False)
        return qwen
    return config


# ---- Gemma 3 (text) ---------------------------------------------------------------------------

_GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")


def _gemma3_config(raw: dict[str, Any], source: str, arch: str) -> ModelConfig:
    """Gemma 3's config.json, with transformers' defaults for what it leaves out: tied
    embeddings, head_dim 256, query_pre_attn_scalar 256, a 4096-token window on five of
    every six layers, RoPE bases 1e6 (full layers, with rope_scaling) and 1e4 (sliding;
    `rope_local_base_freq`), or 5.x's rope_parameters per layer type."""
    raw = {"head_dim": 256, "max_position_embeddings": 131072, "tie_word_embeddings": True,
           "rope_theta": 1_000_000.0, **raw}
    fields = decoder_fields(raw, source, arch)
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise CheckpointError(f"{source}: hidden_activation {act!r} is not supported for "
                              f"{arch}; expected 'gelu_pytorch_tanh'")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if raw.get(key):
            raise CheckpointError(f"{source}: {key}={raw[key]!r} is not supported (Gemma 3 "
                                  "text models leave it unset)")
    layers = fields["num_layers"]
    types = raw.get("layer_types")
    if types is None:
        pattern = positive_int(source, "sliding_window_pattern",
                               raw.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]
    if (not isinstance(types, list) or len(types) != layers
            or any(t not in _GEMMA3_LAYER_TYPES for t in types)):
        raise CheckpointError(f"{source}: layer_types must list one of "
                              f"{', '.join(_GEMMA3_LAYER_TYPES)} per layer ({layers}), got "
                              f"{types!r}")
    window = positive_int(source, "sliding_window", raw.get("sliding_window", 4096))
    nested = raw.get("rope_parameters")
    if isinstance(nested, dict) and isinstance(nested.get("full_attention"), dict):
        full = nested["full_attention"]
        local = nested.get("sliding_attention") or {"rope_theta": 10000.0}
    else:
        full = {**(raw.get("rope_scaling") or {}), "rope_theta": raw["rope_theta"]}
        local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    scalar = raw.get("query_pre_attn_scalar", 256)
    cap = raw.get("final_logit_softcapping")
    if not isinstance(scalar, (int, float)) or scalar <= 0 or (
            cap is not None and (not isinstance(cap, (int, float)) or cap <= 0)):
        raise CheckpointError(f"{source}: query_pre_attn_scalar ({scalar!r}) and "
                              f"final_logit_softcapping ({cap!r}) must be positive numbers")
    bias = bool(raw.get("attention_bias", False))
    fields.update(rope=parse_rope(raw, source, full), mlp_bias=False)
    return ModelConfig(**fields, qkv_bias=bias, o_bias=bias, layer_types=tuple(types),
                       sliding_window=window, local_rope=parse_rope(raw, source, local),
                       attention_scale=float(scalar) ** -0.5,
                       final_logit_softcapping=None if cap is None else float(cap))


def _gemma3_tensors(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Llama layout without MLP biases, plus q/k norms always and a norm after
    attention and around the MLP (pre_feedforward_layernorm, post_feedforward_layernorm)."""
    out = _llama_tensors(c)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_norm.weight"] = (c.head_dim,)
        out[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        out[p + "pre_feedforward_layernorm.weight"] = (c.hidden_size,)
        out[p + "post_feedforward_layernorm.weight"] = (c.hidden_size,)
    return out


# llama.cpp's loader fixes a gemma3 file's layers as five sliding-window layers to every
# global one (the file does not say), and their RoPE base unless the file does.
_GEMMA3_GGUF_PATTERN = 6
_GEMMA3_GGUF_LOCAL_BASE = 10000.0
# ...and Gemma 3 27B's query_pre_attn_scalar (hidden_size / heads, not head_dim), known by
# its layer count.
_GEMMA3_27B_LAYERS = 62


def _gemma3_gguf_config(file: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a gemma3 GGUF file, as llama.cpp reads the file: the window
    (`gemma3.attention.sliding_window`; absent or 0: every layer global) on five of every
    six layers, their RoPE base (`gemma3.rope.freq_base_swa`, else 10000; never scaled),
    query_pre_attn_scalar the head dimension (hidden_size / heads for the 27B), GELU-tanh,
    and the soft-capping the file states (attn_logit_softcapping, which Gemma 3 leaves
    unset, is then refused by the config rule)."""
    p = "gemma3."
    layers = config["num_hidden_layers"]
    window = file.integer(p + "attention.sliding_window", 0)
    sliding = [bool(window) and i % _GEMMA3_GGUF_PATTERN < _GEMMA3_GGUF_PATTERN - 1
               for i in range(layers)]
    out = {k: v for k, v in config.items() if k != "hidden_act"}
    out.update(
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_local_base_freq=float(
            f"{file.number(p + 'rope.freq_base_swa', _GEMMA3_GGUF_LOCAL_BASE):.7g}"),
        query_pre_attn_scalar=(config["hidden_size"] // config["num_attention_heads"]
                               if layers == _GEMMA3_27B_LAYERS else config["head_dim"]),
    )
    if window:
        out["sliding_window"] = window
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if file.has(p + key):
            out[key] = float(f"{file.number(p + key):.7g}")
    return out


_GEMMA3_GGUF = GGUFLayout(
    architecture="gemma3",
    global_names=_LLAMA_GGUF.global_names,
    layer_names={
        **_LLAMA_GGUF.layer_names,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    },
    rotary_rows_permuted=False,  # llama.cpp rotates Gemma's halves, as HF does
    norm_shift=1.0,
    hf_config=_gemma3_gguf_config,
)


def _demo_gemma3(s: DemoShape, common: dict[str, Any]) -> dict[str, Any]:
    common = {k: v for k, v in common.items() if k != "hidden_act"}
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **common,
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": s.head_dim,
        "rms_norm_eps": 1e-6,
        # untied, so the demo exercises lm_head (real Gemma 3 ties it)
        "tie_word_embeddings": False,
        "attention_bias": False,
        "query_pre_attn_scalar": s.head_dim // 2,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": None,
        # alternating, so even the two-layer tiny demo has both kinds; a window that
        # is no multiple of the block size
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(s.num_layers)],
        "sliding_window": s.original_context // 10,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }


# ---- Qwen3-MoE ----------------------------------------------------------------------------

def _qwen3_moe_config(raw: dict[str, Any], source: str, arch: str) -> ModelConfig:
    """Qwen3-MoE: Qwen3's attention (q/k norms always; biases by `attention_bias`) and a
    mixture-of-experts MLP on every layer but those in `mlp_only_layers` or skipped by
    `decoder_sparse_step`. transformers 5.x writes the expert count as
    `num_local_experts`, 4.x as `num_experts`."""
    fields = decoder_fields(raw, source, arch)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported; expected 'silu'")
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{source}: use_sliding_window=true is not supported for "
                              f"{arch} (Qwen3-MoE checkpoints leave it false)")
    layers = fields["num_layers"]
    count_key = "num_experts" if "num_experts" in raw else "num_local_experts"
    if count_key not in raw:
        raise CheckpointError(f"{source}: field 'num_experts' (or 'num_local_experts') is "
                              f"required for {arch}")
    experts = positive_int(source, count_key, raw[count_key])
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if key not in raw:
            raise CheckpointError(f"{source}: field {key!r} is required for {arch}")
    top_k = positive_int(source, "num_experts_per_tok", raw["num_experts_per_tok"])
    if top_k > experts:
        raise CheckpointError(f"{source}: num_experts_per_tok={top_k} is more than "
                              f"{count_key}={experts}")
    normalize = raw.get("norm_topk_prob", False)
    if not isinstance(normalize, bool):
        raise CheckpointError(f"{source}: norm_topk_prob must be true or false, got "
                              f"{normalize!r}")
    step = positive_int(source, "decoder_sparse_step", raw.get("decoder_sparse_step", 1))
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(_is_int(i) and 0 <= i < layers for i in only):
        raise CheckpointError(f"{source}: mlp_only_layers must list layer indices from 0 "
                              f"to {layers - 1} (num_hidden_layers={layers}), got {only!r}")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    moe = MoEConfig(experts, top_k,
                    positive_int(source, "moe_intermediate_size", raw["moe_intermediate_size"]),
                    normalize, dense)
    bias = bool(raw.get("attention_bias", False))
    fields["mlp_bias"] = False
    return ModelConfig(**fields, qkv_bias=bias, o_bias=bias, moe=moe)


def _qwen3_moe_tensors(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Llama layout with q/k norms, where a sparse layer's MLP is a router
    `mlp.gate.weight` [E, hidden] and E experts stored one by one, as transformers
    4.x and 5.x save them: `mlp.experts.{e}.gate_proj.weight` and `up_proj.weight`
    [I, hidden], `down_proj.weight` [hidden, I]. The model keeps these names and stacks
    their storage into [E, 2I, hidden] and [E, hidden, I] (model/qwen3_moe.py); GGUF
    files store each projection stacked, [E, ...] (`ffn_gate_exps`...), sliced on load."""
    assert c.moe is not None
    h, inter, dense = c.hidden_size, c.moe.intermediate_size, c.moe.dense_layers
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in _llama_tensors(c).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        sparse = layer is not None and int(layer) not in dense
        if sparse and ".mlp." in name:
            if name.endswith("mlp.gate_proj.weight"):
                p = f"model.layers.{layer}.mlp."
                out[p + "gate.weight"] = (c.moe.num_experts, h)
                for e in range(c.moe.num_experts):
                    out[f"{p}experts.{e}.gate_proj.weight"] = (inter, h)
                    out[f"{p}experts.{e}.up_proj.weight"] = (inter, h)
                    out[f"{p}experts.{e}.down_proj.weight"] = (h, inter)
            continue
        out[name] = shape
        if name.endswith("self_attn.o_proj.weight"):
            p = f"model.layers.{layer}.self_attn."
            out[p + "q_norm.weight"] = (c.head_dim,)
            out[p + "k_norm.weight"] = (c.head_dim,)
    return out


def _qwen3_moe_gguf_config(file: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a qwen3moe GGUF file: the experts from `qwen3moe.expert_count`,
    `expert_used_count` and `expert_feed_forward_length`, every layer sparse (llama.cpp's
    qwen3moe has no dense layers), and the chosen experts' weights renormalized, as
    llama.cpp runs qwen3moe (its converter writes no key for norm_topk_prob; every
    Qwen3-MoE release sets it) unless `expert_weights_norm` says otherwise."""
    p = "qwen3moe."
    out = dict(config)
    for key, hf_key in (("expert_count", "num_experts"),
                        ("expert_used_count", "num_experts_per_tok"),
                        ("expert_feed_forward_length", "moe_intermediate_size")):
        if not file.has(p + key):
            raise file.missing(p + key, "a Qwen3-MoE model's experts")
        value = file.integer(p + key)
        if value <= 0:
            raise CheckpointError(f"{file.path}: metadata {p}{key}={value} must be a "
                                  "positive integer; the file is corrupt or mis-converted")
        out[hf_key] = value
    out["norm_topk_prob"] = file.flag(p + "expert_weights_norm", True)
    return out


_QWEN3_MOE_GGUF = GGUFLayout(
    architecture="qwen3moe",
    global_names=_LLAMA_GGUF.global_names,
    layer_names={**_LLAMA_GGUF.layer_names, "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"},
    rotary_rows_permuted=False,  # Qwen's RoPE rotates halves in llama.cpp too
    expert_names={"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                  "down_proj": "ffn_down_exps"},
    hf_config=_qwen3_moe_gguf_config,
)


def _demo_qwen3_moe(s: DemoShape, common: dict[str, Any]) -> dict[str, Any]:
    """Qwen3's demo with experts: 4 (tiny) or 8 of them, 2 per token, each a slice of the
    dense MLP's width (so the demo's parameter count stays near the dense one's)."""
    experts = 4 if s.hidden_size < 256 else 8
    return {
        **_demo_qwen("qwen3")(s, common),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": s.intermediate_size // experts,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    }


_LLAMA_MODEL = "tandem_engine.model.llama:CausalLM"

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), _LLAMA_MODEL, _llama_config, _llama_tensors,
           gguf=_LLAMA_GGUF, demo=DemoRecipe(_demo_llama, bos=True)),
    Family("mistral", ("MistralForCausalLM",), _LLAMA_MODEL, _llama_config, _llama_tensors),
    Family("qwen2", ("Qwen2ForCausalLM",), _LLAMA_MODEL, _llama_config, _llama_tensors,
           demo=DemoRecipe(_demo_qwen("qwen2"))),
    Family("qwen3", ("Qwen3ForCausalLM",), _LLAMA_MODEL, _llama_config, _llama_tensors,
           demo=DemoRecipe(_demo_qwen("qwen3"))),
    Family("gemma3", ("Gemma3ForCausalLM",), "tandem_engine.model.gemma3:Gemma3ForCausalLM",
           _gemma3_config, _gemma3_tensors, gguf=_GEMMA3_GGUF,
           demo=DemoRecipe(_demo_gemma3, bos=True), flex_attention=False),
    # Kept off flex (and so off captured CUDA graphs): on CUDA the experts run one
    # matmul per expert, sized by token counts read back to the host.
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",),
           "tandem_engine.model.qwen3_moe:Qwen3MoeForCausalLM", _qwen3_moe_config,
           _qwen3_moe_tensors, gguf=_QWEN3_MOE_GGUF, demo=DemoRecipe(_demo_qwen3_moe),
           flex_attention=False),
)


def _index(families: tuple[Family, ...]) -> dict[str, Family]:
    """Architecture -> family, checking the registry once at import: unique names and
    architectures, GGUF architectures and demo pre-tokenizers that exist."""
    by_arch: dict[str, Family] = {}
    names, ggufs = set(), set()
    for family in families:
        if family.name in names:
            raise ValueError(f"model family {family.name!r} is registered twice")
        names.add(family.name)
        for arch in family.architectures:
            if arch in by_arch:
                raise ValueError(f"architecture {arch!r} is registered by both "
                                 f"{by_arch[arch].name!r} and {family.name!r}")
            by_arch[arch] = family
        if family.gguf is not None:
            if family.gguf.architecture in ggufs:
                raise ValueError(f"GGUF architecture {family.gguf.architecture!r} is "
                                 "registered twice")
            ggufs.add(family.gguf.architecture)
        if family.demo is not None and family.demo.pre_tokenizer not in GGUF_PRE_TOKENIZERS:
            raise ValueError(f"model family {family.name!r}: demo pre-tokenizer "
                             f"{family.demo.pre_tokenizer!r} is not in tokenizer.py")
    return by_arch


_BY_ARCHITECTURE = _index(FAMILIES)
SUPPORTED_ARCHITECTURES = tuple(_BY_ARCHITECTURE)
# `tandem demo-model --arch`
DEMO_FAMILIES = tuple(f.name for f in FAMILIES if f.demo is not None)
# llama.cpp's `general.architecture` -> family, for the GGUF reader
GGUF_FAMILIES = {f.gguf.architecture: f for f in FAMILIES if f.gguf is not None}


def family_named(name: str) -> Family:
    """The family registered under `name` (ValueError naming the registered ones)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"model family {name!r} is not registered; known: "
                     f"{', '.join(f.name for f in FAMILIES)}")


# ---- config.json pieces every family reads the same way ----------------------------------

def positive_int(source: str, key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _is_int(value: object) -> bool:
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

