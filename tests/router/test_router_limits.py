"""The router's request bounds and event loop: body and prompt limits, token ids out of
range, lone surrogates and deep JSON answered 400/413 (never 500), a 500 that closes its
connection explicitly, no in-flight count leaked by a refused submission, and a long
prompt tokenized off the event loop while `/healthz` stays instant (a real uvicorn
server in a thread, over scripted engines)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from tandem_engine import protocol as p
from tandem_engine.router import api_params as ap
from tandem_engine.router.api_params import InvalidRequest, RequestLimits
from tandem_engine.router.engines import EnginePool
from tandem_engine.sampling_params import MAX_TOKEN_ID, SamplingParams
from tandem_engine.tokenizer import Tokenizer
from test_router_disagg import scripted_dispatcher

A = "127.0.0.1:2001"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.from_path(tiny_llama)


def _answers(request_id, prompt, sampling, pin, resume, pull) -> list:
    return [p.Output(request_id, [7], "ok", finished=True, finish_reason="length")]


def _app(tokenizer: Tokenizer, limits: RequestLimits | None = None):
    """The app over one scripted engine (max_model_len 2048), without its lifespan (the
    scripted engine has no socket)."""
    from tandem_engine.router.openai_api import build_app

    dispatcher, _, _ = scripted_dispatcher({A: ("mixed", _answers)})
    return build_app(dispatcher.pool, tokenizer, "tiny", dispatcher, limits)


@pytest.fixture
def client(tokenizer: Tokenizer):
    from fastapi.testclient import TestClient

    return TestClient(_app(tokenizer, RequestLimits(max_body_bytes=4096,
                                                    max_prompt_chars=100)),
                      raise_server_exceptions=False)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---- the raw body ----------------------------------------------------------------------------


def test_deep_json_is_refused_naming_the_limit() -> None:
    for depth in (100_000, ap.MAX_JSON_DEPTH + 1):
        with pytest.raises(InvalidRequest, match=f"deeper than {ap.MAX_JSON_DEPTH}"):
            ap.decode_body(b"[" * depth + b"]" * depth)
    deep = {"model": "tiny", "prompt": "x", "stop": [[[]]]}
    for _ in range(ap.MAX_JSON_DEPTH):
        deep["stop"] = [deep["stop"]]
    with pytest.raises(InvalidRequest) as exc:
        ap.decode_body(json.dumps(deep).encode())
    assert exc.value.param.startswith("stop[0][0]")
    body = {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}]}
    assert ap.decode_body(json.dumps(body).encode()) == body


def test_lone_surrogates_are_refused_naming_the_field() -> None:
    for raw, param in [(rb'{"model": "tiny", "prompt": "a\ud800b"}', "prompt"),
                       (rb'{"messages": [{"role": "user", "content": "\udfff"}]}',
                        "messages[0].content"),
                       (rb'{"stop": ["ok", "\ud800"]}', "stop[1]"),
                       (rb'{"\ud800": 1}', None)]:  # the key cannot name itself
        with pytest.raises(InvalidRequest, match="lone UTF-16 surrogate") as exc:
            ap.decode_body(raw)
        assert exc.value.param == param and exc.value.status == 400
    # A surrogate pair is one real character.
    assert ap.decode_body(rb'{"prompt": "\ud83d\ude00"}') == {"prompt": "\U0001F600"}


@pytest.mark.parametrize("prompt, param", [
    ([2**64], "prompt"), ([2**63], "prompt"), ([1, -1], "prompt"), ([[1], [2**70]], "prompt"),
])
def test_token_ids_out_of_range_are_refused(prompt, param) -> None:
    with pytest.raises(InvalidRequest, match="must be an integer between 0 and") as exc:
        ap.parse_completion({"model": "tiny", "prompt": prompt})
    assert exc.value.param == param


@pytest.mark.parametrize("ids", [[2**64], [2**63], [-1], [MAX_TOKEN_ID + 1]])
def test_stop_token_ids_out_of_range_are_refused(ids) -> None:
    with pytest.raises(InvalidRequest) as exc:
        ap.parse_completion({"model": "tiny", "prompt": "x", "stop_token_ids": ids})
    assert exc.value.param == "stop_token_ids"


def test_error_messages_quote_a_huge_value_shortened() -> None:
    with pytest.raises(InvalidRequest) as exc:
        ap.parse_completion({"model": "tiny", "prompt": "x", "max_tokens": "9" * 100_000})
    assert len(exc.value.message) < 300


def test_prompt_characters_are_bounded() -> None:
    limits = RequestLimits(max_prompt_chars=10)
    ap.check_prompt_chars(ap.parse_completion({"model": "m", "prompt": ["x" * 10, [1] * 50]}),
                          limits)
    with pytest.raises(InvalidRequest, match="--max-prompt-chars") as exc:
        ap.check_prompt_chars(ap.parse_completion({"model": "m", "prompt": ["x", "y" * 11]}),
                              limits)
    assert exc.value.param == "prompt" and "11 characters" in exc.value.message
    chat = ap.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x" * 6},
                                                     {"role": "user", "content": "y" * 6}]})
    with pytest.raises(InvalidRequest, match="over the limit of 10") as exc:
        ap.check_prompt_chars(chat, limits)
    assert exc.value.param == "messages"
    with pytest.raises(ValueError, match="max_body_bytes"):
        RequestLimits(max_body_bytes=0)


def test_releasing_the_gil_encodes_the_same_ids(tokenizer: Tokenizer) -> None:
    text = "The quick brown fox <s> jumps é 😀"
    for special in (True, False):
        assert tokenizer.encode_releasing_gil(text, special) == tokenizer.encode(text, special)


# ---- the in-flight count ---------------------------------------------------------------------


class _Socket:
    def send(self, frame: bytes, flags: int = 0):  # pragma: no cover - never reached
        raise AssertionError("an unencodable message was sent")


def test_a_refused_submission_leaves_nothing_in_flight() -> None:
    client = EnginePool([A]).clients[0]
    client.connected, client._socket = True, _Socket()
    with pytest.raises(OverflowError):  # msgpack has no integer that large
        client.submit("r.1", [2**64], SamplingParams(max_tokens=2))
    assert client.inflight == 0


def _refuses(request_id, prompt, sampling, pin, resume, pull) -> list:
    return [p.Reject(request_id, 400, "prompt token id 9 is outside the vocabulary")]


def test_a_refused_attempt_leaves_nothing_in_flight() -> None:
    """However the dispatch of a choice ends (here the engine refuses it), the engine's
    in-flight count returns to where it was."""
    from tandem_engine.router.attempts import EngineRejected

    dispatcher, _, _ = scripted_dispatcher({A: ("mixed", _refuses)})
    engine = dispatcher.pool.by_key[A]
    engine._queues = {}
    original = engine.submit

    def tracked(request_id, *args, **kw):
        engine._queues[request_id] = original(request_id, *args, **kw)
        return engine._queues[request_id]

    def abort(request_id):
        engine.aborted.append(request_id)
        engine._queues.pop(request_id, None)

    engine.submit, engine.abort = tracked, abort

    async def go() -> None:
        async for _ in dispatcher.generate("r", [9, 9, 9], SamplingParams(max_tokens=2)):
            pass

    with pytest.raises(EngineRejected):
        asyncio.run(go())
    assert engine.inflight == 0 and engine.aborted == ["r.1"]


# ---- the app ---------------------------------------------------------------------------------


def test_the_app_answers_every_bad_body_in_the_openai_shape(client) -> None:
    err = _error(client.post("/v1/completions", content=b"x" * 5000), 413)
    assert "--max-body-bytes" in err["message"] and "4096" in err["message"]
    r = client.post("/v1/completions", content=b"x" * 5000)
    assert r.headers["connection"] == "close" and err["code"] == "request_too_large"
    chunked = iter([b"x" * 3000, b"x" * 3000])  # no Content-Length: counted as it comes
    assert _error(client.post("/v1/completions", content=chunked), 413)["param"] is None
    err = _error(client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 101}),
                 400)
    assert err["param"] == "prompt" and "--max-prompt-chars" in err["message"]
    err = _error(client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x" * 101}]}), 400)
    assert err["param"] == "messages"
    assert _error(client.post("/v1/completions", content=b"[" * 2000 + b"]" * 2000),
                  400)["message"].startswith("the request body nests deeper")
    err = _error(client.post("/v1/completions", content=rb'{"model": "tiny", "prompt": '
                             rb'"\ud800"}'), 400)
    assert err["param"] == "prompt"
    for body, param in [({"prompt": [1, 2**64]}, "prompt"),
                        ({"prompt": "x", "stop_token_ids": [2**64]}, "stop_token_ids")]:
        err = _error(client.post("/v1/completions", json={"model": "tiny", **body}), 400)
        assert err["param"] == param
    assert client.app.state.dispatcher.pool.by_key[A].inflight == 0
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 100})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x" * 100}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


def test_a_500_closes_its_connection_explicitly(client) -> None:
    def boom() -> None:
        raise RuntimeError("a bug")

    client.app.get("/boom")(boom)
    r = client.get("/boom")
    err = _error(r, 500)
    assert err["type"] == "server_error" and "RuntimeError" in err["message"]
    assert r.headers["connection"] == "close"


# ---- the event loop, over real HTTP ----------------------------------------------------------


def test_healthz_stays_instant_while_a_huge_request_is_refused_or_tokenized(
        tokenizer: Tokenizer) -> None:
    import uvicorn
    from tandem_engine.cli.serve import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_app(tokenizer), host="127.0.0.1", port=port,
                                           lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started

    def timed(method: str, path: str, **kw) -> tuple[float, httpx.Response]:
        start = time.monotonic()
        with httpx.Client(base_url=url, timeout=30) as http:
            r = http.request(method, path, **kw)
        return time.monotonic() - start, r

    def healthz_while(path: str, body: bytes) -> tuple[float, httpx.Response, float]:
        with ThreadPoolExecutor(2) as pool:
            big = pool.submit(timed, "POST", path, content=body,
                              headers={"Content-Type": "application/json"})
            worst = 0.0
            while not big.done():
                took, r = timed("GET", "/healthz")
                assert r.status_code == 200
                worst = max(worst, took)
            took, r = big.result()
        return took, r, worst

    try:
        huge = json.dumps({"model": "tiny", "prompt": "The quick brown fox. " * 400_000})
        took, r, worst = healthz_while("/v1/completions", huge.encode())  # 8.4 MB
        assert r.status_code == 413 and took < 1.0, (r.status_code, took)
        assert worst < 0.5, worst
        # Under both limits: ~1 s of tokenizing (more on a busy machine), then refused
        # against the context. On the event loop, /healthz would wait all that time.
        long = json.dumps({"model": "tiny", "prompt": "The quick brown fox. " * 45_000})
        took, r, worst = healthz_while("/v1/completions", long.encode())
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # Blocked, the first /healthz would wait nearly the whole tokenizing; on a loaded
        # 2-core machine a free loop still saw one answer take 0.46 s of 0.72 s (the OS
        # running other work), so the bound separates the two cases, not a latency goal.
        assert worst < min(1.0, 0.75 * took), (worst, took)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_router_flags_set_the_limits() -> None:
    from tandem_engine.router.main import build_parser

    args = build_parser().parse_args(["--engine", A, "--model", "m"])
    assert (args.max_body_bytes, args.max_prompt_chars) == (4 * 1024 * 1024, 1_000_000)
    args = build_parser().parse_args(["--engine", A, "--model", "m", "--max-body-bytes", "9",
                                      "--max-prompt-chars", "7"])
    assert (args.max_body_bytes, args.max_prompt_chars) == (9, 7)


def test_the_wire_limit_matches_the_router_bound() -> None:
    # Every id the router lets through can be encoded for the engine.
    p.encode(p.Submit("r", [MAX_TOKEN_ID], SamplingParams(stop_token_ids=[MAX_TOKEN_ID])))
