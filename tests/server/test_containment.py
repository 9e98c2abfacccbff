"""Failure containment: bad sampling values are refused at the edge and at admission; a
request whose sampling still fails ends alone with finish reason `error` while its batch
goes on; steps that keep failing with nobody to blame make the engine unhealthy."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from reference import random_prompts
from tandem_engine import LLM, SamplingParams
from tandem_engine import protocol as p
from tandem_engine.errors import RequestRejected
from tandem_engine.router.api_params import InvalidRequest, engine_sampling, parse_completion
from tandem_engine.router.attempts import Attempt, Progress, RequestFailed, colocated
from tandem_engine.router.openai_api import _failure_body
from tandem_engine.server.admin import build_admin_app
from tandem_engine.server.control import EngineControl
from tandem_engine.server.worker import UNHEALTHY_AFTER_STEP_FAILURES, EngineWorker

# ---- refused up front ---------------------------------------------------------------------


def test_sampling_values_the_sampler_cannot_honour_are_refused_at_the_edge() -> None:
    with pytest.raises(RequestRejected, match=r"top_p=1e-46 is invalid: must be in \[1e-08"):
        SamplingParams(top_p=1e-46)
    with pytest.raises(RequestRejected, match="stop_token_ids=-1"):
        SamplingParams(stop_token_ids=[-1])
    with pytest.raises(RequestRejected, match="stop_token_ids=4294967296"):
        SamplingParams(stop_token_ids=[2**32])
    # A temperature under the floor is greedy (the documented choice), not an overflow.
    assert SamplingParams(temperature=1e-39).greedy
    assert SamplingParams(temperature=1e-5).greedy is False
    # The router's edge names the parameter.
    options = parse_completion({"model": "m", "prompt": "x", "top_p": 1e-46}).options
    with pytest.raises(InvalidRequest, match="top_p") as info:
        engine_sampling(options, 4, 0)
    assert info.value.param == "top_p"


def test_stop_token_ids_outside_the_vocabulary_are_refused_at_admission(
        tiny_llama: Path) -> None:
    llm = LLM(tiny_llama)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(RequestRejected,
                       match=rf"stop_token_ids={vocab} is invalid: token id {vocab} is "
                             rf"outside the model's vocabulary \[0, {vocab}\)"):
        llm.engine.add_request("r", [5, 6, 7], SamplingParams(min_tokens=1,
                                                              stop_token_ids=[vocab]))
    assert not llm.engine.requests  # nothing was queued
    with pytest.raises(RequestRejected, match="logprobs=5 is invalid: the model's vocabulary "
                                              "has only 3 tokens"):
        SamplingParams(logprobs=5).check_vocabulary(3)


# ---- one request fails, the batch goes on -------------------------------------------------

def _normal_requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    prompts = random_prompts(vocab, [9, 17, 12, 30, 5, 21, 14, 8], seed=11)
    return [(ids, SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8,
                                 top_p=0.9, seed=100 + i, ignore_eos=True))
            for i, ids in enumerate(prompts)]


def _run(llm: LLM, requests, bad=None) -> dict[str, object]:
    engine = llm.engine
    for i, (ids, params) in enumerate(requests):
        engine.add_request(f"ok-{i}", ids, params)
    if bad is not None:
        ids, params, field, value = bad
        engine.add_request("bad", ids, params)
        # Past validation (as a bug would be): the sampler cannot honour this value.
        object.__setattr__(params, field, value)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    return finals


@pytest.mark.parametrize(("field", "value"), [("top_p", 1e-46),
                                              ("stop_token_ids", (10**6,))])
def test_a_request_whose_sampling_raises_fails_alone(tiny_llama: Path, field: str,
                                                     value: object) -> None:
    llm = LLM(tiny_llama)
    vocab = llm.engine.model_config.vocab_size
    requests = _normal_requests(vocab)
    expected = {rid: out.token_ids for rid, out in _run(llm, requests).items()}
    bad = (random_prompts(vocab, [10], seed=3)[0],
           SamplingParams(max_tokens=12, min_tokens=4, temperature=1.0, seed=7), field, value)
    finals = _run(LLM(tiny_llama), _normal_requests(vocab), bad)
    failed = finals.pop("bad")
    assert failed.finish_reason == "error"
    assert "sampling this request failed" in failed.error
    assert {rid: out.token_ids for rid, out in finals.items()} == expected
    assert all(out.finish_reason == "length" and out.error is None for out in finals.values())


def test_non_finite_logits_fail_only_that_row() -> None:
    import torch
    from tandem_engine.model.sampler import Sampler

    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(seed=1)]
    result = Sampler(0).sample(logits, ["a", "b", "c"], params, [(), (), ()])
    assert list(result.errors) == [1] and "non-finite logits" in result.errors[1]
    assert result.token_ids[0] == int(torch.argmax(logits[0]))


def test_the_error_travels_on_the_wire() -> None:
    from tandem_engine.engine.outputs import CompletionOutput, RequestOutput
    from tandem_engine.server.worker import _Stream, stream_delta

    out = RequestOutput("x/r", None, [1, 2], [CompletionOutput(
        0, "", [], None, None, finish_reason="error", error="why")], finished=True)
    delta = stream_delta(_Stream(b"x", "r", None), out)
    assert (delta.finish_reason, delta.error) == ("error", "why")
    assert p.decode(p.encode(delta)).error == "why"


# ---- the router: an `error` output ends that choice only, never failed over ----------------

class _FakeClient:
    key = "e0"
    connected = True
    load = None

    def view(self):
        return type("View", (), {"weight_version": "v1"})()


def test_an_error_output_is_a_500_for_that_client_and_never_a_failover() -> None:
    async def run() -> list[object]:
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait((0.0, p.Output("r", [5], "a")))
        queue.put_nowait((0.0, p.Output("r", [], "", finished=True, finish_reason="error",
                                        error="sampling this request failed (boom)")))
        attempt = Attempt(_FakeClient(), "r.1", queue, 5.0, 5.0)
        steps = []
        with pytest.raises(RequestFailed) as info:
            async for step in colocated(attempt, Progress()):
                steps.append(step)
        steps.append(info.value)
        return steps

    steps = asyncio.run(run())
    assert [s.token_ids for s in steps[:-1]] == [[5]]
    status, body = _failure_body(steps[-1])
    assert status == 500 and body["error"]["code"] == "request_failed"
    assert "sampling this request failed (boom)" in body["error"]["message"]


# ---- nobody to blame: unhealthy -----------------------------------------------------------

def test_steps_that_keep_failing_make_the_engine_unhealthy(tiny_llama: Path) -> None:
    engine = LLM(tiny_llama).engine
    worker = EngineWorker(engine, engine_id="e0", model_name="tiny", heartbeat_interval=0.05)
    client = TestClient(build_admin_app(EngineControl(worker)))
    shutdown_ready = threading.Event()
    holder: dict[str, object] = {}

    def serve() -> None:
        async def main() -> None:
            holder["loop"], holder["stop"] = asyncio.get_running_loop(), asyncio.Event()
            shutdown_ready.set()
            await worker.serve("tcp://127.0.0.1:*", holder["stop"])
        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert shutdown_ready.wait(10)
        deadline = time.monotonic() + 10
        while not worker.alive:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert client.get("/healthz").status_code == 200

        def broken_forward(prepared):
            raise RuntimeError("device lost")

        engine.runner.forward = broken_forward  # every step fails, no request to blame
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4))
        worker._wake.set()
        while worker.unhealthy is None:
            assert time.monotonic() < deadline, "never became unhealthy"
            time.sleep(0.02)
        health = client.get("/healthz")
        assert health.status_code == 503
        assert health.json()["status"] == "unhealthy"
        assert "device lost" in health.json()["cause"]
        assert client.get("/readyz").status_code == 503
        assert worker.load().draining  # routers stop sending
        metrics = client.get("/metrics").text
        failures = next(line for line in metrics.splitlines()
                        if line.startswith("tandem_step_failures_total"))
        assert float(failures.split()[-1]) >= UNHEALTHY_AFTER_STEP_FAILURES
        assert client.post("/v1/undrain").status_code == 409
    finally:
        loop, stop = holder.get("loop"), holder.get("stop")
        if loop is not None:
            loop.call_soon_threadsafe(stop.set)
        thread.join(15)
