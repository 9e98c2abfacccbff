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
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tandem_engine import SamplingParams
from tandem_engine import protocol as p
from tandem_engine.router.attempts import GenerationFailed
from tandem_engine.router.dispatch import DispatchConfig, Dispatcher
from tandem_engine.router.engines import EngineClient, EngineLost, EnginePool
from tandem_engine.router.metrics import RouterMetrics
from tandem_engine.tokenizer import Tokenizer

PROMPT = [5, 6, 7, 8, 9]
TARGET = [100, 101, 102, 103, 104, 105]  # what a greedy run of PROMPT produces
AGENT = p.KVTransferInfo("prefill-agent", b"meta", {"block_size": 16})


# ---- scripted engines ---------------------------------------------------------------------------

# (request id, prompt, sampling, pin_for_handoff, resume, pull) -> what the engine sends
Script = Callable[[str, list[int], SamplingParams, bool, "p.Resume | None",
                   "p.PullSource | None"], list[Any]]


@dataclass(frozen=True)
class Call:
    """One Submit a scripted engine received."""

    key: str
    prompt: list[int]
    sampling: SamplingParams
    pin: bool
    resume: p.Resume | None
    pull: p.PullSource | None
    lora: p.LoRARef | None = None


def scripted(client: EngineClient, role: str, script: Script, calls: list[Call],
             version: str = "v1") -> None:
    """Make `client` a connected engine of `role` that answers each submit with
    `script`'s outputs (no sockets)."""
    load = p.Load("RUNNING", 0, 0, 0.0, version, 1)
    client.welcome = p.Welcome(p.PROTOCOL_VERSION, client.key, "inc", role, "tiny", 16, 2048,
                               load, AGENT if role != "mixed" else None)
    client.load = load
    client.connected = True

    def submit(request_id: str, prompt: list[int], sampling: SamplingParams,
               cache_salt: str | None = None, *, pin_for_handoff: bool = False,
               resume: p.Resume | None = None,
               pull: p.PullSource | None = None,
               lora: p.LoRARef | None = None, priority: int = 0) -> asyncio.Queue:
        assert isinstance(sampling, SamplingParams)
        calls.append(Call(client.key, list(prompt), sampling, pin_for_handoff, resume, pull,
                          lora))
        queue: asyncio.Queue = asyncio.Queue()
        for item in script(request_id, prompt, sampling, pin_for_handoff, resume, pull):
            queue.put_nowait((time.monotonic(), item))
        return queue

    client.submit = submit  # type: ignore[method-assign]
    client.aborted = []  # type: ignore[attr-defined]
    client.abort = client.aborted.append  # type: ignore[method-assign,attr-defined]
    client.unpinned = []  # type: ignore[attr-defined]
    client.unpin = client.unpinned.append  # type: ignore[method-assign,attr-defined]


def colocated(request_id: str, prompt: list[int], sampling: SamplingParams, pin: bool,
              resume: p.Resume | None, pull: p.PullSource | None) -> list[Any]:
    """A correct engine: the original prompt, continuing TARGET after the resumed tokens;
    one character of text per token. With `pin` it stops after the first token and hands
    off (unless that token ends the generation)."""
    assert prompt == PROMPT
    done = len(resume.token_ids) if resume is not None else 0
    assert resume is None or resume.token_ids == TARGET[:done]
    assert resume is None or resume.sent_chars == done  # one character per token
    assert pull is None or done == 1  # a decode engine resumes after the first token
    n = min(1 if pin else sampling.max_tokens - done, len(TARGET) - done)
    tokens = TARGET[done:done + n]
    reason = "stop" if done + n == len(TARGET) else \
        "length" if done + n >= sampling.max_tokens else None
    handoff = p.Handoff(request_id, [7]) if pin and reason is None else None
    outs = [p.Output(request_id, [t], "x") for t in tokens] or [p.Output(request_id, [], "")]
    last = outs[-1]
    outs[-1] = p.Output(request_id, last.token_ids, last.text, finished=True,
                        finish_reason=reason, handoff=handoff)
    return outs


def _run(dispatcher: Dispatcher, sampling: SamplingParams) -> list:
    async def go() -> list:
        return [d async for d in dispatcher.generate("r", PROMPT, sampling)]
    return asyncio.run(go())


def scripted_dispatcher(roles: dict[str, tuple[str, Script]], **config: Any
                        ) -> tuple[Dispatcher, list[Call], RouterMetrics]:
    """A Dispatcher over scripted engines: address -> (role, script)."""
    pool = EnginePool(list(roles))
    calls: list[Call] = []
    for client in pool.clients:
        role, script = roles[client.key]
        scripted(client, role, script, calls)
    metrics = RouterMetrics()
    return Dispatcher(pool, DispatchConfig(**config), metrics=metrics), calls, metrics


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama)


PRE, DEC = "127.0.0.1:1001", "127.0.0.1:1002"


def _count(metrics: RouterMetrics, outcome: str) -> float:
    return metrics.disaggregated.labels(outcome)._value.get()


def test_prefill_then_pulled_decode() -> None:
    dispatcher, calls, metrics = scripted_dispatcher(
        {PRE: ("prefill", colocated), DEC: ("decode", colocated)})
    sampling = SamplingParams(max_tokens=6, temperature=0.0, min_tokens=3)
    deltas = _run(dispatcher, sampling)
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert deltas[0].token_ids == [TARGET[0]] and not deltas[0].finished  # at once
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    pre, dec = calls
    # Both engines get the original prompt and sampling: the prefill engine stops after
    # the first token itself, the decode engine resumes after it.
    assert (pre.key, pre.prompt, pre.sampling, pre.pin, pre.resume, pre.pull) == (
        PRE, PROMPT, sampling, True, None, None)
    assert (dec.key, dec.prompt, dec.sampling, dec.pin) == (DEC, PROMPT, sampling, False)
    assert dec.resume == p.Resume([TARGET[0]], sent_chars=1)
    assert dec.pull == p.PullSource(AGENT, "r.1", [7])  # from the prefill's Handoff
    assert _count(metrics, "handoff") == 1
    assert metrics.handoff_versions.labels("v1", "v1")._value.get() == 1
    # The decode engine pulled: its notification, not the router, frees the pin.
    assert dispatcher.pool.by_key[PRE].unpinned == []


def test_done_after_the_first_token_never_reaches_the_decode_engine() -> None:
    dispatcher, calls, metrics = scripted_dispatcher(
        {PRE: ("prefill", colocated), DEC: ("decode", colocated)})
    deltas = _run(dispatcher, SamplingParams(max_tokens=1))
    assert [d.token_ids for d in deltas] == [[TARGET[0]]]
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert [c.key for c in calls] == [PRE]
    assert calls[0].pin is False  # nothing to pin: no decode engine will pull it
    assert _count(metrics, "finished_at_prefill") == 1


def test_a_failed_prefill_falls_back_to_colocated_decode() -> None:
    def lost(request_id, prompt, sampling, pin, resume, pull):
        return [EngineLost("gone")]

    dispatcher, calls, metrics = scripted_dispatcher(
        {PRE: ("prefill", lost), DEC: ("decode", colocated)})
    deltas = _run(dispatcher, SamplingParams(max_tokens=6))
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert [(c.key, c.prompt, c.pin, c.resume, c.pull) for c in calls] == [
        (PRE, PROMPT, True, None, None), (DEC, PROMPT, False, None, None)]
    assert _count(metrics, "fallback") == 1


def test_a_decode_engine_lost_mid_stream_fails_over_colocated() -> None:
    dispatcher, calls, metrics = scripted_dispatcher(
        {PRE: ("prefill", colocated), DEC: ("decode", colocated)})
    decode = dispatcher.pool.by_key[DEC]

    def dies(request_id, prompt, sampling, pin, resume, pull):
        decode.connected = False
        return [*colocated(request_id, prompt, sampling, pin, resume, pull)[:2],
                EngineLost("gone")]

    scripted(decode, "decode", dies, calls)
    deltas = _run(dispatcher, SamplingParams(max_tokens=6))
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert deltas[-1].finished
    # Prefill, pulled decode (two tokens), then the rest on the only engine left: always
    # the original prompt and sampling, resumed after the tokens so far.
    assert [(c.key, c.prompt, c.sampling.max_tokens, c.resume, c.pull is not None)
            for c in calls] == [
        (PRE, PROMPT, 6, None, False),
        (DEC, PROMPT, 6, p.Resume(TARGET[:1], 1), True),
        (PRE, PROMPT, 6, p.Resume(TARGET[:3], 3), False)]
    assert decode.aborted == ["r.2"]
    assert dispatcher.pool.by_key[PRE].unpinned == ["r.1"]  # whether it pulled or not
    assert metrics.failovers.labels("engine_lost")._value.get() == 1
    assert metrics.resumed._value.get() == 1  # failed over mid-stream, then completed


def test_a_refused_pull_fails_over_colocated() -> None:
    """A decode engine that refuses the pulled request (even with a 4xx) is the
    handoff's problem, not the request's: the choice goes on colocated."""
    def refuses(request_id, prompt, sampling, pin, resume, pull):
        return [p.Reject(request_id, 400, "cannot pull")]

    dispatcher, calls, metrics = scripted_dispatcher(
        {PRE: ("prefill", colocated), DEC: ("decode", refuses)})
    deltas = _run(dispatcher, SamplingParams(max_tokens=6))
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert [(c.key, c.resume, c.pull is not None) for c in calls] == [
        (PRE, None, False), (DEC, p.Resume(TARGET[:1], 1), True),
        (PRE, p.Resume(TARGET[:1], 1), False)]
    assert metrics.failovers.labels("rejected")._value.get() == 1
    # Nobody will pull the prefill's KV: its pin is released now, not by the pin TTL.
    assert dispatcher.pool.by_key[PRE].unpinned == ["r.1"]


def test_a_client_gone_during_the_decode_attempt_releases_the_prefill_pin() -> None:
    dispatcher, _, _ = scripted_dispatcher(
        {PRE: ("prefill", colocated), DEC: ("decode", colocated)})

    async def two_tokens() -> list:
        async with aclosing(dispatcher.generate("r", PROMPT, SamplingParams(max_tokens=6))
                            ) as stream:
            seen = []
            async for delta in stream:
                seen.append(delta.token_ids)
                if len(seen) == 2:
                    return seen
    assert asyncio.run(two_tokens()) == [TARGET[:1], TARGET[1:2]]  # then the client left
    assert dispatcher.pool.by_key[DEC].aborted == ["r.2"]
    assert dispatcher.pool.by_key[PRE].unpinned == ["r.1"]


def test_a_choice_out_of_attempts_releases_the_prefill_pin() -> None:
    dispatcher, _, _ = scripted_dispatcher(
        {PRE: ("prefill", colocated), DEC: ("decode", colocated)}, max_attempts=1)
    with pytest.raises(GenerationFailed):
        _run(dispatcher, SamplingParams(max_tokens=6))
    assert dispatcher.pool.by_key[PRE].unpinned == ["r.1"]


def test_mixed_pools_are_not_disaggregated() -> None:
    dispatcher, calls, metrics = scripted_dispatcher(
        {PRE: ("mixed", colocated), DEC: ("mixed", colocated)})
    deltas = _run(dispatcher, SamplingParams(max_tokens=6))
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert len(calls) == 1 and (calls[0].pin, calls[0].pull) == (False, None)
    assert dispatcher.picker.pick_pair(PROMPT) is None
    # A prefill engine alone (no decode engine) is no pair either.
    scripted(dispatcher.pool.by_key[PRE], "prefill", colocated, calls)
    assert dispatcher.picker.pick_pair(PROMPT) is None
    assert sum(_count(metrics, o) for o in ("handoff", "fallback")) == 0


def test_pairs_never_mix_weight_versions() -> None:
    dispatcher, _, _ = scripted_dispatcher(
        {PRE: ("prefill", colocated), DEC: ("decode", colocated)})
    decode = dispatcher.pool.by_key[DEC]
    decode.load = p.Load("RUNNING", 0, 0, 0.0, "v2", 2)  # newer: the serving version
    assert dispatcher.picker.pick_pair(PROMPT) is None


def test_a_prefill_refit_under_the_request_hands_no_kv_across_versions() -> None:
    """The prefill engine's version changed between the pick and its first token (a
    Recompute refit): the decode engine, still on the old version, never pulls; the
    rest runs on an engine of the first token's version."""
    dispatcher, calls, metrics = scripted_dispatcher(
        {PRE: ("prefill", colocated), DEC: ("decode", colocated)})
    prefill = dispatcher.pool.by_key[PRE]

    def refit_then_first_token(request_id, prompt, sampling, pin, resume, pull):
        if pin:
            prefill.load = p.Load("RUNNING", 0, 0, 0.0, "v2", 2)
        return colocated(request_id, prompt, sampling, pin, resume, pull)

    scripted(prefill, "prefill", refit_then_first_token, calls)
    deltas = _run(dispatcher, SamplingParams(max_tokens=6))
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert [(c.key, c.pull is not None) for c in calls] == [(PRE, False), (PRE, False)]
    assert _count(metrics, "version_changed") == 1 and _count(metrics, "handoff") == 0
    assert prefill.unpinned == ["r.1"]  # its KV is never pulled


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


def test_the_decode_engine_resumes_after_the_text_the_client_has(
        tokenizer: Tokenizer) -> None:
    """The prefill engine sends only its safe text (it holds back what could begin a stop
    string); the decode engine learns how much the client has (`Resume.sent_chars`),
    finds the stop string spanning the hand-over and sends the rest. The router relays
    the engines' text as it is."""
    words = tokenizer.encode("the quick brown fox jumps over the lazy dog",
                             add_special_tokens=False)
    texts = [tokenizer.decode(words[:n]) for n in range(len(words) + 1)]
    first = texts[1]
    assert first and len(texts[2]) > len(first)
    stop = texts[2][len(first) - 1:len(first) + 1]  # spans the hand-over

    def engine(request_id, prompt, sampling, pin, resume, pull):
        if pin:  # the prefill engine: the first token, its text held back, pinned
            return [p.Output(request_id, words[:1], first[:-1], finished=True,
                             handoff=p.Handoff(request_id, [7]))]
        return [p.Output(request_id, words[1:2], "", finished=True, finish_reason="stop",
                         stop_reason=stop)]

    dispatcher, calls, _ = scripted_dispatcher(
        {PRE: ("prefill", engine), DEC: ("decode", engine)})
    deltas = _run(dispatcher, SamplingParams(max_tokens=6, temperature=0.0, stop=[stop]))
    assert [c.key for c in calls] == [PRE, DEC]
    assert calls[1].resume == p.Resume(words[:1], sent_chars=len(first) - 1)
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


def test_a_generation_ended_at_the_first_token_is_not_handed_off() -> None:
    def eos_first(request_id, prompt, sampling, pin, resume, pull):
        return [p.Output(request_id, [TARGET[0]], "x", finished=True, finish_reason="stop")]

    dispatcher, calls, metrics = scripted_dispatcher(
        {PRE: ("prefill", eos_first), DEC: ("decode", colocated)})
    deltas = _run(dispatcher, SamplingParams(max_tokens=6, temperature=0.0))
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert [c.key for c in calls] == [PRE] and calls[0].pin is True
    assert _count(metrics, "finished_at_prefill") == 1
