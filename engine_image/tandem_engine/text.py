"""The one owner of a generation's text: detokenization, stop strings, `min_tokens`,
hold-back and `include_stop_str_in_output`.

Every path that shows text goes through `TextStream`: `LLM.generate`, streaming and
non-streaming serving, a decode engine continuing a prefill engine's first token, and
an engine continuing a generation another engine began (a failover). The engine owns
one per request and ends the request as soon as a stop string matches, so its blocks
are freed at once; the engine process and the router only relay the text it releases.

Hold-back: while a generation runs, the last `len(longest stop string) - 1` characters
are not released, because they may be the start of a stop string; released text is
therefore never retracted. At the end everything left is released (trimmed at the stop
string, which is kept only with `include_stop_str_in_output`).

Resuming: a stream built with `resumed_token_ids` re-derives those tokens' text (so a
stop string that spans the hand-over is found, and byte-level BPE has its context) and
counts them toward `min_tokens`; `sent_chars` says how much of that text the client
already has, so nothing is sent twice and nothing the previous engine held back is lost.

Torch-free and pure apart from the tokenizer it decodes with.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem_engine.sampling_params import SamplingParams
from tandem_engine.tokenizer import IncrementalDetokenizer, Tokenizer


def find_stop(text: str, stops: Sequence[str], new_chars: int) -> tuple[int, str] | None:
    """The earliest stop string completed by the last `new_chars` characters of `text`,
    as (index where it starts, the stop string); None when there is none. Only a match
    that ends inside the newest text counts, so each call costs O(new text + longest
    stop string)."""
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


def hold_back(stops: Sequence[str]) -> int:
    """Characters a running generation keeps back: they may begin a stop string."""
    return max((len(s) for s in stops), default=1) - 1


class TextStream:
    """The text of one generation, token by token.

    `push` adds a generated token (one that did not end the generation by itself: EOS
    and stop tokens add no text) and reports whether a stop string ended it;
    `visible(finished)` is the text that may be shown now. It only ever grows, and
    once finished it is the whole text."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, *,
                 resumed_token_ids: Sequence[int] = (), sent_chars: int = 0) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._hold = hold_back(self._stops)
        self._text = "".join(self._detokenizer.push(t) for t in resumed_token_ids)
        self._num_tokens = len(resumed_token_ids)
        self._released = min(sent_chars, len(self._text))
        self.stop_string: str | None = None  # the stop string that ended the generation

    @property
    def num_tokens(self) -> int:
        """Tokens pushed, resumed ones included."""
        return self._num_tokens

    def push(self, token_id: int) -> bool:
        """Add one generated token; True when a stop string is now complete (the text is
        trimmed at it and the generation must end)."""
        if self.stop_string is not None:
            raise RuntimeError("push() after a stop string ended the generation")
        self._num_tokens += 1
        delta = self._detokenizer.push(token_id)
        self._text += delta
        if not (self._stops and self._num_tokens >= self._min_tokens):
            return False
        match = find_stop(self._text, self._stops, len(delta))
        if match is None:
            return False
        i, stop = match
        self._text = self._text[: i + len(stop)] if self._include_stop else self._text[:i]
        self.stop_string = stop
        return True

    def visible(self, finished: bool) -> str:
        """The text that may be shown now: all of it once the generation finished (or a
        stop string matched), else all but what may begin a stop string."""
        if finished or self.stop_string is not None:
            end = len(self._text)
        else:
            end = max(self._released, len(self._text) - self._hold)
        self._released = max(self._released, end)
        return self._text[:end]
