"""GGUF checkpoints: llama.cpp's one-file format, read into the engine's HF-named tensors.

`read_gguf_checkpoint` validates everything a GGUF file says before any tensor is
dequantized: the metadata becomes a HuggingFace-style config (and from it a
`ModelConfig`), then every tensor's name, type and shape is checked against what that
config needs, and the reader has already checked that the file is complete. Only then
does `load_tensors` read them: under `--quantization none` dequantized (the `gguf`
library's numpy code) into the engine's dtype; otherwise the projections stay integer
weights for the quantized kernels (model/gguf_blocks.py, model/quant.py). So a refit to
a bad GGUF changes nothing.

llama.cpp's converter reorders the rows of q_proj and k_proj (its RoPE kernels rotate
adjacent pairs, HF rotates halves); loading undoes that. Without `output.weight` the
model has tied embeddings. Llama 3 RoPE scaling is stored as a `rope_freqs` tensor of
per-frequency factors; it is turned back into the equivalent `rope_scaling` parameters.
For Gemma 3 (`gemma3`) the converter keeps the q/k rows in HF's order and adds 1 to every
norm weight (Gemma's RMSNorm scales by 1 + w); loading subtracts it (the layout's
`norm_shift`). What a family's metadata says beyond the keys every family has (Gemma 3:
the sliding window and its layers) is its layout's `hf_config` rule (model/family.py).
A mixture-of-experts family (Qwen3-MoE, `qwen3moe`) stores each expert projection of a
layer stacked as one [E, ...] tensor (`blk.N.ffn_gate_exps.weight`...); it is
dequantized once and sliced into the per-expert HF names its layout names
(`model.layers.N.mlp.experts.{e}.gate_proj.weight`); its `hf_config` rule reads the
expert counts (`qwen3moe.expert_count`...).

`export_hf_folder` writes the same model as a HuggingFace folder (used by `tandem
models`). The checkpoint-level rules (the refit shape check, the dtype) stay in
`checkpoint.py`, the one entry point for both formats.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.torch import save_file

from tandem_engine.config import normalize_dtype
from tandem_engine.errors import CheckpointError, list_problems
from tandem_engine.generation_config import generation_defaults
from tandem_engine.gguf_file import GGUFFile, GGUFTensor, open_gguf
from tandem_engine.model.families import GGUF_FAMILIES
from tandem_engine.model.family import Family, ModelConfig
from tandem_engine.model.gguf_blocks import as_quantized, auto_kind
from tandem_engine.model.quant import Kind, QuantizedWeight
from tandem_engine.tokenizer import Tokenizer

# llama.cpp architecture names this loader maps (the families with a GGUF layout).
SUPPORTED_ARCHITECTURES = tuple(GGUF_FAMILIES)
_Q = GGMLQuantizationType
SUPPORTED_TYPES = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1,
                   _Q.Q4_K, _Q.Q5_K, _Q.Q6_K)
SUPPORTED_TYPE_NAMES = tuple(t.name for t in SUPPORTED_TYPES)
ROPE_FREQS = "rope_freqs.weight"
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_PROBLEMS_SHOWN = 10
_BLOCK = re.compile(r"^blk\.(\d+)\.")

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
_REQUANTIZE = ("re-quantize the model with llama.cpp's llama-quantize to one of them "
               "(Q8_0, Q4_0, Q4_K_M...), or give the HuggingFace checkpoint folder")


def gguf_tensor_name(hf_name: str, family: Family = GGUF_FAMILIES["llama"]) -> str:
    """The GGUF name of an HF parameter name in `family`'s GGUF layout
    (model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight); for one expert's
    projection, the stacked tensor that holds it at `gguf_expert_index`
    (model.layers.3.mlp.experts.5.up_proj.weight -> blk.3.ffn_up_exps.weight)."""
    layout = family.gguf
    if layout is None:
        raise KeyError(f"model family {family.name!r} has no GGUF layout")
    if hf_name in layout.global_names:
        return layout.global_names[hf_name]
    expert = _HF_EXPERT.match(hf_name)
    if expert is not None and expert.group(3) in layout.expert_names:
        return f"blk.{expert.group(1)}.{layout.expert_names[expert.group(3)]}.weight"
    match = _HF_LAYER.match(hf_name)
    if match is None or match.group(2) not in layout.layer_names:
        raise KeyError(f"no GGUF name for tensor {hf_name!r}")
    layer, module, kind = match.groups()
    return f"blk.{layer}.{layout.layer_names[module]}.{kind}"


def gguf_expert_index(hf_name: str, family: Family) -> int | None:
    """The expert an HF tensor belongs to where `family`'s GGUF files stack its experts
    (its slice of the stacked tensor); None for every other tensor."""
    expert = _HF_EXPERT.match(hf_name)
    layout = family.gguf
    if expert is None or layout is None or expert.group(3) not in layout.expert_names:
        return None
    return int(expert.group(2))


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A validated GGUF file: its config and, for every tensor the config needs (HF
    names), the GGUF tensor that holds it. Nothing has been dequantized yet."""

    path: Path
    config: ModelConfig
    hf_config: dict[str, Any]  # what config.json of the same model says
    tensors: dict[str, GGUFTensor]
    # HF name -> its slice of the stacked GGUF tensor it maps to (experts only)
    expert_index: dict[str, int] = field(default_factory=dict)

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data (quantized, as stored) that `load_tensors` reads."""
        unique = {t.name: t for t in self.tensors.values()}
        return sum(int(t.data.nbytes) for t in unique.values())

    def load_tensors(self, dtype: torch.dtype, on_tensor: Callable[[int], None] | None = None,
                     quantization: str = "none",
                     targets: tuple[set[str], str | None] | None = None,
                     ) -> dict[str, torch.Tensor | QuantizedWeight]:
        """Every tensor in `dtype` (dequantized), with llama.cpp's Q/K row order and norm
        shift undone; with a `quantization` other than none, the `targets` (the model's
        Linear weights, and its tied embedding: `checkpoint.quantization_targets`) as
        `QuantizedWeight`s instead, as model/gguf_blocks.py says.
        `on_tensor` is told the stored bytes of each tensor once it is done."""
        c = self.config
        linears, tied = targets if targets is not None else (set(), None)
        layout = c.family.gguf
        permuted = layout is not None and layout.rotary_rows_permuted
        shift = 0.0 if layout is None else layout.norm_shift
        out: dict[str, torch.Tensor] = {}
        stacked: tuple[str, torch.Tensor] | None = None  # the experts' tensor last read
        for name, tensor in self.tensors.items():
            expert = self.expert_index.get(name)
            if expert is not None:
                # A layer's experts follow one another: each stacked tensor is
                # dequantized once, and its slices are contiguous.
                if stacked is None or stacked[0] != tensor.name:
                    stacked = (tensor.name, _dequantized(self.path, tensor).to(dtype))
                    if on_tensor is not None:
                        on_tensor(int(tensor.data.nbytes))
                out[name] = stacked[1][expert]
                continue
            kind = _kind(tensor, name, quantization, linears, tied)
            if kind is not None:
                out[name] = _held_quantized(self.path, tensor, kind, name, c, permuted)
                if on_tensor is not None:
                    on_tensor(int(tensor.data.nbytes))
                continue
            weight = _dequantized(self.path, tensor)
            if permuted and ".self_attn.q_proj." in name:
                weight = unpermute_rotary_rows(weight, c.num_heads)
            elif permuted and ".self_attn.k_proj." in name:
                weight = unpermute_rotary_rows(weight, c.num_kv_heads)
            if shift and name.endswith("norm.weight"):
                weight = weight - shift
            out[name] = weight.to(dtype).contiguous()
            if on_tensor is not None:
                on_tensor(int(tensor.data.nbytes))
        return out


def read_gguf_checkpoint(path: str | Path) -> GGUFCheckpoint:
    """Open and validate a GGUF checkpoint without dequantizing anything.

    Every problem is a CheckpointError naming the file, the metadata key or tensor, and
    the fix."""
    file = open_gguf(path)
    hf_config = gguf_hf_config(file)
    config = ModelConfig.from_hf_dict(hf_config, source=f"{file.path} (GGUF metadata)")
    return GGUFCheckpoint(file.path, config, hf_config, *_check_tensors(file, config))


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation. Its converter stores each head's rows as
    interleaved pairs (row 2j from HF row j, row 2j+1 from HF row j + head_dim/2), the
    layout its RoPE kernel rotates; HF rotates the two halves of each head."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def export_hf_folder(gguf_path: str | Path, out_dir: str | Path,
                     dtype: str = "float32") -> Path:
    """Write the model of a GGUF file as a HuggingFace checkpoint folder and return it:
    model.safetensors (dequantized to `dtype`; no lm_head when tied), config.json
    (the family's architecture, no quantization config), tokenizer.json, tokenizer_config.json
    (special tokens, chat template) and generation_config.json (EOS/BOS ids, and for a
    model known to `tandem models` its recommended sampling, so the folder serves with the
    same defaults as the GGUF).

    Validates the whole file first; `out_dir` is created if needed and the five files in
    it are overwritten."""
    dtype = normalize_dtype(dtype, "export_hf_folder", "dtype")
    checkpoint = read_gguf_checkpoint(gguf_path)
    tokenizer = Tokenizer.from_gguf(checkpoint.path)
    tensors = checkpoint.load_tensors(_TORCH_DTYPES[dtype])
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tensors.clear()
    hf_config = {**checkpoint.hf_config, "torch_dtype": dtype}
    _write_json(folder / "config.json", hf_config)
    generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id") if k in hf_config}
    sampling = generation_defaults(checkpoint.path).sampling_kwargs()
    if sampling:  # transformers samples with them only when do_sample is set
        generation.update(do_sample=True, **sampling)
    _write_json(folder / "generation_config.json", generation)
    tokenizer.save_pretrained(folder, model_max_length=checkpoint.config.max_position_embeddings)
    return folder


# ---- metadata -> config ---------------------------------------------------------------------

def gguf_hf_config(file: GGUFFile) -> dict[str, Any]:
    """The config.json (transformers 4.x spelling) of the model a GGUF file holds,
    validated with GGUF key names in every error. Long on purpose: one straight list of
    metadata keys and their checks reads better than the same list cut into pieces."""
    arch = file.string("general.architecture")
    if arch not in GGUF_FAMILIES:
        raise CheckpointError(
            f"{file.path}: general.architecture {arch!r} is not supported for GGUF files; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (Llama and Mistral models as "
            "llama, Gemma 3 as gemma3, Qwen3-MoE as qwen3moe). "
            "Give the model's HuggingFace checkpoint folder instead")
    family = GGUF_FAMILIES[arch]
    p = f"{arch}."

    def positive(key: str, default: Any = None) -> int:
        if default is None and not file.has(key):
            raise file.missing(key, f"a {arch} model's shape")
        value = file.integer(key, default)
        if value <= 0:
            raise CheckpointError(f"{file.path}: metadata {key}={value} must be a positive "
                                  "integer; the file is corrupt or mis-converted")
        return value

    layers = positive(p + "block_count")
    hidden = positive(p + "embedding_length")
    if file.has(p + "expert_count") and not (family.gguf and family.gguf.expert_names):
        raise CheckpointError(
            f"{file.path}: metadata {p}expert_count: this {arch} model has experts "
            "(Mixtral-style), which Tandem does not run for this architecture; experts "
            "are supported for qwen3moe (Qwen3-MoE)")
    ffn = positive(p + "feed_forward_length")
    heads = positive(p + "attention.head_count")
    kv_heads = positive(p + "attention.head_count_kv", heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"{file.path}: metadata {p}attention.head_count={heads} is not a multiple of "
            f"{p}attention.head_count_kv={kv_heads}; the metadata is inconsistent: convert "
            "the model again")
    if file.has(p + "attention.key_length"):
        head_dim = positive(p + "attention.key_length")
    elif hidden % heads:
        raise CheckpointError(
            f"{file.path}: metadata {p}embedding_length={hidden} is not divisible by "
            f"{p}attention.head_count={heads} and {p}attention.key_length (the head "
            "dimension) is missing; convert the model again")
    else:
        head_dim = hidden // heads
    value_dim = positive(p + "attention.value_length", head_dim)
    rope_dim = positive(p + "rope.dimension_count", head_dim)
    if value_dim != head_dim or rope_dim != head_dim or head_dim % 2:
        raise CheckpointError(
            f"{file.path}: head dimension {head_dim} with {p}attention.value_length="
            f"{value_dim} and {p}rope.dimension_count={rope_dim}: Tandem supports equal "
            "key and value head sizes with RoPE over the whole (even) head")
    eps_key = p + "attention.layer_norm_rms_epsilon"
    if not file.has(eps_key):
        raise file.missing(eps_key, "the RMSNorm layers")
    eps = file.number(eps_key)
    theta = file.number(p + "rope.freq_base", 10000.0)
    if not (math.isfinite(eps) and eps > 0 and math.isfinite(theta) and theta > 0):
        raise CheckpointError(f"{file.path}: metadata {eps_key}={eps} and {p}rope.freq_base="
                              f"{theta} must be positive numbers")
    context = positive(p + "context_length")
    if file.has(p + "vocab_size"):
        vocab = positive(p + "vocab_size")
    elif file.has("tokenizer.ggml.tokens"):
        vocab = len(file.strings("tokenizer.ggml.tokens"))
    else:
        raise file.missing("tokenizer.ggml.tokens", f"the vocabulary size ({p}vocab_size is "
                           "missing too)")

    names = file.tensors
    eos = [file.integer(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")
           if file.has(f"tokenizer.ggml.{k}_token_id")]
    eos = list(dict.fromkeys(eos))
    config: dict[str, Any] = {
        "architectures": [family.architectures[0]],
        "model_type": family.name,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        # float32 in the file: 9.999999747e-06 is the 1e-05 of the original config
        "rms_norm_eps": float(f"{eps:.7g}"),
        "rope_theta": float(f"{theta:.7g}"),
        "rope_scaling": _rope_scaling(file, p, theta, head_dim),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_gate.bias" in names,
        "torch_dtype": "float32",
    }
    if file.has("tokenizer.ggml.bos_token_id"):
        config["bos_token_id"] = file.integer("tokenizer.ggml.bos_token_id")
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if family.gguf is not None and family.gguf.hf_config is not None:
        config = family.gguf.hf_config(file, config)
    return config


def _rope_scaling(file: GGUFFile, p: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    kind = file.string(p + "rope.scaling.type", "none")
    if file.has(p + "rope.scale_linear"):  # the key before rope.scaling.type existed
        kind = "linear"
    freqs = file.tensors.get(ROPE_FREQS)
    if kind not in ("none", "linear") or (kind == "linear" and freqs is not None):
        raise CheckpointError(
            f"{file.path}: metadata {p}rope.scaling.type={kind!r}"
            f"{' with a rope_freqs tensor' if freqs is not None else ''} is not supported; "
            "supported: none, linear, and Llama 3 scaling (a rope_freqs tensor)")
    if kind == "linear":
        key = p + "rope.scaling.factor"
        factor = file.number(key if file.has(key) else p + "rope.scale_linear")
        return {"rope_type": "linear", "factor": factor}
    if freqs is None:
        return None
    if freqs.qtype not in (_Q.F32, _Q.F16) or freqs.shape != (head_dim // 2,):
        raise CheckpointError(
            f"{file.path}: tensor {ROPE_FREQS!r} is {freqs.type_name} with shape "
            f"{freqs.shape}, expected F32 with shape ({head_dim // 2},) (one factor per "
            "RoPE frequency)")
    factors = dequantize(freqs.data, freqs.qtype).astype(np.float64).reshape(-1)
    return llama3_rope_scaling(factors, theta, head_dim, where=f"{file.path}: {ROPE_FREQS!r}")


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int,
                        where: str = "rope_freqs") -> dict[str, Any] | None:
    """The Llama 3 `rope_scaling` parameters that give these per-frequency factors.

    Llama 3 scaling divides frequency i by 1 when its wavelength w is short, by `factor`
    when it is long, and in between by 1 / ((1 - s) / factor + s) with s linear in 1/w.
    The factors fix `factor` and that line, not the three cut-off parameters, so
    low_freq_factor is taken as 1 (Llama 3.1/3.2's value) where the line leaves a
    choice. Raises CheckpointError when no Llama 3 parameters reproduce the factors."""
    if np.all(np.abs(factors - 1.0) < 1e-6):
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor = float(factors.max())
    one = np.isclose(factors, 1.0, rtol=1e-5, atol=0)
    full = np.isclose(factors, factor, rtol=1e-5, atol=0)
    medium = ~(one | full)
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    low = 1.0
    if medium.sum() >= 2:  # s = a / w + b, with a = orig / (high - low), b = -low / (high - low)
        a, b = np.polyfit(1 / wavelen[medium], smooth[medium], 1)
        orig = round(-a / b) if b < 0 else 0
        span = orig / a if orig > 0 else 0.0
        low, high = -b * span, -b * span + span
    elif medium.sum() == 1:  # high_freq_factor 4 as Llama 3.1 (one point fixes one parameter)
        high = 4.0
        orig = round(wavelen[medium][0] * (low + smooth[medium][0] * (high - low)))
    else:  # no wavelength inside the blend: any cut-offs between the two groups
        shortest_scaled = wavelen[full].min()
        longest_kept = wavelen[one].max() if one.any() else shortest_scaled / 8
        orig = math.ceil((longest_kept + shortest_scaled) / 2)
        high = (1 + orig / longest_kept) / 2
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
              "high_freq_factor": float(high), "original_max_position_embeddings": int(orig)}
    if orig <= 0 or not low < high or not np.allclose(
            _llama3_factors(params, wavelen), factors, rtol=1e-4, atol=0):
        raise CheckpointError(
            f"{where}: these RoPE frequency factors are not Llama 3 scaling (factors "
            f"{np.round(factors, 4).tolist()}); this RoPE variant is not supported")
    return params


def _llama3_factors(params: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter stores in rope_freqs for these parameters."""
    orig, factor = params["original_max_position_embeddings"], params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    smooth = (orig / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, blended))


# ---- tensors ---------------------------------------------------------------------------------

def _check_tensors(file: GGUFFile, config: ModelConfig
                   ) -> tuple[dict[str, GGUFTensor], dict[str, int]]:
    """Every tensor the config needs, by HF name, after checking names, types and shapes,
    and each expert's slice of the stacked tensor that holds it."""
    expected = config.expected_tensors()
    family = config.family
    wanted: dict[str, list[str]] = {}  # GGUF name -> the HF names it holds
    for name in expected:
        wanted.setdefault(gguf_tensor_name(name, family), []).append(name)
    index = {name: e for name in expected
             if (e := gguf_expert_index(name, family)) is not None}
    problems: list[str] = []
    found: dict[str, GGUFTensor] = {}
    unsupported = False
    for gguf_name, hf_names in wanted.items():
        hf_name = hf_names[0]
        shape = expected[hf_name]
        if hf_name in index:  # [E, ...]: one slice per expert
            shape = (len(hf_names), *shape)
            hf_name = f"{hf_name}, experts 0 to {len(hf_names) - 1}"
        tensor = file.tensors.get(gguf_name)
        if tensor is None:
            problems.append(f"missing tensor {gguf_name!r} ({hf_name}), expected shape {shape}")
        elif tensor.qtype not in SUPPORTED_TYPES:
            unsupported = True
            problems.append(
                f"tensor {gguf_name!r} has type {tensor.type_name}, which Tandem cannot "
                f"dequantize; supported: {', '.join(SUPPORTED_TYPE_NAMES)}")
        elif tensor.shape != shape:
            problems.append(f"tensor {gguf_name!r} ({hf_name}) has shape {tensor.shape}, "
                            f"expected {shape} from the metadata")
        elif shape[-1] % tensor.block_size:
            problems.append(f"tensor {gguf_name!r} has rows of {shape[-1]} values, not a "
                            f"multiple of the {tensor.type_name} block ({tensor.block_size})")
        else:
            found.update(dict.fromkeys(hf_names, tensor))
    for gguf_name, tensor in file.tensors.items():
        if gguf_name in wanted or gguf_name == ROPE_FREQS:
            continue
        hint = ""
        match = _BLOCK.match(gguf_name)
        if match and int(match.group(1)) >= config.num_layers:
            hint = f"; the metadata says block_count={config.num_layers}"
        problems.append(f"unexpected tensor {gguf_name!r} with shape {tensor.shape}: not part "
                        f"of a {family.name} model with this metadata{hint}")
    if problems:
        raise CheckpointError(
            f"GGUF file {file.path} does not hold the model its metadata describes "
            f"({config.num_layers} layers, hidden size {config.hidden_size}):"
            + list_problems(problems, _MAX_PROBLEMS_SHOWN)
            + (f"\n{_REQUANTIZE}" if unsupported else ""))
    return found, index


def _kind(tensor: GGUFTensor, name: str, quantization: str, linears: set[str],
          tied: str | None) -> Kind | None:
    """How `--quantization` holds this tensor: int8, int4 or dense (None)."""
    if quantization == "none" or (name not in linears and name != tied):
        return None
    if quantization == "auto":
        kind = auto_kind(tensor.qtype)
        if kind is None:
            return None
    else:
        kind = "int4" if quantization == "int4" else "int8"
    return "int8" if name == tied else kind  # an embedding is held as int8 rows


def _held_quantized(path: Path, tensor: GGUFTensor, kind: Kind, name: str, c: ModelConfig,
                    permuted: bool) -> QuantizedWeight:
    try:
        weight = as_quantized(tensor, kind)
    except (ValueError, NotImplementedError) as exc:
        raise CheckpointError(f"{path}: cannot read tensor {tensor.name!r} "
                              f"({tensor.type_name}) as {kind}: {exc}") from exc
    heads = (c.num_heads if ".self_attn.q_proj." in name
             else c.num_kv_heads if ".self_attn.k_proj." in name else None)
    if permuted and heads is not None:
        rows = torch.arange(weight.shape[0])[:, None]
        weight = weight.permute_rows(unpermute_rotary_rows(rows, heads)[:, 0])
    return weight


def _dequantized(path: Path, tensor: GGUFTensor) -> torch.Tensor:
    try:
        values = dequantize(tensor.data, tensor.qtype)
    except (ValueError, NotImplementedError) as exc:
        raise CheckpointError(f"{path}: cannot dequantize tensor {tensor.name!r} "
                              f"({tensor.type_name}): {exc}") from exc
    values = values.reshape(tensor.shape)
    if not values.flags.writeable:  # F32 data is a view of the read-only memory map
        values = values.copy()
    return torch.from_numpy(values)


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
