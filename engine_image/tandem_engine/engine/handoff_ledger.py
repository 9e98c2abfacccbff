"""The engine's ledger of KV handoffs: requests whose prompt KV is being pulled from a
prefill engine, and handed-over requests carrying the prefill engine's proposals.

A decode engine's handed-over request is admitted with its blocks allocated (its own
prefix-cache hits reused) and sits here, outside the scheduler, until its pull ends:
then it decodes from the pulled KV, or — a failed pull — is recomputed from its prompt
and first token (`num_fallbacks` counts those), so it still completes. Blocks a failed
pull may still be writing are quarantined, never reused, until released or their TTL.
A prefill engine's side is a pin on the handed-off prompt's blocks (`pin`).

Not thread-safe by itself: `LLMEngine` calls it under its lock, and publishes after.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tandem_engine.core.kv import KVCacheManager
from tandem_engine.core.request import Request
from tandem_engine.core.scheduler import Scheduler
from tandem_engine.engine.outputs import PullPlan
from tandem_engine.errors import RequestRejected


class HandoffLedger:
    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, *, pin_ttl_s: float,
                 quarantine_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.clock = clock  # what pin and quarantine TTLs count from
        self.scheduler = scheduler
        self.pin_ttl_s = pin_ttl_s
        self.quarantine_ttl_s = quarantine_ttl_s
        self.pulling: dict[str, Request] = {}
        # Handed-over requests with the prefill engine's proposals, until their first step.
        self.carrying: dict[str, Request] = {}
        self.num_fallbacks = 0  # handed-over requests recomputed here

    def pin(self, request: Request) -> None:
        """A prefill engine's request handed over: keep its prompt's KV for the pull."""
        request.pinned_blocks = self.kv.pin(request.request_id, self.clock() + self.pin_ttl_s)

    def plan_pull(self, request: Request, proposals: list[int]) -> PullPlan:
        """Allocate the prompt's blocks of a handed-over `request` (reusing this engine's
        prefix hits) and list what is still to pull. Raises RequestRejected, with the
        request's blocks freed, when the pool has no room now."""
        if proposals:
            request.carried_proposals = proposals
            request.carried_for = request.num_tokens
            self.carrying[request.request_id] = request
        request_id = request.request_id
        try:
            hit = self.kv.acquire_cached_prefix(request)
            n = request.num_prompt_tokens
            if not self.kv.allocate_slots(request_id, n):
                raise RequestRejected(
                    f"no room for {n} prompt tokens of KV on this engine right now")
        except RequestRejected:
            self.kv.free(request_id)
            self.carrying.pop(request_id, None)
            raise
        table = self.kv.block_table(request_id)
        first = hit // self.kv.block_size
        self.pulling[request_id] = request
        return PullPlan(request_id, list(range(first, len(table))), table[first:],
                        reused_blocks=first)

    def quarantine(self, request_id: str, block_ids: list[int]) -> int | None:
        """Before `complete` of a pull whose transfer state is unknown: keep its
        `block_ids` unused until the quarantine is released or its TTL ends. Returns the
        quarantine id; None when none is kept (no block qualified, or the request is no
        longer pulling)."""
        if request_id not in self.pulling:
            return None
        return self.kv.quarantine(request_id, block_ids, self.clock() + self.quarantine_ttl_s)

    def complete(self, request_id: str, ok: bool) -> None:
        """End a pull. ok: the request decodes from its pulled KV at once. Not ok: it is
        recomputed here from prompt + first token (it still completes)."""
        request = self.pulling.pop(request_id, None)
        if request is None:
            return  # aborted meanwhile
        if ok:
            request.num_computed_tokens = request.num_prompt_tokens
            self.kv.cache_computed_blocks(request)
        else:
            self.kv.free(request_id)
            request.num_computed_tokens = 0
            request.num_cached_blocks = 0
            self.num_fallbacks += 1
        self.scheduler.admit_pulled(request)

    def fail_all(self) -> None:
        """The pool is copied away or dropped (a suspend): every pull still writing into it
        counts as failed (its request recomputes after the resume; a late completion is
        ignored)."""
        for request_id in list(self.pulling):
            self.complete(request_id, ok=False)

    def forget(self, request_id: str) -> None:
        self.pulling.pop(request_id, None)

    def use_carried_proposals(self, limit: Callable[[Request], int]) -> set[str]:
        """Handed-over requests ready for their first decode step (KV pulled or
        recomputed, still running or admitted this step) get the proposals the prefill
        engine made, at most `limit(request)`, for exactly the tokens they have; returns
        their ids. Proposals for tokens the request no longer ends with are dropped."""
        used = set()
        for request_id, request in list(self.carrying.items()):
            if request.finished or request.carried_for != request.num_tokens:
                del self.carrying[request_id]
            elif (request_id not in self.pulling
                  and request.num_tokens - request.num_computed_tokens == 1):
                request.spec_token_ids = request.carried_proposals[:max(limit(request), 0)]
                request.carried_proposals = []
                del self.carrying[request_id]
                used.add(request_id)
        return used
