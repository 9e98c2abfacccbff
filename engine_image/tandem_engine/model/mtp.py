"""Multi-token-prediction heads: the layout Tandem reads, applies and fits.

Medusa-style residual heads stored in the served checkpoint itself, needing no KV
cache of their own (docs/mtp.md):

* config.json: `"num_mtp_heads": N` (absent or 0: no heads) and optionally
  `"mtp_hidden_act"`: "silu" (default; Medusa's residual block) or "identity" (a
  linear residual, what `tandem mtp-heads fit` writes: least squares solves it
  exactly). transformers ignores both keys and the tensors below (an unused-weights
  warning), so the checkpoint still loads there as the plain model.
* tensors, beside the model's: `mtp.{i}.weight` [hidden, hidden] for i in 0..N-1, and
  `mtp.{i}.bias` [hidden] (optional, per head; absent = zero).
* head i maps the target's final-normed hidden state h at position t to
  h_i = h + act(W_i h + b_i), and the target's own lm_head (tied or not) turns h_i into
  logits for the token at position t + 2 + i. (The lm_head on h itself gives the token
  at t + 1: the one the target samples.)

The engine uses them so (`engine.speculative.MtpProposer`): after each forward, a request that
sampled keeps the hidden state of the row that produced the last token it emitted
(position t; that token x sits at t + 1 and is not computed yet). At the next step,
proposal j = argmax of head j's logits: the tokens at t + 2 + j, the ones after x. A
point-mass proposal, so the engine's acceptance stays exact; the heads change only how
many proposals are accepted, never the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem_engine.config import ModelConfig

MTP_PREFIX = "mtp."


@dataclass(frozen=True)
class MtpHeads:
    """N heads stacked: weight [N, hidden, hidden] (out, in, as nn.Linear), bias [N, hidden]
    (zero where a head has none)."""

    weight: torch.Tensor
    bias: torch.Tensor
    act: str = "silu"

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    def to(self, device: torch.device, dtype: torch.dtype) -> MtpHeads:
        return MtpHeads(self.weight.to(device, dtype), self.bias.to(device, dtype), self.act)

    def hidden(self, h: torch.Tensor, n: int) -> torch.Tensor:
        """[n, R, hidden]: heads 0..n-1 applied to the rows of `h` ([R, hidden])."""
        z = torch.einsum("rh,noh->nro", h, self.weight[:n]) + self.bias[:n, None, :]
        return h.unsqueeze(0) + (F.silu(z) if self.act == "silu" else z)

    def propose(self, h: torch.Tensor, n: int,
                logits: Callable[[torch.Tensor], torch.Tensor]) -> list[list[int]]:
        """Per row of `h`: the argmax tokens of heads 0..n-1, through the target's lm_head
        (`logits`: [M, hidden] -> [M, vocab])."""
        rows = h.shape[0]
        states = self.hidden(h, n).reshape(n * rows, h.shape[1])
        tokens = logits(states).argmax(-1).view(n, rows)
        return tokens.t().tolist()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of these heads (every bias written)."""
        out: dict[str, torch.Tensor] = {}
        for i in range(self.num_heads):
            out[f"{MTP_PREFIX}{i}.weight"] = self.weight[i].contiguous()
            out[f"{MTP_PREFIX}{i}.bias"] = self.bias[i].contiguous()
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
    return MtpHeads(torch.stack(weights), torch.stack(biases), config.mtp_hidden_act)


def random_heads(hidden_size: int, num_heads: int, generator: torch.Generator,
                 act: str = "silu") -> MtpHeads:
    """Heads of random weights (std 1/sqrt(hidden)) and zero bias: a demo model's, valid in
    layout, predicting nothing in particular."""
    weight = torch.randn(num_heads, hidden_size, hidden_size,
                         generator=generator) / hidden_size ** 0.5
    return MtpHeads(weight, torch.zeros(num_heads, hidden_size), act)


def fit_heads(sequences: Sequence[torch.Tensor], num_heads: int,
              ridge: float = 1e-3) -> MtpHeads:
    """Linear residual heads (act "identity") fitted in closed form: for each head i,
    W_i h_t + b_i ≈ h_{t+1+i} - h_t over every position t of every sequence of final-normed
    hidden states ([L, hidden] each, consecutive positions), by ridge-regularized least
    squares (`ridge` times the mean feature energy on the diagonal, bias unpenalized; the
    normal equations solved in float64). Fewer positions than hidden + 1 unknowns is
    allowed: the ridge picks the small solution that (nearly) interpolates them."""
    if num_heads < 1:
        raise ValueError(f"fit_heads: num_heads={num_heads} must be at least 1")
    hidden = sequences[0].shape[1]
    weights, biases = [], []
    for i in range(num_heads):
        xs = [s[:len(s) - 1 - i] for s in sequences if len(s) > 1 + i]
        ys = [s[1 + i:] - s[:len(s) - 1 - i] for s in sequences if len(s) > 1 + i]
        if not xs:
            raise ValueError(f"fit_heads: no sequence is longer than {i + 1} positions, so "
                             f"head {i} has nothing to learn: give longer sequences")
        x = torch.cat(xs).double()
        x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
        y = torch.cat(ys).double()
        gram = x.t() @ x
        penalty = ridge * gram.diagonal()[:hidden].mean()
        gram[range(hidden), range(hidden)] += penalty
        solution = torch.linalg.solve(gram, x.t() @ y)  # [hidden + 1, hidden]
        weights.append(solution[:hidden].t().float())
        biases.append(solution[hidden].float())
    return MtpHeads(torch.stack(weights), torch.stack(biases), "identity")
