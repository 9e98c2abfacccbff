"""Stop-string matching on streamed text, shared by the engine and the router.

Torch-free and pure: the engine trims its output at a stop string; the router does the
same for text that spans an engine failover. Only a match that ends inside the newest
text counts as new, so each call costs O(new text + longest stop string).
"""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], new_chars: int) -> tuple[int, str] | None:
    """The earliest stop string completed by the last `new_chars` characters of `text`,
    as (index where it starts, the stop string); None when there is none."""
    if not stops:
        return None
    longest = max(len(s) for s in stops)
    search_from = max(0, len(text) - new_chars - longest + 1)
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, search_from)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def trim_at_stop(text: str, match: tuple[int, str], include_stop: bool) -> str:
    i, stop = match
    return text[: i + len(stop)] if include_stop else text[:i]
