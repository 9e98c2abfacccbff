"""The engine: `add_request`, `step`, `abort`, its lifecycle, and what happens to a token.

One `step()` = schedule → prepare inputs → forward → sample → post-process (append the
token, detokenize, check stop conditions, release finished requests' blocks). Every
phase is timed so benchmarks can show where a step's time goes. With speculative
decoding (`EngineConfig.speculative`), proposals are made before the schedule and
verified after the sampling (engine/speculative.py).

Lifecycle (lifecycle.py holds the table): pause stops stepping with every request
kept; suspend also releases KV memory under a mode; refit swaps weights while paused or
suspended and bumps the weight epoch, which salts prefix-cache hashes so KV computed by
old weights is never matched again.

Threads: every public method holds one lock, so a server thread may signal while
another thread steps (a signal waits for the current step). Readers that must never
wait for a step (heartbeats, `/v1/state`, the KV progress thread) read `stats`, an
immutable snapshot published at the end of every step and every change; nothing
outside this package reaches into the engine's fields.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tandem_engine.admin_wire import RefitRequest
from tandem_engine.config import EngineConfig
from tandem_engine.core.kv import KVCacheManager
from tandem_engine.core.kv.hashing import block_salt
from tandem_engine.core.request import FinishReason, Request
from tandem_engine.core.scheduler import Scheduler
from tandem_engine.engine.admission import check_tokens
from tandem_engine.engine.handoff_ledger import HandoffLedger
from tandem_engine.engine.kv_modes import release_pool, restore_pool
from tandem_engine.engine.kv_sizing import size_kv_pool
from tandem_engine.engine.output_processor import OutputProcessor
from tandem_engine.engine.outputs import PullPlan, RequestOutput
from tandem_engine.engine.speculation import Speculation, speculation_inputs
from tandem_engine.engine.speculative import Proposer
from tandem_engine.engine.stats import EngineStats, PrefixCacheStats, StepTiming
from tandem_engine.errors import RequestRejected
from tandem_engine.lifecycle import (
    REFIT_STATES,
    STABLE_STATES,
    EngineState,
    EngineStateError,
    KVMode,
    Signal,
    transition_for,
)
from tandem_engine.model.checkpoint import LoadProgressCallback, load_checkpoint
from tandem_engine.model.device import resolve_device
from tandem_engine.model.family import ModelConfig
from tandem_engine.model.runner import ModelRunner, resolve_dtype
from tandem_engine.model.sampler import Sampler
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.tokenizer import Tokenizer
from tandem_engine.weights import WeightIdentity


class LLMEngine:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig,
                 tensors: dict[str, torch.Tensor], tokenizer: Tokenizer,
                 source: str | Path | None = None) -> None:
        """`source` is where the checkpoint came from (named in errors: a draft model that
        does not match it, mtp heads it lacks)."""
        engine_config.validate()
        # From here on the config names a concrete device (auto resolved, a GPU checked).
        engine_config = dataclasses.replace(
            engine_config, device=str(resolve_device(engine_config.device)))
        self.model_config = model_config
        self.config = engine_config
        self.tokenizer = tokenizer
        dtype = resolve_dtype(model_config, engine_config)
        mtp_heads, draft = speculation_inputs(engine_config, model_config, tensors, tokenizer,
                                              dtype, source)
        context = model_config.max_position_embeddings
        if engine_config.max_model_len is not None and engine_config.max_model_len > context:
            raise ValueError(
                f"engine option max_model_len={engine_config.max_model_len} exceeds the "
                f"model's context of {context} tokens (max_position_embeddings): lower it")
        self.model_context = engine_config.max_model_len or context
        sizing = size_kv_pool(model_config, engine_config, tensors, dtype, self.model_context,
                              draft)
        num_blocks = sizing.num_blocks
        self.kv = KVCacheManager(num_blocks, engine_config.block_size,
                                 engine_config.enable_prefix_caching)
        # A request may never need more KV than the whole pool holds.
        self.max_model_len = min(self.model_context, self.kv.capacity_tokens)

        self.runner = sizing.runner or ModelRunner(model_config, engine_config, tensors,
                                                   num_blocks, self.max_model_len)
        self.scheduler = Scheduler(self.kv, engine_config.max_num_seqs,
                                   engine_config.max_num_batched_tokens)
        self.sampler = Sampler(engine_config.seed, device=self.runner.device)
        self.outputs = OutputProcessor(
            tokenizer, frozenset(tokenizer.eos_token_ids or model_config.eos_token_ids),
            self.max_model_len)
        self.speculation = Speculation(
            engine_config, draft, mtp_heads, num_blocks, self.max_model_len, dtype,
            self.runner, self.sampler, self.outputs, target_logits=self._target_logits,
            target_embed=self._target_embed,
            checkpoint=str(source) if source is not None else "(tensors given)")
        self.draft = self.speculation.draft  # method draft's model (None: another method)
        self.runner.capture_hidden = self.speculation.needs_hidden
        self.handoffs = HandoffLedger(self.kv, self.scheduler,
                                      pin_ttl_s=engine_config.kv_pin_ttl_s,
                                      quarantine_ttl_s=engine_config.kv_quarantine_ttl_s)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self.step_timings: list[StepTiming] = []
        self.num_preemptions = 0
        self._weights = WeightIdentity(uri="", version="initial", epoch=0)
        self._weight_bytes = self.runner.weight_bytes  # changes only with a refit
        self._state = EngineState.RUNNING
        self._suspend_mode: KVMode | None = None
        self._lock = threading.RLock()
        self._state_changed = threading.Condition(self._lock)
        self._publish()

    @classmethod
    def from_checkpoint(cls, path: str | Path, engine_config: EngineConfig,
                        progress: LoadProgressCallback | None = None) -> LLMEngine:
        """Load the checkpoint at `path`; `progress` is told how far the load is
        (see `load_checkpoint`)."""
        dtype = None if engine_config.dtype == "auto" else engine_config.dtype
        model_config, tensors = load_checkpoint(path, dtype, progress=progress)
        engine = cls(model_config, engine_config, tensors, Tokenizer.from_path(path), path)
        engine.set_weights(WeightIdentity(Path(path).resolve().as_uri(), "initial", 0))
        return engine

    def _target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The serving model's lm_head (the mtp heads' output goes through it)."""
        return self.runner.model.logits(hidden)

    def _target_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The serving model's input embedding (heads with mtp_token_input read it)."""
        return self.runner.model.embed(token_ids)

    # ---- what other threads read --------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot (lock-free: published at the end of every step and change)."""
        return self._stats

    @property
    def device(self) -> torch.device:
        """Where the model runs (fixed for the engine's life)."""
        return self.runner.device

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks pinned for pulls right now; safe from any thread without the lock."""
        return self.kv.num_pinned_blocks

    @property
    def proposer(self) -> Proposer | None:
        """Who proposes draft tokens (None: speculative decoding off)."""
        return self.speculation.proposer

    @proposer.setter
    def proposer(self, proposer: Proposer | None) -> None:
        self.speculation.proposer = proposer

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def weight_version(self) -> str:
        return self._weights.version

    @property
    def weight_epoch(self) -> int:
        return self._weights.epoch

    def _publish(self) -> None:
        """Called with the lock held (or before any other thread exists)."""
        kv = self.kv
        self._stats = EngineStats(
            state=self._state, weights=self._weights,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_pulling=len(self.handoffs.pulling), kv_usage=kv.usage,
            num_pinned_blocks=kv.num_pinned_blocks,
            num_quarantined_blocks=kv.num_quarantined_blocks, block_size=kv.block_size,
            max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
            prefix_cache=PrefixCacheStats(kv.queried_tokens, kv.hit_tokens,
                                          kv.pool.evictions, kv.pool.num_cached),
            num_preemptions=self.num_preemptions,
            num_pull_fallbacks=self.handoffs.num_fallbacks,
            speculative=self.speculation.snapshot(), weight_bytes=self._weight_bytes,
            last_refit_peak_bytes=self.runner.last_refit_peak_bytes)

    def set_weights(self, weights: WeightIdentity) -> None:
        """Name the weights serving now (the checkpoint loaded at start, under the version
        and epoch its fleet knows it by)."""
        with self._lock:
            self._weights = weights
            self._publish()

    def drain_step_timings(self) -> list[StepTiming]:
        """The timings of the steps since the last call (for metrics)."""
        with self._lock:
            timings, self.step_timings = self.step_timings, []
            return timings

    def kv_pool(self) -> torch.Tensor | None:
        """The KV pool tensor (None while suspended without it), for a KV transfer agent
        to register."""
        with self._lock:
            return self.runner.kv_cache

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None,
                    cache_salt: str | None = None, pin_for_handoff: bool = False,
                    resumed_token_ids: Sequence[int] = (), sent_chars: int = 0) -> Request:
        """Queue a request (also while paused or suspended). Raises RequestRejected (and
        changes nothing) if it cannot run. `cache_salt` isolates its prefix cache. With
        `pin_for_handoff` (a prefill engine's request) it ends after its first token unless
        that token ends the generation, keeping the prompt's KV pinned (listed in its final
        output) until `unpin` or the pin TTL. `resumed_token_ids` continue a generation
        begun elsewhere (their text is re-derived; `sent_chars` of it were already shown)."""
        with self._lock:
            request = self._new_request(request_id, prompt, params or SamplingParams(),
                                        cache_salt, resumed_token_ids, sent_chars)
            request.pin_for_handoff = pin_for_handoff
            if not self._end_at_admission(request):
                self.scheduler.add(request)
            self._publish()
            return request

    def _new_request(self, request_id: str, prompt: str | Sequence[int],
                     params: SamplingParams, cache_salt: str | None,
                     resumed_token_ids: Sequence[int], sent_chars: int) -> Request:
        if self._state in (EngineState.STOPPING, EngineState.STOPPED):
            raise EngineStateError(f"the engine is {self._state}: it accepts no requests")
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use; pick a new one")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
        resumed = list(resumed_token_ids)
        check_tokens(token_ids, resumed, params, self.model_config.vocab_size,
                     self.max_model_len, self.model_context, self.kv.capacity_tokens)
        request = Request(request_id, token_ids, params, next(self._arrivals), prompt=text,
                          token_ids=token_ids + resumed, cache_salt=cache_salt,
                          salt=block_salt(self.weight_epoch, cache_salt))
        if resumed:
            request.epoch_segments.append((self.weight_epoch, 0))
            # A seeded request continues the random stream of the engine it came from.
            self.sampler.skip_draws(request_id, params, len(resumed),
                                    self.model_config.vocab_size)
        self.requests[request_id] = request
        self.outputs.add(request, resumed, sent_chars)
        return request

    def _end_at_admission(self, request: Request) -> bool:
        """A resumed request that already reached its limits ends now (its output carries
        the text the engine before held back)."""
        reason = self.outputs.finish_reason_at_start(request)
        if reason is None:
            return False
        self._finish(request, reason)
        self._pending_outputs.append(self.outputs.output(request))
        return True

    # ---- KV handoff (disaggregated prefill/decode) ----------------------------------------

    def unpin(self, request_id: str) -> bool:
        """The puller is done with a handed-off prompt's KV: release it."""
        with self._lock:
            released = self.kv.unpin(request_id)
            self._publish()
            return released

    def add_pulled_request(self, request_id: str, prompt_token_ids: Sequence[int],
                           params: SamplingParams, resumed_token_ids: Sequence[int],
                           sent_chars: int = 0, cache_salt: str | None = None,
                           proposals: Sequence[int] = ()) -> PullPlan:
        """A decode engine's side of a handoff: the prompt was computed elsewhere and its
        first token (`resumed_token_ids`) sampled there. Blocks are allocated (reusing
        this engine's own prefix hits); the returned plan lists the prompt's block
        positions still to pull and the local blocks to pull them into. Call
        `complete_pull` when the transfer ends. `proposals`: the prefill engine's
        speculative proposals for the tokens after the first, verified in this engine's
        first step of the request (when it speculates at all)."""
        with self._lock:
            request = self._new_request(request_id, list(prompt_token_ids), params,
                                        cache_salt, resumed_token_ids, sent_chars)
            if self._end_at_admission(request):
                self._publish()
                return PullPlan(request_id, [], [], reused_blocks=0)
            try:
                plan = self.handoffs.plan_pull(request, list(proposals))
            except RequestRejected:
                self._forget(request)
                raise
            self._publish()
            return plan

    def quarantine(self, request_id: str, block_ids: list[int]) -> int | None:
        """Before `complete_pull` of a pull whose transfer state is unknown: keep its
        `block_ids` unused until `release_quarantine(id)` or the TTL (None: none kept)."""
        with self._lock:
            qid = self.handoffs.quarantine(request_id, block_ids, time.monotonic())
            self._publish()
            return qid

    def release_quarantine(self, quarantine_id: int) -> bool:
        with self._lock:
            released = self.kv.release_quarantine(quarantine_id)
            self._publish()
            return released

    def complete_pull(self, request_id: str, ok: bool) -> None:
        """End a pull. ok: the request decodes from its pulled KV at once. Not ok: it is
        recomputed here from prompt + first token (it still completes)."""
        with self._lock:
            self.handoffs.complete(request_id, ok)
            self._publish()

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks are freed at once. False if unknown."""
        with self._lock:
            request = self.requests.get(request_id)
            if request is None:
                return False
            self._finish(request, FinishReason.ABORT)
            self._pending_outputs.append(self.outputs.output(request))
            self._publish()
            return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished + len(self.handoffs.pulling) > 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that got a token or finished.
        Unless RUNNING, only returns outputs already due (aborts, a stop's aborts)."""
        with self._lock:
            outputs, self._pending_outputs = self._pending_outputs, []
            if self._state is EngineState.RUNNING:
                outputs += self._step()
            self._publish()
            return outputs

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self.kv.expire_pins(time.monotonic())
        self.kv.expire_quarantine(time.monotonic())
        t0 = time.perf_counter()
        self.speculation.propose(self.scheduler.running, self.handoffs)
        scheduled = self.scheduler.schedule()
        self.num_preemptions += len(scheduled.preempted)
        if scheduled.empty:
            return outputs
        t1 = time.perf_counter()
        prepared = self.runner.prepare(scheduled)
        t2 = time.perf_counter()
        batch = self.runner.forward(prepared)
        t3 = time.perf_counter()
        result, seeded_states = self.speculation.sample(batch)
        for request, first, logits in batch.prompt_logits:
            targets = request.token_ids[first:first + len(logits)]
            request.prompt_logprobs.extend(self.sampler.prompt_logprobs(
                logits, targets, request.params.prompt_logprobs))
        t4 = time.perf_counter()
        reasons, accepted = self.speculation.emit(batch, result, seeded_states,
                                                  self.weight_epoch)
        self.scheduler.advance(scheduled, accepted)
        for request, reason in zip(batch.requests, reasons, strict=True):
            if reason is not None:
                self._finish(request, reason)
            outputs.append(self.outputs.output(request))
        t5 = time.perf_counter()
        self.step_timings.append(StepTiming(
            num_running=len(scheduled.chunks),
            num_prefill_tokens=scheduled.num_prefill_tokens,
            num_decode_tokens=scheduled.num_decode_tokens,
            schedule_s=t1 - t0, prepare_s=t2 - t1, forward_s=t3 - t2, sample_s=t4 - t3,
            postprocess_s=t5 - t4))
        return outputs

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.finish_reason = reason
        if reason is FinishReason.HANDOFF:
            self.handoffs.pin(request, time.monotonic())
        self.handoffs.forget(request.request_id)
        self.scheduler.finish(request)
        self.sampler.forget(request.request_id)
        self.speculation.forget(request.request_id)
        self.requests.pop(request.request_id, None)

    def _forget(self, request: Request) -> None:
        """Drop a request that was never queued (refused at admission)."""
        self.sampler.forget(request.request_id)
        self.outputs.forget(request.request_id)
        self.requests.pop(request.request_id, None)

    # ---- lifecycle ------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop stepping. In-flight requests keep their KV; new requests queue."""
        self._signal(Signal.PAUSE)

    def unpause(self) -> None:
        self._signal(Signal.UNPAUSE)

    def suspend(self, mode: KVMode | str = KVMode.PERSIST) -> int:
        """Release KV memory (from PAUSED); returns the bytes of KV storage released (a
        draft model's pool included: it is dropped, not kept, under offload too)."""
        try:
            kv_mode = KVMode(mode)
        except ValueError:
            raise EngineStateError(
                f"KV management mode {mode!r} is unknown; use one of "
                f"{', '.join(m.value for m in KVMode)}") from None
        released = 0

        def release() -> None:
            nonlocal released
            released = release_pool(kv_mode, self.runner, self.scheduler, self.kv,
                                    self.handoffs, self.speculation)
            self._suspend_mode = kv_mode

        self._signal(Signal.SUSPEND, release)
        return released

    def resume(self) -> None:
        """Bring KV memory back (to RESUMED, a paused state: unpause to run)."""

        def restore() -> None:
            restore_pool(self._suspend_mode, self.runner, self.speculation)
            self._suspend_mode = None

        self._signal(Signal.RESUME, restore)

    def stop(self) -> None:
        """End the engine: every unfinished request finishes with reason `abort`."""

        def abort_all() -> None:
            for request in list(self.requests.values()):
                self._finish(request, FinishReason.ABORT)
                self._pending_outputs.append(self.outputs.output(request))

        self._signal(Signal.STOP, abort_all)

    def wait_until(self, state: EngineState | str, timeout: float | None = None) -> None:
        """Block until the engine is in `state` (a stable state only)."""
        target = EngineState(state)
        if target not in STABLE_STATES:
            raise ValueError(f"wait_until({target}): only stable states can be waited for "
                             f"({', '.join(sorted(str(s) for s in STABLE_STATES))})")
        with self._state_changed:
            if not self._state_changed.wait_for(lambda: self._state is target, timeout):
                raise TimeoutError(f"engine still {self._state} after {timeout} s, "
                                   f"not {target}")

    def refit(self, source: str | Path, version: str | None = None,
              epoch: int | None = None, uri: str | None = None,
              low_memory: bool = False, draft: str | Path | None = None) -> int:
        """In process: `apply_refit` of a `RefitRequest` for checkpoint `source` (a folder
        or a GGUF file) under `version` (default: the path), named `uri` (default: its
        file:// URI), with the draft checkpoint `draft` (method draft only)."""
        request = RefitRequest(
            uri=uri or Path(source).resolve().as_uri(), version=version or str(source),
            epoch=epoch, low_memory=low_memory,
            draft_uri=None if draft is None else Path(draft).resolve().as_uri())
        return self.apply_refit(request, source, draft)

    def apply_refit(self, request: RefitRequest, checkpoint: str | Path,
                    draft: str | Path | None = None) -> int:
        """Swap in the weights `request` names, read from `checkpoint` (the local folder or
        GGUF file its URI names, admitted by the caller), PAUSED, SUSPENDED or RESUMED only.
        Everything is validated before any parameter changes; on error the old weights
        keep serving. Returns the new weight epoch: `request.epoch` when given (a fleet's
        orchestrator numbers its refits pool-wide, so every engine on the same refit has
        the same epoch), else the current one + 1. The weights are then named
        `request.uri` under `request.version` (default: the URI). `request.low_memory`
        streams the new weights into the serving ones tensor by tensor (device peak: 1x the
        weights plus one tensor, instead of old + new; `stats.last_refit_peak_bytes` says
        what it was). `draft`, read for `request.draft_uri` (method draft only), also swaps
        the draft model's weights for that checkpoint's (same shape and vocabulary,
        validated with the rest before anything changes); its KV of every request is
        dropped, and each request catches up once."""
        with self._lock:
            if self._state not in REFIT_STATES:
                raise EngineStateError(
                    f"refit is not allowed in state {self._state}; allowed in "
                    f"{', '.join(sorted(str(s) for s in REFIT_STATES))}: pause first")
            self.speculation.check_refit_draft(draft)
            dtype = str(self.runner.dtype).removeprefix("torch.")
            config, tensors = load_checkpoint(checkpoint, dtype, reference=self.model_config)
            swap_speculation = self.speculation.prepare_refit(config, tensors, checkpoint,
                                                              draft, self.tokenizer, dtype)
            self.runner.load_weights(tensors, low_memory=request.low_memory)
            swap_speculation()
            self._weight_bytes = self.runner.weight_bytes
            self.model_config = config
            new_epoch = self.weight_epoch + 1 if request.epoch is None else request.epoch
            self._weights = WeightIdentity(request.uri, request.version or request.uri,
                                           new_epoch)
            # Requests holding no KV yet compute everything under the new weights; the
            # ones with KV keep their salt (their leading blocks are old-weight KV).
            for waiting in self.scheduler.waiting:
                if waiting.num_computed_tokens == 0:
                    waiting.resalt(block_salt(self.weight_epoch, waiting.cache_salt))
            self._publish()
            return self.weight_epoch

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self.kv.reset_prefix_cache()
            self._publish()

    def prefix_cache_stats(self) -> dict[str, int]:
        return dataclasses.asdict(self.stats.prefix_cache)

    def _signal(self, signal: Signal, action=None) -> None:
        with self._state_changed:
            transition = transition_for(self._state, signal)
            before = self._state
            self._state = transition.transient
            try:
                if action is not None:
                    action()
            except BaseException:
                self._state = before
                self._publish()
                raise
            self._state = transition.target
            self._publish()
            self._state_changed.notify_all()
