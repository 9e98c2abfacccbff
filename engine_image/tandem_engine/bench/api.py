"""`tandem bench` as a library, for scripts that start their own stack and then measure
it (benchmarks/serving.py, benchmarks/disagg_serving.py): the same load generator and
numbers as the command, one call per run."""

from __future__ import annotations

import asyncio

from tandem_engine.bench import runner
from tandem_engine.bench.arrivals import Arrivals
from tandem_engine.bench.client import BenchClient
from tandem_engine.bench.report import run_entry
from tandem_engine.bench.workloads import BenchRequest, TextSource


def text_source(base_url: str, model: str, api_key: str | None = None) -> TextSource:
    """Text sized for this server's tokenizer (its /tokenize; 1 token per word without)."""

    async def measure_ratio() -> float | None:
        client = BenchClient(base_url, model, api_key=api_key)
        try:
            return await client.tokens_per_word(TextSource.sample_text())
        finally:
            await client.aclose()

    return TextSource(asyncio.run(measure_ratio()) or 1.0)


def measure(base_url: str, model: str, requests: list[BenchRequest], arrivals: Arrivals, *,
            slo: dict[str, float] | None = None, warmup: int = 0, seed: int = 0,
            api_key: str | None = None, connect_deadline_s: float = 30.0) -> dict:
    """Run `requests` against the server; returns the report's run entry (`point`
    None): `summary`, `by_model` (requests naming adapters: `workloads.assign_models`),
    `timeline`, `weight_versions`, `requests` (docs/bench.md)."""

    async def go() -> dict:
        client = BenchClient(base_url, model, api_key=api_key)
        try:
            await client.probe(connect_deadline_s)
            await runner.warm_up(client, requests, warmup)
            result = await runner.run(client, requests, arrivals, seed=seed)
        finally:
            await client.aclose()
        return run_entry(result, arrivals, slo or {}, None,
                         by_model=any(r.model is not None for r in requests))

    return asyncio.run(go())
