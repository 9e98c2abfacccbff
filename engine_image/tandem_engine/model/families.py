"""The model families' registry entries: each architecture's HF-config rule, tensor
layout, model class, GGUF layout and demo recipe (the types and what every family shares
are in `model/family.py`). A new family is a model file and its entry here.

Torch-free, as `family.py` is: the `tandem` parser reads `--arch` (DEMO_FAMILIES) from
here without importing torch; each model class is named ("module:Class") and imported
on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tandem_engine.errors import CheckpointError
from tandem_engine.model.family import (
    DemoRecipe,
    DemoShape,
    Family,
    GGUFLayout,
    ModelConfig,
    MoEConfig,
    decoder_fields,
    is_int,
    parse_rope,
    positive_int,
    register,
)
from tandem_engine.tokenizer import GGUF_PRE_TOKENIZERS

if TYPE_CHECKING:
    from tandem_engine.gguf_file import GGUFFile


# ---- the Llama decoder: Llama, Mistral, Qwen2, Qwen3 -----------------------------------------

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
    if not isinstance(only, list) or not all(is_int(i) and 0 <= i < layers for i in only):
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


BY_ARCHITECTURE = _index(FAMILIES)
register(FAMILIES, BY_ARCHITECTURE)
SUPPORTED_ARCHITECTURES = tuple(BY_ARCHITECTURE)
# `tandem demo-model --arch`
DEMO_FAMILIES = tuple(f.name for f in FAMILIES if f.demo is not None)
# llama.cpp's `general.architecture` -> family, for the GGUF reader
GGUF_FAMILIES = {f.gguf.architecture: f for f in FAMILIES if f.gguf is not None}
