"""How a fleet-wide refit runs: the words for it and their defaults, stated once.

The InferencePool's `spec.refit`, `tandem refit`'s flags and the refit transaction
(`tandem_engine.fleet`) share these. The module is torch-free and imports nothing, so the
operator's spec parser and the CLI's argument parser use it without the fleet's HTTP
client. The CRD states the same words and defaults in its schema (enums are CamelCase
strings there); tests/test_crd.py checks that the two agree.
"""

from __future__ import annotations

import enum


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


def choices(kind: type[enum.Enum]) -> tuple[str, ...]:
    """The spellings a user may write for `kind` (argparse choices, the spec's enums)."""
    return tuple(str(member.value) for member in kind)
