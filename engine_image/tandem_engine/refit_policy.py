"""How a fleet-wide refit runs: the words for it and their defaults, stated once.

The InferencePool's `spec.refit`, `tandem refit`'s flags and the refit transaction
(`tandem_engine.fleet`) share these. The module is torch-free and imports nothing, so the
operator's spec parser and the CLI's argument parser use it without the fleet's HTTP
client. The CRD states the same words and defaults in its schema (enums are CamelCase
strings there); tests/operator_tests/test_crd.py checks that the two agree.
"""

from __future__ import annotations

import enum
import math


class RefitStrategy(str, enum.Enum):
    ROLLING = "Rolling"  # waves per role that keep a prefill and a decode engine serving
    ALL_AT_ONCE = "AllAtOnce"  # every engine together (RL weight sync)

    def __str__(self) -> str:
        return self.value


class InFlight(str, enum.Enum):
    """What happens to an engine's in-flight requests when it is refit."""

    DRAIN = "Drain"  # they finish on the old weights first
    RECOMPUTE = "Recompute"  # their KV is dropped and re-prefilled on the new weights

    def __str__(self) -> str:
        return self.value


class OnFailure(str, enum.Enum):
    ROLLBACK = "Rollback"  # every engine goes back to the previous weights
    HALT = "Halt"  # engines it touched serve again on whatever weights they have

    def __str__(self) -> str:
        return self.value


DEFAULT_DRAIN_TIMEOUT_S = 120  # how long one engine's in-flight requests get to finish
DEFAULT_MAX_UNAVAILABLE = 1  # engines per role refit at once (Rolling)
# A refitted engine's perplexity on the probe text may be at most this factor above the
# previous weights' (`spec.refit.verify.maxPerplexityRatio`); unset (None) by default.
MAX_PERPLEXITY_RATIO_LIMIT = 1e6


def perplexity_ratio_problem(value: float) -> str | None:
    """Why `value` cannot be a maximum perplexity ratio, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{value!r} is not a number"
    if not (math.isfinite(value) and 1.0 <= value <= MAX_PERPLEXITY_RATIO_LIMIT):
        return (f"{value} is outside 1..{MAX_PERPLEXITY_RATIO_LIMIT:g} (the new weights' "
                "perplexity on the probe text over the previous weights'; leave it unset "
                "to skip the check)")
    return None


def choices(kind: type[enum.Enum]) -> tuple[str, ...]:
    """The spellings a user may write for `kind` (argparse choices, the spec's enums)."""
    return tuple(str(member.value) for member in kind)
