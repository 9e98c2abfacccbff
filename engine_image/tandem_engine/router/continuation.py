"""The text of a generation that moved to another engine mid-stream.

Engines detokenize and check stop strings themselves, but only over the tokens they
generated. When a request fails over, the new engine receives prompt + the tokens
already generated as its prompt, so on its own it would (a) lose text the old engine
was still holding back (the start of a possible stop string, or a character whose
bytes were incomplete), (b) miss a stop string that spans the hand-over point, and
(c) decode its first tokens without the context that byte-level BPE needs.

So after a failover the router derives the text itself, exactly as the engine would
over the whole generation: one incremental detokenizer primed with the tokens already
generated, the engine's stop-string search (only matches ending in new text, after
`min_tokens`), and the same hold-back of `longest stop string - 1` characters.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem_engine.text import find_stop, trim_at_stop
from tandem_engine.tokenizer import IncrementalDetokenizer, Tokenizer


class TextContinuation:
    def __init__(self, tokenizer: Tokenizer, *, generated_ids: Sequence[int], sent_text: str,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        # The engine's text for these tokens; `sent_text` is a prefix of it (what the
        # old engine held back is the rest).
        self._text = "".join(self._detokenizer.push(t) for t in generated_ids)
        self._sent = min(len(sent_text), len(self._text))
        self._num_tokens = len(generated_ids)
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.stop_reason: str | None = None

    def push(self, token_id: int, *, is_stop_token: bool = False) -> str:
        """Add one generated token; return the text now safe to send. A stop or EOS token
        adds no text (as in the engine). After a stop string matched (`stop_reason`
        set), the returned text is the final piece and nothing more may be pushed."""
        if self.stop_reason is not None:
            raise RuntimeError("push() after a stop string ended the generation")
        self._num_tokens += 1
        if is_stop_token:
            return ""
        delta = self._detokenizer.push(token_id)
        self._text += delta
        if self._stop and self._num_tokens >= self._min_tokens and self._find_stop(len(delta)):
            return self._take(len(self._text))
        return self._take(max(self._sent, len(self._text) - self._hold))

    def finish(self) -> str:
        """At the end of the generation: everything still held back."""
        return self._take(len(self._text))

    def _find_stop(self, delta_len: int) -> bool:
        match = find_stop(self._text, self._stop, delta_len)
        if match is None:
            return False
        self._text = trim_at_stop(self._text, match, self._include_stop)
        self.stop_reason = match[1]
        return True

    def _take(self, end: int) -> str:
        if end <= self._sent:
            return ""
        piece = self._text[self._sent:end]
        self._sent = end
        return piece
