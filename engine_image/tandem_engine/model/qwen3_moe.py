"""Qwen3-MoE over a flat batch of tokens: the Qwen3 decoder with a mixture-of-experts MLP.

Attention is the Llama decoder's (model/llama.py) with Qwen3's q/k norms. A sparse layer's
MLP routes each token to `experts_per_token` of `num_experts` SiLU experts: a linear
router, softmax in float32, the top k (renormalized to sum 1 with `norm_topk_prob`), and
the token's output is the routing-weighted sum of its experts' outputs, as transformers'
Qwen3MoeSparseMoeBlock computes it. A layer listed in `mlp_only_layers` (or skipped by
`decoder_sparse_step`) keeps a dense MLP.

Checkpoints store the experts one by one (`mlp.experts.{e}.gate_proj.weight`, what
transformers 4.x and 5.x write; GGUF files are sliced into the same names), and the
parameters keep those names, so the loader, the refit check and the in-place refit see
the checkpoint's own layout. Their storage is stacked: as the model loads, each layer
copies its experts into one [E, 2 * I, hidden] gate/up tensor and one [E, hidden, I]
down tensor, and every expert's parameters become views into them (a refit that streams
weights in place writes through the views). A step then sorts its (token, expert)
pairs by expert and runs one grouped matmul per stacked tensor over the contiguous runs
of tokens each expert got: a fixed number of kernels, whatever the batch.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from tandem_engine.model.family import ModelConfig, MoEConfig
from tandem_engine.model.layers import RMSNorm
from tandem_engine.model.llama import MLP, Attention, CausalLM


class _Weight(nn.Module):
    """Holds one expert projection's `weight` under the checkpoint's name. Not an
    nn.Linear on purpose: the runner packs every Linear of the decoder layers for oneDNN,
    which would replace the view into the stacked experts with a copy."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = _Weight(inter, hidden)
        self.up_proj = _Weight(inter, hidden)
        self.down_proj = _Weight(hidden, inter)


class SparseMoE(nn.Module):
    """Router `gate` [E, hidden] and the experts, stacked once loaded (`stack_experts`)."""

    def __init__(self, c: ModelConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.normalize = moe.experts_per_token, moe.normalize_top_k
        self.inter = moe.intermediate_size
        self.gate = nn.Linear(c.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(c.hidden_size, moe.intermediate_size)
                                     for _ in range(moe.num_experts))
        self.gate_up: torch.Tensor | None = None  # [E, 2I, hidden]
        self.down: torch.Tensor | None = None  # [E, hidden, I]
        self.register_load_state_dict_post_hook(SparseMoE.stack_experts)

    @staticmethod
    def stack_experts(module: SparseMoE, _incompatible_keys: object = None) -> None:
        """Copy the experts' weights into the two stacked tensors and make each expert's
        parameters views into them (runs after load_state_dict)."""
        experts = list(module.experts)
        with torch.no_grad():
            gate_up = torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight))
                                   for e in experts])
            down = torch.stack([e.down_proj.weight for e in experts])
        inter = module.inter
        for i, e in enumerate(experts):
            e.gate_proj.weight = nn.Parameter(gate_up[i, :inter], requires_grad=False)
            e.up_proj.weight = nn.Parameter(gate_up[i, inter:], requires_grad=False)
            e.down_proj.weight = nn.Parameter(down[i], requires_grad=False)
        module.gate_up, module.down = gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.gate_up is not None and self.down is not None, "load the weights first"
        t, hidden = x.shape
        # transformers' router: softmax over every expert in float32, then the top k
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        # (token, expert) pairs grouped by expert: a stable sort keeps each expert's
        # tokens in order, so a token's outputs are summed in expert order as in
        # transformers (up to float rounding).
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0])
        h = _grouped_linear(x[token], self.gate_up, counts)
        h = F.silu(h[:, :self.inter]) * h[:, self.inter:]
        out = _grouped_linear(h, self.down, counts) * weights.reshape(-1)[order, None]
        return torch.zeros(t, hidden, dtype=x.dtype, device=x.device).index_add_(0, token, out)


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` grouped by expert (counts[e] consecutive rows for expert e) times each
    expert's weight [E, out, in] transposed: one grouped matmul where torch has one for
    these tensors (CPU, rows aligned to 16 bytes; measured as fast as the loop and
    bit-identical to F.linear per expert), else one matmul per expert that has tokens."""
    w = weight.transpose(1, 2)
    if x.device.type == "cpu" and _aligned(x) and _aligned(w):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return F.grouped_mm(x, w, offs=offs)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start:start + n] = x[start:start + n] @ w[e]
            start += n
    return out


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return all(s == 1 or (s * size) % 16 == 0 for s in t.stride()) and (
        t.data_ptr() % 16 == 0)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, sparse: bool) -> None:
        super().__init__()
        assert c.moe is not None
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # Qwen3's attention: the Llama decoder's with q/k norms (always, for this family)
        self.self_attn = Attention(dataclasses.replace(c, qk_norm=True))
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(c, c.moe) if sparse else MLP(c)


class DecoderStack(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        assert c.moe is not None, "a Qwen3-MoE config has experts"
        # Given its weight, the embedding skips its random init (see model/llama.py).
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size,
                                         _weight=torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(c, i not in c.moe.dense_layers)
                                    for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3MoeForCausalLM(CausalLM):
    """The whole model (a `layers.DecoderModel`): the Llama decoder's forward pass, RoPE,
    embedding and head over the Qwen3-MoE layers."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__(c)
        # The Llama stack built above is replaced (build_model constructs on the meta
        # device, so it never allocates).
        self.model = DecoderStack(c)
