"""Multi-token-prediction heads: the layout Tandem reads, applies and fits.

Medusa-style residual heads stored in the served checkpoint itself, needing no KV
cache of their own (docs/mtp.md):

* config.json: `"num_mtp_heads": N` (absent or 0: no heads) and optionally
  `"mtp_hidden_act"`: "silu" (default; Medusa's residual block) or "identity" (a
  linear residual, what `tandem mtp-heads fit` writes: least squares solves it
  exactly). transformers ignores both keys and the tensors below (an unused-weights
  warning), so the checkpoint still loads there as the plain model.
* `"mtp_token_input": true` (default false): each head also reads the target's input
  embedding e(x) of the token x at t + 1 (below), through `mtp.{i}.token_weight`.
* tensors, beside the model's: `mtp.{i}.weight` [hidden, hidden] for i in 0..N-1,
  `mtp.{i}.bias` [hidden] (optional, per head; absent = zero) and, with
  mtp_token_input, `mtp.{i}.token_weight` [hidden, hidden].
* head i maps the target's final-normed hidden state h at position t to
  h_i = h + act(W_i h + U_i e(x) + b_i) (the U_i term only with mtp_token_input), and the
  target's own lm_head (tied or not) turns h_i into logits for the token at position
  t + 2 + i. (The lm_head on h itself gives the token x at t + 1: the one the target
  sampled there, known when the heads run.)

The engine uses them so (`engine.speculative.MtpProposer`): after each forward, a request that
sampled keeps the hidden state of the row that produced the last token it emitted
(position t; that token x sits at t + 1 and is not computed yet). At the next step,
proposal j = argmax of head j's logits (given h and x): the tokens at t + 2 + j, the
ones after x. A
point-mass proposal, so the engine's acceptance stays exact; the heads change only how
many proposals are accepted, never the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem_engine.model.family import ModelConfig

MTP_PREFIX = "mtp."


@dataclass(frozen=True)
class MtpHeads:
    """N heads stacked: weight [N, hidden, hidden] (out, in, as nn.Linear), bias [N, hidden]
    (zero where a head has none), token_weight [N, hidden, hidden] or None (heads that
    do not read the emitted token's embedding)."""

    weight: torch.Tensor
    bias: torch.Tensor
    act: str = "silu"
    token_weight: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    def to(self, device: torch.device, dtype: torch.dtype) -> MtpHeads:
        token = None if self.token_weight is None else self.token_weight.to(device, dtype)
        return MtpHeads(self.weight.to(device, dtype), self.bias.to(device, dtype), self.act,
                        token)

    def hidden(self, h: torch.Tensor, n: int, e: torch.Tensor | None = None) -> torch.Tensor:
        """[n, R, hidden]: heads 0..n-1 applied to the rows of `h` ([R, hidden]); `e`
        ([R, hidden]) is the embedding of each row's emitted token (used only by heads
        with a token_weight)."""
        z = torch.einsum("rh,noh->nro", h, self.weight[:n]) + self.bias[:n, None, :]
        if self.token_weight is not None:
            assert e is not None, "these heads read the emitted token's embedding"
            z = z + torch.einsum("rh,noh->nro", e, self.token_weight[:n])
        return h.unsqueeze(0) + (F.silu(z) if self.act == "silu" else z)

    def propose(self, h: torch.Tensor, n: int, logits: Callable[[torch.Tensor], torch.Tensor],
                e: torch.Tensor | None = None) -> list[list[int]]:
        """Per row of `h`: the argmax tokens of heads 0..n-1, through the target's lm_head
        (`logits`: [M, hidden] -> [M, vocab])."""
        rows = h.shape[0]
        states = self.hidden(h, n, e).reshape(n * rows, h.shape[1])
        tokens = logits(states).argmax(-1).view(n, rows)
        return tokens.t().tolist()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of these heads (every bias written)."""
        out: dict[str, torch.Tensor] = {}
        for i in range(self.num_heads):
            out[f"{MTP_PREFIX}{i}.weight"] = self.weight[i].contiguous()
            out[f"{MTP_PREFIX}{i}.bias"] = self.bias[i].contiguous()
            if self.token_weight is not None:
                out[f"{MTP_PREFIX}{i}.token_weight"] = self.token_weight[i].contiguous()
        return out


def take_mtp_heads(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> MtpHeads | None:
    """Remove the heads' tensors (`mtp.*`, validated by the loader) from a loaded
    checkpoint's `tensors`, so the rest builds the model; return them stacked, or None
    when the checkpoint has none."""
    mine = {name: tensors.pop(name) for name in [n for n in tensors
                                                 if n.startswith(MTP_PREFIX)]}
    if config.num_mtp_heads == 0:
        return None
    weights = [mine[f"{MTP_PREFIX}{i}.weight"] for i in range(config.num_mtp_heads)]
    biases = [mine.get(f"{MTP_PREFIX}{i}.bias", torch.zeros_like(w[0]))
              for i, w in enumerate(weights)]
    token = (torch.stack([mine[f"{MTP_PREFIX}{i}.token_weight"]
                          for i in range(config.num_mtp_heads)])
             if config.mtp_token_input else None)
    return MtpHeads(torch.stack(weights), torch.stack(biases), config.mtp_hidden_act, token)


def random_heads(hidden_size: int, num_heads: int, generator: torch.Generator,
                 act: str = "silu") -> MtpHeads:
    """Heads of random weights (std 1/sqrt(hidden)) and zero bias: a demo model's, valid in
    layout, predicting nothing in particular."""
    weight = torch.randn(num_heads, hidden_size, hidden_size,
                         generator=generator) / hidden_size ** 0.5
    return MtpHeads(weight, torch.zeros(num_heads, hidden_size), act)


def fit_heads(sequences: Sequence[torch.Tensor], num_heads: int, ridge: float = 1e-3,
              token_embeddings: Sequence[torch.Tensor] | None = None) -> MtpHeads:
    """Linear residual heads (act "identity") fitted in closed form: for each head i,
    W_i h_t + U_i e_t + b_i ≈ h_{t+1+i} - h_t over every position t of every sequence of
    final-normed hidden states ([L, hidden] each, consecutive positions), by
    ridge-regularized least squares (`ridge` times the mean feature energy on the
    diagonal, bias unpenalized; the normal equations solved in float64). With
    `token_embeddings` ([L - 1, hidden] each: e_t, the embedding of the token state t
    produced) the heads read it (U_i); without, they have no U_i. Fewer positions than
    unknowns is allowed: the ridge picks the small solution that (nearly) interpolates
    them."""
    if num_heads < 1:
        raise ValueError(f"fit_heads: num_heads={num_heads} must be at least 1")
    hidden = sequences[0].shape[1]
    with_tokens = token_embeddings is not None
    embeds = token_embeddings if with_tokens else [None] * len(sequences)
    weights, token_weights, biases = [], [], []
    for i in range(num_heads):
        xs, ys = [], []
        for s, e in zip(sequences, embeds, strict=True):
            n = len(s) - 1 - i
            if n <= 0:
                continue
            xs.append(s[:n] if e is None else torch.cat([s[:n], e[:n]], dim=1))
            ys.append(s[1 + i:] - s[:n])
        if not xs:
            raise ValueError(f"fit_heads: no sequence is longer than {i + 1} positions, so "
                             f"head {i} has nothing to learn: give longer sequences")
        x = torch.cat(xs).double()
        features = x.shape[1]
        x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
        y = torch.cat(ys).double()
        gram = x.t() @ x
        penalty = ridge * gram.diagonal()[:features].mean()
        gram[range(features), range(features)] += penalty
        solution = torch.linalg.solve(gram, x.t() @ y)  # [features + 1, hidden]
        weights.append(solution[:hidden].t().float())
        if with_tokens:
            token_weights.append(solution[hidden:features].t().float())
        biases.append(solution[features].float())
    return MtpHeads(torch.stack(weights), torch.stack(biases), "identity",
                    torch.stack(token_weights) if with_tokens else None)
