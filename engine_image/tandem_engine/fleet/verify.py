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
5. it is **over-confident** (on by default): the probability it leaves off its most likely
   next token, averaged over `PROBE_TEXT` (its *uncertainty*, 1 - the mean top-1 mass), fell
   below `min_uncertainty_ratio` (`spec.refit.verify.minUncertaintyRatio`,
   `tandem refit --min-uncertainty-ratio`, default `DEFAULT_MIN_UNCERTAINTY_RATIO`; 0 turns
   it off) of the baseline's, *and* its perplexity on `PROBE_TEXT` is above the baseline's.
   Weights whose logits were scaled up (a final norm x 1e36) keep their greedy tokens, so
   rules 2 and 3 pass them, but every sampled text is then the greedy one and the probe's
   tokens get logprobs like -6.7e35. Both conditions, so that it cannot misfire: weights
   that grew more certain *and* predict the text better (they learnt it) pass, and so do
   weights that fit it worse but are as unsure as before (another domain). What real
   weights score (`benchmarks/refit_verify_scores.py`, docs/benchmarks.md): SmolLM2-135M
   refitted to itself 1.0, to its bf16 copy 0.9999, with noise of 1-3 % of each tensor's
   std 1.02-1.05; its final norm x 2: 0.53, x 4: 0.28, x 10: 0.13 (refused), x 1e36: 0.

Checkpoints with non-finite weights never get this far: loading refuses them
(`model/checkpoint.py`), so the engine refuses the refit itself.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from tandem_engine.admin_wire import CanaryReply, CanaryRequest, decode_canary

PROBE_TEXT = ("The library opens at nine in the morning and closes at six in the evening. "
              "Visitors may borrow up to five books at a time, and each loan lasts three "
              "weeks. Late returns cost ten cents a day.")
CANARY_TOKENS = 16
CANARY_TIMEOUT_S = 30.0
# Rule 5: a refitted engine's uncertainty on the probe text may not fall below this
# fraction of the previous weights' while its perplexity rises (0: no check).
DEFAULT_MIN_UNCERTAINTY_RATIO = 0.25


def canary_request(timeout: float = CANARY_TIMEOUT_S) -> dict[str, Any]:
    """The body of `/v1/canary` every engine gets, so canaries of one version compare."""
    return CanaryRequest(prompt=PROBE_TEXT, max_tokens=CANARY_TOKENS,
                         timeout=timeout).to_body()


@dataclass(frozen=True)
class CanaryReading:
    """One engine's canary: its greedy tokens, the probe text's mean negative
    log-likelihood per token in nats (perplexity = e^mean_nll), and the mean probability of
    the most likely next token over the probe text's positions (None from an engine that
    does not report it: rule 5 is then skipped)."""

    engine: str
    version: str
    token_ids: list[int]
    mean_nll: float
    top1_mass: float | None = None

    @classmethod
    def from_reply(cls, engine: str, version: str, reply: CanaryReply | dict[str, Any]
                   ) -> CanaryReading:
        """From `/v1/canary`'s reply (its JSON object: a msgspec.ValidationError, a
        ValueError, names the field that does not fit)."""
        if not isinstance(reply, CanaryReply):
            reply = decode_canary(reply)
        return cls(engine, version, list(reply.token_ids), reply.mean_nll, reply.top1_mass)

    @property
    def perplexity(self) -> float:
        return perplexity(self.mean_nll)

    @property
    def uncertainty(self) -> float | None:
        """The probability left for tokens other than the most likely one, on average."""
        return None if self.top1_mass is None else max(0.0, 1.0 - self.top1_mass)

    @property
    def degenerate(self) -> bool:
        return len(self.token_ids) > 1 and len(set(self.token_ids)) == 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CanaryReading:
        return cls(str(data["engine"]), str(data["version"]),
                   [int(t) for t in data["token_ids"]], float(data["mean_nll"]),
                   _optional_float(data.get("top1_mass")))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def uncertainty_ratio_problem(value: float) -> str | None:
    """Why `value` cannot be a minimum uncertainty ratio (rule 5), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{value!r} is not a number"
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        return (f"{value} is outside 0..1 (the least fraction of the previous weights' "
                "uncertainty on the probe text a refitted engine keeps; 0 turns the check off)")
    return None


def perplexity(mean_nll: float) -> float:
    """e^mean_nll, infinite where that overflows a float."""
    return math.exp(mean_nll) if mean_nll < 700 else math.inf


def problem(reading: CanaryReading, baseline: CanaryReading | None,
            max_perplexity_ratio: float | None,
            min_uncertainty_ratio: float = DEFAULT_MIN_UNCERTAINTY_RATIO) -> str | None:
    """Why `reading` (an engine on the new weights) fails rules 3 to 5 against `baseline`
    (the previous weights), or None when it passes. Without a baseline (none could be
    read), a degenerate output still fails: nothing shows it was normal before; rule 5,
    which is on by default, is then skipped rather than failing every refit."""
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
    if min_uncertainty_ratio and baseline is not None:
        return _over_confident(reading, baseline, min_uncertainty_ratio)
    return None


def _over_confident(reading: CanaryReading, baseline: CanaryReading, ratio: float
                    ) -> str | None:
    """Rule 5: less unsure than `ratio` of the baseline, and worse on the probe text."""
    left, before = reading.uncertainty, baseline.uncertainty
    if left is None or before is None:
        return None  # an engine too old to report its top-1 mass
    if not (left < ratio * before and reading.mean_nll > baseline.mean_nll):
        return None
    return (f"over-confident canary: the most likely next token holds {reading.top1_mass:.4%} "
            f"of the probability on average over the probe text, leaving {left:.3g} to all "
            f"others, under {ratio:g}x the previous weights' {before:.3g} ({baseline.version}), "
            f"while the probe text's perplexity rose "
            f"{perplexity(reading.mean_nll - baseline.mean_nll):.3g}x "
            f"({reading.perplexity:.4g} against {baseline.perplexity:.4g}): scaled-up logits "
            "(every sample would be the greedy text); refit.verify.minUncertaintyRatio "
            "(tandem refit --min-uncertainty-ratio) sets the limit, 0 turns the check off")
