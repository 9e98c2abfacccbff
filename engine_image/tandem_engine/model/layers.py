"""What every model family builds on: RMSNorm, RoPE tables, the model interface, building
a model from a checkpoint's tensors, and the weight plumbing (oneDNN-packed projections,
in-place streaming for a low-memory refit) the runner applies to any family.

A family's model class (named by its `model/family.Family` entry) is a `DecoderModel`:
the runner, the CUDA graphs, the engine's mtp proposer and the mtp tool call only these
methods, never the family's modules.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tandem_engine.model.attention import AttentionMetadata
from tandem_engine.model.family import ModelConfig, RopeConfig
from tandem_engine.model.quant import QuantEmbedding, QuantizedWeight, QuantLinear, install


class DecoderModel(Protocol):
    """The interface of every family's model (an nn.Module)."""

    config: ModelConfig

    def prepare_positions(self, max_positions: int) -> None:
        """Build the RoPE tables for positions 0..max_positions-1 on the weights' device
        and in their dtype (after the weights are loaded)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[T] tokens at [T] positions -> [T, hidden] final-normed hidden states, writing
        each token's keys and values into `kv_cache` ([layers, 2, blocks, block_size,
        kv_heads, head_dim]) at `meta.slot_mapping`."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embedding of tokens ([M] -> [M, hidden]), as the first layer sees it."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [M, hidden] -> float32 logits [M, vocab]."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class NativeRMSNorm(nn.Module):
    """RMSNorm in one native call for float32 on CPU (`pack_norms`); other inputs take
    the torch form."""

    def __init__(self, norm: RMSNorm, native: ModuleType) -> None:
        super().__init__()
        self.weight, self.eps, self.native = norm.weight, norm.eps, native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or self.weight.dtype != torch.float32:
            return RMSNorm.forward(self, x)  # type: ignore[arg-type]
        return self.native.rms_norm(x.contiguous(), self.weight, self.eps)


def pack_norms(model: nn.Module, native: ModuleType) -> None:
    """Swap every RMSNorm for its native form, in place (weights shared)."""
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if type(child) is RMSNorm:
                setattr(owner, name, NativeRMSNorm(child, native))


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                      .to(torch.float32) / head_dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept,
        # a smooth blend between the two cut-offs.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


class RotaryEmbedding:
    """cos/sin tables for every position, computed once in float32."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(rope, head_dim)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def vocab_logits(hidden: torch.Tensor, embed_tokens: nn.Module,
                 lm_head: nn.Module | None) -> torch.Tensor:
    """Float32 logits of final-normed hidden states: the LM head, or with tied
    embeddings the input embedding's rows (dense or quantized)."""
    if lm_head is not None:
        return lm_head(hidden).to(torch.float32)
    if isinstance(embed_tokens, QuantEmbedding):
        return embed_tokens.project(hidden).to(torch.float32)
    return F.linear(hidden, embed_tokens.weight).to(torch.float32)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class PackedLinear(nn.Module):
    """A Linear whose weight is prepacked for oneDNN on CPU.

    oneDNN's packed-weight matmul ran 1.5-1.7x faster than the default CPU matmul at
    every batch size a step produces (1 to 512 rows) on the development machine."""

    BATCH_HINT = 64

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.load_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def load_weight(self, weight: torch.Tensor) -> None:
        """Pack `weight` ([out, in]) in place of the current one."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.BATCH_HINT)
        self.packed_shape = weight.shape

    def weight_nbytes(self) -> int:
        total = self.packed.numel() * self.packed.element_size()
        return total + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """float32 always; bfloat16 where oneDNN runs it in hardware (AVX-512 BF16, AMX):
    packed once at load, not reordered on every call as the default matmul does."""
    if not (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack_linears(model: nn.Module) -> None:
    """Swap every projection inside the decoder layers (the tensors under the family's
    `layer_prefix`; not the output head) for its packed form, in place."""
    prefix = model.config.family.layer_prefix
    linears = [(owner, name) for owner_name, owner in model.named_modules()
               for name, child in owner.named_children()
               if isinstance(child, nn.Linear) and f"{owner_name}.{name}".startswith(prefix)]
    for owner, name in linears:
        setattr(owner, name, PackedLinear(getattr(owner, name)))


Repacked = PackedLinear | QuantLinear | QuantEmbedding  # a weight held in a kernel's layout


def stream_weights(model: nn.Module, tensors: dict[str, torch.Tensor | QuantizedWeight],
                   dtype: torch.dtype) -> int:
    """Overwrite the model's weights in place, one tensor at a time, from `tensors`
    (validated against the model's config; emptied as it goes). Device memory never holds
    more than the model plus the one tensor being converted; parameter addresses stay the
    same (captured CUDA graphs stay valid). Returns the most bytes staged on the device
    for one tensor (0 when every tensor already has the model's dtype).

    Every name and shape is checked before the first copy; a copy that fails midway
    (out of memory) leaves a mix of weights: refit again."""
    params = dict(model.named_parameters())
    packed = {name: m for name, m in model.named_modules()
              if isinstance(m, PackedLinear | QuantLinear | QuantEmbedding)}
    targets: dict[str, torch.Tensor | Repacked] = {}
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        target: torch.Tensor | Repacked | None = params.get(name)
        if target is None and owner in packed:
            target = packed[owner] if leaf == "weight" else packed[owner].bias
        if target is None:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in the model")
        if isinstance(target, QuantLinear | QuantEmbedding) != isinstance(
                tensor, QuantizedWeight):
            raise ValueError(f"checkpoint tensor {name!r} is "
                             f"{'quantized' if isinstance(tensor, QuantizedWeight) else 'dense'}"
                             ", the model's is not")
        shape = (tuple(target.packed_shape) if isinstance(target, Repacked)
                 else tuple(target.shape))
        if tuple(tensor.shape) != shape:
            raise ValueError(f"checkpoint tensor {name!r} is {tuple(tensor.shape)}, the "
                             f"model's is {shape}")
        targets[name] = target
    missing = sorted(set(params) - set(targets))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} of the model's tensors, "
                         f"e.g. {missing[0]!r}")
    staged = 0
    with torch.no_grad():
        for name, target in targets.items():
            tensor = tensors.pop(name)
            if isinstance(tensor, QuantizedWeight):
                assert isinstance(target, QuantLinear | QuantEmbedding)
                target.load_weight(tensor)
            elif isinstance(target, PackedLinear):
                target.load_weight(tensor.to(dtype))
            else:
                if tensor.dtype != dtype:
                    # Converted on the device: one tensor of the checkpoint's dtype there.
                    staged = max(staged, tensor.numel() * tensor.element_size())
                target.copy_(tensor)
    return staged


def build_model(config: ModelConfig, tensors: dict[str, torch.Tensor | QuantizedWeight],
                device: torch.device, max_positions: int, dtype: torch.dtype | None = None,
                native: ModuleType | None = None) -> nn.Module:
    """Instantiate the config's family's model without allocating, adopt the checkpoint's
    dense tensors as parameters, put the quantized ones' modules in place (in `dtype`,
    default the dense tensors'), and build its RoPE tables for `max_positions` positions."""
    with torch.device("meta"):
        model = config.family.model_class()(config)
    quantized = {k: v for k, v in tensors.items() if isinstance(v, QuantizedWeight)}
    dense = {k: v.to(device) for k, v in tensors.items() if not isinstance(v, QuantizedWeight)}
    if quantized:
        if dtype is None:
            dtype = next(iter(dense.values())).dtype
        biases = {k: dense.pop(k) for k in list(dense)
                  if k.endswith(".bias") and f"{k.removesuffix('bias')}weight" in quantized}
        install(model, quantized, biases, device, dtype, native)
    result = model.load_state_dict(dense, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"the weights do not fit the model: missing {result.missing_keys[:3]}"
                         f", unexpected {result.unexpected_keys[:3]}")
    model.prepare_positions(max_positions)
    return model.eval()
