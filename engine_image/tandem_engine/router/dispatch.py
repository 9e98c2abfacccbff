"""One generation across engines: pick, submit, stream, fail over, cancel.

`Dispatcher.generate` yields `Delta`s for one choice of one HTTP request. It owns the
"no lost requests" rule: when the serving engine dies (heartbeat deadline, closed
connection, restart), stops the request itself (an `abort` the router did not ask
for: the engine is stopping), refuses it with a 5xx, or goes silent while RUNNING
for longer than the output timeout, the request is resubmitted to another engine of
the same weight version with prompt = original prompt + every token received so far,
`max_tokens` / `min_tokens` reduced by that many. The client's stream just continues;
for greedy decoding the tokens equal an uninterrupted run. From the first failover on,
the router derives the text itself (`continuation.py`).

Every wait has a deadline: the first output (`first_output_timeout`), each next one
(`output_timeout`; an engine that is paused keeps its requests, so silence from a
non-RUNNING engine is waited out), and finding an engine to continue on
(`failover_timeout`). Leaving the generator early (client gone) aborts the request on
its engine.

Disaggregated serving: when the serving version has an alive RUNNING prefill engine
and an alive RUNNING decode engine (mixed engines with a KV transfer agent may act as
either), a choice first runs on a prefill engine (picked by prefix affinity) with
`max_tokens=1` and `pin_for_handoff`; its first token is streamed at once, and unless
the choice is done, it continues on a decode engine (picked by load, same version)
that pulls the pinned KV (`Submit.pull`) and streams from the second token on. A
prefill that fails falls back to the colocated path; a decode engine that fails is
failed over like any engine (colocated, prompt + tokens so far).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tandem_engine import protocol as p
from tandem_engine.core.kv.hashing import block_hashes, block_salt
from tandem_engine.router.continuation import TextContinuation
from tandem_engine.router.engines import (
    EngineClient,
    EngineLost,
    EnginePool,
    EngineUnavailable,
    QueueItem,
)
from tandem_engine.router.metrics import RouterMetrics
from tandem_engine.router.routing import (
    DEFAULT_WEIGHTS,
    RUNNING,
    EngineView,
    PrefixIndex,
    RoutingWeights,
    choose,
    eligible,
    serving_version,
)
from tandem_engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class NoEngineAvailable(Exception):
    """No engine can take the request now (HTTP 503)."""


class EngineRejected(Exception):
    """An engine refused the request as invalid (its `Reject` status, usually 400)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class GenerationFailed(Exception):
    """A request could not be completed on any engine (HTTP 503, or an error event
    mid-stream)."""


@dataclass(frozen=True)
class DispatchConfig:
    first_output_timeout: float = 120.0  # submit -> first output of an attempt
    output_timeout: float = 60.0  # between outputs of a RUNNING engine
    failover_timeout: float = 30.0  # to find an engine of the request's version
    max_attempts: int = 4  # engine submissions per choice, failovers included
    prefix_index_blocks: int = 65536  # per engine
    weights: RoutingWeights = DEFAULT_WEIGHTS

    def __post_init__(self) -> None:
        for name in ("first_output_timeout", "output_timeout", "failover_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts} must be >= 1")


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


@dataclass(frozen=True)
class _Stalled:
    """A RUNNING engine produced nothing within the output timeout."""

    reason: str


@dataclass
class _Progress:
    """What one choice has produced so far, across engines."""

    generated: list[int] = field(default_factory=list)
    sent_text: list[str] = field(default_factory=list)
    version: str | None = None  # the weight version that produced `generated`
    continuation: TextContinuation | None = None
    attempts: int = 0
    last_token_at: float | None = None


class Dispatcher:
    def __init__(self, pool: EnginePool, tokenizer: Tokenizer,
                 config: DispatchConfig = DispatchConfig(),
                 metrics: RouterMetrics | None = None) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self._indexes: dict[str, PrefixIndex] = {}
        # Per engine address: the client object and its epoch_changes the index is for.
        self._index_generation: dict[str, tuple[EngineClient, int]] = {}
        self._tie_break = itertools.count()

    # ---- what the API layer asks before dispatching ----------------------------------------

    def ready(self) -> bool:
        return serving_version(self.pool.views()) is not None

    async def wait_until_serving(self) -> bool:
        """Whether an engine serves, waiting up to the failover timeout while engines are
        only away for now (paused, suspended, refitting, verifying: an all-at-once refit's
        window) rather than failing the request."""
        deadline = time.monotonic() + self.config.failover_timeout
        while not self.ready():
            if time.monotonic() > deadline or not any(
                    v.coming_back for v in self.pool.views()):
                return False
            await asyncio.sleep(0.05)
        return True

    def max_model_len(self) -> int | None:
        """The context limit of the serving version (the smallest among its engines)."""
        engines = eligible(self.pool.views())
        return min(e.max_model_len for e in engines) if engines else None

    # ---- routing ------------------------------------------------------------------------------

    def pick(self, token_ids: Sequence[int], cache_salt: str | None = None,
             version: str | None = None, exclude: Sequence[str] = ()) -> EngineClient | None:
        """The engine for `token_ids` (recorded in its prefix index), or None.

        A colocated request avoids prefill-role engines while another engine can take it."""
        candidates = eligible(self.pool.views(), version, exclude)
        preferred = [e for e in candidates if self.pool.by_key[e.key].role != "prefill"]
        return self._choose(preferred or candidates, token_ids, cache_salt)

    def pick_pair(self, token_ids: Sequence[int], cache_salt: str | None = None
                  ) -> tuple[EngineClient, EngineClient] | None:
        """(prefill engine, decode engine) of the serving version for a disaggregated
        request, or None when the serving version lacks a prefill or a decode engine."""
        candidates = eligible(self.pool.views())
        clients = self.pool.by_key
        if not (any(clients[e.key].role == "prefill" for e in candidates)
                and any(clients[e.key].role == "decode" for e in candidates)):
            return None
        able = [e for e in candidates if clients[e.key].can_hand_over]
        prefills = [e for e in able if clients[e.key].role in ("prefill", "mixed")]
        if not prefills:
            return None
        # Prefer a dedicated prefill engine; a mixed one only when none is available.
        prefills = [e for e in prefills if clients[e.key].role == "prefill"] or prefills
        decodes = [e for e in able if clients[e.key].role in ("decode", "mixed")]
        prefill = self._choose(prefills, token_ids, cache_salt)
        assert prefill is not None
        decodes = [e for e in decodes if e.key != prefill.key]
        decodes = [e for e in decodes if clients[e.key].role == "decode"] or decodes
        if not decodes:
            return None
        # Load only: the decode engine pulls whatever it lacks.
        decode = choose(decodes, {}, self.config.weights, next(self._tie_break))
        assert decode is not None
        self._index(decode.key).add(block_hashes(token_ids, decode.block_size,
                                                 block_salt(decode.weight_epoch, cache_salt)))
        return prefill, clients[decode.key]

    def _choose(self, candidates: Sequence[EngineView], token_ids: Sequence[int],
                cache_salt: str | None) -> EngineClient | None:
        if not candidates:
            return None
        hashes: dict[str, list[int]] = {}
        fraction: dict[str, float] = {}
        by_chain: dict[tuple[int, int], list[int]] = {}
        for e in candidates:
            chain = (e.weight_epoch, e.block_size)
            if chain not in by_chain:
                by_chain[chain] = block_hashes(token_ids, e.block_size,
                                               block_salt(e.weight_epoch, cache_salt))
            hashes[e.key] = by_chain[chain]
            n = len(hashes[e.key])
            fraction[e.key] = self._index(e.key).match(hashes[e.key]) / n if n else 0.0
        chosen = choose(candidates, fraction, self.config.weights, next(self._tie_break))
        assert chosen is not None
        self._index(chosen.key).add(hashes[chosen.key])
        return self.pool.by_key[chosen.key]

    def _index(self, key: str) -> PrefixIndex:
        # An engine that restarted or refit holds none of the blocks we remember, nor does
        # a new engine at the address of one that left the pool (Kubernetes discovery).
        client = self.pool.by_key.get(key)
        if client is None:  # it left the pool: nothing to remember
            return PrefixIndex(1)
        generation = (client, client.epoch_changes)
        if key not in self._indexes:
            for gone in self._indexes.keys() - self.pool.by_key.keys():
                del self._indexes[gone], self._index_generation[gone]
            self._indexes[key] = PrefixIndex(self.config.prefix_index_blocks)
        elif self._index_generation[key] != generation:
            self._indexes[key].clear()
        self._index_generation[key] = generation
        return self._indexes[key]

    def _remember(self, client: EngineClient, token_ids: list[int],
                  cache_salt: str | None) -> None:
        """After a request finished: the engine also caches its generated blocks."""
        v = client.view()
        self._index(client.key).add(
            block_hashes(token_ids, v.block_size, block_salt(v.weight_epoch, cache_salt)))

    # ---- one choice -----------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: dict[str, Any], cache_salt: str | None = None,
                       arrival: float | None = None) -> AsyncIterator[Delta]:
        """Stream one generation. Raises NoEngineAvailable / EngineRejected before any
        token, GenerationFailed when it cannot be completed."""
        arrival = time.monotonic() if arrival is None else arrival
        progress = _Progress()
        excluded: set[str] = set()
        handoff: tuple[EngineClient, p.PullSource] | None = None
        pair = self.pick_pair(prompt_token_ids, cache_salt)
        if pair is not None:
            prefill, decode = pair
            source: list[p.PullSource] = []
            async for delta in self._prefill(request_id, prefill, prompt_token_ids, sampling,
                                             cache_salt, progress, excluded, arrival, source):
                yield delta
                if delta.finished:
                    self._count_disaggregated("finished_at_prefill")
                    self._remember(prefill, prompt_token_ids + progress.generated,
                                   cache_salt)
                    return
            if source and decode.view().weight_version != progress.version:
                # The prefill engine was refitted under the request (a Recompute refit)
                # and the decode engine picked with it was not: never hand KV across
                # versions; the rest is computed on an engine of the first token's version.
                self._count_disaggregated("version_changed")
            elif source:
                handoff = decode, source[0]
                self._count_disaggregated("handoff")
                if self.metrics is not None:  # a record that versions never mix
                    self.metrics.handoff_versions.labels(
                        prefill.view().weight_version, decode.view().weight_version).inc()
            else:
                self._count_disaggregated("no_pin" if progress.generated else "fallback")
        while True:
            if progress.generated and len(progress.generated) >= sampling.get("max_tokens", 16):
                # Every token arrived but the final word did not: the length is reached.
                yield Delta([], progress.continuation.finish() if progress.continuation
                            else "", None, True, "length", None)
                return
            pull = None
            if handoff is not None:
                # The decode engine pulls the prompt's KV and counts the first token (from
                # the prefill engine) as its first output: original prompt and sampling.
                (client, pull), handoff = handoff, None
                if progress.attempts >= self.config.max_attempts:
                    raise GenerationFailed(f"request {request_id} failed on "
                                           f"{progress.attempts} engine attempts; giving up")
                prompt, rest = prompt_token_ids, sampling
            else:
                client = await self._engine_for(request_id, prompt_token_ids, cache_salt,
                                                progress, excluded)
                prompt = prompt_token_ids + progress.generated
                rest = _remaining(sampling, len(progress.generated))
            if not progress.generated:
                progress.version = client.view().weight_version
            progress.attempts += 1
            sub_id = f"{request_id}.{progress.attempts}"
            try:
                queue = client.submit(sub_id, prompt, rest, cache_salt, pull=pull)
            except EngineUnavailable as exc:
                self._failover(progress, excluded, client, "unavailable", str(exc))
                continue
            if self.metrics is not None:
                self.metrics.engine_requests.labels(client.key).inc()
                if progress.attempts == 1:
                    self.metrics.ingress_latency.observe(time.monotonic() - arrival)
            finished = False
            try:
                async for delta in self._stream(client, sub_id, queue, sampling, progress,
                                                excluded, arrival, pulled=pull is not None):
                    finished = delta.finished
                    yield delta
                    if finished:
                        self._remember(client, prompt_token_ids + progress.generated,
                                       cache_salt)
                        return
            finally:
                if not finished:
                    client.abort(sub_id)  # failover, client gone, or an error: stop it there

    def _count_disaggregated(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.disaggregated.labels(outcome).inc()

    async def _prefill(self, request_id: str, client: EngineClient, prompt: list[int],
                       sampling: dict[str, Any], cache_salt: str | None,
                       progress: _Progress, excluded: set[str], arrival: float,
                       source: list[p.PullSource]) -> AsyncIterator[Delta]:
        """The prefill step of a disaggregated choice: the first token, streamed as it
        arrives (a finished delta when the choice is done), and, when the prefill engine
        pinned the prompt's KV, its `PullSource` appended to `source`. Returns without
        a token when the prefill failed: the caller serves the choice colocated."""
        progress.version = client.view().weight_version
        progress.attempts += 1
        sub_id = f"{request_id}.{progress.attempts}"
        first = dict(sampling, max_tokens=1)
        if sampling.get("min_tokens"):
            first["min_tokens"] = min(1, int(sampling["min_tokens"]))
        done_at_first = sampling.get("max_tokens", 16) <= 1
        try:
            # Pin the prompt's KV only when a decode engine will need it.
            queue = client.submit(sub_id, prompt, first, cache_salt,
                                  pin_for_handoff=not done_at_first)
        except EngineUnavailable as exc:
            self._failover(progress, excluded, client, "unavailable", str(exc))
            return
        if self.metrics is not None:
            self.metrics.engine_requests.labels(client.key).inc()
            self.metrics.ingress_latency.observe(time.monotonic() - arrival)
        finished = False
        try:
            waited_first = True
            while True:
                received_at, item = await self._next(client, queue, waited_first)
                waited_first = False
                if isinstance(item, EngineLost | _Stalled):
                    cause = "engine_lost" if isinstance(item, EngineLost) else "stalled"
                    self._failover(progress, excluded, client, cause, item.reason)
                    break
                if isinstance(item, p.Reject):
                    if item.status >= 500 or progress.generated:
                        self._failover(progress, excluded, client, "rejected", item.message)
                        break
                    raise EngineRejected(item.status, item.message)
                if item.finished and item.finish_reason == "abort":
                    self._failover(progress, excluded, client, "engine_aborted",
                                   f"engine {client.key} aborted the request")
                    break
                out = item
                pinned = out.pin_id is not None and out.pinned_blocks is not None
                if out.finished:
                    finished = True
                    ends = done_at_first or out.finish_reason != "length"
                    if not ends:  # more to come from the decode engine
                        out = msgspec.structs.replace(out, finished=False,
                                                      finish_reason=None, stop_reason=None)
                        # From the first token on the router derives the text, holding
                        # back what could begin a stop string, as the engine would.
                        self._start_continuation(progress, sampling, at_start=True)
                delta = self._delta(out, progress, False)
                delta.received_at = received_at
                if delta.token_ids:
                    # The tokens' version is the engine's now: a Recompute refit can
                    # change it under a request.
                    progress.version = client.view().weight_version
                if delta.finished and pinned:
                    client.abort(sub_id)  # ended at the first token (EOS, stop): unpin
                if delta.token_ids or delta.text or delta.finished:
                    self._observe(delta, progress, arrival)
                    yield delta
                if delta.finished:
                    return
                if item.finished:
                    if pinned and len(progress.generated) == 1:
                        source.append(p.PullSource(client.welcome.kv_transfer, item.pin_id,
                                                   list(item.pinned_blocks),
                                                   progress.generated[0]))
                    break
        finally:
            if not finished:
                client.abort(sub_id)
        if progress.generated:
            # The router derives the text from here on, the first token's included, so a
            # stop string spanning the hand-over is found wherever the rest comes from.
            self._start_continuation(progress, sampling)

    async def _engine_for(self, request_id: str, prompt: list[int], cache_salt: str | None,
                          progress: _Progress, excluded: set[str]) -> EngineClient:
        if progress.attempts >= self.config.max_attempts:
            raise GenerationFailed(f"request {request_id} failed on {progress.attempts} "
                                   "engine attempts; giving up")
        if not progress.generated:
            client = self.pick(prompt, cache_salt, exclude=sorted(excluded))
            if client is None and await self.wait_until_serving():
                client = self.pick(prompt, cache_salt, exclude=sorted(excluded))
            if client is None:
                raise NoEngineAvailable(no_engine_message(self.pool, excluded))
            return client
        # Tokens exist: only their own weight version may continue them; wait for one.
        deadline = time.monotonic() + self.config.failover_timeout
        while True:
            client = self.pick(prompt + progress.generated, cache_salt, progress.version,
                               sorted(excluded))
            if client is not None:
                return client
            if time.monotonic() > deadline:
                raise GenerationFailed(
                    f"request {request_id}: no RUNNING engine of weight version "
                    f"{progress.version!r} to continue on within "
                    f"{self.config.failover_timeout} s")
            await asyncio.sleep(0.05)

    def _failover(self, progress: _Progress, excluded: set[str], client: EngineClient,
                  reason: str, detail: str) -> None:
        log.warning("failing over from %s after %d tokens (%s)", client.key,
                    len(progress.generated), detail)
        if self.metrics is not None:
            self.metrics.failovers.labels(reason).inc()
        if reason != "engine_lost":
            excluded.add(client.key)  # a dead engine is skipped anyway; a live one refused

    async def _stream(self, client: EngineClient, sub_id: str, queue: asyncio.Queue[QueueItem],
                      sampling: dict[str, Any], progress: _Progress, excluded: set[str],
                      arrival: float, pulled: bool = False) -> AsyncIterator[Delta]:
        """Deltas from one engine attempt; returns without a final delta to fail over.
        A `pulled` attempt (a decode engine's) that is refused fails over too: the
        request itself was fine on the prefill engine."""
        first = True
        while True:
            received_at, item = await self._next(client, queue, first)
            first = False
            if isinstance(item, EngineLost | _Stalled):
                cause = "engine_lost" if isinstance(item, EngineLost) else "stalled"
                self._failover(progress, excluded, client, cause, item.reason)
                self._start_continuation(progress, sampling)
                return
            if isinstance(item, p.Reject):
                if item.status >= 500 or pulled:
                    self._failover(progress, excluded, client, "rejected", item.message)
                    self._start_continuation(progress, sampling)
                    return
                if progress.generated:
                    raise GenerationFailed(f"engine {client.key} refused the continuation of "
                                           f"a request: {item.message}")
                raise EngineRejected(item.status, item.message)
            engine_aborted = item.finished and item.finish_reason == "abort"
            delta = self._delta(item, progress, engine_aborted)
            delta.received_at = received_at
            if delta.token_ids:
                progress.version = client.view().weight_version
            if delta.token_ids or delta.text or delta.finished:
                self._observe(delta, progress, arrival)
                yield delta
            if delta.finished:
                return
            if engine_aborted:  # the engine stopped it (draining, stopping): not us
                self._failover(progress, excluded, client, "engine_aborted",
                               f"engine {client.key} aborted the request")
                self._start_continuation(progress, sampling)
                return

    async def _next(self, client: EngineClient, queue: asyncio.Queue[QueueItem], first: bool
                    ) -> tuple[float, Any]:
        timeout = self.config.first_output_timeout if first else self.config.output_timeout
        while True:
            getter = asyncio.ensure_future(queue.get())
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
            load = client.load
            if client.connected and load is not None and load.state != RUNNING:
                continue  # a paused engine keeps its requests: wait for it
            return time.monotonic(), _Stalled(f"no output from {client.key} for {timeout} s")

    def _start_continuation(self, progress: _Progress, sampling: dict[str, Any],
                            at_start: bool = False) -> None:
        if (progress.generated or at_start) and progress.continuation is None:
            progress.continuation = TextContinuation(
                self.tokenizer, generated_ids=progress.generated,
                sent_text="".join(progress.sent_text), stop=sampling.get("stop") or (),
                include_stop_str_in_output=bool(sampling.get("include_stop_str_in_output")),
                skip_special_tokens=sampling.get("skip_special_tokens", True),
                min_tokens=int(sampling.get("min_tokens") or 0))

    def _delta(self, out: p.Output, progress: _Progress, engine_aborted: bool) -> Delta:
        token_ids, logprobs = list(out.token_ids), out.logprobs
        cont = progress.continuation
        finished = out.finished and not engine_aborted
        reason, stop_reason = (out.finish_reason, out.stop_reason) if finished else (None, None)
        if cont is None:
            text = out.text
        else:
            pieces = []
            for i, token in enumerate(token_ids):
                last_is_stop = (out.finish_reason == "stop" and i == len(token_ids) - 1
                                and not isinstance(out.stop_reason, str))
                pieces.append(cont.push(token, is_stop_token=last_is_stop and finished))
                if cont.stop_reason is not None:  # a stop string spanning the hand-over
                    token_ids = token_ids[:i + 1]
                    logprobs = logprobs[:i + 1] if logprobs is not None else None
                    finished, reason, stop_reason = True, "stop", cont.stop_reason
                    break
            if finished and cont.stop_reason is None:
                pieces.append(cont.finish())
            text = "".join(pieces)
        progress.generated += token_ids
        progress.sent_text.append(text)
        return Delta(token_ids, text, logprobs, finished, reason, stop_reason)

    def _observe(self, delta: Delta, progress: _Progress, arrival: float) -> None:
        if self.metrics is None:
            return
        now = time.monotonic()
        if delta.token_ids:
            if progress.last_token_at is None:
                self.metrics.time_to_first_token.observe(now - arrival)
            else:
                self.metrics.inter_token_latency.observe(
                    (now - progress.last_token_at) / len(delta.token_ids))
            progress.last_token_at = now
            self.metrics.generated_tokens.inc(len(delta.token_ids))
        if delta.finished:
            self.metrics.e2e_latency.observe(now - arrival)


def _remaining(sampling: dict[str, Any], generated: int) -> dict[str, Any]:
    """The sampling parameters for the rest of a generation that has `generated` tokens."""
    if not generated:
        return sampling
    rest = dict(sampling)
    rest["max_tokens"] = sampling.get("max_tokens", 16) - generated
    if sampling.get("min_tokens"):
        rest["min_tokens"] = max(0, sampling["min_tokens"] - generated)
    return rest


def no_engine_message(pool: EnginePool, excluded: set[str] | frozenset[str] = frozenset()
                      ) -> str:
    views = pool.views()
    states = ", ".join(f"{v.key}: {v.state if v.alive else 'unreachable'}" for v in views)
    refused = f"; refused by {', '.join(sorted(excluded))}" if excluded else ""
    return f"no engine is available to serve the request (engines: {states}{refused})"
