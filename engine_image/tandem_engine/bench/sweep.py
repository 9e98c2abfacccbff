"""`--sweep rate=1,2,4` / `--sweep concurrency=1,4,16`: one run per value, the same
workload each time, giving the throughput-latency curve of the report's `sweep.png`."""

from __future__ import annotations

import re
from dataclasses import replace

from tandem_engine.bench.arrivals import Arrivals

PARAMETERS = ("rate", "concurrency")
MAX_POINTS = 32


class SweepError(ValueError):
    """Bad --sweep syntax: the message shows the expected form."""


def parse_sweep(text: str) -> tuple[str, list[float]]:
    match = re.fullmatch(r"\s*(\w+)\s*=\s*(.+)", text)
    param = match.group(1) if match else None
    if param not in PARAMETERS:
        raise SweepError(f"--sweep {text!r}: expected rate=V1,V2,... or concurrency=N1,N2,... "
                         "(e.g. --sweep rate=1,2,4,8)")
    try:
        values = [float(v) for v in match.group(2).split(",")]  # type: ignore[union-attr]
    except ValueError as exc:
        raise SweepError(f"--sweep {text!r}: values must be numbers separated by commas"
                         ) from exc
    if not 1 <= len(values) <= MAX_POINTS:
        raise SweepError(f"--sweep: 1 to {MAX_POINTS} values (got {len(values)})")
    if any(v <= 0 for v in values):
        raise SweepError(f"--sweep {param}: every value must be > 0")
    if param == "concurrency" and any(v != int(v) for v in values):
        raise SweepError("--sweep concurrency: values must be whole numbers")
    return param, values


def sweep_points(param: str, values: list[float], base: Arrivals
                 ) -> list[tuple[dict, Arrivals]]:
    """(point, arrivals) per value: rate -> Poisson at it (keeping --max-concurrency);
    concurrency -> a closed loop of that many."""
    out = []
    for v in values:
        if param == "rate":
            arrivals = Arrivals("poisson", rate=v, max_concurrency=base.max_concurrency)
        else:
            arrivals = replace(base, kind="closed", rate=None, concurrency=int(v),
                               max_concurrency=None)
        out.append(({param: v if param == "rate" else int(v)}, arrivals))
    return out
