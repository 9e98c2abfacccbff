"""One benchmark run: send a workload on an arrival process and collect the records.

The run's clock starts at 0 when the first request is due; every record's times are on
it. While the run lasts, a poller reads the router's `GET /v1/engines` (Tandem's router:
each engine's `weight_version`) once per `version_poll_s` and keeps each change, so a
refit during a run shows on the report's timeline. A server without that endpoint is
polled once and then left alone.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tandem_engine.bench.arrivals import Arrivals, send_offsets
from tandem_engine.bench.client import BenchClient, RequestRecord
from tandem_engine.bench.progress import Progress
from tandem_engine.bench.workloads import BenchRequest


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float
    weight_versions: list[dict] = field(default_factory=list)  # [{"t_s", "versions"}]


class _Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


async def _poll_versions(client: BenchClient, clock: _Clock, every_s: float,
                         out: list[dict]) -> None:
    last = None
    while True:
        body = await client.get_json("/v1/engines", timeout_s=max(1.0, every_s))
        if not isinstance(body, dict) or not isinstance(body.get("engines"), list):
            if not out:
                return  # not a Tandem router: nothing to follow
        else:
            versions = sorted({str(e.get("weight_version")) for e in body["engines"]
                               if isinstance(e, dict) and e.get("alive", True)})
            if versions != last:
                out.append({"t_s": round(max(0.0, clock()), 3), "versions": versions})
                last = versions
        await asyncio.sleep(every_s)


async def run(client: BenchClient, requests: list[BenchRequest], arrivals: Arrivals, *,
              seed: int = 0, progress: Progress | None = None,
              version_poll_s: float = 1.0) -> RunResult:
    progress = progress or Progress(quiet=True)
    offsets = send_offsets(arrivals, len(requests), seed, [r.arrival_s for r in requests])
    limit = arrivals.in_flight_limit
    slots = asyncio.Semaphore(limit) if limit else None
    records = [RequestRecord(index=i, output_len=r.output_len, model=r.model or client.model)
               for i, r in enumerate(requests)]
    clock = _Clock()
    versions: list[dict] = []
    poller = (asyncio.create_task(_poll_versions(client, clock, version_poll_s, versions))
              if version_poll_s > 0 else None)

    async def one(i: int) -> None:
        if slots is None:
            await client.complete(records[i], requests[i].prompt, clock)
        else:
            async with slots:
                await client.complete(records[i], requests[i].prompt, clock)
        progress.advance()

    progress.start(len(requests), arrivals.describe())
    try:
        if offsets is None:
            queue = iter(range(len(requests)))

            async def worker() -> None:
                for i in queue:  # a shared iterator: each index is taken once
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(min(limit or 1, len(requests)))))
        else:
            tasks = []
            for i in sorted(range(len(requests)), key=lambda i: offsets[i]):
                delay = offsets[i] - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        duration = clock()
    finally:
        progress.close()
        if poller is not None:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
    return RunResult(records, duration, versions)


async def warm_up(client: BenchClient, requests: list[BenchRequest], n: int) -> None:
    """`n` requests (the workload's first, short outputs, under their adapters) before
    measuring; not recorded."""
    if n <= 0 or not requests:
        return
    clock = _Clock()
    picked = [requests[i % len(requests)] for i in range(n)]
    await asyncio.gather(*(client.complete(RequestRecord(-1, min(r.output_len, 4), r.model),
                                           r.prompt, clock) for r in picked))
