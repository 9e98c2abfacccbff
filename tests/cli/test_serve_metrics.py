"""One `/metrics` for the local stack: `tandem serve`'s router also serves its engines'
series (`vllm:*` and the engines' `tandem_*`), merged into one valid exposition; a
frozen or dead engine is left out of a scrape within its deadline, never an error."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tandem_engine.cli.serve import free_port
from tandem_engine.router.metrics import ENGINE_SCRAPE_TIMEOUT, RouterMetrics, merge_families
from test_serve import start_serve, stop_serve

ENGINE_TEXT = """# HELP vllm:num_requests_running Requests in the running batch
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine_id="{e}",role="mixed"}} 1.0
# HELP vllm:prompt_tokens_total Prompt tokens
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine_id="{e}",role="mixed"}} {n}
"""


def families(text: str) -> dict[str, list]:
    """name -> samples, parsed with prometheus_client's own text parser."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def type_lines(text: str) -> Counter:
    return Counter(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE"))


def test_engines_series_merge_into_one_family_each() -> None:
    texts = [ENGINE_TEXT.format(e="engine-0", n=3), ENGINE_TEXT.format(e="engine-1", n=5),
             # Another type under a known name, a router family's name, a repeated sample.
             "# TYPE vllm:num_requests_running_total counter\n"
             "vllm:num_requests_running_total 7\n"
             "# TYPE tandem_router_requests_total counter\ntandem_router_requests_total 9\n"
             + ENGINE_TEXT.format(e="engine-1", n=5)]
    merged = merge_families(texts, reserved={"tandem_router_requests"})
    assert [(f.name, f.type) for f in merged] == [("vllm:num_requests_running", "gauge"),
                                                  ("vllm:prompt_tokens", "counter")]
    assert [(s.labels["engine_id"], s.value) for s in merged[1].samples] == [
        ("engine-0", 3.0), ("engine-1", 5.0)]


def test_a_router_scrape_leaves_out_a_frozen_engine_within_its_deadline() -> None:
    with socket.socket() as frozen:  # accepts connections, never answers
        frozen.bind(("127.0.0.1", 0))
        frozen.listen()
        urls = [f"http://127.0.0.1:{frozen.getsockname()[1]}/metrics",
                f"http://127.0.0.1:{free_port()}/metrics"]  # nothing listens: refused
        metrics = RouterMetrics(urls)
        started = time.monotonic()
        text = asyncio.run(metrics.scrape()).decode()
        assert time.monotonic() - started < ENGINE_SCRAPE_TIMEOUT + 1
    errors = {s.labels["url"]: s.value
              for s in families(text)["tandem_router_engine_metrics_scrape_errors"]
              if s.name.endswith("_total")}
    assert errors == {urls[0]: 1.0, urls[1]: 1.0}
    assert "tandem_router_requests" in families(text)
    # Without engine URLs (a router in Kubernetes) the router serves its own series only.
    own = RouterMetrics()
    assert asyncio.run(own.scrape()) == own.render()


@pytest.fixture
def stack(tiny_llama: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int, dict]]:
    port = free_port()
    proc, _ = start_serve(tmp_path, "--model", str(tiny_llama), "--engines", "2", "--port",
                          str(port), "--served-model-name", "t")
    try:
        yield proc, port, json.loads((tmp_path / f"tandem-{port}" / "stack.json").read_text())
    finally:
        stop_serve(proc)


@pytest.mark.slow
def test_serve_metrics_carry_both_engines_vllm_series(stack) -> None:
    _, port, description = stack
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    prompt_tokens = 0
    for prompt in ("Seven bridges", "A letter arrived", "The harbour at night",
                   "In the old library"):
        got = client.completions.create(model="t", prompt=prompt, max_tokens=4, temperature=0)
        prompt_tokens += got.usage.prompt_tokens

    reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert reply.status_code == 200
    text = reply.text
    assert max(type_lines(text).values()) == 1  # one TYPE per family, engines merged
    parsed = families(text)  # and it parses
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:time_to_first_token_seconds", "tandem_engine_state"):
        assert {s.labels["engine_id"] for s in parsed[name]} == {"engine-0", "engine-1"}, name
        assert {s.labels["role"] for s in parsed[name]} == {"mixed"}
    served = sum(s.value for s in parsed["vllm:prompt_tokens"] if s.name.endswith("_total"))
    assert served == prompt_tokens  # what the engines counted, seen through the router
    assert "tandem_router_requests" in parsed  # beside the router's own series

    # A frozen engine: left out of the scrape within its deadline, counted, no error.
    frozen = description["engines"][1]
    pid = description["children"][frozen["name"]]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert reply.status_code == 200 and took < ENGINE_SCRAPE_TIMEOUT + 2, took
    parsed = families(reply.text)
    assert {s.labels["engine_id"] for s in parsed["vllm:num_requests_running"]} == {"engine-0"}
    errors = {s.labels["url"]: s.value
              for s in parsed["tandem_router_engine_metrics_scrape_errors"]
              if s.name.endswith("_total")}
    assert errors[frozen["metrics_url"]] == 1.0
    assert errors[description["engines"][0]["metrics_url"]] == 0.0
