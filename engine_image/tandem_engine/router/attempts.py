"""One submission of a choice to one engine, streamed: the unit `dispatch` fails over.

An attempt yields the choice's new output as `Delta`s and then exactly one outcome,
its last item:

* `Finished`  the choice is done (its final Delta was yielded before);
* `FailOver`  the engine cannot go on (lost, stalled, aborted the request itself, or
              refused it with a 5xx): continue elsewhere, resuming the tokens so far;
* `HandOff`   a prefill engine produced the first token: continue on a decode engine
              that pulls the pinned KV (`source`), or colocated when nothing was pinned.

A request the engine refuses as invalid raises `EngineRejected` (before any token) or
`GenerationFailed` (a continuation refused); one the engine failed by itself (finish
reason `error`: its sampling could not be honoured) raises `RequestFailed`, never a
failover, since it would fail the same way anywhere. The router never derives text: a
Delta's text is the engine's `Output.text`, and `Progress` counts what the client
already has so the next engine can be told (`Resume`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tandem_engine import protocol as p
from tandem_engine.router.engines import EngineClient, EngineLost, QueueItem
from tandem_engine.router.routing import RUNNING


class NoEngineAvailable(Exception):
    """No engine can take the request now (HTTP 503)."""


class EnginesBusy(Exception):
    """Every engine that could take the request refused it with a full queue (their
    `--max-queued-requests`): HTTP 429, retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineRejected(Exception):
    """An engine refused the request as invalid (its `Reject` status, usually 400)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class GenerationFailed(Exception):
    """A request could not be completed on any engine (HTTP 503, or an error event
    mid-stream)."""


class RequestFailed(Exception):
    """The engine failed this request alone (finish reason `error`): HTTP 500, or an error
    event mid-stream. Not failed over: another engine would fail it the same way."""


@dataclass
class Delta:
    """New output of one choice since the previous delta."""

    token_ids: list[int]
    text: str
    logprobs: list[p.TokenLogprobs] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    received_at: float | None = None  # when the engine output behind it arrived (monotonic)
    num_cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    prompt_logprobs: list[p.TokenLogprobs] | None = None  # prompt tokens 1.., when asked


@dataclass(frozen=True)
class Finished:
    """The choice is done; its final Delta was the item before."""


@dataclass(frozen=True)
class FailOver:
    """The engine cannot go on with the choice."""

    reason: str  # the failovers metric label: engine_lost | stalled | engine_aborted | ...
    detail: str

    @property
    def exclude(self) -> bool:
        """Whether to avoid the engine for the rest of the choice: a lost engine is skipped
        anyway (it is not alive); a live one refused."""
        return self.reason != "engine_lost"


@dataclass(frozen=True)
class HandOff:
    """A prefill engine's part is done after the first token. `source` is where a decode
    engine pulls the prompt's KV; None when the engine pinned nothing."""

    source: p.PullSource | None


Outcome = Finished | FailOver | HandOff
Step = Delta | Outcome


@dataclass
class Progress:
    """What one choice has produced so far, across engines."""

    generated: list[int] = field(default_factory=list)
    sent_chars: int = 0  # characters of text the client has
    version: str | None = None  # the weight version that produced `generated`
    attempts: int = 0
    engines: list[str] = field(default_factory=list)  # where each attempt was submitted
    # Speculative decoding, summed over the engines' final outputs: proposed tokens
    # verified for this choice and how many were accepted (for the request log).
    spec_proposed: int = 0
    spec_accepted: int = 0

    def resume(self) -> p.Resume | None:
        """What the next engine continues from (None before the first token)."""
        if not self.generated:
            return None
        return p.Resume(list(self.generated), self.sent_chars)

    def record(self, out: p.Output, version: str, received_at: float,
               finished: bool) -> Delta | None:
        """Account for one engine output; the Delta to send, None when it has nothing.
        `version` is the engine's weight version now: a Recompute refit can change it
        under a request, and the tokens are that version's."""
        reason, stop_reason = (out.finish_reason, out.stop_reason) if finished else (None, None)
        if out.token_ids:
            self.version = version
        self.generated += out.token_ids
        self.spec_proposed += out.num_spec_proposed
        self.spec_accepted += out.num_spec_accepted
        self.sent_chars += len(out.text)
        if not (out.token_ids or out.text or finished):
            return None
        return Delta(list(out.token_ids), out.text, out.logprobs, finished, reason,
                     stop_reason, received_at, out.num_cached_tokens, out.prompt_logprobs)


@dataclass(frozen=True)
class Stalled:
    """A RUNNING engine produced nothing within the output timeout."""

    reason: str


class Attempt:
    """One submission's output queue on one engine, read with the deadlines: the first
    output within `first_output_timeout`, each next one within `output_timeout`. An
    engine that is connected but not RUNNING (paused) keeps its requests, so its silence
    is waited out."""

    def __init__(self, client: EngineClient, sub_id: str, queue: asyncio.Queue[QueueItem],
                 first_output_timeout: float, output_timeout: float) -> None:
        self.client = client
        self.sub_id = sub_id
        self._queue = queue
        self._timeout = first_output_timeout
        self._output_timeout = output_timeout

    async def next(self) -> tuple[float, p.Output | p.Reject | EngineLost | Stalled]:
        timeout, self._timeout = self._timeout, self._output_timeout
        while True:
            getter = asyncio.ensure_future(self._queue.get())
            try:
                # Not asyncio.wait_for: before Python 3.12 it can swallow a cancellation
                # that coincides with an arriving item, and then the client's disconnect
                # would never abort the request.
                done, _ = await asyncio.wait({getter}, timeout=timeout)
            finally:
                if not getter.done():
                    getter.cancel()
            if done:
                return getter.result()
            load = self.client.load
            if self.client.connected and load is not None and load.state != RUNNING:
                continue  # a paused engine keeps its requests: wait for it
            return time.monotonic(), Stalled(f"no output from {self.client.key} "
                                             f"for {timeout} s")


def colocated(attempt: Attempt, progress: Progress, *, pulled: bool = False
              ) -> AsyncIterator[Step]:
    """A whole generation (or the rest of one) on one engine; ends with Finished or
    FailOver. A `pulled` attempt (a decode engine's, after a handoff) that is refused
    fails over too: the request itself was fine on the prefill engine."""
    return _relay(attempt, progress, prefill=False, pulled=pulled)


def prefill(attempt: Attempt, progress: Progress) -> AsyncIterator[Step]:
    """The first token on a prefill engine (submitted with `pin_for_handoff`); ends with
    Finished when that token ends the choice, HandOff when the rest goes on elsewhere,
    FailOver when the prefill failed. Refused after a first token (a resumed choice), it
    fails over: the request itself was fine."""
    return _relay(attempt, progress, prefill=True, pulled=False)


async def _relay(attempt: Attempt, progress: Progress, *, prefill: bool, pulled: bool
                 ) -> AsyncIterator[Step]:
    """The one loop of every attempt: relay the engine's outputs as Deltas until one
    outcome. A prefill's final output without a finish reason is the prefill's end, not
    the choice's: it hands off."""
    while True:
        received_at, item = await attempt.next()
        if isinstance(item, EngineLost | Stalled):
            yield _lost(item)
            return
        if isinstance(item, p.Reject):
            fail_over = bool(progress.generated) if prefill else pulled
            yield _refused(item, attempt, progress, fail_over=fail_over)
            return
        _raise_if_failed(item, attempt)
        aborted = item.finished and item.finish_reason == "abort"
        ends = item.finished and not aborted \
            and (item.finish_reason is not None or not prefill)
        delta = progress.record(item, attempt.client.view().weight_version, received_at,
                                finished=ends)
        if delta is not None:
            yield delta
        if aborted:
            yield _engine_aborted(attempt)
            return
        if item.finished:
            yield Finished() if ends else HandOff(_pull_source(attempt, item, progress))
            return


def _pull_source(attempt: Attempt, out: p.Output, progress: Progress) -> p.PullSource | None:
    """Where a decode engine finds the prompt's KV that the prefill engine pinned."""
    welcome = attempt.client.welcome
    agent = welcome.kv_transfer if welcome is not None else None
    if out.handoff is None or agent is None or len(progress.generated) != 1:
        return None
    return p.PullSource(agent, out.handoff.pin_id, list(out.handoff.block_ids),
                        list(out.handoff.proposals))


def _lost(item: EngineLost | Stalled) -> FailOver:
    return FailOver("engine_lost" if isinstance(item, EngineLost) else "stalled", item.reason)


def _engine_aborted(attempt: Attempt) -> FailOver:
    # Not the router's abort: the engine stopped the request (draining, stopping).
    return FailOver("engine_aborted", f"engine {attempt.client.key} aborted the request")


def _raise_if_failed(out: p.Output, attempt: Attempt) -> None:
    if out.finished and out.finish_reason == "error":
        raise RequestFailed(f"engine {attempt.client.key} failed the request: "
                            f"{out.error or 'no cause given'}")


def _refused(reject: p.Reject, attempt: Attempt, progress: Progress, *,
             fail_over: bool) -> FailOver:
    """A 5xx (or a refusal `fail_over` says is the engine's problem) fails over; so does a
    429 before any token (the engine's queue is full: another may have room); any other
    refusal is the request's and reaches the client."""
    if reject.status == 429 and not progress.generated:
        return FailOver("queue_full", reject.message)
    if reject.status >= 500 or fail_over:
        return FailOver("rejected", reject.message)
    if progress.generated:
        raise GenerationFailed(f"engine {attempt.client.key} refused the continuation of a "
                               f"request: {reject.message}")
    raise EngineRejected(reject.status, reject.message)
