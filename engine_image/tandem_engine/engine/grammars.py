"""Structured outputs inside the engine: compiled constraints, one matcher per request,
and the token masks the sampler applies.

A request with `SamplingParams.structured_outputs` is held out of scheduling
(`Request.grammar_pending`) until its constraint is compiled. Compiles run on a
background thread (llguidance drops the GIL while it builds), once per distinct
constraint: an LRU cache of `EngineConfig.structured_outputs_cache_size` compiled
matchers, each request getting a copy. So a request waits only for its own grammar, and
a schema seen before costs a copy.

A request's matcher is always derived from its tokens: created from the compiled one
and advanced over every output token the request already has (tokens resumed from
another engine: the first token of a disaggregated handoff, a failover's), then over
each token as it is appended (`advance`). Preemption and chunked prefill do not touch
output tokens, so the matcher stays where it is. Speculative proposals are cut at the
first token the constraint forbids before they are verified (`valid_prefix`); a step
that verifies a draft needs one mask per position, each computed with the matcher
advanced over the proposals before it and rolled back after (`masks`). Once the
constraint is complete and admits no further token (`complete`), the request ends with
reason stop, as at an EOS.

Masks are int32 bitmaps (one bit per vocabulary id) filled on the host by the library
and applied on the logits' device (`model.sampler.apply_token_masks`). The time spent
computing them is returned with them, so the step timings show it.

Not thread-safe by itself: `LLMEngine` calls it under its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from tandem_engine.core.request import Request
from tandem_engine.model.sampler import TokenMasks
from tandem_engine.structured_outputs import (
    StructuredOutputsParams,
    grammar_text,
    ll_tokenizer,
    parser_limits,
)
from tandem_engine.tokenizer import Tokenizer


class GrammarError(Exception):
    """A request's constraint cannot be used (it does not compile here, or the tokens it
    already has violate it); the message says which."""


class Grammars:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int) -> None:
        """`vocab_size`: the logits' width (a mask has one bit per logit)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._ll_tokenizer: Any = None  # built on first use (~0.2 s)
        self._compiler: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[StructuredOutputsParams, Future[Any]] = OrderedDict()
        self._pending: dict[str, tuple[Request, Future[Any]]] = {}
        self._matchers: dict[str, Any] = {}
        self._executor: Any = None  # llguidance's pool for masks of many rows at once

    # ---- admission ----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Start (or reuse) the compile of the request's constraint; it is not scheduled
        until `poll` finds it done."""
        spec = request.params.structured_outputs
        if spec is None:
            return
        request.grammar_pending = True
        self._pending[request.request_id] = (request, self._compile(spec))

    def _compile(self, spec: StructuredOutputsParams) -> Future[Any]:
        future = self._compiled.get(spec)
        if future is not None:
            self._compiled.move_to_end(spec)
            return future
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        future = self._compiler.submit(self._build, spec)
        self._compiled[spec] = future
        while len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)  # requests holding it keep their copy
        return future

    def _build(self, spec: StructuredOutputsParams) -> Any:
        """The compiled matcher of `spec` (on the compile thread)."""
        import llguidance

        if self._ll_tokenizer is None:
            self._ll_tokenizer = ll_tokenizer(self._tokenizer, self.vocab_size)
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar_text(spec),
                                       limits=parser_limits(), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"structured_outputs.{spec.kind} does not compile: "
                               f"{matcher.get_error()}")
        return matcher

    def poll(self) -> list[tuple[Request, str]]:
        """Give every request whose compile finished its matcher (advanced over the output
        tokens it already has) and make it schedulable. Returns the requests that cannot
        go on, with why."""
        failed: list[tuple[Request, str]] = []
        for request_id, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            request.grammar_pending = False
            try:
                matcher = future.result().deep_copy()
                output = request.output_token_ids
                if output and not matcher.consume_tokens(output):
                    raise GrammarError("the tokens already generated for this request "
                                       "violate its structured_outputs constraint: "
                                       f"{matcher.get_error()}")
            except Exception as exc:  # the compile's error, or the library's own
                if self._compiled.get(request.params.structured_outputs) is future:
                    del self._compiled[request.params.structured_outputs]  # not cached
                failed.append((request, str(exc)))
                continue
            self._matchers[request_id] = matcher
        return failed

    @property
    def waiting(self) -> bool:
        """Some request waits for its compile."""
        return bool(self._pending)

    def wait(self, timeout: float) -> None:
        """Block until a pending compile finishes (or `timeout` seconds): an engine with
        nothing else to run waits here instead of spinning."""
        futures = {future for _, future in self._pending.values()}
        if futures:
            wait(futures, timeout, return_when=FIRST_COMPLETED)

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)

    # ---- a step -------------------------------------------------------------------------------

    def constrained(self, request: Request) -> bool:
        return request.request_id in self._matchers

    def valid_prefix(self, request: Request, draft: Sequence[int]) -> int:
        """How many leading proposals the constraint allows (all without one; none while
        it compiles)."""
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            return len(draft) if request.params.structured_outputs is None else 0
        return matcher.validate_tokens(list(draft)) if draft else 0

    def masks(self, requests: Sequence[Request], drafts: Sequence[Sequence[int]]
              ) -> tuple[TokenMasks | None, float]:
        """The masks of a step's constrained rows, and the seconds computing them took:
        request i has 1 + len(drafts[i]) logits rows, row j sampled after its first j
        proposals (which the constraint allows: `valid_prefix` cut them)."""
        plain: list[tuple[Any, int]] = []  # (matcher, mask row): rows with no proposals
        drafted: list[tuple[Any, int, list[int]]] = []  # (matcher, first mask row, draft)
        rows: list[int] = []  # each mask row's logits row
        first = 0
        for request, draft in zip(requests, drafts, strict=True):
            matcher = self._matchers.get(request.request_id)
            if matcher is not None:
                if draft:
                    drafted.append((matcher, len(rows), list(draft)))
                else:
                    plain.append((matcher, len(rows)))
                rows += range(first, first + len(draft) + 1)
            first += 1 + len(draft)
        if not rows:
            return None, 0.0
        import llguidance.torch as llt

        start = time.perf_counter()
        bitmask = llt.allocate_token_bitmask(len(rows), self.vocab_size)
        if plain:
            self._fill_parallel(bitmask, plain)
        for matcher, row, draft in drafted:
            # Each position's mask with the matcher past the proposals before it, then
            # back to where the request's tokens end.
            llt.fill_next_token_bitmask(matcher, bitmask, row)
            for ahead, token in enumerate(draft, start=1):
                if not matcher.consume_token(token):
                    raise AssertionError("valid_prefix lets only allowed proposals through")
                llt.fill_next_token_bitmask(matcher, bitmask, row + ahead)
            matcher.rollback(len(draft))
        return TokenMasks(bitmask, rows), time.perf_counter() - start

    def _fill_parallel(self, bitmask: torch.Tensor, targets: list[tuple[Any, int]]) -> None:
        import llguidance
        import llguidance.torch as llt

        if len(targets) == 1:
            llt.fill_next_token_bitmask(targets[0][0], bitmask, targets[0][1])
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=max(
                1, min(4, torch.get_num_threads())))
        llt.fill_next_token_bitmask_par(self._executor, targets, bitmask)

    def advance(self, request: Request, token: int) -> str | None:
        """The request's matcher takes its new token; None, or why it cannot (a token the
        constraint forbids: the mask makes this a bug, not a user error)."""
        matcher = self._matchers.get(request.request_id)
        if matcher is None or matcher.consume_token(token):
            return None
        return (f"token {token} violates this request's structured_outputs constraint: "
                f"{matcher.get_error()}")

    def complete(self, request: Request) -> bool:
        """The constraint is satisfied and admits no further token: the request ends."""
        matcher = self._matchers.get(request.request_id)
        return matcher is not None and matcher.is_stopped()

