"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat batch of tokens.

Parameter names mirror the HuggingFace checkpoints so a state dict loads as is. The
forward pass takes every scheduled token of a step as one [T] sequence (prefill
chunks and decodes of many requests together); only attention needs to know which
request a token belongs to, and it learns that from `AttentionMetadata`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem_engine.config import ModelConfig, RopeConfig
from tandem_engine.model.attention import AttentionMetadata, paged_attention, write_kv


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim ** -0.5
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, q, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias)
        self.o_proj = nn.Linear(q, c.hidden_size, bias=c.o_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


class DecoderStack(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        # Given its weight, the embedding skips its random init: that init (normal_) would
        # import torch._dynamo, 1.3 s of every engine start, for values the checkpoint's
        # tensors replace anyway.
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size,
                                         _weight=torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole model. `kv_cache` is [layers, 2, blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.model = DecoderStack(c)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(
            c.hidden_size, c.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin,
                                    kv_cache[i, 0], kv_cache[i, 1], meta)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).to(torch.float32)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_linears(model: CausalLM) -> None:
    """Swap every projection inside the decoder layers for its packed form, in place."""
    for layer in model.model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name, child in list(owner.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(owner, name, PackedLinear(child))


def stream_weights(model: CausalLM, tensors: dict[str, torch.Tensor],
                   dtype: torch.dtype) -> int:
    """Overwrite the model's weights in place, one tensor at a time, from `tensors`
    (validated against the model's config; emptied as it goes). Device memory never holds
    more than the model plus the one tensor being converted; parameter addresses stay the
    same (captured CUDA graphs stay valid). Returns the most bytes staged on the device
    for one tensor (0 when every tensor already has the model's dtype).

    Every name and shape is checked before the first copy; a copy that fails midway
    (out of memory) leaves a mix of weights: refit again."""
    params = dict(model.named_parameters())
    packed = {name: m for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    targets: dict[str, torch.Tensor | PackedLinear] = {}
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        target: torch.Tensor | PackedLinear | None = params.get(name)
        if target is None and owner in packed:
            target = packed[owner] if leaf == "weight" else packed[owner].bias
        if target is None:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in the model")
        shape = (tuple(target.packed_shape) if isinstance(target, PackedLinear)
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
            if isinstance(target, PackedLinear):
                target.load_weight(tensor.to(dtype))
            else:
                if tensor.dtype != dtype:
                    # Converted on the device: one tensor of the checkpoint's dtype there.
                    staged = max(staged, tensor.numel() * tensor.element_size())
                target.copy_(tensor)
    return staged


def build_model(config: ModelConfig, tensors: dict[str, torch.Tensor],
                device: torch.device) -> CausalLM:
    """Instantiate without allocating, then adopt the checkpoint's tensors as parameters."""
    with torch.device("meta"):
        model = CausalLM(config)
    model.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=True,
                          assign=True)
    return model.eval()
