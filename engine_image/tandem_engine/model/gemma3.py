"""Gemma 3 (text) over a flat batch of tokens: what sets it apart from the Llama decoder.

* embeddings scaled by sqrt(hidden_size) (in the weights' dtype, as transformers does);
* RMSNorm computed in float32 with weight (1 + w), a norm after attention and around
  the MLP (pre and post feed-forward), and RMS q/k norms over each head;
* a GELU-tanh gated MLP;
* attention scaled by query_pre_attn_scalar ** -0.5; sliding-window layers (a query
  sees the last `sliding_window` positions) interleaved with global ones, each kind
  with its own RoPE (sliding: the local base; global: rope_theta with its scaling);
* optional final logit soft-capping.

Parameter names are the HuggingFace checkpoint's, so the state dict loads as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem_engine.model.attention import AttentionMetadata, paged_attention, write_kv
from tandem_engine.model.family import ModelConfig
from tandem_engine.model.layers import RotaryEmbedding, apply_rope, vocab_logits


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, cast back to x's dtype at the end."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, sliding: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.attention_scale if c.attention_scale is not None else c.head_dim ** -0.5
        self.window = c.sliding_window if sliding else None
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, q, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias)
        self.o_proj = nn.Linear(q, c.hidden_size, bias=c.o_bias)
        self.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale, window=self.window)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, sliding)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)
        self.post_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)


class DecoderStack(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        # Given its weight, the embedding skips its random init (see llama.DecoderStack).
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size,
                                         _weight=torch.empty(c.vocab_size, c.hidden_size))
        types = c.layer_types or ("full_attention",) * c.num_layers
        self.layers = nn.ModuleList(DecoderLayer(c, t == "sliding_attention") for t in types)
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)


class Gemma3ForCausalLM(nn.Module):
    """The whole model (a `layers.DecoderModel`)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.model = DecoderStack(c)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(
            c.hidden_size, c.vocab_size, bias=False)
        self.embed_scale = c.hidden_size ** 0.5
        self.rope: RotaryEmbedding | None = None  # global layers; prepare_positions
        self.local_rope: RotaryEmbedding | None = None  # sliding-window layers

    def prepare_positions(self, max_positions: int) -> None:
        c, weight = self.config, self.model.norm.weight  # dense even when quantized
        self.rope = RotaryEmbedding(c.rope, c.head_dim, max_positions, weight.device,
                                    weight.dtype)
        self.local_rope = RotaryEmbedding(c.local_rope or c.rope, c.head_dim, max_positions,
                                          weight.device, weight.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert self.rope is not None and self.local_rope is not None, (
            "prepare_positions() before forward()")
        full, local = self.rope.lookup(positions), self.local_rope.lookup(positions)
        x = self.embed(input_ids)
        for i, layer in enumerate(self.model.layers):
            cos, sin = local if layer.sliding else full
            h = layer.self_attn(layer.input_layernorm(x), cos, sin,
                                kv_cache[i, 0], kv_cache[i, 1], meta)
            x = x + layer.post_attention_layernorm(h)
            h = layer.mlp(layer.pre_feedforward_layernorm(x))
            x = x + layer.post_feedforward_layernorm(h)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = vocab_logits(hidden, self.model.embed_tokens, self.lm_head)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)
