"""Disaggregated routing: a prefill engine computes the prompt and the first token and
pins the prompt's KV; a decode engine pulls it and streams the rest.

The fast tests drive `Dispatcher.generate` over scripted engine clients (no sockets):
the message flow, the fallbacks, and that mixed pools are untouched. The slow test runs
real `tandem-engine` processes (`--role prefill` / `--role decode`, NIXL) behind a real
router and compares greedy output with the offline engine token for token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tandem_engine import SamplingParams
from tandem_engine import protocol as p
from tandem_engine.router.dispatch import Dispatcher
from tandem_engine.router.engines import EngineClient, EngineLost, EnginePool
from tandem_engine.router.metrics import RouterMetrics
from tandem_engine.tokenizer import Tokenizer

PROMPT = [5, 6, 7, 8, 9]
TARGET = [100, 101, 102, 103, 104, 105]  # what a greedy run of PROMPT produces
AGENT = p.KVTransferInfo("prefill-agent", b"meta", {"block_size": 16})


# ---- scripted engines ---------------------------------------------------------------------------

Script = Callable[[str, list[int], dict[str, Any], bool, "p.PullSource | None"], list[Any]]


def _setup(client: EngineClient, role: str, script: Script, calls: list[tuple]) -> None:
    load = p.Load("RUNNING", 0, 0, 0.0, "v1", 1)
    client.welcome = p.Welcome(p.PROTOCOL_VERSION, client.key, "inc", role, "tiny", 16, 2048,
                               load, AGENT if role != "mixed" else None)
    client.load = load
    client.connected = True

    def submit(request_id: str, prompt: list[int], sampling: dict[str, Any],
               cache_salt: str | None = None, *, pin_for_handoff: bool = False,
               pull: p.PullSource | None = None) -> asyncio.Queue:
        calls.append((client.key, list(prompt), dict(sampling), pin_for_handoff, pull))
        queue: asyncio.Queue = asyncio.Queue()
        for item in script(request_id, prompt, sampling, pin_for_handoff, pull):
            queue.put_nowait((time.monotonic(), item))
        return queue

    client.submit = submit  # type: ignore[method-assign]
    client.aborted = []  # type: ignore[attr-defined]
    client.abort = client.aborted.append  # type: ignore[method-assign,attr-defined]


def colocated(request_id: str, prompt: list[int], sampling: dict[str, Any],
              pin: bool, pull: p.PullSource | None) -> list[Any]:
    """A correct engine: continues TARGET from wherever `prompt` leaves it."""
    done = len(prompt) - len(PROMPT)
    if pull is not None:  # the pulled stream starts after the first token
        assert pull.first_token == TARGET[0]
        done = 1
    n = min(sampling["max_tokens"] - (1 if pull is not None else 0), len(TARGET) - done)
    tokens = TARGET[done:done + n]
    outs = [p.Output(request_id, [t], "x") for t in tokens]
    last = outs[-1]
    pinned = pin and sampling["max_tokens"] < len(TARGET)
    outs[-1] = p.Output(request_id, last.token_ids, "x", finished=True,
                        finish_reason="length" if done + n < len(TARGET) else "stop",
                        pin_id=request_id if pinned else None,
                        pinned_blocks=[7] if pinned else None)
    return outs


def _run(dispatcher: Dispatcher, sampling: dict[str, Any]) -> list:
    async def go() -> list:
        return [d async for d in dispatcher.generate("r", PROMPT, sampling)]
    return asyncio.run(go())


def _dispatcher(tokenizer: Tokenizer, roles: dict[str, tuple[str, Script]]
                ) -> tuple[Dispatcher, list[tuple], RouterMetrics]:
    pool = EnginePool(list(roles))
    calls: list[tuple] = []
    for client in pool.clients:
        role, script = roles[client.key]
        _setup(client, role, script, calls)
    metrics = RouterMetrics()
    return Dispatcher(pool, tokenizer, metrics=metrics), calls, metrics


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama)


PRE, DEC = "127.0.0.1:1001", "127.0.0.1:1002"


def _count(metrics: RouterMetrics, outcome: str) -> float:
    return metrics.disaggregated.labels(outcome)._value.get()


def test_prefill_then_pulled_decode(tokenizer: Tokenizer) -> None:
    dispatcher, calls, metrics = _dispatcher(
        tokenizer, {PRE: ("prefill", colocated), DEC: ("decode", colocated)})
    deltas = _run(dispatcher, {"max_tokens": 6, "temperature": 0.0, "min_tokens": 3})
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert deltas[0].token_ids == [TARGET[0]] and not deltas[0].finished  # at once
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    (k1, prompt1, s1, pin1, pull1), (k2, prompt2, s2, pin2, pull2) = calls
    assert (k1, prompt1, pin1, pull1) == (PRE, PROMPT, True, None)
    assert s1["max_tokens"] == 1 and s1["min_tokens"] == 1
    assert (k2, prompt2, pin2) == (DEC, PROMPT, False)
    assert s2 == {"max_tokens": 6, "temperature": 0.0, "min_tokens": 3}
    assert pull2 == p.PullSource(AGENT, "r.1", [7], TARGET[0])
    assert _count(metrics, "handoff") == 1


def test_done_after_the_first_token_never_reaches_the_decode_engine(
        tokenizer: Tokenizer) -> None:
    dispatcher, calls, metrics = _dispatcher(
        tokenizer, {PRE: ("prefill", colocated), DEC: ("decode", colocated)})
    deltas = _run(dispatcher, {"max_tokens": 1})
    assert [d.token_ids for d in deltas] == [[TARGET[0]]]
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert [c[0] for c in calls] == [PRE]
    assert calls[0][3] is False  # nothing to pin: no decode engine will pull it
    assert _count(metrics, "finished_at_prefill") == 1


def test_a_failed_prefill_falls_back_to_colocated_decode(tokenizer: Tokenizer) -> None:
    def lost(request_id, prompt, sampling, pin, pull):
        return [EngineLost("gone")]

    dispatcher, calls, metrics = _dispatcher(
        tokenizer, {PRE: ("prefill", lost), DEC: ("decode", colocated)})
    deltas = _run(dispatcher, {"max_tokens": 6})
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert [(c[0], c[1], c[3], c[4]) for c in calls] == [(PRE, PROMPT, True, None),
                                                         (DEC, PROMPT, False, None)]
    assert _count(metrics, "fallback") == 1


def test_a_decode_engine_lost_mid_stream_fails_over_colocated(tokenizer: Tokenizer) -> None:
    dispatcher, calls, _ = _dispatcher(
        tokenizer, {PRE: ("prefill", colocated), DEC: ("decode", colocated)})
    decode = dispatcher.pool.by_key[DEC]

    def dies(request_id, prompt, sampling, pin, pull):
        decode.connected = False
        return [*colocated(request_id, prompt, sampling, pin, pull)[:2], EngineLost("gone")]

    _setup(decode, "decode", dies, calls)
    deltas = _run(dispatcher, {"max_tokens": 6})
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert deltas[-1].finished
    # Prefill, pulled decode (two tokens), then the rest on the only engine left.
    assert [(c[0], c[1], c[2]["max_tokens"], c[4] is not None) for c in calls] == [
        (PRE, PROMPT, 1, False), (DEC, PROMPT, 6, True), (PRE, PROMPT + TARGET[:3], 3, False)]


def test_mixed_pools_are_not_disaggregated(tokenizer: Tokenizer) -> None:
    dispatcher, calls, metrics = _dispatcher(
        tokenizer, {PRE: ("mixed", colocated), DEC: ("mixed", colocated)})
    deltas = _run(dispatcher, {"max_tokens": 6})
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert len(calls) == 1 and calls[0][3:] == (False, None)
    assert dispatcher.pick_pair(PROMPT) is None
    # A prefill engine alone (no decode engine) is no pair either.
    _setup(dispatcher.pool.by_key[PRE], "prefill", colocated, calls)
    assert dispatcher.pick_pair(PROMPT) is None
    assert sum(_count(metrics, o) for o in ("handoff", "fallback")) == 0


def test_pairs_never_mix_weight_versions(tokenizer: Tokenizer) -> None:
    dispatcher, _, _ = _dispatcher(
        tokenizer, {PRE: ("prefill", colocated), DEC: ("decode", colocated)})
    decode = dispatcher.pool.by_key[DEC]
    decode.load = p.Load("RUNNING", 0, 0, 0.0, "v2", 2)  # newer: the serving version
    assert dispatcher.pick_pair(PROMPT) is None


# ---- real engine processes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def disagg_cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    pytest.importorskip("nixl_cu12")
    from test_router_e2e import run_cluster

    yield from run_cluster(tiny_llama, tmp_path_factory.mktemp("router-disagg"),
                           ("prefill", "decode"))


@pytest.mark.slow
def test_disaggregated_completions_match_the_offline_engine(disagg_cluster,
                                                           tiny_llama: Path) -> None:
    from tandem_engine import LLM
    from test_router_e2e import MODEL

    c = disagg_cluster
    prefill_admin, decode_admin = c.admin_urls
    before = httpx.get(f"{decode_admin}/v1/state", timeout=5).json()["kv_pulls"]
    llm = LLM(tiny_llama)
    prompts = ["Hello there", "Once upon a time in a land far away", "The engine"]
    refs = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True))]
    client = c.client()
    for prompt, ref in zip(prompts, refs, strict=True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"return_token_ids": True,
                                                  "ignore_eos": True})
        assert r.choices[0].model_extra["token_ids"] == ref.token_ids
        assert r.choices[0].text == ref.text
        chunks = list(client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True}))
        assert [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]] \
            == ref.token_ids
        assert "".join(ch.choices[0].text for ch in chunks) == ref.text
    after = httpx.get(f"{decode_admin}/v1/state", timeout=5).json()["kv_pulls"]
    assert after["pulled_blocks"] > before["pulled_blocks"]
    assert after["failed"] == before["failed"] == 0
    assert c.metric("tandem_router_disaggregated_requests_total", outcome="handoff") == 6
    # Every pull's notification unpinned its prompt.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if httpx.get(f"{prefill_admin}/v1/state", timeout=5).json()["pinned_blocks"] == 0:
            break
        time.sleep(0.1)
    assert httpx.get(f"{prefill_admin}/v1/state", timeout=5).json()["pinned_blocks"] == 0
    # max_tokens=1 is done on the prefill engine, which pins nothing for it.
    r = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=1, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == refs[0].token_ids[:1]
    assert c.metric("tandem_router_disaggregated_requests_total",
                    outcome="finished_at_prefill") == 1
    assert httpx.get(f"{prefill_admin}/v1/state", timeout=5).json()["pinned_blocks"] == 0


def test_a_stop_string_starting_in_the_first_token_is_never_half_streamed(
        tokenizer: Tokenizer) -> None:
    """The first token comes from the prefill engine; the router holds back its text's
    tail when it could begin a stop string, exactly as an engine holds back its own."""
    words = tokenizer.encode("the quick brown fox jumps over the lazy dog",
                             add_special_tokens=False)
    texts = [tokenizer.decode(words[:n]) for n in range(len(words) + 1)]
    first = texts[1]
    assert first and len(texts[2]) > len(first)
    stop = texts[2][len(first) - 1:len(first) + 1]  # spans the hand-over

    def engine(request_id, prompt, sampling, pin, pull):
        if pin:  # the prefill engine: the first token, pinned
            return [p.Output(request_id, words[:1], first, finished=True,
                             finish_reason="length", pin_id=request_id, pinned_blocks=[7])]
        return [p.Output(request_id, [t], "?") for t in words[1:4]] + [
            p.Output(request_id, [], "", finished=True, finish_reason="length")]

    dispatcher, calls, _ = _dispatcher(
        tokenizer, {PRE: ("prefill", engine), DEC: ("decode", engine)})
    deltas = _run(dispatcher, {"max_tokens": 6, "temperature": 0.0, "stop": [stop]})
    assert [c[0] for c in calls] == [PRE, DEC]
    assert deltas[0].token_ids == words[:1] and deltas[0].text == first[:-1]
    assert "".join(d.text for d in deltas) == first[:-1]
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert deltas[-1].stop_reason == stop


@pytest.mark.slow
def test_concurrent_load_leaks_no_block_and_no_pin(disagg_cluster) -> None:
    """Many streams at once through prefill → NIXL → decode, some abandoned mid-stream:
    afterwards no block is held on either engine and no pin is left on the prefill one."""
    from concurrent.futures import ThreadPoolExecutor

    from test_router_e2e import MODEL

    c = disagg_cluster
    client = c.client()
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
             "kappa", "lambda", "mu"]

    def one(i: int) -> int:
        prompt = " ".join(words[(i + k) % len(words)] for k in range(5 + 7 * (i % 6)))
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        n = 0
        for n, _ in enumerate(stream, 1):
            if i % 5 == 4 and n == 3:  # the client goes away mid-stream
                stream.close()
                break
        return n

    with ThreadPoolExecutor(12) as pool:
        counts = list(pool.map(one, range(36)))
    assert all(n >= 3 for n in counts), counts
    prefill_admin, decode_admin = c.admin_urls

    def settled() -> bool:
        pre = httpx.get(f"{prefill_admin}/v1/state", timeout=5).json()
        dec = httpx.get(f"{decode_admin}/v1/state", timeout=5).json()
        return (pre["pinned_blocks"] == 0 and pre["kv_usage"] == 0 and dec["kv_usage"] == 0
                and pre["num_running"] + dec["num_running"] == 0)

    deadline = time.monotonic() + 15
    while not settled():
        assert time.monotonic() < deadline, (
            "blocks or pins still held 15 s after the load: "
            f"{httpx.get(f'{prefill_admin}/v1/state', timeout=5).json()} "
            f"{httpx.get(f'{decode_admin}/v1/state', timeout=5).json()}")
        time.sleep(0.1)
    dec = httpx.get(f"{decode_admin}/v1/state", timeout=5).json()["kv_pulls"]
    assert dec["failed"] == 0 and dec["pulled_blocks"] > 0


def test_a_pin_left_by_a_generation_ended_at_the_first_token_is_released(
        tokenizer: Tokenizer) -> None:
    def eos_first(request_id, prompt, sampling, pin, pull):
        return [p.Output(request_id, [TARGET[0]], "x", finished=True, finish_reason="stop",
                         pin_id=request_id if pin else None, pinned_blocks=[7] if pin else None)]

    dispatcher, calls, _ = _dispatcher(
        tokenizer, {PRE: ("prefill", eos_first), DEC: ("decode", colocated)})
    deltas = _run(dispatcher, {"max_tokens": 6, "temperature": 0.0})
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert [c[0] for c in calls] == [PRE] and calls[0][3] is True
    prefill = next(c for c in dispatcher.pool.clients if c.key == PRE)
    assert prefill.aborted == ["r.1"]  # the engine unpins on abort
