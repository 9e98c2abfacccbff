"""Per-request state: tokens, progress through the KV cache, and how it finished.

A request's token list is prompt + generated tokens. `num_computed_tokens` counts the
leading tokens whose KV is in the cache; the scheduler moves it forward, and resets it
to 0 when the request is preempted (its KV is dropped and recomputed on readmission,
so prompt + generated tokens effectively become its new prompt). With speculative
decoding, a decode step may compute its last token plus proposals; only the verified
ones count as computed afterwards (`Scheduler.advance`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem_engine.lora_request import LoRARequest
from tandem_engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    # A prefill engine's part is done after the first token: the prompt's KV is pinned
    # and the generation continues on a decode engine (never shown to a client).
    HANDOFF = "handoff"
    # The engine could not go on with this request (its sampling raised, its logits were
    # not finite); `Request.error` says why. Only this request ends: the batch goes on.
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int
    prompt: str | None = None
    # vLLM's: lower is scheduled first (and preempts running requests of a larger one);
    # equal priorities go by arrival (core/scheduler.py).
    priority: int = 0
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # with FinishReason.ERROR: what went wrong
    num_preemptions: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    # Teacher-forced logprobs of the prompt tokens (None for the first), when asked.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    # Prefix caching: the chain salt (weight epoch + cache_salt), the full-block hashes
    # under it, and how many leading blocks are registered in the cache.
    cache_salt: str | None = None
    salt: bytes = b""
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    # Prompt tokens matched in the prefix cache at first admission (-1: not admitted yet).
    num_cached_tokens: int = -1
    # (weight epoch, index of the first output token generated under it), one entry
    # per epoch the request generated tokens in.
    epoch_segments: list[tuple[int, int]] = field(default_factory=list)
    # Disaggregation: after the first token, end with HANDOFF and keep the prompt's KV
    # pinned for another engine (unless that token ends the generation).
    pin_for_handoff: bool = False
    pinned_blocks: list[int] | None = None
    # Speculative decoding: the tokens proposed to follow `token_ids` this step (not part
    # of it until the model verifies them). Set by the engine before each schedule,
    # dropped whenever the request's KV is (preemption, suspend).
    spec_token_ids: list[int] = field(default_factory=list)
    # Totals over its life: proposals verified for it, and how many of them were accepted.
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    # Proposals that travel with a disaggregated handoff (method mtp): on the prefill
    # engine the ones made from its last hidden state for the tokens after the first; on
    # the decode engine the ones received, verified in its first step while the request
    # still has `carried_for` tokens, then dropped.
    carried_proposals: list[int] = field(default_factory=list)
    carried_for: int = 0
    # Structured outputs: its constraint is still compiling (engine/grammars.py); the
    # scheduler admits it only once it is ready.
    grammar_pending: bool = False
    # LoRA: the adapter it runs under (None: the base model), the device slot that holds
    # it (-1: none yet), and whether it waits for a slot (engine/loras.py).
    lora: LoRARequest | None = None
    lora_slot: int = -1
    lora_pending: bool = False

    @property
    def held(self) -> bool:
        """Not schedulable yet: its grammar compiles, or its adapter waits for a slot."""
        return self.grammar_pending or self.lora_pending

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    def resalt(self, salt: bytes) -> None:
        """Give a request that holds no KV a new chain salt (after a weight refit)."""
        assert self.num_computed_tokens == 0, "a request with KV keeps its salt"
        if salt != self.salt:
            self.salt = salt
            self.block_hashes = []
            self.num_cached_blocks = 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still to be computed."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
