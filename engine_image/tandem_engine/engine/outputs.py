"""What the engine hands back: vLLM-shaped `RequestOutput` / `CompletionOutput`, and a
decode engine's `PullPlan` for a handed-over prompt."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem_engine.core.request import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # with finish_reason "error": why the request failed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # (weight epoch, first output token index generated under it), one per epoch.
    epoch_segments: list[tuple[int, int]] = field(default_factory=list)
    # For a handoff request: the pinned prompt KV blocks, in position order.
    pinned_blocks: list[int] | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    # Speculative decoding, so far: proposals verified for this request, and accepted.
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    # A handoff's speculative proposals for the tokens after its first (method mtp).
    handoff_proposals: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PullPlan:
    """Which prompt blocks a decode engine must pull, and where to."""

    request_id: str
    block_indices: list[int]  # positions in the prompt's block list (prefill side)
    local_blocks: list[int]  # this engine's blocks, one per index
    reused_blocks: int  # leading blocks this engine already had cached


@dataclass(frozen=True)
class PromptScore:
    """How likely a text is under the model (`LLM.score`)."""

    token_ids: list[int]
    logprobs: list[float]  # of token_ids[1:], each given the tokens before it

    @classmethod
    def of(cls, out: RequestOutput) -> PromptScore:
        entries = (out.prompt_logprobs or [None])[1:]
        ids = out.prompt_token_ids
        return cls(list(ids), [entry[t].logprob for t, entry in zip(ids[1:], entries,
                                                                     strict=True)])

    @property
    def total_logprob(self) -> float:
        return math.fsum(self.logprobs)

    @property
    def perplexity(self) -> float:
        return math.exp(-self.total_logprob / len(self.logprobs))


def mean_top1_mass(out: RequestOutput) -> float:
    """The mean probability of the most likely next token over a text's positions (after
    the first): how sure the model is, whatever the text's own tokens. `out` must come from
    a request with prompt_logprobs >= 1, so each position also holds its most likely token
    (a refit's canary: fleet/verify.py, rule 5)."""
    entries = (out.prompt_logprobs or [None])[1:]
    top1 = [max(lp.logprob for lp in entry.values()) for entry in entries]
    return math.fsum(math.exp(lp) for lp in top1) / len(top1)
