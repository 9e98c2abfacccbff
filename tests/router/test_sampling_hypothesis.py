"""Hypothesis-generated sampling parameters through the real stack: one `tandem-engine`
process on the tiny demo model behind one `tandem-router` process, driven with the
official `openai` client (raw httpx only for the JSON the SDK refuses to send: NaN).

Every generated body is classified up front: each parameter value is drawn as valid or
invalid, and the few cross-field rules (min_tokens <= max_tokens, top_logprobs needs
logprobs, seed + n - 1 fits, stop ids inside the 2048-token vocabulary) are applied.
A valid body must answer 200 with a well-formed body; an invalid one a 4xx in the
OpenAI error shape whose `param` is one of the invalid parameters. Never a 5xx, never
a hang. Meanwhile a greedy "witness" request runs over and over next to them: its
tokens must equal its solo run every time and its latency stay under a bound, and when
the storm is over nothing is left running, in flight or holding KV blocks.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_router_e2e import MODEL, Cluster, _metric, _wait_for, run_cluster

pytestmark = pytest.mark.slow

VOCAB = 2048  # the tiny demo checkpoint's vocabulary (demo_model.TOKENIZER_VOCAB_SIZE)
MAX_SEED = 2**63 - 1
CLIENT_TIMEOUT = 20.0  # a request still unanswered after this is a hang
# Reproducible in CI: the same 40 examples in the same order on every run.
SETTINGS = settings(max_examples=40, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])

# Each parameter's values, valid ones first, then invalid ones. Valid generation lengths
# stay small (max_tokens <= 8, n <= 3) so 40 examples fit the time budget.
VALID, INVALID = True, False
PARAMS: dict[str, tuple[list[Any], list[Any]]] = {
    "temperature": ([0, 0.0, 1e-40, 1e-5, 0.7, 1, 2.0],
                    [-1, -1e-40, 2.5, 1e30, "nan", "0.5", True, math.nan, math.inf]),
    "top_p": ([1e-8, 0.5, 1, 1.0], [1e-50, 0, 0.0, 1.5, -0.1, "1", math.nan]),
    "top_k": ([-1, 0, 1, 5, 10**6], [-2, 2**64, 1.5, "5"]),
    "min_tokens": ([0, 1, 4], [-1, "2", 1.5]),  # > max_tokens: a cross-field rule
    "max_tokens": ([1, 4, 8, 8.0], [0, -1, 10**6, 2**64, "8"]),
    "seed": ([0, 1, 12345, MAX_SEED], [-1, 2**63, 2**64, "7"]),
    "stop": (["e", ["\n", " the"], ["x" * 256]],
             ["", [""], ["x" * 257], ["a"] * 17, 5, [1]]),
    # [VOCAB] and [2**31 - 1] pass the router's range check; the engine refuses them.
    "stop_token_ids": ([[], [0], [1, 2], [VOCAB - 1]],
                       [[VOCAB], [2**31 - 1], [2**31], [2**64], [-1], "3", [1.5]]),
    "n": ([1, 2, 3, 2.0], [0, -1, 17, "2"]),
    "ignore_eos": ([True, False], ["yes", 1]),
    "presence_penalty": ([0, 0.5, -2, 2.0], [2.5, -3, "1", math.nan]),
    "frequency_penalty": ([0, 1.5, -0.5], [2.1, "0", math.inf]),
    "repetition_penalty": ([1, 1.3, 0.5], [0, -1, 101, "1", math.nan]),
    "min_p": ([0, 0.05, 1], [-0.1, 1.5, "0.1", math.nan]),
    "frobnicate": ([], [1, "x", {"a": [1]}]),  # unknown parameters are refused, by name
}
COMPLETION_LOGPROBS = ([0, 1, 5, 20], [21, -1, True])
CHAT_LOGPROBS = ([True, False], [1, "true"])
CHAT_TOP_LOGPROBS = ([0, 2, 20], [21, -1])  # needs logprobs=true: a cross-field rule
PROMPTS = ["Once upon a time", "The witness", "a", "Hello, world! " * 3]


@dataclass
class Case:
    chat: bool
    body: dict[str, Any]
    bad: set[str]  # the parameters that make the body invalid; empty: it must succeed


def _value(draw, name: str, values: tuple[list[Any], list[Any]], body: dict, bad: set,
           mode: str) -> None:
    """Maybe set body[name]: absent half the time (never for mode "bad"), else a valid
    value, or any value (mode "any"), or an invalid one (mode "bad")."""
    ok, nok = values
    if mode != "bad" and draw(st.booleans()):
        return
    pool = ([(v, VALID) for v in ok] if mode != "bad" else []) \
        + ([(v, INVALID) for v in nok] if mode != "valid" else [])
    if not pool:  # a parameter with no valid value (unknown ones) is left out
        return
    value, valid = draw(st.sampled_from(pool))
    body[name] = value
    if not valid:
        bad.add(name)


@st.composite
def cases(draw) -> Case:
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": MODEL, "stream": draw(st.booleans())}
    prompt = draw(st.sampled_from(PROMPTS))
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    params = {**PARAMS, **({"logprobs": CHAT_LOGPROBS, "top_logprobs": CHAT_TOP_LOGPROBS}
                           if chat else {"logprobs": COMPLETION_LOGPROBS})}
    # Half the bodies hold only valid values, a quarter exactly one invalid one (the
    # error must name it), a quarter any mix.
    mode = draw(st.sampled_from(["valid", "valid", "one bad", "any"]))
    target = draw(st.sampled_from([name for name, (_, nok) in params.items() if nok]))
    bad: set[str] = set()
    for name, values in params.items():
        _value(draw, name, values, body, bad, "bad" if mode == "one bad" and name == target
               else "any" if mode == "any" else "valid")
    if chat:
        if "top_logprobs" in body and body.get("logprobs") is not True:
            bad.add("top_logprobs")
        # Chat's default max_tokens is the whole context left: keep generations short.
        body.setdefault("max_tokens", draw(st.sampled_from([1, 4, 8])))
    # The cross-field rules, on values that are valid on their own.
    if not bad & {"seed", "n"} and body.get("seed", 0) + int(body.get("n", 1)) - 1 > MAX_SEED:
        bad.add("seed")
    if not bad & {"min_tokens", "max_tokens"} \
            and body.get("min_tokens", 0) > body.get("max_tokens", 16):
        bad.add("min_tokens")
    if "stop_token_ids" not in bad and any(t >= VOCAB for t in body.get("stop_token_ids", [])):
        bad.add("stop_token_ids")  # only the engine knows the vocabulary
    return Case(chat, body, bad)


# ---- sending a case ---------------------------------------------------------------------------

SDK_ARGS = {"temperature", "top_p", "max_tokens", "seed", "stop", "n", "logprobs",
            "top_logprobs", "stream"}


def _send(client: openai.OpenAI, http: httpx.Client, case: Case) -> tuple[int, Any]:
    """(HTTP status, JSON body or list of stream chunks) for one case."""
    body = {**case.body, "return_token_ids": True}
    if not _json_safe(body):  # NaN / inf: the SDK (rightly) refuses to encode them
        path = "/v1/chat/completions" if case.chat else "/v1/completions"
        r = http.post(path, content=json.dumps(body),
                      headers={"Content-Type": "application/json"})
        return r.status_code, r.json()
    known = {k: v for k, v in body.items() if k in SDK_ARGS}
    extra = {k: v for k, v in body.items() if k not in SDK_ARGS | {"model", "messages",
                                                                   "prompt"}}
    create = client.chat.completions.create if case.chat else client.completions.create
    where = {"messages": body["messages"]} if case.chat else {"prompt": body["prompt"]}
    try:
        answer = create(model=MODEL, **where, **known, extra_body=extra)
        if body["stream"]:
            return 200, [chunk.model_dump() for chunk in answer]
        return 200, answer.model_dump()
    except openai.APIStatusError as exc:
        return exc.status_code, {"error": exc.body}


def _json_safe(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


def _check(case: Case, status: int, answer: Any) -> None:
    assert status < 500, f"{status} for {case.body}: {answer}"
    if case.bad:
        assert 400 <= status < 500, f"{sorted(case.bad)} accepted ({status}): {case.body}"
        error = answer["error"]
        assert isinstance(error.get("message"), str) and error.get("type"), answer
        assert error.get("param") in case.bad, \
            f"param={error.get('param')!r}, expected one of {sorted(case.bad)}: {answer}"
        return
    assert status == 200, f"a valid body got {status}: {case.body}: {answer}"
    n = int(case.body.get("n", 1))
    max_tokens = int(case.body.get("max_tokens", 16))
    stops = case.body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    chunks = answer if case.body["stream"] else [answer]
    for chunk in chunks:
        for choice in chunk["choices"]:
            i = choice["index"]
            piece = (choice["delta"] if case.body["stream"] else choice["message"])["content"] \
                if case.chat else choice["text"]
            texts[i] = texts.get(i, "") + (piece or "")
            tokens.setdefault(i, []).extend(choice.get("token_ids") or [])
            if choice.get("finish_reason"):
                reasons[i] = choice["finish_reason"]
    assert sorted(reasons) == list(range(n)), f"choices {sorted(reasons)} of n={n}: {answer}"
    for i in range(n):
        assert reasons[i] in ("stop", "length"), reasons
        assert all(0 <= t < VOCAB for t in tokens[i]), tokens[i]
        assert len(tokens[i]) <= max_tokens, (len(tokens[i]), case.body)
        if reasons[i] == "length":
            assert len(tokens[i]) == max_tokens, (tokens[i], case.body)
        if not case.body.get("min_tokens"):  # stop strings count after min_tokens only
            assert not any(s in texts[i] for s in stops), (texts[i], stops)


# ---- the witness ----------------------------------------------------------------------------

WITNESS = {"model": MODEL, "prompt": "The witness says", "max_tokens": 16, "temperature": 0,
           "ignore_eos": True, "return_token_ids": True}


def _witness_once(http: httpx.Client) -> tuple[list[int], float]:
    started = time.monotonic()
    r = http.post("/v1/completions", json=WITNESS)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"], time.monotonic() - started


class Witness(threading.Thread):
    """Runs the witness request back to back until stopped, recording each answer."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stopping = url, threading.Event()
        self.runs: list[tuple[list[int], float]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=CLIENT_TIMEOUT) as http:
                while not self.stopping.is_set():
                    self.runs.append(_witness_once(http))
        except BaseException as exc:  # reported by the test
            self.error = exc


@pytest.fixture(scope="module")
def stack(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_cluster(tiny_llama, tmp_path_factory.mktemp("sampling-hypothesis"),
                           ("mixed",))


def test_generated_sampling_parameters_never_break_or_disturb_the_stack(
        stack: Cluster) -> None:
    with httpx.Client(base_url=stack.router_url, timeout=CLIENT_TIMEOUT) as http:
        solo = [_witness_once(http) for _ in range(3)]
    solo_tokens = solo[0][0]
    assert len(solo_tokens) == 16 and all(run[0] == solo_tokens for run in solo)
    solo_latency = statistics.median(run[1] for run in solo)
    # Each hypothesis request is small (<= 3 choices x 8 tokens) and they run one at a
    # time, so the witness shares its batch with at most a few sequences. On two cores
    # that also run the router, the engine, this test process and other people's
    # tests, a step can stall for a second or more; 3 s of slack over the solo run, and
    # at least 5x it, tells such noise from a request that blocks or starves the batch
    # (which costs the whole CLIENT_TIMEOUT).
    bound = max(5 * solo_latency, solo_latency + 3.0)

    witness = Witness(stack.router_url)
    witness.start()
    client = stack.client().with_options(timeout=CLIENT_TIMEOUT)
    seen = {"ok": 0, "refused": 0}
    try:
        with httpx.Client(base_url=stack.router_url, timeout=CLIENT_TIMEOUT) as http:
            @SETTINGS
            @given(case=cases())
            def one(case: Case) -> None:
                status, answer = _send(client, http, case)
                _check(case, status, answer)
                seen["ok" if status == 200 else "refused"] += 1

            one()
    finally:
        witness.stopping.set()
        witness.join(timeout=CLIENT_TIMEOUT + 5)
    assert witness.error is None, f"the witness failed: {witness.error!r}"
    assert seen["ok"] >= 5 and seen["refused"] >= 5, seen  # both sides were exercised
    assert len(witness.runs) >= 5, f"only {len(witness.runs)} witness runs"
    for tokens, latency in witness.runs:
        assert tokens == solo_tokens, "another request changed the witness's greedy output"
        assert latency < bound, \
            f"witness took {latency:.2f} s (solo {solo_latency:.2f} s, bound {bound:.2f} s)"

    # Nothing leaked: the engine is healthy and idle, the router has nothing in flight.
    admin = stack.admin_urls[0]
    assert httpx.get(f"{admin}/healthz", timeout=5).status_code == 200
    assert httpx.get(f"{stack.router_url}/healthz", timeout=5).status_code == 200

    def engine_metric(name: str) -> float:
        return _metric(httpx.get(f"{admin}/metrics", timeout=5).text, name, {})

    def idle() -> bool:
        return (stack.engine_view()[stack.engine_keys[0]]["inflight"] == 0
                and engine_metric("vllm:num_requests_running") == 0
                and engine_metric("vllm:num_requests_waiting") == 0
                and engine_metric("vllm:kv_cache_usage_perc") == 0)

    _wait_for(idle, 5.0, "the router and engine to go idle")
    assert engine_metric("tandem_kv_pinned_blocks") == 0
    assert engine_metric("tandem_kv_quarantined_blocks") == 0
    assert stack.metric("tandem_router_engine_inflight", engine=stack.engine_keys[0]) == 0
    assert all(proc.poll() is None for proc in stack.procs)
