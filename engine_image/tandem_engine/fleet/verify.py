"""What a refitted engine's canary must show before it serves: the rules, pure and torch-free.

A canary is one request on an engine's admin API (`/v1/canary`) that no router sees: the
engine scores `PROBE_TEXT` (teacher-forced: how likely each token is given the ones
before it) and generates `CANARY_TOKENS` greedy tokens after it. A refit transaction reads
one canary from the previous weights before it touches any engine (the baseline), then
one from every engine it refits. An engine fails verification when

1. its canary cannot run: the engine found NaN or Inf logits (or prompt logprobs), or it
   timed out (the engine answers 409/504; the transaction reports that text);
2. its tokens differ from the ones another engine produced on the same weights version;
3. its output is **degenerate**: all `CANARY_TOKENS` tokens are one token id repeated,
   while the baseline's were not (weights that collapsed to a constant prediction);
4. with `max_perplexity_ratio` set (`spec.refit.verify.maxPerplexityRatio`,
   `tandem refit --max-perplexity-ratio`): its perplexity on `PROBE_TEXT` is more than
   that factor above the baseline's. Off by default: a legitimate training step may change
   the perplexity of one fixed text a lot; an RL pool, whose steps are small, turns it on.

Checkpoints with non-finite weights never get this far: loading refuses them
(`model/checkpoint.py`), so the engine refuses the refit itself.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

PROBE_TEXT = ("The library opens at nine in the morning and closes at six in the evening. "
              "Visitors may borrow up to five books at a time, and each loan lasts three "
              "weeks. Late returns cost ten cents a day.")
CANARY_TOKENS = 16
CANARY_TIMEOUT_S = 30.0


def canary_request(timeout: float = CANARY_TIMEOUT_S) -> dict[str, Any]:
    """The body of `/v1/canary` every engine gets, so canaries of one version compare."""
    return {"prompt": PROBE_TEXT, "max_tokens": CANARY_TOKENS, "timeout": timeout}


@dataclass(frozen=True)
class CanaryReading:
    """One engine's canary: its greedy tokens and the probe text's mean negative
    log-likelihood per token in nats (perplexity = e^mean_nll)."""

    engine: str
    version: str
    token_ids: list[int]
    mean_nll: float

    @classmethod
    def from_reply(cls, engine: str, version: str, reply: dict[str, Any]) -> CanaryReading:
        return cls(engine, version, [int(t) for t in reply["token_ids"]],
                   float(reply["mean_nll"]))

    @property
    def perplexity(self) -> float:
        return perplexity(self.mean_nll)

    @property
    def degenerate(self) -> bool:
        return len(self.token_ids) > 1 and len(set(self.token_ids)) == 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CanaryReading:
        return cls(str(data["engine"]), str(data["version"]),
                   [int(t) for t in data["token_ids"]], float(data["mean_nll"]))


def perplexity(mean_nll: float) -> float:
    """e^mean_nll, infinite where that overflows a float."""
    return math.exp(mean_nll) if mean_nll < 700 else math.inf


def problem(reading: CanaryReading, baseline: CanaryReading | None,
            max_perplexity_ratio: float | None) -> str | None:
    """Why `reading` (an engine on the new weights) fails rules 3 and 4 against `baseline`
    (the previous weights), or None when it passes. Without a baseline (none could be
    read), a degenerate output still fails: nothing shows it was normal before."""
    if not math.isfinite(reading.mean_nll):
        return f"the probe text's log-likelihood is not finite ({reading.mean_nll})"
    if reading.degenerate and (baseline is None or not baseline.degenerate):
        before = ("" if baseline is None else
                  f", where the previous weights ({baseline.version}) gave "
                  f"{baseline.token_ids}")
        return (f"degenerate canary: {len(reading.token_ids)} greedy tokens are all token "
                f"{reading.token_ids[0]}{before}")
    if max_perplexity_ratio is not None:
        if baseline is None:
            return ("no baseline perplexity from the previous weights to compare with "
                    f"(refit.verify.maxPerplexityRatio is {max_perplexity_ratio})")
        # Compare in log space: the ratio of perplexities is e^(difference of the NLLs).
        log_ratio = reading.mean_nll - baseline.mean_nll
        if log_ratio > math.log(max_perplexity_ratio):
            return (f"perplexity {reading.perplexity:.4g} on the probe text is "
                    f"{perplexity(log_ratio):.3g}x the previous weights' "
                    f"{baseline.perplexity:.4g} ({baseline.version}), above "
                    f"refit.verify.maxPerplexityRatio {max_perplexity_ratio:g}")
    return None
