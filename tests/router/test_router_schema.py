"""The router's API surface as a client sees it: every error in the OpenAI shape (404,
405 and 422 too), vLLM's /health, /version, /tokenize and /detokenize, the OpenAPI
description, and schemathesis fuzzing the real stack (an engine and two routers, one
with API keys) against that description: no 5xx, no hang, answers as documented, and
the stack healthy afterwards. Hypothesis goes where the description does not: hostile
object keys (lone surrogates, huge ones) at every level the API reads, and unbounded
numbers in every integer parameter of the table (`api_params.INT_PARAMS`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tandem_engine import protocol as p
from tandem_engine.router.api_params import INT_PARAMS
from tandem_engine.tokenizer import Tokenizer
from test_api_params import HUGE, in_range, int_param_body
from test_router_disagg import scripted_dispatcher

A = "127.0.0.1:2001"
KEY = "sk-schema-key"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.from_path(tiny_llama)


def _answers(request_id, prompt, sampling, pin, resume, pull) -> list:
    return [p.Output(request_id, [7], "ok", finished=True, finish_reason="length")]


def _client(tokenizer: Tokenizer, api_keys: tuple[str, ...] = (), script=_answers):
    """The app over one scripted engine (max_model_len 2048), without its lifespan."""
    from fastapi.testclient import TestClient
    from tandem_engine.router.openai_api import build_app

    dispatcher, _, _ = scripted_dispatcher({A: ("mixed", script)})
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


def _breaks(request_id, prompt, sampling, pin, resume, pull) -> list:
    raise OverflowError("can't serialize ints")  # what msgpack said of a 2**64 top_k


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_s_unexpected_failure_is_a_500_that_closes_its_connection(
        tokenizer: Tokenizer, stream: bool) -> None:
    """An exception a choice's task meets (not the handler) answers through `_failure`,
    not the app's 500 handler: it too says `Connection: close`."""
    client = _client(tokenizer, script=_breaks)
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                             "max_tokens": 2, "stream": stream})
    err = _error(r, 500)
    assert err["type"] == "server_error" and "OverflowError" in err["message"]
    assert r.headers["connection"] == "close"


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


def _types(schema: dict) -> set[str]:
    """Every JSON type a schema admits (through anyOf, and an enum's values)."""
    found = set()
    for branch in schema.get("anyOf", [schema]):
        kind = branch.get("type", [])
        found |= {kind} if isinstance(kind, str) else set(kind)
        for value in branch.get("enum", []):
            found.add({bool: "boolean", str: "string", type(None): "null"}[type(value)])
    return found


def _subschemas(schema: Any, kind: str) -> Iterator[dict]:
    """The (sub)schemas of one JSON type: an anyOf's branches and arrays' items too."""
    if not isinstance(schema, dict):
        return
    if kind in _types({k: v for k, v in schema.items() if k in ("type", "enum")}):
        yield schema
    for branch in schema.get("anyOf", []):
        yield from _subschemas(branch, kind)
    yield from _subschemas(schema.get("items"), kind)


# A table type -> the JSON types its description admits (null aside).
JSON_TYPES = {"string": {"string"}, "integer": {"integer"}, "number": {"number"},
              "boolean": {"boolean"}, "object": {"object"}, "token_ids": {"array"},
              "stop": {"string", "array"}, "prompt": {"string", "array"},
              "messages": {"array"}, "json": set(), "any": set()}


def _floats(*numbers: float) -> tuple[float, ...]:
    """Bounds as FastAPI's OpenAPI model holds them: floats."""
    return tuple(float(n) for n in numbers)


def _assert_described(schema: dict, param) -> None:
    """`schema` says what the table entry `param` says: its type and bounds."""
    from tandem_engine.router import param_table as table

    where = param.name
    null = set() if param.required or param.type in ("any", "json") else {"null"}
    assert _types(schema) == JSON_TYPES[param.type] | null, (where, schema)
    bound = param.bound
    if isinstance(bound, table.IntRange):
        integers = list(_subschemas(schema, "integer"))
        assert integers, where
        for integer in integers:
            assert _floats(integer["minimum"], integer["maximum"]) \
                == _floats(bound.low, bound.high), where
    elif isinstance(bound, table.NumberRange):
        low = schema["exclusiveMinimum" if bound.low_open else "minimum"]
        assert _floats(low, schema["maximum"]) == _floats(bound.low, bound.high), where
    elif isinstance(bound, table.Length):
        strings = list(_subschemas(schema, "string"))
        assert strings, where
        for string in strings:
            assert (string["minLength"], string["maxLength"]) == (bound.low, bound.high)
        if bound.max_items is not None:
            assert [a["maxItems"] for a in _subschemas(schema, "array")] == [bound.max_items]
    elif isinstance(bound, table.Choice):
        assert schema["enum"] == [*bound.values, None], where
    else:  # no bound but the shape's own
        assert not {"minimum", "maximum", "minLength", "maxLength", "enum"} & set(schema) \
            or param.name == "model", where
    if param.name == "model":
        assert "tiny" in schema["enum"]
    if param.members:
        assert set(schema["properties"]) == {m.name for m in param.members}, where
    if param.type == "messages":
        assert set(schema["items"]["properties"]) == set(table.MESSAGE_FIELDS)
        assert schema["items"]["properties"]["role"]["enum"] == list(table.CHAT_ROLES)


def test_the_openapi_request_bodies_are_the_parameter_table(tokenizer: Tokenizer) -> None:
    """The served description documents, for each endpoint, exactly the table's
    implemented and informational parameters (a refused one only takes a neutral value),
    each with the table's type and bounds, required as the table says."""
    from tandem_engine.router import param_table as table

    paths = _client(tokenizer).get("/openapi.json").json()["paths"]

    def body(path: str) -> dict:
        return paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]

    prompt_form, chat_form = body("/tokenize")["anyOf"]
    bodies = {table.COMPLETIONS: body("/v1/completions"),
              table.CHAT: body("/v1/chat/completions"), table.TOKENIZE: prompt_form,
              table.TOKENIZE_CHAT: chat_form, table.DETOKENIZE: body("/detokenize")}
    assert set(bodies) == set(table.ENDPOINTS)
    for endpoint, described in bodies.items():
        documented = table.params(endpoint, table.Status.IMPLEMENTED,
                                  table.Status.INFORMATIONAL)
        assert set(described["properties"]) == {p.name for p in documented}, endpoint
        assert set(described["required"]) == {p.name for p in documented if p.required}
        for param in documented:
            _assert_described(described["properties"][param.name], param)
    # The parameters the hand-written description had lost.
    for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "prompt_logprobs"):
        assert name in bodies[table.COMPLETIONS]["properties"]
        assert name in bodies[table.CHAT]["properties"]
    # The utility endpoints take no other field, and say so.
    assert all(bodies[e]["additionalProperties"] is False
               for e in (table.TOKENIZE, table.TOKENIZE_CHAT, table.DETOKENIZE))


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


# ---- hostile keys and unbounded integers, through the real routers ---------------------------

FUZZ = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
LONE_SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)


@pytest.fixture(scope="module")
def http(stack: tuple[str, str]) -> Iterator[httpx.Client]:
    """One keep-alive connection pool to the open router, for many small requests."""
    with httpx.Client(base_url=stack[0], timeout=30) as client:
        yield client


def _post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    """`body` as JSON, a lone surrogate written as its escape (json.dumps' ensure_ascii),
    NaN and Infinity as Python writes them."""
    return http.post(path, content=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})


def _refusal(r: httpx.Response) -> dict:
    """The OpenAI error of a 4xx; a 5xx, or any other shape, fails."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def _answered(r: httpx.Response) -> None:
    """200, or a 4xx in the OpenAI shape: never a 5xx."""
    if r.status_code != 200:
        _refusal(r)


# Where the API reads an object: (path, body, the object in it that gets the key).
def _spots() -> dict[str, tuple[str, dict, Any]]:
    def chat(**kw: Any) -> dict:
        return {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 1, **kw}

    completion = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    spots: dict[str, tuple[str, dict, Any]] = {}
    for name, path, body in [("completions", "/v1/completions", completion),
                             ("chat", "/v1/chat/completions", chat()),
                             ("tokenize", "/tokenize", {"prompt": "x"}),
                             ("detokenize", "/detokenize", {"tokens": [1]})]:
        spots[name] = (path, body, lambda b: b)
    spots["messages[0]"] = ("/v1/chat/completions", chat(), lambda b: b["messages"][0])
    spots["messages[0].content[0]"] = (
        "/v1/chat/completions", chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "x"}]}]),
        lambda b: b["messages"][0]["content"][0])
    spots["tokenize messages[0]"] = (
        "/tokenize", {"messages": [{"role": "user", "content": "x"}]},
        lambda b: b["messages"][0])
    for name in ("chat_template_kwargs", "response_format", "metadata"):
        spots[name] = ("/v1/chat/completions", chat(**{name: {}}), lambda b, n=name: b[n])
    for name in ("stream_options", "logit_bias", "metadata"):
        spots[f"completions {name}"] = ("/v1/completions", {**completion, name: {}},
                                        lambda b, n=name: b[n])
    return spots


SPOTS = _spots()


def hostile_keys() -> st.SearchStrategy[str]:
    """Object keys no parser may trust: a lone surrogate (alone or inside text), a huge
    key, an empty one, NULs and separators, and names the API itself reads."""
    return st.one_of(
        st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), LONE_SURROGATE,
                  st.text(max_size=4)),
        st.builds(lambda c, n: c * n, st.characters(codec="utf-8"),
                  st.integers(1_000, 50_000)),
        st.sampled_from(["", "\x00", "\u2028", "\ufeff", "a.b", "[0]", "model", "role",
                         "content", "include_usage", "messages", "self", "__class__",
                         "raise_exception", "add_generation_prompt", "0"]),
        st.text(max_size=16))


JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8),
                        st.just({"k": [1, "v"]}))


def _has_lone_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def test_lone_surrogate_keys_are_400s_naming_their_object(stack: tuple[str, str]) -> None:
    """The issue's repros: a key `{"\\ud800": 1}` was a 500 (UnicodeEncodeError) at every
    level; it is a 400 naming the object that holds it."""
    url = stack[0]
    repros = [
        ("/v1/completions", rb'{"model":"tiny","prompt":"hi","max_tokens":2,"\ud800":1}',
         None, "the request body"),
        ("/v1/chat/completions", rb'{"model":"tiny","max_tokens":2,"messages":[{"role":"user",'
         rb'"content":"hi","\ud800":1}]}', "messages[0]", "messages[0]"),
        ("/v1/chat/completions", rb'{"model":"tiny","max_tokens":2,"messages":[{"role":"user",'
         rb'"content":"hi"}],"chat_template_kwargs":{"\ud800":1}}', "chat_template_kwargs",
         "chat_template_kwargs"),
        ("/v1/completions", rb'{"model":"tiny","prompt":"hi","max_tokens":2,"stream":true,'
         rb'"stream_options":{"\ud800":true}}', "stream_options", "stream_options"),
        ("/tokenize", rb'{"prompt":"hi","\ud800":1}', None, "the request body"),
        ("/tokenize", rb'{"messages":[{"role":"user","content":"hi","\udfff":1}]}',
         "messages[0]", "messages[0]"),
        ("/detokenize", rb'{"tokens":[1],"a\ud800b":1}', None, "the request body"),
    ]
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, raw, param, where in repros:
            r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            error = _refusal(r)
            assert r.status_code == 400 and error["param"] == param, (path, error)
            assert error["message"].startswith(
                f"{where} holds a key with a lone UTF-16 surrogate"), error
    _healthy(url, {})


@pytest.mark.parametrize("name, value", [
    ("top_k", 2**64), ("top_k", 10**30), ("top_k", 1e308), ("top_k", -2**63 - 1),
    ("seed", 2**64), ("n", 1e308), ("max_tokens", 10**30), ("min_tokens", 2**64),
    ("max_completion_tokens", 1e308), ("top_logprobs", 2**64), ("prompt", 2**64),
    ("stop_token_ids", 10**30), ("tokens", 2**64)])
def test_integers_past_their_bound_are_400s_naming_it(http: httpx.Client, name: str,
                                                      value: Any) -> None:
    """The issue's repro: top_k=2**64 reached the engine's msgpack encoder, a 500 ("can't
    serialize ints") without `Connection: close`. Every integer parameter's range is its
    `INT_PARAMS` entry, a 400 naming the parameter, the range and what it means."""
    bound = INT_PARAMS[name]
    path, body = int_param_body(name, value)
    for stream in ((False, True) if path == "/v1/completions" else (False,)):
        r = _post(http, path, {**body, "stream": True} if stream else body)
        error = _refusal(r)
        assert r.status_code == 400 and error["param"] == name, error
        assert f"between {bound.low} and {bound.high}" in error["message"], error
        assert len(error["message"]) < 300, error  # 1e308 quoted as sent, not 309 digits


@FUZZ
@given(spot=st.sampled_from(sorted(SPOTS)), key=hostile_keys(), value=JSON_VALUES)
def test_hostile_keys_anywhere_are_never_a_5xx(http: httpx.Client, spot: str, key: str,
                                               value: Any) -> None:
    path, template, where = SPOTS[spot]
    body = json.loads(json.dumps(template))  # a fresh copy
    where(body)[key] = value
    r = _post(http, path, body)
    if _has_lone_surrogate(key):
        error = _refusal(r)
        assert r.status_code == 400 and "a key with a lone UTF-16 surrogate" in error["message"]
    else:
        _answered(r)


def unbounded_numbers() -> st.SearchStrategy[Any]:
    """Numbers from far past any integer field's range (and JSON's usual integers): 2**64
    and its neighbours, 10**30, 1e308, -0.0, NaN, Infinity, fractions."""
    return st.one_of(
        st.sampled_from([*HUGE, -0.0, 0.0, 1.0, 2**64 - 1, 2**63 - 1, 2**31, 2**31 - 1]),
        st.integers(min_value=-(2**256), max_value=2**256),
        st.integers(min_value=2**63 - 4, max_value=2**64 + 4),
        st.integers(min_value=-4, max_value=2100),
        st.floats())


@FUZZ
@given(name=st.sampled_from(sorted(INT_PARAMS)), value=unbounded_numbers())
def test_unbounded_integers_in_every_integer_parameter_are_never_a_5xx(
        http: httpx.Client, name: str, value: Any) -> None:
    bound = INT_PARAMS[name]
    r = _post(http, *int_param_body(name, value))
    if in_range(value, bound):
        _answered(r)  # in range: a 400 only for what the model bounds (context, vocabulary)
    else:
        error = _refusal(r)
        assert r.status_code == 400 and error["param"] == name, error
        assert f"between {bound.low} and {bound.high}" in error["message"], error


def test_the_routers_stay_healthy_after_the_hostile_bodies(stack: tuple[str, str]) -> None:
    open_url, keyed_url = stack
    _healthy(open_url, {})
    _healthy(keyed_url, {"Authorization": f"Bearer {KEY}"})
