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
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tandem_engine.admin_wire import RefitRequest
from tandem_engine.config import EngineConfig, context_room
from tandem_engine.core.kv import KVCacheManager
from tandem_engine.core.kv.hashing import block_salt
from tandem_engine.core.request import FinishReason, Request
from tandem_engine.core.scheduler import Scheduler
from tandem_engine.engine.draft_model import (
    DraftModelProposer,
    draft_kv_blocks,
    load_draft_checkpoint,
)
from tandem_engine.engine.output_processor import OutputProcessor
from tandem_engine.engine.outputs import PullPlan, RequestOutput
from tandem_engine.engine.speculative import (
    DraftedHistory,
    MtpProposer,
    SpecDecodeCounters,
    accepted_length,
    check_mtp_heads,
    make_proposer,
)
from tandem_engine.engine.stats import EngineStats, PrefixCacheStats, StepTiming
from tandem_engine.engine.step_guard import sample_contained
from tandem_engine.errors import CheckpointError, RequestRejected
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
from tandem_engine.model.device import profile_step_blocks, profile_step_memory, resolve_device
from tandem_engine.model.family import ModelConfig
from tandem_engine.model.mtp import MtpHeads, take_mtp_heads
from tandem_engine.model.runner import (
    ModelRunner,
    StepBatch,
    kv_sized_by_memory_fraction,
    num_kv_blocks,
    resolve_dtype,
)
from tandem_engine.model.sampler import Sampler, SampleResult, TokenHistory
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.tokenizer import Tokenizer
from tandem_engine.weights import WeightIdentity

log = logging.getLogger(__name__)


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
        # The checkpoint's multi-token-prediction heads are not part of the model: the mtp
        # proposer owns them (a served checkpoint's heads are unused otherwise).
        spec = engine_config.speculative
        checkpoint = str(source) if source is not None else "(tensors given)"
        mtp_heads = take_mtp_heads(model_config, tensors)
        if spec is not None and spec.method == "mtp":
            check_mtp_heads(spec, mtp_heads, checkpoint)

        context = model_config.max_position_embeddings
        if engine_config.max_model_len is not None and engine_config.max_model_len > context:
            raise ValueError(
                f"engine option max_model_len={engine_config.max_model_len} exceeds the "
                f"model's context of {context} tokens (max_position_embeddings): lower it")
        self.model_context = engine_config.max_model_len or context
        # The draft method's checkpoint, validated against this model before any sizing:
        # its weights and pool share the memory the KV pool is sized from.
        draft = None
        if spec is not None and spec.method == "draft":
            assert spec.model is not None  # SpeculativeConfig.validate
            draft = load_draft_checkpoint(spec.model, source or "the served model",
                                          model_config, tokenizer, dtype)
        runner: ModelRunner | None = None
        if kv_sized_by_memory_fraction(engine_config):
            # Load the weights beside a scratch pool, profile the largest step, then size
            # the pool from what gpu_memory_utilization leaves (refused unless a request
            # of model_context tokens fits).
            runner = ModelRunner(model_config, engine_config, tensors,
                                 profile_step_blocks(engine_config), self.model_context)
            profile = profile_step_memory(runner, engine_config)
            if draft is not None:  # the draft's weights and a pool of as many blocks
                profile = dataclasses.replace(profile,
                                              weights=profile.weights + draft.weight_bytes)
            num_blocks = num_kv_blocks(model_config, engine_config, dtype, profile,
                                       self.model_context)
            if draft is not None:
                num_blocks = draft_kv_blocks(num_blocks, model_config, draft.config)
            runner.resize_kv(num_blocks)
            log.info("KV cache sized by gpu_memory_utilization=%s: %d blocks (%.2f GiB)",
                     engine_config.gpu_memory_utilization, num_blocks, runner.kv_bytes / 2**30)
        else:
            num_blocks = num_kv_blocks(model_config, engine_config, dtype)
        self.kv = KVCacheManager(num_blocks, engine_config.block_size,
                                 engine_config.enable_prefix_caching)
        # A request may never need more KV than the whole pool holds.
        self.max_model_len = min(self.model_context, self.kv.capacity_tokens)

        self.runner = runner or ModelRunner(model_config, engine_config, tensors, num_blocks,
                                            self.max_model_len)
        self.scheduler = Scheduler(self.kv, engine_config.max_num_seqs,
                                   engine_config.max_num_batched_tokens)
        self.sampler = Sampler(engine_config.seed, device=self.runner.device)
        self.outputs = OutputProcessor(
            tokenizer, frozenset(tokenizer.eos_token_ids or model_config.eos_token_ids),
            self.max_model_len)
        self.proposer = None if spec is None else make_proposer(
            spec, engine_config, draft, num_blocks, self.max_model_len, dtype,
            mtp_heads=self._heads_on_device(mtp_heads), target_logits=self._target_logits,
            target_embed=self._target_embed,
            checkpoint=checkpoint)
        # The draft method's proposer again, for the lifecycle (suspend, resume, refit).
        self.draft = self.proposer if isinstance(self.proposer, DraftModelProposer) else None
        self.runner.capture_hidden = isinstance(self.proposer, MtpProposer)
        self.spec_counters = SpecDecodeCounters()
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self.step_timings: list[StepTiming] = []
        self.num_preemptions = 0
        self._weights = WeightIdentity(uri="", version="initial", epoch=0)
        self._state = EngineState.RUNNING
        self._pulling: dict[str, Request] = {}
        # Handed-over requests with the prefill engine's proposals, until their first step.
        self._carrying: dict[str, Request] = {}
        self.num_pull_fallbacks = 0
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
        return self.runner.model.compute_logits(hidden)

    def _target_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The serving model's input embedding (heads with mtp_token_input read it)."""
        return self.runner.model.embed(token_ids)

    def _heads_on_device(self, heads: MtpHeads | None) -> MtpHeads | None:
        return None if heads is None else heads.to(self.runner.device, self.runner.dtype)

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
    def state(self) -> EngineState:
        return self._state

    @property
    def weights(self) -> WeightIdentity:
        return self._weights

    @property
    def weight_version(self) -> str:
        return self._weights.version

    @property
    def weight_epoch(self) -> int:
        return self._weights.epoch

    @property
    def weight_uri(self) -> str:
        return self._weights.uri

    def _publish(self) -> None:
        """Called with the lock held (or before any other thread exists)."""
        kv = self.kv
        self._stats = EngineStats(
            state=self._state, weights=self._weights,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_pulling=len(self._pulling), kv_usage=kv.usage,
            num_pinned_blocks=kv.num_pinned_blocks,
            num_quarantined_blocks=kv.num_quarantined_blocks, block_size=kv.block_size,
            max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
            prefix_cache=PrefixCacheStats(kv.queried_tokens, kv.hit_tokens,
                                          kv.pool.evictions, kv.pool.num_cached),
            num_preemptions=self.num_preemptions, num_pull_fallbacks=self.num_pull_fallbacks,
            speculative=None if self.proposer is None else self.spec_counters.snapshot())

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
        self._check_tokens(token_ids, resumed, params)
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

    def _check_tokens(self, token_ids: list[int], resumed: list[int],
                      params: SamplingParams) -> None:
        if not token_ids:
            raise RequestRejected("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        for what, ids in (("prompt", token_ids), ("resumed", resumed)):
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestRejected(
                    f"{what} token id {bad!r} is outside the model's vocabulary [0, {vocab})")
        params.check_vocabulary(vocab)
        if context_room(len(token_ids), self.max_model_len) < 1:
            raise RequestRejected(
                f"prompt has {len(token_ids)} tokens, which leaves no room to generate within "
                f"this engine's limit of {self.max_model_len} tokens (model context "
                f"{self.model_context}, KV cache {self.kv.capacity_tokens} tokens): shorten "
                f"the prompt to at most {self.max_model_len - 1} tokens or give the engine "
                "a larger KV cache")

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
            if proposals:
                request.carried_proposals = list(proposals)
                request.carried_for = request.num_tokens
                self._carrying[request_id] = request
            if self._end_at_admission(request):
                self._publish()
                return PullPlan(request_id, [], [], reused_blocks=0)
            try:
                hit = self.kv.acquire_cached_prefix(request)
                n = request.num_prompt_tokens
                if not self.kv.allocate_slots(request_id, n):
                    raise RequestRejected(
                        f"no room for {n} prompt tokens of KV on this engine right now")
            except RequestRejected:
                self.kv.free(request_id)
                self._forget(request)
                raise
            table = self.kv.block_table(request_id)
            first = hit // self.kv.block_size
            self._pulling[request_id] = request
            self._publish()
            return PullPlan(request_id, list(range(first, len(table))), table[first:],
                            reused_blocks=first)

    def quarantine(self, request_id: str, block_ids: list[int]) -> int | None:
        """Before `complete_pull` of a pull whose transfer state is unknown: keep its
        `block_ids` unused until `release_quarantine(id)` or the TTL (None: none kept)."""
        with self._lock:
            ttl = time.monotonic() + self.config.kv_quarantine_ttl_s
            qid = (self.kv.quarantine(request_id, block_ids, ttl)
                   if request_id in self._pulling else None)
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
            request = self._pulling.pop(request_id, None)
            if request is None:
                return  # aborted meanwhile
            if ok:
                request.num_computed_tokens = request.num_prompt_tokens
                self.kv.cache_computed_blocks(request)
            else:
                self.kv.free(request_id)
                request.num_computed_tokens = 0
                request.num_cached_blocks = 0
                self.num_pull_fallbacks += 1
            self.scheduler.admit_pulled(request)
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
        return self.scheduler.num_unfinished + len(self._pulling) > 0

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
        if self.proposer is not None:
            self._propose()
        scheduled = self.scheduler.schedule()
        self.num_preemptions += len(scheduled.preempted)
        if scheduled.empty:
            return outputs
        t1 = time.perf_counter()
        prepared = self.runner.prepare(scheduled)
        t2 = time.perf_counter()
        batch = self.runner.forward(prepared)
        t3 = time.perf_counter()
        requests = batch.requests
        result, seeded_states = self._sample(batch)
        for request, first, logits in batch.prompt_logits:
            targets = request.token_ids[first:first + len(logits)]
            request.prompt_logprobs.extend(self.sampler.prompt_logprobs(
                logits, targets, request.params.prompt_logprobs))
        t4 = time.perf_counter()
        reasons: list[FinishReason | None] = []
        accepted: dict[str, int] = {}
        last_rows: list[int] = []  # per request: the row that produced its last token
        first = 0
        for request, draft in zip(requests, batch.drafts, strict=True):
            before = request.num_tokens
            reasons.append(self._emit(request, draft, first, result, accepted,
                                      seeded_states.get(request.request_id),
                                      batch.logits.shape[-1]))
            last_rows.append(first + request.num_tokens - before - 1)
            first += 1 + len(draft)
        if batch.hidden is not None and isinstance(self.proposer, MtpProposer):
            # Requests going on propose from their row next step; a handoff proposes now,
            # and its proposals travel with it to the decode engine.
            going_on = [i for i, reason in enumerate(reasons)
                        if reason is None or reason is FinishReason.HANDOFF]
            self.proposer.remember([requests[i] for i in going_on], batch.hidden[
                torch.tensor([last_rows[i] for i in going_on], dtype=torch.long,
                             device=batch.hidden.device)])
            handoffs = [requests[i] for i in going_on if reasons[i] is FinishReason.HANDOFF]
            limits = [self._proposal_limit(request) for request in handoffs]
            for request, draft in zip(handoffs, self.proposer.propose(handoffs, limits),
                                      strict=True):
                request.carried_proposals = draft
        self.scheduler.advance(scheduled, accepted)
        for request, reason in zip(requests, reasons, strict=True):
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

    def _propose(self) -> None:
        """Give every running decode its proposals for this step (none past its
        max_tokens or the context: a step emits at most proposals + 1 tokens). The
        proposer sees the step's candidates together (a draft model proposes for all of
        them in one batch)."""
        assert self.proposer is not None
        cap = self.config.speculative.disable_by_batch_size if self.config.speculative else None
        if cap is not None and len(self.scheduler.running) > cap:
            for request in self.scheduler.running:
                request.spec_token_ids = []
            return
        carried = self._use_carried_proposals()
        candidates: list[Request] = []
        limits: list[int] = []
        for request in self.scheduler.running:
            if request.request_id in carried:
                continue
            request.spec_token_ids = []
            if (request.num_tokens - request.num_computed_tokens != 1
                    or request.pin_for_handoff):
                continue
            limit = self._proposal_limit(request)
            if limit >= 1:
                candidates.append(request)
                limits.append(limit)
        if candidates:
            for request, draft in zip(candidates, self.proposer.propose(candidates, limits),
                                      strict=True):
                request.spec_token_ids = draft

    def _use_carried_proposals(self) -> set[str]:
        """Handed-over requests ready for their first decode step (KV pulled or
        recomputed, still running or admitted this step) get the proposals the prefill
        engine made, for exactly the tokens they have; returns their ids. Proposals for
        tokens the request no longer ends with are dropped."""
        used = set()
        for request_id, request in list(self._carrying.items()):
            if request.finished or request.carried_for != request.num_tokens:
                del self._carrying[request_id]
            elif (request_id not in self._pulling
                  and request.num_tokens - request.num_computed_tokens == 1):
                limit = max(self._proposal_limit(request), 0)
                request.spec_token_ids = request.carried_proposals[:limit]
                request.carried_proposals = []
                del self._carrying[request_id]
                used.add(request_id)
        return used

    def _proposal_limit(self, request: Request) -> int:
        """How many tokens may be proposed after the request's last: none past its
        max_tokens or the context (a step emits at most proposals + 1 tokens)."""
        return min(request.params.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens) - 1

    def _sample(self, batch: StepBatch) -> tuple[SampleResult, dict[str, torch.Tensor]]:
        """One token per logits row. A request verifying a draft has one row per position,
        sampled with the history it has there (the proposals before it taken as given).
        Also returns, for seeded requests with a draft, their generators' states before."""
        ids: list[str] = []
        params = []
        banned: list[tuple[int, ...]] = []
        histories: list[TokenHistory] = []
        seeded_states: dict[str, torch.Tensor] = {}
        for request, draft in zip(batch.requests, batch.drafts, strict=True):
            if draft:
                state = self.sampler.seeded_state(request.request_id, request.params)
                if state is not None:
                    seeded_states[request.request_id] = state
            for ahead in range(len(draft) + 1):
                ids.append(request.request_id)
                params.append(request.params)
                banned.append(self.outputs.banned_tokens(request, ahead))
                histories.append(DraftedHistory(request, draft[:ahead]) if ahead else request)
        result = sample_contained(self.sampler, batch.logits, ids, params, banned, histories)
        return result, seeded_states

    def _emit(self, request: Request, draft: tuple[int, ...], first: int,
              result: SampleResult, accepted: dict[str, int], seeded_state: torch.Tensor | None,
              vocab: int) -> FinishReason | None:
        """Append the tokens a request gets this step (rows `first`...: the accepted
        proposals, then the draw at the first mismatch) until one ends it; record in
        `accepted` how many proposals now count as computed. Returns why it ends, if it
        does."""
        drawn = result.token_ids[first:first + 1 + len(draft)]
        n = 1 + accepted_length(draft, drawn)  # tokens emitted
        if seeded_state is not None and n < len(drawn):
            # Take back the draws made after the first rejection (they belong to later
            # tokens), so a seeded request draws what it would without speculation.
            self.sampler.rewind(request.request_id, request.params, seeded_state, n, vocab)
        request.error = next((result.errors[r] for r in range(first, first + n)
                              if r in result.errors), None)
        if request.error is not None:
            return FinishReason.ERROR  # this request alone cannot go on
        if draft:
            assert self.proposer is not None
            self.proposer.observe(request, len(draft), n - 1)
            self.spec_counters.record(len(draft), n - 1)
            request.num_spec_proposed += len(draft)
            request.num_spec_accepted += n - 1
        segments = request.epoch_segments
        if not segments or segments[-1][0] != self.weight_epoch:
            segments.append((self.weight_epoch, request.num_output_tokens))
        reason = None
        appended = 0
        for row in range(first, first + n):
            appended += 1
            reason = self.outputs.append(request, drawn[row - first], row, result)
            if reason is not None:
                break
        if draft:
            # The positions computed are the last token's and the appended proposals'.
            accepted[request.request_id] = appended - 1
        return reason

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.finish_reason = reason
        if reason is FinishReason.HANDOFF:
            request.pinned_blocks = self.kv.pin(
                request.request_id, time.monotonic() + self.config.kv_pin_ttl_s)
        self._pulling.pop(request.request_id, None)
        self.scheduler.finish(request)
        self.sampler.forget(request.request_id)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
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
            if kv_mode is not KVMode.PERSIST:
                # The pool is copied away or dropped: pulls still writing into it count as
                # failed (their requests recompute after the resume; a late completion is
                # ignored).
                for request_id in list(self._pulling):
                    self.complete_pull(request_id, ok=False)
            if self.draft is not None and kv_mode is not KVMode.PERSIST:
                # The draft's pool is not kept: every request catches up after the resume.
                released += self.draft.release_kv()
            if kv_mode is KVMode.OFFLOAD:
                released += self.runner.offload_kv()
            elif kv_mode is KVMode.RECOMPUTE:
                # Checkpoint every in-flight request as prompt + generated tokens; the
                # cache's contents are gone, so nothing may match them any more.
                self.scheduler.preempt_all()
                self.kv.reset_prefix_cache()
                released += self.runner.free_kv()
            self._suspend_mode = kv_mode

        self._signal(Signal.SUSPEND, release)
        return released

    def resume(self) -> None:
        """Bring KV memory back (to RESUMED, a paused state: unpause to run)."""

        def restore() -> None:
            if self._suspend_mode is KVMode.OFFLOAD:
                self.runner.restore_kv()
            elif self._suspend_mode is KVMode.RECOMPUTE:
                self.runner.allocate_kv()
            if self.draft is not None:
                self.draft.restore_kv()
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
            if draft is not None and self.draft is None:
                method = "off" if self.proposer is None else self.config.speculative.method
                raise ValueError(
                    f"refit draft={str(draft)!r}: this engine has no draft model "
                    f"(speculative decoding: {method}); give draft only to an engine "
                    "started with speculative method draft, or leave it out")
            dtype = str(self.runner.dtype).removeprefix("torch.")
            config, tensors = load_checkpoint(checkpoint, dtype, reference=self.model_config)
            heads = take_mtp_heads(config, tensors)
            if isinstance(self.proposer, MtpProposer):
                try:
                    check_mtp_heads(self.proposer.config, heads, str(checkpoint))
                except ValueError as exc:
                    raise CheckpointError(f"refit refused, the old weights keep serving: "
                                          f"{exc}") from None
            draft_checkpoint = None
            if draft is not None:
                assert self.draft is not None
                draft_checkpoint = load_draft_checkpoint(
                    draft, checkpoint, config, self.tokenizer, dtype,
                    reference=self.draft.model_config)
            self.runner.load_weights(tensors, low_memory=request.low_memory)
            if draft_checkpoint is not None:
                assert self.draft is not None
                self.draft.load_weights(draft_checkpoint)
            if isinstance(self.proposer, MtpProposer):
                heads = self._heads_on_device(heads)
                assert heads is not None
                self.proposer.load_heads(heads)
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
