"""The Llama decoder (families llama, mistral, qwen2, qwen3) over a flat batch of tokens.

Parameter names mirror the HuggingFace checkpoints so a state dict loads as is. The
forward pass takes every scheduled token of a step as one [T] sequence (prefill
chunks and decodes of many requests together); only attention needs to know which
request a token belongs to, and it learns that from `AttentionMetadata`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem_engine.model.attention import AttentionMetadata, paged_attention, write_kv
from tandem_engine.model.family import ModelConfig
from tandem_engine.model.layers import RMSNorm, RotaryEmbedding, apply_rope, vocab_logits


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
    """The whole model (a `layers.DecoderModel`). `kv_cache` is
    [layers, 2, blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.model = DecoderStack(c)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(
            c.hidden_size, c.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None  # prepare_positions builds it

    def prepare_positions(self, max_positions: int) -> None:
        weight = self.model.norm.weight  # dense even when the embedding is quantized
        self.rope = RotaryEmbedding(self.config.rope, self.config.head_dim, max_positions,
                                    weight.device, weight.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert self.rope is not None, "prepare_positions() before forward()"
        cos, sin = self.rope.lookup(positions)
        x = self.embed(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin,
                                    kv_cache[i, 0], kv_cache[i, 1], meta)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_logits(hidden, self.model.embed_tokens, self.lm_head)
