"""The autoscaling planner's Prometheus source (`tandem-operator --prometheus-url`): the
same signals as the pods' own /metrics, as PromQL over a real Prometheus (Debian's, as the
dashboard test runs it) scraping a real local stack (`tandem serve --demo --prefill 1
--decode 1`) whose series carry the `namespace` and `pool` labels a PodMonitor gives a
pool's pods."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import openai
import pytest
from tandem_operator.autoscaler import PoolState, PrometheusReader
from tandem_operator.spec import PoolSpec
from test_dashboard_prometheus import (  # noqa: F401  (fixtures)
    MODEL,
    Prometheus,
    host_port,
    serve,
    wait_serving_stack,
)

pytestmark = pytest.mark.slow

def pool(name: str) -> PoolSpec:
    return PoolSpec.from_body({
        "metadata": {"name": name, "namespace": "serving", "uid": "u", "generation": 1},
        "spec": {"model": {"name": MODEL, "weights": {"uri": "file:///w", "version": "v1"}},
                 "autoscaling": {"slo": {"ttftSeconds": "1", "itlSeconds": "0.1"},
                                 "windowSeconds": 60}}})


def test_the_prometheus_source_reads_the_pools_signals(
        serve: tuple[subprocess.Popen, int, Path], tmp_path: Path) -> None:  # noqa: F811
    proc, port, folder = serve
    stack = wait_serving_stack(proc, port, folder)
    prometheus = Prometheus(tmp_path, {
        "engine": [host_port(e["metrics_url"]) for e in stack["engines"]],
        "router": [f"127.0.0.1:{port}"]}, labels={"namespace": "serving", "pool": "demo"})
    try:
        prometheus.wait_all_up()
        prometheus.wait_scrapes(1)  # every counter has a sample from before the load
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=60)
        for i in range(6):
            stream = client.completions.create(
                model=MODEL, prompt=f"Request {i}: the river ran past the mill", max_tokens=16,
                stream=True, extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in stream if c.choices)
        prometheus.wait_scrapes(3)

        async def read(name: str):  # type: ignore[no-untyped-def]
            reader = PrometheusReader(prometheus.url)
            try:
                return await reader.read(PoolState(started=0.0), pool(name), [], 0.0)
            finally:
                await reader.close()

        signals = asyncio.run(read("demo"))
        assert signals is not None
        assert signals.latency_source == "prometheus"
        assert signals.ttft_seconds is not None and 0 < signals.ttft_seconds < 30
        assert signals.itl_seconds is not None and 0 < signals.itl_seconds < 10
        # scraped twice (the stack's router carries its engines' series as well), each
        # engine still counts once
        assert signals.prefill.engines == 1 and signals.decode.engines == 1
        assert signals.decode.tokens_per_second > 0  # 6 x 16 tokens over the window
        assert signals.prefill.tokens_per_second > 0
        assert 0 <= signals.decode.kv_usage <= 1 and signals.decode.queue_depth == 0
        # another pool's name selects nothing: no latency, no engines
        empty = asyncio.run(read("other"))
        assert empty is not None and empty.ttft_seconds is None
        assert empty.decode.engines == 0 and empty.latency_source == ""
    finally:
        prometheus.stop()
        print(f"---- prometheus (tail) ----\n{prometheus.log.read_text()[-3000:]}")

