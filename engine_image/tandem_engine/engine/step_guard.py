"""Containing a step's sampling failure to the requests that caused it.

Validation (`SamplingParams`, `LLMEngine.add_request`) refuses every sampling value
the sampler is known not to honour; this is the net under it. When sampling a batch
raises, the batch is sampled again row by row from the same random state (seeded
requests draw exactly what they would have), and a row whose own parameters raise
while a plain greedy draw from the same logits does not is a culprit: it fails with
finish reason `error`, everyone else gets their token in this same step. A row that
raises even under greedy means the sampler itself is broken, not a request: the
original error propagates and counts as a step failure nobody caused (the worker
marks the engine unhealthy after a few in a row).
"""

from __future__ import annotations

import logging

import torch

from tandem_engine.model.sampler import Sampler, SampleResult, TokenHistory, TokenMasks
from tandem_engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_PLAIN = SamplingParams(max_tokens=1, temperature=0.0)


def sample_contained(sampler: Sampler, logits: torch.Tensor, request_ids: list[str],
                     params: list[SamplingParams], banned: list[tuple[int, ...]],
                     histories: list[TokenHistory] | None = None,
                     masks: TokenMasks | None = None) -> SampleResult:
    """`sampler.sample`, but a row that raises is reported in `SampleResult.errors`
    instead of failing the batch. Raises only when no request can be blamed."""
    states = sampler.checkpoint(request_ids, params)
    try:
        return sampler.sample(logits, request_ids, params, banned, histories, masks)
    except Exception as batch_error:
        sampler.restore(states)
        rows: list[SampleResult | None] = []
        errors: dict[int, str] = {}
        for row, (rid, p, b) in enumerate(zip(request_ids, params, banned, strict=True)):
            one = logits[row:row + 1]
            history = None if histories is None else histories[row:row + 1]
            try:
                rows.append(sampler.sample(one, [rid], [p], [b], history,
                                           None if masks is None else masks.row(row)))
                continue
            except Exception as exc:
                try:
                    sampler.sample(one, [rid], [_PLAIN], [()])
                except Exception:  # even a plain draw fails: the sampler's fault
                    raise batch_error from None
                errors[row] = (f"sampling this request failed ({type(exc).__name__}: {exc}); "
                               "its sampling parameters cannot be honoured")
                rows.append(None)
                log.warning("request %s failed in sampling: %s", rid, errors[row])
        if not errors:
            log.warning("a batch's sampling raised but every row alone succeeded: %r",
                        batch_error)
        return _merge(rows, errors)


def _merge(rows: list[SampleResult | None], errors: dict[int, str]) -> SampleResult:
    """One batch's result from per-row results (None: a failed row)."""
    with_logprobs = any(r is not None and r.logprobs is not None for r in rows)

    def pick(r: SampleResult | None, name: str, empty):
        value = getattr(r, name) if r is not None else None
        return value[0] if value is not None else empty

    for row, r in enumerate(rows):
        if r is not None and r.errors:
            errors[row] = r.errors[0]
    return SampleResult(
        token_ids=[pick(r, "token_ids", 0) for r in rows],
        logprobs=[pick(r, "logprobs", 0.0) for r in rows] if with_logprobs else None,
        ranks=[pick(r, "ranks", 1) for r in rows] if with_logprobs else None,
        top_ids=[pick(r, "top_ids", []) for r in rows] if with_logprobs else None,
        top_logprobs=[pick(r, "top_logprobs", []) for r in rows] if with_logprobs else None,
        errors=errors)
