"""The engine: `add_request`, `step`, `abort`, its lifecycle, and what happens to a token.

One `step()` = schedule → prepare inputs → forward → sample → post-process (append the
token, detokenize, check stop conditions, release finished requests' blocks). Every
phase is timed so benchmarks can show where a step's time goes. With speculative
decoding (`EngineConfig.speculative`), proposals are made before the schedule and
verified after the sampling (engine/speculative.py).

Lifecycle (lifecycle.py holds the table, engine/state_machine.py moves the state): pause
stops stepping with every request kept; suspend also releases KV memory under a mode
(engine/kv_modes.py); refit (engine/refit.py) swaps weights while paused or suspended
and bumps the weight epoch, which salts prefix-cache hashes so KV computed by old
weights is never matched again.

Threads: every public method holds one lock, so a server thread may signal while
another thread steps (a signal waits for the current step). Readers that must never
wait for a step (heartbeats, `/v1/state`, the KV progress thread) read `stats`, an
immutable snapshot published at the end of every step and every change; nothing
outside this package reaches into the engine's fields.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tandem_engine.admin_wire import RefitRequest
from tandem_engine.config import EngineConfig
from tandem_engine.core.kv import KVCacheManager
from tandem_engine.core.kv.events import KVEventBatch
from tandem_engine.core.kv.hashing import block_salt
from tandem_engine.core.request import FinishReason, Request
from tandem_engine.core.scheduler import Scheduler
from tandem_engine.engine.admission import check_tokens
from tandem_engine.engine.grammars import Grammars
from tandem_engine.engine.handoff_ledger import HandoffLedger
from tandem_engine.engine.kv_modes import parse_kv_mode, release_pool, restore_pool
from tandem_engine.engine.kv_sizing import size_kv_pool
from tandem_engine.engine.loras import LoRAManager
from tandem_engine.engine.output_processor import OutputProcessor
from tandem_engine.engine.outputs import PullPlan, RequestOutput
from tandem_engine.engine.refit import ServingWeights, refit_request
from tandem_engine.engine.speculation import Speculation, speculation_inputs
from tandem_engine.engine.speculative import Proposer
from tandem_engine.engine.state_machine import StateMachine
from tandem_engine.engine.stats import EngineStats, LoRAStats, PrefixCacheStats, StepTiming
from tandem_engine.errors import RequestRejected
from tandem_engine.lifecycle import EngineState, EngineStateError, KVMode, Signal
from tandem_engine.lora_request import LoRARequest
from tandem_engine.model.checkpoint import LoadProgressCallback, load_checkpoint
from tandem_engine.model.device import resolve_device
from tandem_engine.model.family import ModelConfig
from tandem_engine.model.runner import ModelRunner, resolve_dtype, resolve_kv_cache_dtype
from tandem_engine.model.sampler import Sampler
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.tokenizer import Tokenizer
from tandem_engine.weights import WeightIdentity

# An engine with nothing to run but requests whose grammars compile waits this long at
# most per step for one of them (signals and new requests wait for the step).
_GRAMMAR_WAIT_S = 0.05


class _Published:
    """A public engine method that is one change to one of the engine's parts
    (`part.method`): made under the engine lock, then published to other threads. It
    takes the part method's signature, and its docstring unless `doc` is given."""

    def __init__(self, part: str, method: str, doc: str | None = None) -> None:
        self.part, self.method, self.doc = part, method, doc

    def __get__(self, engine: LLMEngine | None, owner: type | None = None) -> Any:
        if engine is None:
            return self
        change = getattr(getattr(engine, self.part), self.method)

        @functools.wraps(change)
        def published(*args: Any, **kwargs: Any) -> Any:
            with engine._lock:
                result = change(*args, **kwargs)
                engine._publish()
                return result

        if self.doc is not None:
            published.__doc__ = self.doc
        return published


# What the mtp heads call back into: over the runner, never the engine, so no reference
# cycle keeps an engine (and its KV pool) alive past its last user until a collection.
def _target_logits(runner: ModelRunner, hidden: torch.Tensor) -> torch.Tensor:
    """The serving model's lm_head (the mtp heads' output goes through it)."""
    return runner.model.logits(hidden)


def _target_embed(runner: ModelRunner, token_ids: torch.Tensor) -> torch.Tensor:
    """The serving model's input embedding (heads with mtp_token_input read it)."""
    return runner.model.embed(token_ids)


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
        dtype = resolve_dtype(model_config, engine_config, tensors)
        mtp_heads, draft = speculation_inputs(engine_config, model_config, tensors, tokenizer,
                                              dtype, source)
        context = model_config.max_position_embeddings
        if engine_config.max_model_len is not None and engine_config.max_model_len > context:
            raise ValueError(
                f"engine option max_model_len={engine_config.max_model_len} exceeds the "
                f"model's context of {context} tokens (max_position_embeddings): lower it")
        self.model_context = engine_config.max_model_len or context
        kv_dtype = resolve_kv_cache_dtype(engine_config, dtype, tensors)
        sizing = size_kv_pool(model_config, engine_config, tensors, kv_dtype,
                              self.model_context, draft)
        num_blocks = sizing.num_blocks
        self.kv = KVCacheManager(num_blocks, engine_config.block_size,
                                 engine_config.enable_prefix_caching)
        # A request may never need more KV than the whole pool holds.
        self.max_model_len = min(self.model_context, self.kv.capacity_tokens)

        self.runner = sizing.runner or ModelRunner(model_config, engine_config, tensors,
                                                   num_blocks, self.max_model_len)
        self.scheduler = Scheduler(self.kv, engine_config.max_num_seqs,
                                   engine_config.max_num_batched_tokens,
                                   engine_config.seat_reserve_ms / 1000)
        self.device: torch.device = self.runner.device  # fixed for the engine's life
        self.loras = LoRAManager(model_config, self.runner.lora,
                                 engine_config.max_cpu_loras or engine_config.max_loras,
                                 engine_config.max_lora_rank)
        self.sampler = Sampler(engine_config.seed, device=self.device)
        self.grammars = Grammars(tokenizer, model_config.vocab_size,
                                 engine_config.structured_outputs_cache_size)
        self.outputs = OutputProcessor(
            tokenizer, frozenset(tokenizer.eos_token_ids or model_config.eos_token_ids),
            self.max_model_len, self.grammars)
        self.speculation = Speculation(
            engine_config, draft, mtp_heads, num_blocks, self.max_model_len, dtype,
            self.runner, self.sampler, self.outputs, self.grammars,
            target_logits=functools.partial(_target_logits, self.runner),
            target_embed=functools.partial(_target_embed, self.runner),
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
        self.weights = ServingWeights(self.runner, self.speculation, tokenizer)
        self._suspend_mode: KVMode | None = None
        self._lock = threading.RLock()
        self.lifecycle = StateMachine(self._lock, self._publish)
        # What other threads read: the latest snapshot, lock-free (published at the end
        # of every step and change).
        self.stats: EngineStats
        self._publish()

    @classmethod
    def from_checkpoint(cls, path: str | Path, engine_config: EngineConfig,
                        progress: LoadProgressCallback | None = None) -> LLMEngine:
        """Load the checkpoint at `path`; `progress` is told how far the load is
        (see `load_checkpoint`)."""
        dtype = None if engine_config.dtype == "auto" else engine_config.dtype
        model_config, tensors = load_checkpoint(path, dtype, progress=progress,
                                                quantization=engine_config.quantization)
        engine = cls(model_config, engine_config, tensors, Tokenizer.from_path(path), path)
        engine.set_weights(WeightIdentity(Path(path).resolve().as_uri(), "initial", 0))
        return engine

    # ---- what other threads read --------------------------------------------------------------

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
        return self.lifecycle.state

    @property
    def weight_version(self) -> str:
        return self.weights.identity.version

    @property
    def weight_epoch(self) -> int:
        return self.weights.identity.epoch

    def _publish(self) -> None:
        """Called with the lock held (or before any other thread exists)."""
        kv, loras = self.kv, self.loras
        lora = None
        if loras.enabled:
            lora = LoRAStats(
                served=tuple(known.identity for known in loras.known.values()),
                resident=tuple(loras.resident()),
                running=tuple(sorted({r.lora.lora_name for r in self.scheduler.running
                                      if r.lora is not None})),
                waiting=tuple(sorted({r.lora.lora_name for r in self.scheduler.waiting
                                      if r.lora is not None})),
                max_loras=self.config.max_loras, loads=loras.loads,
                evictions=loras.evictions, hits=loras.hits)
        self.stats = EngineStats(
            state=self.lifecycle.state, weights=self.weights.identity,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_pulling=len(self.handoffs.pulling), kv_usage=kv.usage,
            num_pinned_blocks=kv.num_pinned_blocks,
            num_quarantined_blocks=kv.num_quarantined_blocks, block_size=kv.block_size,
            max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
            prefix_cache=PrefixCacheStats(kv.queried_tokens, kv.hit_tokens,
                                          kv.pool.evictions, kv.pool.num_cached),
            num_preemptions=self.num_preemptions,
            num_pull_fallbacks=self.handoffs.num_fallbacks,
            speculative=self.speculation.snapshot(), weight_bytes=self.weights.bytes,
            kv_cache_bytes=self.runner.kv_bytes if self.runner.kv_cache is not None else 0,
            kv_cache_dtype=str(self.runner.kv_dtype).removeprefix("torch."),
            last_refit_peak_bytes=self.weights.last_refit_peak_bytes, lora=lora)

    set_weights = _Published("weights", "name")

    def drain_kv_events(self) -> KVEventBatch | None:
        """The prefix cache's changes since the last call (core/kv/events.py), for routers."""
        with self._lock:
            return self.kv.pool.drain_events()

    def kv_snapshot(self) -> tuple[KVEventBatch | None, int, list[int]]:
        """The pending changes as a batch (publish it first), then every hash the prefix
        cache holds as of that batch's seq: a router's starting point."""
        with self._lock:
            batch = self.kv.pool.drain_events()
            return batch, self.kv.pool.events.seq, self.kv.pool.cached_hashes()

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
                    resumed_token_ids: Sequence[int] = (), sent_chars: int = 0,
                    lora_name: str | None = None, lora_version: str | None = None,
                    priority: int = 0) -> Request:
        """Queue a request (also while paused or suspended). Raises RequestRejected (and
        changes nothing) if it cannot run. `cache_salt` isolates its prefix cache. With
        `pin_for_handoff` (a prefill engine's request) it ends after its first token unless
        that token ends the generation, keeping the prompt's KV pinned (listed in its final
        output) until `unpin` or the pin TTL. `resumed_token_ids` continue a generation
        begun elsewhere (their text is re-derived; `sent_chars` of it were already shown).
        `lora_name`: the LoRA adapter it runs under (one `load_lora` loaded), refused
        unless at `lora_version` when that is given. `priority` (vLLM's): lower is
        scheduled first and may preempt running requests of a larger one; equal
        priorities go by arrival (core/scheduler.py)."""
        with self._lock:
            request = self._admit(request_id, prompt, params or SamplingParams(), cache_salt,
                                  resumed_token_ids, sent_chars, pin_for_handoff, lora_name,
                                  lora_version, priority)
            if not request.finished:
                self.scheduler.add(request)
            self._publish()
            return request

    def _admit(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
               cache_salt: str | None, resumed_token_ids: Sequence[int], sent_chars: int,
               pin_for_handoff: bool = False, lora_name: str | None = None,
               lora_version: str | None = None, priority: int = 0) -> Request:
        """A new request, checked (RequestRejected: nothing changed) and known to every
        part but the scheduler. A resumed request that already reached its limits is
        finished at once (its output carries the text the engine before held back)."""
        state = self.lifecycle.state
        if state in (EngineState.STOPPING, EngineState.STOPPED):
            raise EngineStateError(f"the engine is {state}: it accepts no requests")
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use; pick a new one")
        lora = self.loras.resolve(lora_name)
        if lora is not None and lora_version is not None and lora.lora_version != lora_version:
            raise RequestRejected(f"LoRA adapter {lora_name!r} is at version "
                                  f"{lora.lora_version} here, not {lora_version}: the request "
                                  "must run where its version is served")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
        resumed = list(resumed_token_ids)
        check_tokens(token_ids, resumed, params, self.model_config.vocab_size,
                     self.max_model_len, self.model_context, self.kv.capacity_tokens)
        request = Request(request_id, token_ids, params, next(self._arrivals), prompt=text,
                          priority=priority,
                          token_ids=token_ids + resumed, cache_salt=cache_salt,
                          salt=block_salt(self.weight_epoch, cache_salt,
                                          lora.identity if lora else None), lora=lora)
        if resumed:
            request.epoch_segments.append((self.weight_epoch, 0))
            # A seeded request continues the random stream of the engine it came from.
            self.sampler.skip_draws(request_id, params, len(resumed),
                                    self.model_config.vocab_size)
        self.requests[request_id] = request
        self.outputs.add(request, resumed, sent_chars)
        request.pin_for_handoff = pin_for_handoff
        reason = self.outputs.finish_reason_at_start(request)
        if reason is not None:
            self._finish(request, reason)
            self._pending_outputs.append(self.outputs.output(request))
        else:
            self.grammars.add(request)  # compiles in the background; scheduled once ready
        return request

    # ---- KV handoff (disaggregated prefill/decode) ----------------------------------------

    unpin = _Published("kv", "unpin",
                       "The puller is done with a handed-off prompt's KV: release it.")

    def add_pulled_request(self, request_id: str, prompt_token_ids: Sequence[int],
                           params: SamplingParams, resumed_token_ids: Sequence[int],
                           sent_chars: int = 0, cache_salt: str | None = None,
                           proposals: Sequence[int] = (), lora_name: str | None = None,
                           lora_version: str | None = None, priority: int = 0) -> PullPlan:
        """A decode engine's side of a handoff: the prompt was computed elsewhere and its
        first token (`resumed_token_ids`) sampled there. Blocks are allocated (reusing
        this engine's own prefix hits); the returned plan lists the prompt's block
        positions still to pull and the local blocks to pull them into. Call
        `complete_pull` when the transfer ends. `proposals`: the prefill engine's
        speculative proposals for the tokens after the first, verified in this engine's
        first step of the request (when it speculates at all). `lora_name` and
        `lora_version`: the adapter the prefill engine computed the prompt under; an
        engine that does not serve that version refuses the pull (RequestRejected), so KV
        of one adapter is never decoded under another. `priority`: as `add_request`'s (a
        handed-over request is admitted ahead of the others, then ranks by it)."""
        with self._lock:
            request = self._admit(request_id, list(prompt_token_ids), params, cache_salt,
                                  resumed_token_ids, sent_chars, lora_name=lora_name,
                                  lora_version=lora_version, priority=priority)
            if request.finished:
                self._publish()
                return PullPlan(request_id, [], [], reused_blocks=0)
            try:
                plan = self.handoffs.plan_pull(request, list(proposals))
            except RequestRejected:  # never queued: every part forgets it
                self.sampler.forget(request_id)
                self.outputs.forget(request_id)
                self.requests.pop(request_id, None)
                raise
            self._publish()
            return plan

    quarantine = _Published(
        "handoffs", "quarantine",
        "Before `complete_pull` of a pull whose transfer state is unknown: keep its "
        "`block_ids` unused until `release_quarantine(id)` or the TTL (None: none kept).")
    release_quarantine = _Published("kv", "release_quarantine",
                                    "Quarantined blocks are safe again (False: unknown id).")
    complete_pull = _Published("handoffs", "complete")

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

    @property
    def num_pull_fallbacks(self) -> int:
        """Handed-over requests recomputed here (their pull failed)."""
        return self.handoffs.num_fallbacks

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that got a token or finished.
        Unless RUNNING, only returns outputs already due (aborts, a stop's aborts)."""
        with self._lock:
            outputs, self._pending_outputs = self._pending_outputs, []
            if self.lifecycle.state is EngineState.RUNNING:
                outputs += self._step()
            self._publish()
            return outputs

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self.kv.expire_pins(time.monotonic())
        self.kv.expire_quarantine(time.monotonic())
        for request, why in self.grammars.poll():  # its constraint cannot be used
            request.error = why
            self._finish(request, FinishReason.ERROR)
            outputs.append(self.outputs.output(request))
        self.loras.assign(self.scheduler.waiting, self.requests.values())
        t0 = time.perf_counter()
        self.speculation.propose(self.scheduler.running, self.handoffs)
        scheduled = self.scheduler.schedule()
        self.num_preemptions += len(scheduled.preempted)
        if scheduled.empty:
            if self.grammars.waiting:  # only compiles to wait for: no spinning
                self.grammars.wait(_GRAMMAR_WAIT_S)
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
            postprocess_s=t5 - t4, grammar_s=self.speculation.mask_s))
        return outputs

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.finish_reason = reason
        if reason is FinishReason.HANDOFF:
            self.handoffs.pin(request)
        self.handoffs.forget(request.request_id)
        self.scheduler.finish(request, reserve_seat=reason in (FinishReason.STOP,
                                                               FinishReason.LENGTH))
        self.sampler.forget(request.request_id)
        self.speculation.forget(request.request_id)
        self.grammars.forget(request.request_id)
        self.requests.pop(request.request_id, None)

    # ---- lifecycle ------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop stepping. In-flight requests keep their KV; new requests queue."""
        self.lifecycle.signal(Signal.PAUSE)

    def unpause(self) -> None:
        self.lifecycle.signal(Signal.UNPAUSE)

    def suspend(self, mode: KVMode | str = KVMode.PERSIST) -> int:
        """Release KV memory (from PAUSED); returns the bytes of KV storage released (a
        draft model's pool included: it is dropped, not kept, under offload too)."""
        kv_mode = parse_kv_mode(mode)
        released = 0

        def release() -> None:
            nonlocal released
            released = release_pool(kv_mode, self.runner, self.scheduler, self.kv,
                                    self.handoffs, self.speculation)
            self._suspend_mode = kv_mode

        self.lifecycle.signal(Signal.SUSPEND, release)
        return released

    def resume(self) -> None:
        """Bring KV memory back (to RESUMED, a paused state: unpause to run)."""

        def restore() -> None:
            restore_pool(self._suspend_mode, self.runner, self.speculation)
            self._suspend_mode = None

        self.lifecycle.signal(Signal.RESUME, restore)

    def stop(self) -> None:
        """End the engine: every unfinished request finishes with reason `abort`."""

        def abort_all() -> None:
            for request in list(self.requests.values()):
                self._finish(request, FinishReason.ABORT)
                self._pending_outputs.append(self.outputs.output(request))

        self.lifecycle.signal(Signal.STOP, abort_all)

    def wait_until(self, state: EngineState | str, timeout: float | None = None) -> None:
        """Block until the engine is in `state` (a stable state only)."""
        self.lifecycle.wait_until(state, timeout)

    def refit(self, source: str | Path, version: str | None = None,
              epoch: int | None = None, uri: str | None = None,
              low_memory: bool = False, draft: str | Path | None = None) -> int:
        """In process: `apply_refit` of a `RefitRequest` for checkpoint `source` (a folder
        or a GGUF file) under `version` (default: the path), named `uri` (default: its
        file:// URI), with the draft checkpoint `draft` (method draft only)."""
        return self.apply_refit(refit_request(source, version, epoch, uri, low_memory, draft),
                                source, draft)

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
        dropped, and each request catches up once (engine/refit.py)."""
        with self._lock:
            self.model_config = self.weights.swap(self.lifecycle.state, request, checkpoint,
                                                  draft, self.model_config,
                                                  self.scheduler.waiting)
            self._publish()
            return self.weight_epoch

    def load_lora(self, lora: LoRARequest) -> None:
        """Serve LoRA adapter `lora` under its name (read and checked now: CheckpointError,
        RequestRejected; nothing changes on error)."""
        with self._lock:
            self.loras.load(lora)
            self._publish()

    unload_lora = _Published("loras", "unload")

    reset_prefix_cache = _Published(
        "kv", "reset_prefix_cache",
        "Forget every cached prefix; blocks in use keep their KV and owners.")

    def prefix_cache_stats(self) -> dict[str, int]:
        return dataclasses.asdict(self.stats.prefix_cache)
