"""What a request must be for an engine to admit it: checked before anything is queued.

Errors name the input, the limit and the fix (`RequestRejected`, answered to the router
as a REJECT and to an OpenAI client as a 400).
"""

from __future__ import annotations

from tandem_engine.config import context_room
from tandem_engine.errors import RequestRejected
from tandem_engine.sampling_params import SamplingParams


def check_tokens(token_ids: list[int], resumed: list[int], params: SamplingParams,
                 vocab: int, max_model_len: int, model_context: int,
                 kv_capacity_tokens: int) -> None:
    """A prompt (and the tokens of a generation resumed here) the engine can run: not
    empty, inside the vocabulary, with room to generate within `max_model_len` (the
    model context `model_context`, capped by the whole KV cache)."""
    if not token_ids:
        raise RequestRejected("prompt is empty: give at least one token")
    for what, ids in (("prompt", token_ids), ("resumed", resumed)):
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(
                f"{what} token id {bad!r} is outside the model's vocabulary [0, {vocab})")
    params.check_vocabulary(vocab)
    if context_room(len(token_ids), max_model_len) < 1:
        raise RequestRejected(
            f"prompt has {len(token_ids)} tokens, which leaves no room to generate within "
            f"this engine's limit of {max_model_len} tokens (model context "
            f"{model_context}, KV cache {kv_capacity_tokens} tokens): shorten "
            f"the prompt to at most {max_model_len - 1} tokens or give the engine "
            "a larger KV cache")
