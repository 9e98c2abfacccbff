"""Continuous batching: which requests run this step, and how many tokens each.

One rule covers prefill, chunked prefill, decode and recompute after preemption: a
request has `num_tokens` tokens of which `num_computed_tokens` have KV; each step it
may compute up to the rest. When its computed count reaches its token count, the
runner samples a new token for it. Per step: decodes first, then chunks of prefills
already running, then new admissions, all under a token budget
(`max_num_batched_tokens`) and a request cap (`max_num_seqs`); a request whose
structured-outputs grammar is still compiling, or whose LoRA adapter waits for a device
slot, is passed over until it is ready.

Priority (vLLM's): every request has an integer `priority`, lower first, 0 by default.
`queue_order` = (priority, arrival) ranks requests everywhere: running requests get the
budget and KV in that order, waiting ones are admitted in it (handed-over requests
first), and nobody overtakes the head of the queue when it cannot run. Preemption is by
recompute: the victim's blocks are freed, any chunk it had this step is taken back, and
it returns to its place in the queue. When the KV cache runs out for a running request,
the running request last in queue order (the worst priority, then the latest arrival)
is preempted. When the head of the queue finds no seat or no KV room, running requests
of a strictly worse priority are preempted for it, worst first, as many as it needs and
none when all of them together would not make room; equal priorities never preempt each
other, so with every priority equal this is first come, first served.

Reserved seats (`seat_reserve_s`): when a request finishes (stop or length) while others
keep running and requests of a strictly worse priority wait, its seat stays free for up
to `seat_reserve_s` for a request of its priority or better. A client that sends one
request at a time (a light tenant, whose requests the router tags ahead) then finds its
seat free on its next request, rather than a worse-priority request that took the seat
in the meantime and whose prefill runs while it arrives (and is then preempted for it,
its prefill wasted). This is the idling of fair disk schedulers (BFQ, CFQ's slice_idle)
for a synchronous client, made cheap: the engine never idles for a reservation (every
reservation lapses once nothing runs), and the other running requests step meanwhile.

Speculative decoding: a running decode whose request carries proposals
(`Request.spec_token_ids`) gets them appended to its chunk last, after every running
request and admission had its share, as far as the budget and the free blocks left
allow: a proposal never preempts anyone and never delays a prefill or an admission.
`advance` then counts only the verified positions as computed and gives back the blocks
that hold none.

The scheduler asks the KV cache manager every memory question and never sees a tensor.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Mapping
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


def queue_order(request: Request) -> tuple[int, int]:
    """The rank of a request among others: the lower priority first, then the earlier
    arrival. Waiting requests are admitted in this order; running ones are preempted in
    its reverse."""
    return request.priority, request.arrival_index


class WaitingQueue:
    """The requests waiting for a seat, in the order the scheduler offers them one:
    handed-over requests first (their prompt was computed on another engine and their
    client waits for the next token), then every other request in `queue_order`. A
    preempted request goes back to its place in that order."""

    def __init__(self) -> None:
        self._handed_over: list[Request] = []
        self._queued: list[Request] = []

    def __len__(self) -> int:
        return len(self._handed_over) + len(self._queued)

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain(self._handed_over, self._queued)

    def __contains__(self, request: object) -> bool:
        return isinstance(request, Request) and self._find(request) is not None

    def push(self, request: Request) -> None:
        bisect.insort(self._queued, request, key=queue_order)

    def worst_priority(self) -> int | None:
        """The largest priority waiting (None when nobody waits): each part is sorted."""
        last = [part[-1].priority for part in (self._handed_over, self._queued) if part]
        return max(last, default=None)

    def push_handed_over(self, request: Request) -> None:
        bisect.insort(self._handed_over, request, key=queue_order)

    def remove(self, request: Request) -> None:
        """Take `request` out (ValueError if it is not waiting)."""
        found = self._find(request)
        if found is None:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        part, i = found
        del part[i]

    def _find(self, request: Request) -> tuple[list[Request], int] | None:
        """Where `request` is (by identity), found by its rank."""
        key = queue_order(request)
        for part in (self._handed_over, self._queued):
            i = bisect.bisect_left(part, key, key=queue_order)
            while i < len(part) and queue_order(part[i]) == key:
                if part[i] is request:
                    return part, i
                i += 1
        return None


@dataclass(frozen=True)
class SeatReservation:
    """A free seat kept until `until` (the scheduler's clock) for a request of `priority`
    or better."""

    priority: int
    until: float


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 seat_reserve_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.seat_reserve_s = seat_reserve_s
        self.clock = clock
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.reserved: list[SeatReservation] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.push(request)

    def schedule(self) -> SchedulerOutput:
        self._lapse_reservations()
        out = SchedulerOutput()
        running = sorted(self.running, key=queue_order)
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            budget = self._budget_left(out)
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._grow_or_preempt(request, n, out):
                self._take(request, n, out)

        admitted: list[Request] = []
        for request in list(self.waiting):
            if self._budget_left(out) <= 0:
                break
            if request.held:
                continue  # its grammar compiles or its adapter waits for a slot: the
                # requests behind it go first
            if not self._admit(request, out, admitted):
                break  # nobody overtakes the head of the queue
            admitted.append(request)
        # Proposals: running decodes', and a handed-over request's first decode step
        # (admitted just now with the prefill engine's proposals).
        budget = self._budget_left(out)
        if budget > 0 and any(c.request.spec_token_ids for c in out.chunks):
            self._add_drafts(out, budget)
        return out

    def _budget_left(self, out: SchedulerOutput) -> int:
        """Tokens the step may still schedule (before proposals)."""
        return self.max_num_batched_tokens - out.num_prefill_tokens - out.num_decode_tokens

    def _admit(self, request: Request, out: SchedulerOutput,
               admitted: list[Request]) -> bool:
        """Move the waiting `request` into the running batch with a chunk of the budget.
        Without a free seat or KV room, running requests of a strictly worse priority are
        preempted for it, worst first: as many as it needs, and none when all of them
        together would not make room (nor one `admitted` this step: a handed-over request
        goes first, and keeps its place). False when it cannot run this step (it holds no
        new blocks then)."""
        worse: list[Request] | None = None
        # Seats reserved for better priorities than this request's are not free for it;
        # one reserved for its priority or worse is its own (the least strict one).
        barred = sum(1 for r in self.reserved if r.priority < request.priority)
        seats_needed = max(len(self.running) + barred + 1 - self.max_num_seqs, 0)
        if seats_needed:
            worse = self._worse_running(request, admitted)
            if seats_needed > len(worse):
                return False
        # A pulled request has its KV already; one that wants prompt logprobs computes
        # its whole prompt (a cached block has no logits).
        if (not self.kv.block_table(request.request_id)
                and not request.wants_prompt_logprobs):
            request.num_computed_tokens = self.kv.acquire_cached_prefix(request)
            if request.num_cached_tokens < 0:  # the first admission's (for usage)
                request.num_cached_tokens = min(request.num_computed_tokens,
                                                request.num_prompt_tokens)
        n = min(request.num_tokens - request.num_computed_tokens, self._budget_left(out))
        wanted = request.num_computed_tokens + n
        room = self.kv.reachable_tokens(request.request_id)
        if room < wanted:
            if worse is None:
                worse = self._worse_running(request, admitted)
            # At most what the victims hold (blocks they share with others stay taken).
            room += self.kv.block_size * sum(len(self.kv.block_table(r.request_id))
                                             for r in worse)
            if room < wanted:
                self._release(request)
                return False
        victims = iter(worse or ())
        for victim in itertools.islice(victims, seats_needed):
            self._preempt_scheduled(victim, out)
        while not self.kv.allocate_slots(request.request_id, wanted):
            victim = next(victims, None)
            if victim is None:  # the victims' blocks were shared: no room after all
                self._release(request)
                return False
            self._preempt_scheduled(victim, out)
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._take(request, n, out)
        mine = [r for r in self.reserved if r.priority >= request.priority]
        if mine:
            self.reserved.remove(max(mine, key=lambda r: r.priority))
        return True

    def _lapse_reservations(self) -> None:
        """Drop the reservations past their time, all of them once nothing runs (the
        engine never idles for one), and the least strict beyond the free seats (a
        preemption-free admission may have taken a seat one counted on)."""
        now = self.clock()
        kept = [r for r in self.reserved if r.until > now] if self.running else []
        free = max(self.max_num_seqs - len(self.running), 0)
        self.reserved = sorted(kept, key=lambda r: r.priority)[:free]

    def _worse_running(self, request: Request, spared: list[Request]) -> list[Request]:
        """The running requests of a strictly worse (larger) priority than `request`'s,
        but for the `spared` ones, last in queue order first: whom it may preempt."""
        spared_ids = {id(r) for r in spared}
        return sorted((r for r in self.running
                       if r.priority > request.priority and id(r) not in spared_ids),
                      key=queue_order, reverse=True)

    def _grow_or_preempt(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Find KV room for `n` more tokens of a running request, preempting the running
        requests last in queue order (the worst priority, then the latest arrival) until
        it fits. False when the request itself was preempted."""
        while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + n):
            victim = max(self.running, key=queue_order)
            self._preempt_scheduled(victim, out)
            if victim is request:
                return False
        return True

    def _preempt_scheduled(self, request: Request, out: SchedulerOutput) -> None:
        """Preempt a running request during a schedule: its chunk of this step (if it
        got one already) is taken back, and the step lists it as preempted."""
        for i, chunk in enumerate(out.chunks):
            if chunk.request is request:
                del out.chunks[i]
                if _counts_as_decode(chunk):
                    out.num_decode_tokens -= chunk.num_tokens
                else:
                    out.num_prefill_tokens -= chunk.num_tokens
                break
        self._preempt(request)
        out.preempted.append(request)

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

    def _take(self, request: Request, n: int, out: SchedulerOutput) -> None:
        samples = request.num_computed_tokens + n == request.num_tokens
        chunk = ScheduledChunk(request, request.num_computed_tokens, n,
                               self.kv.block_table(request.request_id), samples)
        out.chunks.append(chunk)
        if _counts_as_decode(chunk):
            out.num_decode_tokens += n
        else:
            out.num_prefill_tokens += n

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
        self.waiting.push(request)

    def preempt_all(self) -> list[Request]:
        """Checkpoint every running request (prompt + generated tokens) back to the queue,
        each to its place in queue order; returns them in that order. Frees all their
        blocks."""
        victims = sorted(self.running, key=queue_order)
        for request in victims:
            self._preempt(request)
        return victims

    def admit_pulled(self, request: Request) -> None:
        """A handed-over request (its prompt KV arrived from another engine, or failed to
        and is recomputed here): ahead of every request that was not handed over,
        straight into decode on its next schedule."""
        request.status = RequestStatus.WAITING
        self.waiting.push_handed_over(request)

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

    def finish(self, request: Request, reserve_seat: bool = False) -> None:
        """Remove a finished or aborted request wherever it is and free its blocks. With
        `reserve_seat` (it completed: its client may come back at once), a running
        request's seat is reserved for its priority while others run and requests of a
        worse priority wait (`seat_reserve_s`; none when 0)."""
        was_running = request.status is RequestStatus.RUNNING
        if was_running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        worst = self.waiting.worst_priority()
        if (reserve_seat and was_running and self.seat_reserve_s > 0 and self.running
                and worst is not None and worst > request.priority):
            self.reserved.append(SeatReservation(request.priority,
                                                 self.clock() + self.seat_reserve_s))


def _counts_as_decode(chunk: ScheduledChunk) -> bool:
    """A chunk of one token that samples the token after an output token (before
    proposals are added): a decode. Anything else computes prompt (or recomputes)."""
    return (chunk.num_tokens == 1 and chunk.samples
            and chunk.request.num_output_tokens > 0)
