"""Continuous batching: which requests run this step, and how many tokens each.

One rule covers prefill, chunked prefill, decode and recompute after preemption: a
request has `num_tokens` tokens of which `num_computed_tokens` have KV; each step it
may compute up to the rest. When its computed count reaches its token count, the
runner samples a new token for it. Per step: decodes first, then chunks of prefills
already running, then new admissions in arrival order (FCFS), all under a token
budget (`max_num_batched_tokens`) and a request cap (`max_num_seqs`); a request whose
structured-outputs grammar is still compiling, or whose LoRA adapter waits for a device
slot, is passed over until it is ready. When the KV
cache runs out, the most recently arrived running request is preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed.

Speculative decoding: a running decode whose request carries proposals
(`Request.spec_token_ids`) gets them appended to its chunk last, after every running
request and admission had its share, as far as the budget and the free blocks left
allow: a proposal never preempts anyone and never delays a prefill or an admission.
`advance` then counts only the verified positions as computed and gives back the blocks
that hold none.

The scheduler asks the KV cache manager every memory question and never sees a tensor.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from tandem_engine.core.kv import KVCacheManager
from tandem_engine.core.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first token position computed this step
    num_tokens: int  # positions computed this step, proposals included
    block_table: list[int]
    samples: bool  # the chunk reaches the end of the request's tokens: a token is sampled
    # Speculative decoding: proposals computed after the request's last token, the chunk's
    # last len(draft) positions (not in the request's tokens). Every position of such a
    # chunk is sampled: position i verifies proposal i, the last one gives a bonus token.
    draft: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._grow_or_preempt(request, n, out):
                budget -= self._take(request, n, out)

        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if request.held:
                continue  # its grammar compiles or its adapter waits for a slot: the
                # requests behind it go first
            # A pulled request has its KV already; one that wants prompt logprobs
            # computes its whole prompt (a cached block has no logits).
            if (not self.kv.block_table(request.request_id)
                    and not request.wants_prompt_logprobs):
                request.num_computed_tokens = self.kv.acquire_cached_prefix(request)
                if request.num_cached_tokens < 0:  # the first admission's (for usage)
                    request.num_cached_tokens = min(request.num_computed_tokens,
                                                    request.num_prompt_tokens)
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + n):
                self._release(request)
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget -= self._take(request, n, out)
        # Proposals: running decodes', and a handed-over request's first decode step
        # (admitted just now with the prefill engine's proposals).
        if budget > 0 and any(c.request.spec_token_ids for c in out.chunks):
            self._add_drafts(out, budget)
        return out

    def _grow_or_preempt(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Find KV room for `n` more tokens of a running request, preempting the latest
        arrivals if needed. False when the request preempted itself."""
        scheduled = {id(c.request) for c in out.chunks}
        while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + n):
            victim = max((r for r in self.running if id(r) not in scheduled),
                         key=lambda r: r.arrival_index)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Append each scheduled decode's proposals to its chunk while the budget and the
        pool's free blocks left allow (never by preempting); return the tokens added."""
        used = 0
        for i, chunk in enumerate(out.chunks):
            request = chunk.request
            if used == budget:
                break
            if chunk.num_tokens != 1 or not chunk.samples or not request.spec_token_ids:
                continue
            room = self.kv.reachable_tokens(request.request_id) - (chunk.start + 1)
            draft = tuple(request.spec_token_ids[:min(budget - used, room)])
            if not draft:
                continue
            grown = self.kv.allocate_slots(request.request_id, chunk.start + 1 + len(draft))
            assert grown, "reachable_tokens promised the room"
            out.chunks[i] = dataclasses.replace(
                chunk, num_tokens=1 + len(draft), draft=draft,
                block_table=self.kv.block_table(request.request_id))
            out.num_decode_tokens += len(draft)
            used += len(draft)
        return used

    def _take(self, request: Request, n: int, out: SchedulerOutput) -> int:
        samples = request.num_computed_tokens + n == request.num_tokens
        chunk = ScheduledChunk(request, request.num_computed_tokens, n,
                               self.kv.block_table(request.request_id), samples)
        out.chunks.append(chunk)
        if n == 1 and samples and request.num_output_tokens > 0:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += n
        return n

    def _release(self, request: Request) -> None:
        """Drop a request's KV (and any proposals): it will be recomputed (or re-matched)
        on admission."""
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0
        request.spec_token_ids = []

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def preempt_all(self) -> list[Request]:
        """Checkpoint every running request (prompt + generated tokens) back to the queue,
        in arrival order ahead of the requests that never ran. Frees all their blocks."""
        victims = sorted(self.running, key=lambda r: r.arrival_index, reverse=True)
        for request in victims:
            self._preempt(request)
        return victims[::-1]

    def admit_pulled(self, request: Request) -> None:
        """A request whose prompt KV arrived from another engine: first in line, straight
        into decode on its next schedule."""
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def advance(self, scheduled: SchedulerOutput,
                accepted: Mapping[str, int] | None = None) -> None:
        """After a forward pass (and after the sampled tokens were appended): the chunks'
        tokens now have KV; full blocks become matchable by later requests. A chunk with
        a draft counts only its last token and its `accepted[request id]` leading
        proposals (0 when absent): the positions after them hold KV of tokens that were
        not accepted, so they are not computed, and blocks holding only such positions go
        back to the pool (none of them was ever cached)."""
        for chunk in scheduled.chunks:
            request = chunk.request
            if chunk.draft:
                request.num_computed_tokens += 1 + (accepted or {}).get(request.request_id, 0)
                self.kv.truncate(request.request_id, request.num_computed_tokens)
            else:
                request.num_computed_tokens += chunk.num_tokens
            self.kv.cache_computed_blocks(request)

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request wherever it is and free its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
