"""Errors a user of the engine can hit; each message names the input, the limit and the fix."""

from __future__ import annotations


class TandemError(Exception):
    """Base class for every error Tandem raises on purpose."""


class CheckpointError(TandemError):
    """A checkpoint (folder or GGUF file) cannot be used: names the file, the tensor or
    metadata key, and what was expected."""


class RequestRejected(TandemError, ValueError):
    """A request cannot be accepted (prompt too long, bad sampling parameters...).

    The engine keeps serving every other request."""


def list_problems(problems: list[str], limit: int = 10) -> str:
    """Problems as an indented bullet list for an error message: the first `limit`, then
    how many more."""
    shown = problems[:limit]
    more = len(problems) - len(shown)
    return ("\n  - " + "\n  - ".join(shown)
            + (f"\n  ... and {more} more problems" if more else ""))
