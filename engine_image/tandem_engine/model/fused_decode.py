"""A decode step of a quantized Llama-family model in one native call (CPU, float32).

At batch 1 the eager forward pass of SmolLM2 makes ~600 torch calls a token (30 layers
of norms, projections, RoPE, the KV write, attention, SiLU and residuals), and their
dispatch costs as much as the arithmetic. `csrc/decode_stack.cpp` runs the same layers
in one call with persistent work buffers: `FusedDecode.build` hands it every layer's
packed weights once, and the runner calls it for steps of decodes only, at any batch
size, and `logits` for the output head of such a step. A short prefill chunk (a step of
at most `runner.FUSED_PREFILL_ROWS` rows) is given to it as decode rows, one a position,
each attending to its position and those before it (`ModelRunner._prefills_as_rows`):
the stack writes a layer's keys and values for every row before any row's attention.
Longer chunks take the eager path, whose projections are the same native kernels. With
many rows the per-row work (norms, RoPE, SiLU) is shared on its pool too.

It applies when the model is `llama.CausalLM`'s layer structure (llama, mistral, qwen2,
qwen3: RMSNorms, optional per-head q/k norms, q/k/v/o and gate/up/down projections) with
every projection, the output head included, quantized for the native kernels
(`QuantLinear` on a float32 CPU engine). `build` returns None, and says why, for
anything else. Its results are the eager path's up to float rounding, which the int8
rounding of activations now and then amplifies (tests/model/test_fused_decode.py).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from tandem_engine.model.attention import AttentionMetadata
from tandem_engine.model.quant import QuantEmbedding, QuantLinear

log = logging.getLogger(__name__)

_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
                ("mlp", "down_proj"))
_NONE = torch.empty(0)


class FusedDecode:
    """The native stack of one loaded model. Holds references to the model's packed
    weights: build a new one after the weights change (the runner does, on every load)."""

    def __init__(self, stack: object, model: nn.Module) -> None:
        self._stack = stack
        self._rope = model.rope
        self._embed = model.embed
        self._scale = float(model.model.layers[0].self_attn.scale)

    @classmethod
    def build(cls, model: nn.Module, native: ModuleType | None) -> FusedDecode | None:
        """The fused step for `model`, or None (logged at debug) when it does not apply."""
        reason = _unsupported(model, native)
        if reason is not None:
            log.debug("decode steps run eagerly: %s", reason)
            return None
        c = model.config
        layers = []
        for layer in model.model.layers:
            attn = layer.self_attn
            tensors = [_norm_weight(layer.input_layernorm),
                       _norm_weight(layer.post_attention_layernorm),
                       _NONE if attn.q_norm is None else _norm_weight(attn.q_norm),
                       _NONE if attn.k_norm is None else _norm_weight(attn.k_norm)]
            for owner, name in _PROJECTIONS:
                tensors += _packed(getattr(getattr(layer, owner), name))
            layers.append(tensors)
        head = _head(model)
        assert head is not None  # _unsupported checked it
        stack = native.DecodeStack(layers, _norm_weight(model.model.norm), _packed(head),
                                   c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                   c.rms_norm_eps)
        return cls(stack, model)

    @staticmethod
    def takes(meta: AttentionMetadata) -> bool:
        """Whether a step with this metadata runs fused: decode rows only (a short
        prefill's positions among them, `ModelRunner._prefills_as_rows`)."""
        return not meta.prefills and meta.flex is None and meta.num_decodes > 0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """What the model's forward returns for a decode-only step: [M, hidden]."""
        assert self._rope is not None
        assert meta.decode_blocks is not None and meta.decode_lens is not None
        x = self._embed(input_ids).contiguous()
        return self._stack.forward(x, self._rope.cos[positions], self._rope.sin[positions],
                                   kv_cache, meta.slot_mapping, meta.decode_blocks,
                                   meta.decode_lens, self._scale)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's `logits` of a fused step's rows, on the stack's own threads."""
        return self._stack.logits(hidden.contiguous())


def _packed(proj: QuantLinear) -> list[torch.Tensor]:
    """A projection as the native stack takes it: weight, scales, minimums (int4) and
    bias, each empty when absent."""
    mins = getattr(proj, "packed_mins", None)
    return [proj.packed, proj.packed_scales, _NONE if mins is None else mins,
            _NONE if proj.bias is None else proj.bias.contiguous()]


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    return norm.weight.detach().contiguous()


def _head(model: nn.Module) -> QuantLinear | None:
    """The output head as a natively packed projection (the tied embedding's rows or
    the LM head), or None."""
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None and isinstance(model.model.embed_tokens, QuantEmbedding):
        lm_head = model.model.embed_tokens.head
    return lm_head if isinstance(lm_head, QuantLinear) and lm_head.native is not None else None


def _unsupported(model: nn.Module, native: ModuleType | None) -> str | None:
    """Why the fused step cannot run `model`, or None when it can."""
    if native is None or not hasattr(native, "DecodeStack"):
        return "no native kernels"
    stack = getattr(model, "model", None)
    layers = getattr(stack, "layers", None)
    if layers is None or getattr(model, "rope", None) is None:
        return "not a Llama-family decoder stack"
    if model.model.norm.weight.dtype != torch.float32:
        return "not a float32 engine"
    for layer in layers:
        for owner, name in _PROJECTIONS:
            proj = getattr(getattr(layer, owner, None), name, None)
            if not isinstance(proj, QuantLinear) or proj.native is None:
                return f"{owner}.{name} is not a natively packed quantized projection"
    if _head(model) is None:
        return "the output head is not a natively packed quantized projection"
    return None
