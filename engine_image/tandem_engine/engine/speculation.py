"""Speculative decoding around the engine's step: who proposes, how a step verifies.

`engine/speculative.py` holds the proposers and the acceptance rule; this module is how
`LLMEngine` uses them. Before the schedule every running decode gets its proposals
(`propose`: a handed-over request the prefill engine's, the rest the proposer's, none past
its max_tokens or the context). The sampling draws one row per position of a request's
draft (`sample`), `emit` takes the longest agreeing prefix (rewinding a seeded request's
generator past the rejected draws), counts it and appends its tokens, and the mtp heads
remember each going request's hidden row (`after_step`). The lifecycle reaches the draft
model's pool (`release_kv`, `restore_kv`) and a refit swaps the draft's weights and the
mtp heads with the served ones (`prepare_refit`). With speculative decoding off, the
proposer is None and every step samples one row per request.

Not thread-safe by itself: `LLMEngine` calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tandem_engine.config import EngineConfig
from tandem_engine.core.request import FinishReason, Request
from tandem_engine.engine.draft_model import DraftCheckpoint, DraftModelProposer
from tandem_engine.engine.draft_model import load_draft_checkpoint as _load_draft
from tandem_engine.engine.grammars import Grammars
from tandem_engine.engine.handoff_ledger import HandoffLedger
from tandem_engine.engine.output_processor import OutputProcessor
from tandem_engine.engine.speculative import (
    DraftedHistory,
    MtpProposer,
    SpecDecodeCounters,
    accepted_length,
    check_mtp_heads,
    make_proposer,
)
from tandem_engine.engine.stats import SpecDecodeStats
from tandem_engine.engine.step_guard import sample_contained
from tandem_engine.errors import CheckpointError
from tandem_engine.model.mtp import MtpHeads, take_mtp_heads
from tandem_engine.model.runner import ModelRunner, StepBatch
from tandem_engine.model.sampler import Sampler, SampleResult, TokenHistory
from tandem_engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tandem_engine.engine.draft_model import ModelConfig


class Speculation:
    def __init__(self, engine_config: EngineConfig, draft: DraftCheckpoint | None,
                 mtp_heads: MtpHeads | None, num_blocks: int, max_model_len: int, dtype: str,
                 runner: ModelRunner, sampler: Sampler, outputs: OutputProcessor,
                 grammars: Grammars, *,
                 target_logits: Callable[[torch.Tensor], torch.Tensor],
                 target_embed: Callable[[torch.Tensor], torch.Tensor],
                 checkpoint: str) -> None:
        """`draft`: method draft's checkpoint, loaded before the KV pool was sized;
        `mtp_heads`: the served checkpoint's heads (moved to the `runner`'s device and
        dtype here); `target_logits` / `target_embed`: the served model's lm_head and input
        embedding (method mtp). The engine's `sampler` draws, its `outputs` append, its
        `grammars` mask what a request's structured-outputs constraint forbids."""
        self.config = engine_config.speculative
        self.max_model_len = max_model_len
        self.device, self.model_dtype = runner.device, runner.dtype
        self.sampler, self.outputs, self.grammars = sampler, outputs, grammars
        self.mask_s = 0.0  # the last `sample`'s time computing structured-outputs masks
        self.proposer = None if self.config is None else make_proposer(
            self.config, engine_config, draft, num_blocks, max_model_len, dtype,
            mtp_heads=self._on_device(mtp_heads), target_logits=target_logits,
            target_embed=target_embed, checkpoint=checkpoint)
        # The draft method's proposer again, for the lifecycle (suspend, resume, refit).
        self.draft = self.proposer if isinstance(self.proposer, DraftModelProposer) else None
        self.mtp = self.proposer if isinstance(self.proposer, MtpProposer) else None
        self.counters = SpecDecodeCounters()

    @property
    def needs_hidden(self) -> bool:
        """Whether the runner must keep each row's last hidden state (the mtp heads')."""
        return self.mtp is not None

    def snapshot(self) -> SpecDecodeStats | None:
        return None if self.proposer is None else self.counters.snapshot()

    def _on_device(self, heads: MtpHeads | None) -> MtpHeads | None:
        return None if heads is None else heads.to(self.device, self.model_dtype)

    # ---- a step ---------------------------------------------------------------------------

    def proposal_limit(self, request: Request) -> int:
        """How many tokens may be proposed after the request's last: none past its
        max_tokens or the context (a step emits at most proposals + 1 tokens)."""
        return min(request.params.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens) - 1

    def propose(self, running: Sequence[Request], handoffs: HandoffLedger) -> None:
        """Give every running decode its proposals for this step. The proposer sees the
        step's candidates together (a draft model proposes for all of them in one batch);
        handed-over requests take the prefill engine's."""
        if self.proposer is None:
            return
        cap = self.config.disable_by_batch_size if self.config is not None else None
        if cap is not None and len(running) > cap:
            for request in running:
                request.spec_token_ids = []
            return
        carried = handoffs.use_carried_proposals(lambda request: min(
            self.proposal_limit(request),
            self.grammars.valid_prefix(request, request.carried_proposals)))
        candidates: list[Request] = []
        limits: list[int] = []
        for request in running:
            if request.request_id in carried:
                continue
            request.spec_token_ids = []
            if (request.num_tokens - request.num_computed_tokens != 1
                    or request.pin_for_handoff):
                continue
            limit = self.proposal_limit(request)
            if limit >= 1:
                candidates.append(request)
                limits.append(limit)
        if candidates:
            for request, draft in zip(candidates, self.proposer.propose(candidates, limits),
                                      strict=True):
                request.spec_token_ids = draft
        for request in running:  # a constraint's forbidden proposals are never verified
            if request.spec_token_ids:
                keep = self.grammars.valid_prefix(request, request.spec_token_ids)
                request.spec_token_ids = request.spec_token_ids[:keep]

    def sample(self, batch: StepBatch) -> tuple[SampleResult, dict[str, torch.Tensor]]:
        """One token per logits row. A request verifying a draft has one row per position,
        sampled with the history it has there (the proposals before it taken as given).
        Also returns, for seeded requests with a draft, their generators' states before."""
        ids: list[str] = []
        params = []
        banned: list[tuple[int, ...]] = []
        histories: list[TokenHistory] = []
        seeded_states: dict[str, torch.Tensor] = {}
        sampler, outputs = self.sampler, self.outputs
        for request, draft in zip(batch.requests, batch.drafts, strict=True):
            if draft:
                state = sampler.seeded_state(request.request_id, request.params)
                if state is not None:
                    seeded_states[request.request_id] = state
            for ahead in range(len(draft) + 1):
                ids.append(request.request_id)
                params.append(request.params)
                banned.append(outputs.banned_tokens(request, ahead))
                histories.append(DraftedHistory(request, draft[:ahead]) if ahead else request)
        masks, self.mask_s = self.grammars.masks(batch.requests, batch.drafts)
        result = sample_contained(sampler, batch.logits, ids, params, banned, histories,
                                  masks)
        return result, seeded_states

    def emit(self, batch: StepBatch, result: SampleResult,
             seeded_states: dict[str, torch.Tensor], epoch: int
             ) -> tuple[list[FinishReason | None], dict[str, int]]:
        """Every request of the step gets its tokens (`_emit`); then the mtp heads
        remember where the going ones are (`after_step`). Returns why each request ends
        (None: it goes on), and for requests with a draft how many proposals now count
        as computed."""
        reasons: list[FinishReason | None] = []
        accepted: dict[str, int] = {}
        last_rows: list[int] = []  # per request: the row that produced its last token
        first = 0
        for request, draft in zip(batch.requests, batch.drafts, strict=True):
            before = request.num_tokens
            reasons.append(self._emit(request, draft, first, result, accepted,
                                      seeded_states.get(request.request_id),
                                      batch.logits.shape[-1], epoch))
            last_rows.append(first + request.num_tokens - before - 1)
            first += 1 + len(draft)
        self.after_step(batch, reasons, last_rows)
        return reasons, accepted

    def _emit(self, request: Request, draft: tuple[int, ...], first: int,
              result: SampleResult, accepted: dict[str, int],
              seeded_state: torch.Tensor | None, vocab: int, epoch: int
              ) -> FinishReason | None:
        """Append the tokens a request gets this step (rows `first`...: the accepted
        proposals, then the draw at the first mismatch) until one ends it; record in
        `accepted` how many proposals now count as computed. A seeded request's generator
        takes back the draws after the first rejection (they belong to later tokens), so
        it draws what it would without speculation. Returns why it ends, if it does."""
        drawn = result.token_ids[first:first + 1 + len(draft)]
        n = 1 + accepted_length(draft, drawn)  # tokens emitted
        if seeded_state is not None and n < len(drawn):
            self.sampler.rewind(request.request_id, request.params, seeded_state, n, vocab)
        request.error = next((result.errors[r] for r in range(first, first + n)
                              if r in result.errors), None)
        if request.error is not None:
            return FinishReason.ERROR  # this request alone cannot go on
        if draft:
            assert self.proposer is not None
            self.proposer.observe(request, len(draft), n - 1)
            self.counters.record(len(draft), n - 1)
            request.num_spec_proposed += len(draft)
            request.num_spec_accepted += n - 1
        segments = request.epoch_segments
        if not segments or segments[-1][0] != epoch:
            segments.append((epoch, request.num_output_tokens))
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

    def after_step(self, batch: StepBatch, reasons: Sequence[FinishReason | None],
                   last_rows: Sequence[int]) -> None:
        """The mtp heads remember the hidden row of every request going on (it proposes
        from it next step); a handoff proposes now, and its proposals travel with it to the
        decode engine."""
        if batch.hidden is None or self.mtp is None:
            return
        requests = batch.requests
        going_on = [i for i, reason in enumerate(reasons)
                    if reason is None or reason is FinishReason.HANDOFF]
        self.mtp.remember([requests[i] for i in going_on], batch.hidden[
            torch.tensor([last_rows[i] for i in going_on], dtype=torch.long,
                         device=batch.hidden.device)])
        handoffs = [requests[i] for i in going_on if reasons[i] is FinishReason.HANDOFF]
        limits = [self.proposal_limit(request) for request in handoffs]
        for request, draft in zip(handoffs, self.mtp.propose(handoffs, limits), strict=True):
            request.carried_proposals = draft

    def forget(self, request_id: str) -> None:
        if self.proposer is not None:
            self.proposer.forget(request_id)

    # ---- the lifecycle --------------------------------------------------------------------

    def release_kv(self) -> int:
        """A suspend that moves the KV pool: the draft's pool is dropped, not kept (every
        request catches up after the resume). Returns its bytes."""
        return 0 if self.draft is None else self.draft.release_kv()

    def restore_kv(self) -> None:
        if self.draft is not None:
            self.draft.restore_kv()

    def check_refit_draft(self, draft: str | Path | None) -> None:
        """A refit may name a draft checkpoint only for an engine with a draft model."""
        if draft is not None and self.draft is None:
            method = "off" if self.config is None else self.config.method
            raise ValueError(
                f"refit draft={str(draft)!r}: this engine has no draft model "
                f"(speculative decoding: {method}); give draft only to an engine "
                "started with speculative method draft, or leave it out")

    def prepare_refit(self, served: ModelConfig, tensors: dict[str, torch.Tensor],
                      checkpoint: str | Path, draft: str | Path | None,
                      tokenizer: Tokenizer, dtype: str) -> Callable[[], None]:
        """Validate what a refit to `checkpoint` (config `served`, `tensors`) swaps here
        — its mtp heads (taken out of `tensors`), and the draft checkpoint `draft` against
        `served` — before any weight changes (CheckpointError, ValueError). Returns the swap
        itself, to call once the served weights are in."""
        heads = take_mtp_heads(served, tensors)
        if self.mtp is not None:
            try:
                check_mtp_heads(self.mtp.config, heads, str(checkpoint))
            except ValueError as exc:
                raise CheckpointError(f"refit refused, the old weights keep serving: "
                                      f"{exc}") from None
        draft_checkpoint = None
        if draft is not None:
            assert self.draft is not None
            draft_checkpoint = _load_draft(draft, checkpoint, served, tokenizer, dtype,
                                           reference=self.draft.model_config)

        def swap() -> None:
            if draft_checkpoint is not None:
                assert self.draft is not None
                self.draft.load_weights(draft_checkpoint)
            if self.mtp is not None:
                on_device = self._on_device(heads)
                assert on_device is not None
                self.mtp.load_heads(on_device)

        return swap


def speculation_inputs(engine_config: EngineConfig, model_config: ModelConfig,
                       tensors: dict[str, torch.Tensor], tokenizer: Tokenizer, dtype: str,
                       source: str | Path | None) -> tuple[MtpHeads | None,
                                                          DraftCheckpoint | None]:
    """Before the engine sizes anything: the checkpoint's multi-token-prediction heads,
    taken out of `tensors` (they are not part of the model: the mtp proposer owns them;
    a served checkpoint's heads are unused otherwise) and checked for method mtp; and
    method draft's checkpoint, validated against the served model (its weights and pool
    share the memory the KV pool is sized from)."""
    spec = engine_config.speculative
    checkpoint = str(source) if source is not None else "(tensors given)"
    heads = take_mtp_heads(model_config, tensors)
    if spec is not None and spec.method == "mtp":
        check_mtp_heads(spec, heads, checkpoint)
    draft = None
    if spec is not None and spec.method == "draft":
        assert spec.model is not None  # SpeculativeConfig.validate
        draft = _load_draft(spec.model, source or "the served model", model_config,
                            tokenizer, dtype)
    return heads, draft
