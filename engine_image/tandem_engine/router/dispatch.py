"""One choice of one request across engines: where each attempt runs, failover, the
handoff from a prefill to a decode engine, and abort when the client leaves.

`Dispatcher.generate` yields `Delta`s for one choice of one HTTP request. It owns the
"no lost requests" rule: when an attempt ends in `FailOver` (its engine died,
stalled, stopped the request itself, or refused it with a 5xx), the choice is
resubmitted to another engine of the same weight version with the original prompt,
the original `SamplingParams` and `Resume(tokens so far, characters the client has)`.
That engine counts the resumed tokens against the limits, re-derives their text and
streams on from the next token and character, so the client's stream just continues
(for greedy decoding it equals an uninterrupted run) and the router never derives text.
When no alive engine runs the choice's version any more while another version serves (a
refit moved its last engine on while another died: `routing.retired`), there is nothing
to wait for: the choice continues on the serving version by recompute (prompt + tokens so
far prefilled on the new weights), as an engine's own Recompute refit continues it.

Every wait has a deadline: the first output of an attempt (`first_output_timeout`),
each next one (`output_timeout`; an engine that is paused keeps its requests, so
silence from a non-RUNNING engine is waited out), finding an engine to continue on
(`failover_timeout`), and at most `max_attempts` submissions per choice. Leaving the
generator early (client gone) aborts the request on its engine.

Disaggregated serving: when the serving version has an alive RUNNING prefill engine
and an alive RUNNING decode engine (mixed engines with a KV transfer agent may act as
either), a choice first runs on a prefill engine (picked by prefix affinity) with
`pin_for_handoff`; its first token is streamed at once, and unless it ends the choice,
the choice continues on a decode engine of the same version (picked by load with it)
that pulls the pinned KV (`Submit.pull`) and resumes after the first token. KV is never
handed across weight versions. A prefill that fails falls back to the colocated path;
a decode engine that fails is failed over like any engine (colocated, resumed).

A choice under a LoRA adapter (the request's `model` named one) runs only on engines that
serve it; its first engine fixes the adapter's version (`Submit.lora`), and the rest of
the choice keeps that version: a decode engine is paired only where it serves it, a
failover continues where it is served, and only when no alive engine serves that version
any more does the choice continue under the name's current version by recompute (as
with weights). Engines refuse a version they do not serve, so no token is ever made
under another adapter's weights.

Each finished choice gets one INFO line in the router's log (`finished_line`): its
engines, prompt and output tokens, finish reason, time, and with speculative decoding
the proposals its engines accepted of those they verified.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from tandem_engine import protocol as p
from tandem_engine.router import attempts
from tandem_engine.router.attempts import (
    Attempt,
    Delta,
    EnginesBusy,
    FailOver,
    Finished,
    GenerationFailed,
    HandOff,
    NoEngineAvailable,
    Outcome,
    Progress,
    Step,
)
from tandem_engine.router.engines import EngineClient, EnginePool, EngineUnavailable
from tandem_engine.router.metrics import ChoiceLatency, RouterMetrics
from tandem_engine.router.picker import EnginePicker, no_engine_message
from tandem_engine.router.routing import (
    DEFAULT_WEIGHTS,
    RoutingWeights,
    adapter_identity,
    eligible,
)
from tandem_engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_READMIT_POLL_S = 0.05  # how often a choice with every engine excluded looks again


@dataclass(frozen=True)
class DispatchConfig:
    first_output_timeout: float = 120.0  # submit -> first output of an attempt
    output_timeout: float = 60.0  # between outputs of a RUNNING engine
    failover_timeout: float = 30.0  # to find an engine of the request's version
    max_attempts: int = 4  # engine submissions per choice, failovers included
    prefix_index_blocks: int = 65536  # per engine
    weights: RoutingWeights = DEFAULT_WEIGHTS
    prefix_routing: str = "exact"  # picker.PREFIX_ROUTING: the engines' KV events, or a guess

    def __post_init__(self) -> None:
        for name in ("first_output_timeout", "output_timeout", "failover_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts} must be >= 1")


@dataclass(frozen=True)
class _Leg:
    """Where a choice's next attempt runs."""

    client: EngineClient
    decode: EngineClient | None = None  # a prefill attempt: the decode engine paired with it
    pull: p.PullSource | None = None  # a decode attempt: the pinned KV to pull
    # A decode attempt: the prefill engine holding that KV, and its request there
    pinned: tuple[EngineClient, str] | None = None

    def release_pin(self) -> None:
        """Tell the prefill engine that nobody will pull its pinned KV (the decode attempt
        did not finish), so the blocks are free now rather than after its pin TTL."""
        if self.pinned is not None:
            client, request_id = self.pinned
            client.unpin(request_id)


@dataclass
class _Choice:
    """One choice being generated: what was asked and where it stands."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    cache_salt: str | None
    latency: ChoiceLatency
    progress: Progress = field(default_factory=Progress)
    excluded: set[str] = field(default_factory=set)  # engines that refused or failed it
    resumed: bool = False  # failed over after tokens were streamed
    adapter: str | None = None  # the LoRA adapter's name (None: the base model)
    lora: p.LoRARef | None = None  # its version, as the latest attempt was submitted
    cache_key: str | None = None  # prompt_cache_key: routing's affinity hint
    priority: int = 0  # the engines schedule lower first (admission.py: with fairness)
    full: set[str] = field(default_factory=set)  # engines that refused it as full (429)

    @property
    def lora_identity(self) -> str | None:
        """The adapter as routing asks for it: its version once an attempt fixed one."""
        return self.lora.identity if self.lora is not None else self.adapter

    @property
    def sub_id(self) -> str:
        """The engine-side request id of the choice's latest attempt."""
        return f"{self.request_id}.{self.progress.attempts}"


def finished_line(choice: _Choice, finish_reason: str | None) -> str:
    """The request log's line for a finished choice: where it ran, its size, why it
    ended, and how speculative decoding did for it (only where any was verified)."""
    progress = choice.progress
    line = (f"request {choice.request_id} finished ({finish_reason}) in "
            f"{time.monotonic() - choice.latency.arrival:.3f} s on "
            f"{' -> '.join(progress.engines)}: {len(choice.prompt)} prompt + "
            f"{len(progress.generated)} output tokens")
    if progress.spec_proposed:
        line += (f", spec accepted {progress.spec_accepted}/{progress.spec_proposed} "
                 f"({progress.spec_accepted / progress.spec_proposed:.0%})")
    return line


class Dispatcher:
    def __init__(self, pool: EnginePool, config: DispatchConfig = DispatchConfig(),
                 metrics: RouterMetrics | None = None) -> None:
        self.pool = pool
        self.config = config
        self.metrics = metrics
        self.picker = EnginePicker(pool, weights=config.weights,
                                   prefix_index_blocks=config.prefix_index_blocks,
                                   wait_timeout=config.failover_timeout,
                                   prefix_routing=config.prefix_routing)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingParams, cache_salt: str | None = None,
                       arrival: float | None = None, adapter: str | None = None,
                       cache_key: str | None = None, priority: int = 0
                       ) -> AsyncIterator[Delta]:
        """Stream one generation (under LoRA adapter `adapter`, a name, when given;
        `cache_key`: the request's prompt_cache_key). Raises NoEngineAvailable /
        EngineRejected before any token, GenerationFailed when it cannot be completed."""
        arrival = time.monotonic() if arrival is None else arrival
        choice = _Choice(request_id, list(prompt_token_ids), sampling, cache_salt,
                         ChoiceLatency(self.metrics, arrival), adapter=adapter,
                         cache_key=cache_key, priority=priority)
        leg: _Leg | None = None
        bypass = self.picker.bypass(choice.prompt, cache_salt, adapter, cache_key)
        if bypass is not None:  # a decode engine holds the whole prompt: no prefill step
            self._count_disaggregated("bypassed")
            leg = _Leg(bypass)
        else:
            pair = self.picker.pick_pair(choice.prompt, cache_salt, adapter, cache_key)
            leg = _Leg(pair[0], decode=pair[1]) if pair is not None else None
        finish_reason: str | None = None
        while True:
            if choice.progress.attempts >= self.config.max_attempts:
                if leg is not None:
                    leg.release_pin()
                raise GenerationFailed(f"request {request_id} failed on "
                                       f"{choice.progress.attempts} engine attempts; giving up")
            if leg is None:
                leg = _Leg(await self._engine_for(choice))
            outcome: Outcome | None = None
            async with aclosing(self._attempt(choice, leg)) as steps:
                async for step in steps:
                    if isinstance(step, Delta):
                        finish_reason = step.finish_reason
                        yield step
                    else:
                        outcome = step
            assert outcome is not None, "an attempt always ends with its outcome"
            if isinstance(outcome, Finished):
                if leg.decode is not None:
                    self._count_disaggregated("finished_at_prefill")
                if choice.resumed and self.metrics is not None:
                    self.metrics.resumed.inc()
                self.picker.remember(leg.client, choice.prompt + choice.progress.generated,
                                     cache_salt, choice.lora_identity)
                if log.isEnabledFor(logging.INFO):
                    log.info("%s", finished_line(choice, finish_reason))
                return
            leg = self._next_leg(choice, leg, outcome)

    async def _attempt(self, choice: _Choice, leg: _Leg) -> AsyncIterator[Step]:
        """Submit the choice on `leg` and stream it: Deltas, then the attempt's outcome.
        Unless it ended in Finished or HandOff (a client gone, a failover, an error),
        the request is aborted on its engine, and a decode attempt's pin is released on
        the prefill engine (`_Leg.release_pin`)."""
        finished = False
        try:
            async with aclosing(self._submitted(choice, leg)) as steps:
                async for step in steps:
                    finished = isinstance(step, Finished)
                    yield step
        finally:
            if not finished:
                leg.release_pin()

    async def _submitted(self, choice: _Choice, leg: _Leg) -> AsyncIterator[Step]:
        progress, client = choice.progress, leg.client
        if not progress.generated:
            progress.version = client.view().weight_version
        progress.attempts += 1
        sub_id = choice.sub_id
        prefill = leg.decode is not None
        lora = self._lora_on(choice, leg)
        if choice.adapter is not None and lora is None:
            yield FailOver("rejected", f"engine {client.key} does not serve LoRA adapter "
                                       f"{choice.lora_identity} (any more)")
            return
        if lora != choice.lora and choice.lora is not None and progress.generated:
            log.warning("request %s: no engine serves LoRA adapter %s any more; continuing "
                        "its %d tokens under %s by recompute", choice.request_id,
                        choice.lora.identity, len(progress.generated), lora.identity)
        choice.lora = lora
        try:
            queue = client.submit(
                sub_id, choice.prompt, choice.sampling, choice.cache_salt,
                # Pin only when a decode engine may need the KV: not for a single token.
                pin_for_handoff=prefill and choice.sampling.max_tokens > 1,
                resume=progress.resume(), pull=leg.pull, lora=lora,
                priority=choice.priority)
        except EngineUnavailable as exc:
            yield FailOver("unavailable", str(exc))
            return
        progress.engines.append(client.key)
        done = False
        try:  # from here every way out leaves the engine's in-flight count as it was
            if self.metrics is not None:
                self.metrics.engine_requests.labels(client.key).inc()
                if progress.attempts == 1:
                    self.metrics.ingress_latency.observe(
                        time.monotonic() - choice.latency.arrival)
            attempt = Attempt(client, sub_id, queue, self.config.first_output_timeout,
                              self.config.output_timeout)
            steps = attempts.prefill(attempt, progress) if prefill else \
                attempts.colocated(attempt, progress, pulled=leg.pull is not None)
            first = not progress.generated
            async with aclosing(steps):
                async for step in steps:
                    if isinstance(step, Delta):
                        choice.latency.observe(len(step.token_ids), step.finished)
                        if first and step.token_ids and self.metrics is not None:
                            first = False
                            self.metrics.engine_time_to_first_token.labels(
                                client.key).observe(time.monotonic() - choice.latency.arrival)
                    done = isinstance(step, Finished | HandOff)
                    yield step
        finally:
            if not done:
                client.abort(sub_id)  # failover, client gone, or an error: stop it there

    @staticmethod
    def _lora_on(choice: _Choice, leg: _Leg) -> p.LoRARef | None:
        """The adapter version a choice runs under on `leg`'s engine: the version it has
        run under so far where that engine serves it; else, unless the leg pulls KV made
        under that version, the version the engine serves of the adapter's name. None:
        the base model, or the engine does not serve the adapter."""
        if choice.adapter is None:
            return None
        view = leg.client.view()
        if choice.lora is not None and choice.lora.identity in view.loras:
            return choice.lora
        if leg.pull is not None:
            return None
        identity = adapter_identity(view, choice.adapter)
        if identity is None:
            return None
        name, _, version = identity.partition("@")
        return p.LoRARef(name, version)

    def _next_leg(self, choice: _Choice, leg: _Leg, outcome: FailOver | HandOff
                  ) -> _Leg | None:
        """Where the choice goes on after `leg` ended unfinished: the decode engine
        pulling the prefill's KV after a handoff, else None (a colocated engine, picked
        when the attempt starts)."""
        if isinstance(outcome, FailOver):
            self._failed_over(choice, leg.client, outcome)
        if leg.decode is None:
            return None
        source = outcome.source if isinstance(outcome, HandOff) else None
        if source is None:
            self._count_disaggregated("no_pin" if choice.progress.generated else "fallback")
            return None
        decode_version = leg.decode.view().weight_version
        if decode_version != choice.progress.version:
            # The prefill engine was refitted under the request (a Recompute refit) and
            # the decode engine picked with it was not: never hand KV across versions;
            # the rest is computed on an engine of the first token's version.
            self._count_disaggregated("version_changed")
            leg.client.unpin(choice.sub_id)
            return None
        self._count_disaggregated("handoff")
        if self.metrics is not None:  # a record that versions never mix
            self.metrics.handoff_versions.labels(leg.client.view().weight_version,
                                                 decode_version).inc()
        return _Leg(leg.decode, pull=source, pinned=(leg.client, choice.sub_id))

    async def _engine_for(self, choice: _Choice) -> EngineClient:
        """A colocated engine for the choice's next attempt: any of the serving version
        before the first token, afterwards only one of the tokens' own version."""
        progress, exclude = choice.progress, sorted(choice.excluded)
        if not progress.generated:
            client = self.picker.pick(choice.prompt, choice.cache_salt, exclude=exclude,
                                      adapter=choice.adapter, cache_key=choice.cache_key)
            if client is None and await self.picker.wait_until_serving():
                client = self.picker.pick(choice.prompt, choice.cache_salt, exclude=exclude,
                                          adapter=choice.adapter, cache_key=choice.cache_key)
            if client is None and choice.full and all(
                    e.key in choice.full
                    for e in eligible(self.pool.views(), adapter=choice.adapter)):
                raise EnginesBusy(f"every engine's queue is full ({len(choice.full)} refused "
                                  "it: their --max-queued-requests): retry after a moment")
            if client is None and choice.excluded:
                client = await self._admitting_again(choice)
            if client is None:
                raise NoEngineAvailable(no_engine_message(self.pool, choice.excluded,
                                                          choice.adapter))
            return client
        adapter = choice.lora_identity
        if adapter is not None and not any(v.alive and adapter in v.loras
                                           for v in self.pool.views()):
            adapter = choice.adapter  # that version is gone everywhere: the name's current
        client = await self.picker.wait_for_version(
            choice.prompt + progress.generated, choice.cache_salt, progress.version, exclude,
            adapter)
        if client is None:
            raise GenerationFailed(
                f"request {choice.request_id}: no RUNNING engine of weight version "
                f"{progress.version!r} to continue on within "
                f"{self.config.failover_timeout} s")
        version = client.view().weight_version
        if version != progress.version:
            log.warning("request %s: no engine runs weight version %r any more; continuing "
                        "its %d tokens on %s (version %r) by recompute", choice.request_id,
                        progress.version, len(progress.generated), client.key, version)
            progress.version = version
        return client

    async def _admitting_again(self, choice: _Choice) -> EngineClient | None:
        """Before the first token, with every engine that could serve the choice excluded:
        one that refused it (a refit's wave was draining it) may admit again (the refit
        re-planned that wave when another engine died). Wait, up to the failover timeout,
        for an engine whose heartbeat says it serves, excluded or not; the attempts cap
        bounds how often one is tried."""
        deadline = time.monotonic() + self.config.failover_timeout
        while time.monotonic() < deadline:
            client = self.picker.pick(choice.prompt, choice.cache_salt,
                                      adapter=choice.adapter)
            if client is not None:
                choice.excluded.discard(client.key)
                return client
            await asyncio.sleep(_READMIT_POLL_S)
        return None

    def _failed_over(self, choice: _Choice, client: EngineClient, outcome: FailOver) -> None:
        log.warning("failing over from %s after %d tokens (%s)", client.key,
                    len(choice.progress.generated), outcome.detail)
        if self.metrics is not None:
            self.metrics.failovers.labels(outcome.reason).inc()
        if choice.progress.generated:
            choice.resumed = True
        if outcome.exclude:
            choice.excluded.add(client.key)
        if outcome.reason == "queue_full":
            choice.full.add(client.key)

    def _count_disaggregated(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.disaggregated.labels(outcome).inc()
