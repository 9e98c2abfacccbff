"""When requests are sent: the arrival process of a run.

Open loop: `poisson` (exponential gaps at `rate` requests/s), `burst` (all at once) and
`trace` (each request's recorded `arrival_s`) fix every send time in advance, whatever
the server does. Closed loop: `closed` keeps `concurrency` requests in flight, sending
the next one as soon as one finishes. `max_concurrency`, when set, also caps the open-
loop kinds (a request then waits for a slot, and its TTFT counts from when it is sent).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("poisson", "closed", "burst", "trace")


class ArrivalError(ValueError):
    """Bad arrival flags: the message names the flag, the limit and the fix."""


@dataclass(frozen=True)
class Arrivals:
    kind: str
    rate: float | None = None  # poisson: requests/s
    concurrency: int | None = None  # closed: requests in flight
    max_concurrency: int | None = None  # an open-loop kind's cap on requests in flight

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ArrivalError(f"unknown arrival kind {self.kind!r}: use one of "
                               f"{', '.join(KINDS)}")
        if self.kind == "poisson" and not (self.rate and self.rate > 0):
            raise ArrivalError(f"--rate must be > 0 requests/s (got {self.rate}); for all "
                               "at once use --burst")
        if self.kind == "closed" and not (self.concurrency and self.concurrency >= 1):
            raise ArrivalError(f"--concurrency must be >= 1 (got {self.concurrency})")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ArrivalError(f"--max-concurrency must be >= 1 (got {self.max_concurrency})")

    @property
    def in_flight_limit(self) -> int | None:
        return self.concurrency if self.kind == "closed" else self.max_concurrency

    def describe(self) -> str:
        if self.kind == "poisson":
            text = f"Poisson {self.rate:g} req/s"
        elif self.kind == "closed":
            return f"closed loop, {self.concurrency} in flight"
        else:
            text = "burst (all at once)" if self.kind == "burst" else "the trace's times"
        if self.max_concurrency:
            text += f", at most {self.max_concurrency} in flight"
        return text

    def to_json(self) -> dict:
        return {"kind": self.kind, "rate": self.rate, "concurrency": self.concurrency,
                "max_concurrency": self.max_concurrency}


def send_offsets(arrivals: Arrivals, n: int, seed: int,
                 trace_times: list[float | None] | None = None) -> list[float] | None:
    """Seconds after the start at which each of `n` requests is due; None: closed loop."""
    if arrivals.kind == "closed":
        return None
    if arrivals.kind == "burst":
        return [0.0] * n
    if arrivals.kind == "trace":
        if trace_times is None or any(t is None for t in trace_times):
            raise ArrivalError("trace arrivals need a workload with arrival times: "
                               "--workload trace --trace FILE")
        return [float(t) for t in trace_times]  # type: ignore[arg-type]
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(arrivals.rate)  # type: ignore[arg-type]
    return out
