"""The router's API surface as a client sees it: every error in the OpenAI shape (404,
405 and 422 too), vLLM's /health, /version, /tokenize and /detokenize, the OpenAPI
description, and schemathesis fuzzing the real stack (an engine and two routers, one
with API keys) against that description: no 5xx, no hang, answers as documented, and
the stack healthy afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tandem_engine import protocol as p
from tandem_engine.tokenizer import Tokenizer
from test_router_disagg import scripted_dispatcher

A = "127.0.0.1:2001"
KEY = "sk-schema-key"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.from_path(tiny_llama)


def _answers(request_id, prompt, sampling, pin, resume, pull) -> list:
    return [p.Output(request_id, [7], "ok", finished=True, finish_reason="length")]


def _client(tokenizer: Tokenizer, api_keys: tuple[str, ...] = ()):
    """The app over one scripted engine (max_model_len 2048), without its lifespan."""
    from fastapi.testclient import TestClient
    from tandem_engine.router.openai_api import build_app

    dispatcher, _, _ = scripted_dispatcher({A: ("mixed", _answers)})
    app = build_app(dispatcher.pool, tokenizer, "tiny", dispatcher, api_keys=api_keys)
    return TestClient(app, raise_server_exceptions=False)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


# ---- errors ----------------------------------------------------------------------------------


def test_unknown_paths_wrong_methods_and_validation_errors_are_openai_shaped(
        tokenizer: Tokenizer) -> None:
    client = _client(tokenizer)
    err = _error(client.post("/v1/nothing", json={}), 404)
    assert "POST /v1/nothing" in err["message"] and err["type"] == "invalid_request_error"
    err = _error(client.get("/v1/completions"), 405)
    assert "GET /v1/completions" in err["message"] and "POST" in err["message"]
    assert client.get("/v1/completions").headers["allow"] == "POST"
    err = _error(client.delete("/tokenize"), 405)
    assert "DELETE /tokenize" in err["message"]

    def typed(limit: int) -> dict:  # FastAPI validates the query parameter: a 422
        return {"limit": limit}

    client.app.get("/typed")(typed)
    err = _error(client.get("/typed", params={"limit": "many"}), 422)
    assert err["param"] == "query.limit" and "GET /typed" in err["message"]
    assert "query.limit" in err["message"]
    err = _error(client.post("/v1/completions", content=b"{nope"), 400)
    assert "not valid JSON" in err["message"]


# ---- vLLM's utility endpoints ----------------------------------------------------------------


def test_tokenize_and_detokenize_answer_as_vllm(tokenizer: Tokenizer) -> None:
    client = _client(tokenizer)
    text = "The quick brown fox"
    r = client.post("/tokenize", json={"model": "tiny", "prompt": text})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode(text)
    assert r.json() == {"count": len(ids), "max_model_len": 2048, "tokens": ids}
    bare = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                          "return_token_strs": True}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert "".join(bare["token_strs"]).replace("▁", " ").strip() == text
    r = client.post("/detokenize", json={"model": "tiny", "tokens": bare["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": text}

    # A chat counts exactly the ids /v1/chat/completions would send to the engine.
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"}]
    api_ids = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    expected = tokenizer.encode(_render(tokenizer, messages, True), add_special_tokens=False)
    assert api_ids == expected
    no_prompt = client.post("/tokenize", json={"messages": messages,
                                               "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == tokenizer.encode(_render(tokenizer, messages, False),
                                                   add_special_tokens=False)
    assert no_prompt["count"] < len(api_ids)


def _render(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    from tandem_engine.router.chat import ChatTemplate

    template = ChatTemplate.from_tokenizer(tokenizer)
    assert template is not None
    return template.render(messages, add_generation_prompt)


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400,
     "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 7}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "truncate": 3}, 400, "truncate"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x" * 2_000_000}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {"prompt": "x"}, 400, "prompt"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_tokenize_bodies_are_refused_naming_the_field(tokenizer: Tokenizer, path: str,
                                                          body: dict, status: int,
                                                          param: str) -> None:
    err = _error(_client(tokenizer).post(path, json=body), status)
    assert err["param"] == param, err


def test_health_and_version(tokenizer: Tokenizer) -> None:
    from tandem_engine.router.openai_api import VERSION

    client = _client(tokenizer)
    r = client.get("/health")
    assert r.status_code == 200 and r.content == b""  # the scripted engine is RUNNING
    client.app.state.dispatcher.picker.ready = lambda: False  # no engine serves
    r = client.get("/health")
    assert r.status_code == 503 and r.content == b""
    assert client.get("/version").json() == {"version": VERSION} and VERSION


def test_the_openapi_description_documents_bodies_errors_and_keys(
        tokenizer: Tokenizer) -> None:
    schema = _client(tokenizer).get("/openapi.json").json()
    paths = schema["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        operation = paths[path]["post"]
        assert operation["requestBody"]["required"] is True
        assert "default" in operation["responses"] and "security" not in operation
    assert "securitySchemes" not in schema.get("components", {})
    keyed = _client(tokenizer, (KEY,))
    assert keyed.get("/openapi.json").status_code == 401
    schema = keyed.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert schema["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert schema["paths"]["/tokenize"]["post"]["security"] == [{"apiKey": []}]
    assert "security" not in schema["paths"]["/health"]["get"]


# ---- schemathesis against the real stack ----------------------------------------------------

FUZZED = r"^/(v1/completions|v1/chat/completions|v1/models|tokenize|detokenize|version)$"
EXAMPLES = 8  # per operation and generation mode: the file stays within a minute


@pytest.fixture(scope="module")
def stack(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[str, str]]:
    """One engine with two routers over it: (open router URL, keyed router URL)."""
    from test_router_auth import keyed_router
    from test_router_e2e import run_cluster

    logs = tmp_path_factory.mktemp("router-schema")
    for cluster in run_cluster(tiny_llama, logs, ("mixed",)):
        with keyed_router(cluster, logs, [KEY]) as keyed_url:
            yield cluster.router_url, keyed_url


def _fuzz(base_url: str, headers: dict[str, str]) -> int:
    """Every fuzzed operation, positive and negative examples; returns how many were sent."""
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        ignored_auth,
        negative_data_rejection,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
        unsupported_method,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_headers_conformance, response_schema_conformance, unsupported_method]
    if headers:
        checks.append(ignored_auth)  # the key is enforced where the schema says so
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=headers,
                                           timeout=10).include(path_regex=FUZZED)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 6, [op.label for op in operations]
    sent = 0
    for operation in operations:
        # /tokenize and /detokenize are described exactly, so whatever breaks their schema
        # must be refused; the generation endpoints accept more than their schema says.
        exact = [negative_data_rejection] if "tokenize" in operation.path else []
        has_body = operation.method.upper() == "POST"  # a GET has nothing to negate
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[:1 + has_body]:
            sent += _fuzz_operation(operation, mode, base_url, headers, checks + exact)
    return sent


def _fuzz_operation(operation, mode, base_url: str, headers: dict[str, str],
                    checks: list) -> int:
    from hypothesis import HealthCheck, given, settings

    sent = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        nonlocal sent
        _bound_the_work(case)
        response = case.call(base_url=base_url, headers=headers, timeout=20)
        case.validate_response(response, checks=checks, headers=headers,
                               transport_kwargs={"base_url": base_url, "headers": headers})
        sent += 1

    run()
    return sent


def _bound_the_work(case) -> None:
    """Keep generation short (a chat without max_tokens runs to the end of the context):
    the fuzzing is about the API's edges, not the engine's throughput."""
    body = case.body
    if not isinstance(body, dict) or not case.operation.path.startswith("/v1/"):
        return
    names = [n for n in ("max_tokens", "max_completion_tokens") if body.get(n) is not None]
    if not names:
        body["max_tokens"] = 4
    for name in names:  # a negative example's wrong value stays wrong
        if isinstance(body[name], int) and not isinstance(body[name], bool) \
                and body[name] > 4:
            body[name] = 4


def _healthy(base_url: str, headers: dict[str, str]) -> None:
    assert httpx.get(f"{base_url}/healthz", timeout=5).status_code == 200
    r = httpx.post(f"{base_url}/v1/completions", headers=headers, timeout=30,
                   json={"model": "tiny", "prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_schemathesis_finds_no_5xx_and_no_hang(stack: tuple[str, str]) -> None:
    open_url, keyed_url = stack
    auth = {"Authorization": f"Bearer {KEY}"}
    start = time.monotonic()
    sent = _fuzz(open_url, {}) + _fuzz(keyed_url, auth)
    assert sent >= (2 + 4 * 2) * 2, sent
    _healthy(open_url, {})
    _healthy(keyed_url, auth)
    assert httpx.get(f"{keyed_url}/readyz", timeout=5).status_code == 200
    print(f"schemathesis: {sent} requests in {time.monotonic() - start:.1f} s")
