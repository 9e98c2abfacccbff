"""From per-request records to the numbers a report shows: latencies, throughput, goodput.

Definitions (all per request, from the client's clock):
* TTFT: send -> first chunk with text. E2E: send -> end of stream.
* ITL: the gaps between consecutive text chunks (every gap of every request counts).
* TPOT: (E2E - TTFT) / (completion_tokens - 1), for requests with at least 2 tokens.
* Throughput: completed requests, and the server-reported prompt and completion tokens
  of completed requests, divided by the run's duration (its start -> last completion).
* Goodput: completed requests per second that meet every SLO given; the ITL SLO applies
  to a request's own p99 gap, so one stall over the limit fails the request.
* Per model (a multi-adapter workload): the same summary over each model's requests,
  divided by the run's duration, so counts and throughputs add up to the run's.
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from tandem_engine.bench.client import RequestRecord

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "itl", "tpot", "e2e")
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


class SLOError(ValueError):
    """Bad --slo syntax: the message shows the expected form."""


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, linear between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100] (got {q})")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def stats(values: Sequence[float]) -> dict | None:
    """mean, p50/p90/p99, min, max, count of `values` (None when there are none)."""
    if not values:
        return None
    out = {"count": len(values), "mean": sum(values) / len(values),
           "min": min(values), "max": max(values)}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=500ms,itl=50ms,e2e=2s` -> {"ttft": 500.0, "itl": 50.0, "e2e": 2000.0} (ms)."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\w+)\s*=\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*", part)
        if not match:
            raise SLOError(f"--slo {text!r}: cannot read {part!r}; expected KEY=VALUE[unit] "
                           f"pairs separated by commas, KEY one of {', '.join(SLO_KEYS)}, "
                           "unit us, ms (default) or s, e.g. --slo ttft=500ms,itl=50ms")
        key, value, unit = match.group(1).lower(), float(match.group(2)), match.group(3)
        if key not in SLO_KEYS:
            raise SLOError(f"--slo: unknown key {key!r}: use {', '.join(SLO_KEYS)}")
        if key in out:
            raise SLOError(f"--slo: {key} given twice")
        if value <= 0:
            raise SLOError(f"--slo: {key} must be > 0 (got {value})")
        out[key] = value * _UNITS[unit or "ms"]
    return out


@dataclass(frozen=True)
class RequestMetrics:
    """One completed request's latencies, in milliseconds."""
    ttft_ms: float
    e2e_ms: float
    itl_ms: tuple[float, ...]
    tpot_ms: float | None

    @classmethod
    def of(cls, r: RequestRecord) -> RequestMetrics:
        if not r.ok or r.first_token_s is None or r.done_s is None:
            raise ValueError(f"request {r.index} did not complete: it has no latencies")
        ttft = (r.first_token_s - r.sent_s) * 1e3
        e2e = (r.done_s - r.sent_s) * 1e3
        gaps = tuple((b - a) * 1e3 for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False))
        tokens = r.completion_tokens or 0
        tpot = (e2e - ttft) / (tokens - 1) if tokens >= 2 else None
        return cls(ttft, e2e, gaps, tpot)

    def meets(self, slo: dict[str, float]) -> bool:
        own = {"ttft": self.ttft_ms, "e2e": self.e2e_ms, "tpot": self.tpot_ms,
               "itl": percentile(self.itl_ms, 99) if self.itl_ms else None}
        return all(own[k] is None or own[k] <= limit for k, limit in slo.items())


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slo: dict[str, float]) -> dict:
    """The `summary` object of the JSON report (see docs/bench.md)."""
    done = [r for r in records if r.ok]
    per = [RequestMetrics.of(r) for r in done]
    inp = sum(r.prompt_tokens or 0 for r in done)
    out = sum(r.completion_tokens or 0 for r in done)
    reported = [r.cached_tokens for r in done if r.cached_tokens is not None]
    cached = sum(reported) if reported else None
    good = sum(m.meets(slo) for m in per) if slo else None
    duration = max(duration_s, 1e-9)
    return {
        "requests": {"sent": len(records), "completed": len(done),
                     "failed": len(records) - len(done)},
        "duration_s": duration_s,
        "tokens": {"input": inp, "output": out, "cached": cached},
        "throughput": {"requests_per_s": len(done) / duration,
                       "input_tokens_per_s": inp / duration,
                       "output_tokens_per_s": out / duration,
                       "total_tokens_per_s": (inp + out) / duration},
        "latency_ms": {"ttft": stats([m.ttft_ms for m in per]),
                       "itl": stats([g for m in per for g in m.itl_ms]),
                       "tpot": stats([m.tpot_ms for m in per if m.tpot_ms is not None]),
                       "e2e": stats([m.e2e_ms for m in per])},
        "prefix_cache": {"reported": bool(reported), "cached_tokens": cached,
                         "hit_rate": cached / inp if cached is not None and inp else None},
        "goodput": None if not slo else {
            "slo_ms": dict(slo), "good_requests": good,
            "requests_per_s": good / duration,
            "fraction": good / len(records) if records else 0.0},
    }


def summarize_by_model(records: Sequence[RequestRecord], duration_s: float,
                       slo: dict[str, float]) -> dict[str, dict]:
    """`summarize` of each model's (adapter's) requests, by name in name order, each over
    the run's whole duration: every count and throughput is that model's share."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(r.model or "", []).append(r)
    return {name: summarize(group, duration_s, slo) for name, group in sorted(groups.items())}


TIMELINE_BINS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


def timeline(records: Sequence[RequestRecord], duration_s: float,
             bin_s: float | None = None) -> dict:
    """Per `bin_s` bin (default: the first of `TIMELINE_BINS_S` giving at most 60 bins):
    output tokens/s (each request's usage spread over its chunks) and requests in flight
    at the bin's middle."""
    if bin_s is None:
        bin_s = next((b for b in TIMELINE_BINS_S if duration_s / b <= 60),
                     TIMELINE_BINS_S[-1])
    bins = max(1, math.ceil(duration_s / bin_s))
    tokens = [0.0] * bins
    for r in records:
        if not r.chunk_times:
            continue
        weight = (r.completion_tokens or len(r.chunk_times)) / len(r.chunk_times)
        for t in r.chunk_times:
            tokens[min(bins - 1, int(t / bin_s))] += weight
    starts = [i * bin_s for i in range(bins)]
    running = [sum(1 for r in records if r.sent_s <= t + bin_s / 2
                   and (r.done_s if r.done_s is not None else math.inf) > t + bin_s / 2)
               for t in starts]
    return {"bin_s": bin_s, "t_s": starts, "output_tokens_per_s": [x / bin_s for x in tokens],
            "running_requests": running}


def request_rows(records: Sequence[RequestRecord]) -> list[dict]:
    """The `requests` list of the JSON report: one row per request, in index order."""
    rows = []
    for r in sorted(records, key=lambda r: r.index):
        m = RequestMetrics.of(r) if r.ok else None
        rows.append({
            "index": r.index, "model": r.model, "sent_s": r.sent_s, "ok": r.ok,
            "error": r.error, "output_len": r.output_len, "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens, "cached_tokens": r.cached_tokens,
            "finish_reason": r.finish_reason, "chunks": len(r.chunk_times),
            "ttft_ms": m.ttft_ms if m else None, "e2e_ms": m.e2e_ms if m else None,
            "tpot_ms": m.tpot_ms if m else None,
            "itl_ms": [round(g, 4) for g in m.itl_ms] if m else []})
    return rows
