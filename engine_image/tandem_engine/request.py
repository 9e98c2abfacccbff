"""Per-request state: tokens, progress through the KV cache, and how it finished.

A request's token list is prompt + generated tokens. `num_computed_tokens` counts the
leading tokens whose KV is in the cache; the scheduler moves it forward, and resets it
to 0 when the request is preempted (its KV is dropped and recomputed on readmission,
so prompt + generated tokens effectively become its new prompt).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem_engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"

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
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    output_text: str = ""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

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
