"""Backing off: a request whose proposals keep being rejected stops proposing for a
while, so workloads that a proposer cannot predict do not pay for verification that
fails (every proposal method uses it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem_engine.core.request import Request

# Back-off (per request): an exponential moving average of the fraction of each
# verified draft that was accepted, weighting the newest draft by BACKOFF_WEIGHT. When it
# falls under BACKOFF_THRESHOLD, the request stops proposing for `pause` generated tokens,
# then tries again with its estimate reset to BACKOFF_RETRY; each pause that follows
# another without an accepted proposal in between doubles, up to BACKOFF_MAX_PAUSE. A
# request whose drafts are rejected twice in a row thus pauses for 8, 16, 32, ... tokens,
# and one with a copy-heavy stretch later comes back to proposing within its pause.
BACKOFF_WEIGHT = 0.5
BACKOFF_THRESHOLD = 0.3
BACKOFF_RETRY = 0.5
BACKOFF_FIRST_PAUSE = 8
BACKOFF_MAX_PAUSE = 256


@dataclass
class AcceptanceBackoff:
    """One request's recent acceptance and whether it may propose now (module docstring:
    the BACKOFF_* constants)."""

    rate: float = 1.0
    pause: int = BACKOFF_FIRST_PAUSE
    resume_at: int = 0  # the request's output-token count from which it proposes again

    def allows(self, num_output_tokens: int) -> bool:
        return num_output_tokens >= self.resume_at

    def observe(self, proposed: int, accepted: int, num_output_tokens: int) -> None:
        if accepted:
            self.pause = BACKOFF_FIRST_PAUSE
        self.rate += BACKOFF_WEIGHT * (accepted / proposed - self.rate)
        if self.rate < BACKOFF_THRESHOLD:
            self.resume_at = num_output_tokens + self.pause
            self.pause = min(2 * self.pause, BACKOFF_MAX_PAUSE)
            self.rate = BACKOFF_RETRY


@dataclass
class Backoffs:
    """Every request's `AcceptanceBackoff`, by request id (created at its first draft)."""

    by_request: dict[str, AcceptanceBackoff] = field(default_factory=dict)

    def allows(self, request: Request) -> bool:
        backoff = self.by_request.get(request.request_id)
        return backoff is None or backoff.allows(request.num_output_tokens)

    def observe(self, request: Request, proposed: int, accepted: int) -> None:
        backoff = self.by_request.setdefault(request.request_id, AcceptanceBackoff())
        backoff.observe(proposed, accepted, request.num_output_tokens)

    def forget(self, request_id: str) -> None:
        self.by_request.pop(request_id, None)
