"""LoRA adapters in the router without engine processes: the pure rules (which engines
serve an adapter, at which version, and the affinity of one already on the device), the
picker over scripted engines (filtering, pairing a prefill and a decode engine of one
version, prefix hashes salted as the engines salt them), the dispatcher (the adapter's
version on every Submit, kept across a refused pull and a failover), the API (`model`
selects an adapter, `/v1/models` lists them, 404 otherwise) and the admin calls (the
admin token, the fan-out to every engine and how its answers combine)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
from tandem_engine import protocol as p
from tandem_engine.core.kv.hashing import block_hashes, block_salt
from tandem_engine.router.engines import EngineClient, EnginePool, EngineUnavailable
from tandem_engine.router.routing import (
    RoutingWeights,
    adapter_identity,
    choose,
    eligible,
    served_adapters,
)
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.tokenizer import Tokenizer
from test_router_disagg import PROMPT, TARGET, colocated, scripted, scripted_dispatcher
from test_router_unit import view

A, B, C = "127.0.0.1:3001", "127.0.0.1:3002", "127.0.0.1:3003"


def serve(client: EngineClient, loras: list[str], resident: list[str] = ()) -> None:
    """Make a scripted engine report these adapters in its load."""
    assert client.load is not None
    client.load = msgspec.structs.replace(client.load, loras=list(loras),
                                          resident_loras=list(resident))


# ---- the rules ---------------------------------------------------------------------------------


def test_an_adapter_is_found_by_name_or_by_identity() -> None:
    e = view("a", loras=frozenset({"sql@1", "chat@v2"}))
    assert adapter_identity(e, "sql") == "sql@1"
    assert adapter_identity(e, "chat@v2") == "chat@v2"
    assert adapter_identity(e, "chat@v1") is None and adapter_identity(e, "x") is None
    engines = [e, view("b", loras=frozenset({"chat@v3"})),
               view("c", loras=frozenset({"chat@v3", "dead@1"})),
               view("d", alive=False, loras=frozenset({"gone@1"}))]
    # By name, each identity alive engines serve, the most served first.
    assert served_adapters(engines) == {"chat": ["chat@v3", "chat@v2"], "dead": ["dead@1"],
                                        "sql": ["sql@1"]}
    assert [x.key for x in eligible(engines, adapter="chat")] == ["a", "b", "c"]
    assert [x.key for x in eligible(engines, adapter="chat@v3")] == ["b", "c"]
    assert [x.key for x in eligible(engines, adapter="sql", exclude=["a"])] == []
    assert [x.key for x in eligible(engines)] == ["a", "b", "c"]  # the base: every engine


def test_an_adapter_on_the_device_is_weighed_against_load() -> None:
    w = RoutingWeights(lora_weight=2.0)
    cold = view("cold", loras=frozenset({"a@1"}))
    warm = view("warm", loras=frozenset({"a@1"}), resident_loras=frozenset({"a@1"}),
                inflight=1)
    assert choose([cold, warm], {}, w, adapter="a").key == "warm"  # 2 - 1 > 0
    assert choose([cold, replace(warm, inflight=3)], {}, w, adapter="a").key == "cold"
    assert choose([cold, warm], {}, w).key == "cold"  # the base model: load alone
    # A cached prefix still counts beside it.
    assert choose([cold, warm], {"cold": 1.0}, w, adapter="a").key == "cold"  # 4 > 2 - 1


# ---- the picker ----------------------------------------------------------------------------------


def _pool(roles: dict[str, str], loras: dict[str, list[str]],
          resident: dict[str, list[str]] | None = None) -> EnginePool:
    pool = EnginePool(list(roles))
    for client in pool.clients:
        scripted(client, roles[client.key], colocated, [])
        serve(client, loras.get(client.key, []), (resident or {}).get(client.key, []))
    return pool


def test_the_picker_offers_only_engines_serving_the_adapter() -> None:
    from tandem_engine.router.picker import EnginePicker

    pool = _pool({A: "mixed", B: "mixed", C: "mixed"},
                 {A: ["sql@1"], B: ["sql@2"], C: []})
    picker = EnginePicker(pool)
    assert {picker.pick([1, 2, 3], adapter="sql").key for _ in range(6)} == {A, B}
    assert {picker.pick([1, 2, 3], adapter="sql@2").key for _ in range(3)} == {B}
    assert picker.pick([1, 2, 3], adapter="chat") is None
    assert {picker.pick([1, 2, 3]).key for _ in range(6)} == {A, B, C}


def test_the_picker_prefers_the_engine_with_the_adapter_resident() -> None:
    from tandem_engine.router.picker import EnginePicker

    pool = _pool({A: "mixed", B: "mixed"}, {A: ["sql@1"], B: ["sql@1"]}, {B: ["sql@1"]})
    picker = EnginePicker(pool)
    assert {picker.pick([1, 2, 3], adapter="sql").key for _ in range(4)} == {B}


def test_prefix_hashes_are_salted_with_the_adapter_version_each_engine_serves() -> None:
    from tandem_engine.router.picker import EnginePicker

    pool = _pool({A: "mixed"}, {A: ["sql@7"]})
    picker = EnginePicker(pool)
    prompt = list(range(64))
    client = picker.pick(prompt, adapter="sql")
    index = picker._index(client.key)
    assert index.match(block_hashes(prompt, 16, block_salt(1, None, "sql@7"))) == 4
    assert index.match(block_hashes(prompt, 16, block_salt(1, None))) == 0  # not the base's


def test_a_pair_serves_the_adapter_at_one_version() -> None:
    from tandem_engine.router.picker import EnginePicker

    pre, dec_other, dec_same = "127.0.0.1:3101", "127.0.0.1:3102", "127.0.0.1:3103"
    pool = _pool({pre: "prefill", dec_other: "decode", dec_same: "decode"},
                 {pre: ["sql@1"], dec_other: ["sql@2"], dec_same: ["sql@1"]},
                 {dec_other: ["sql@2"]})
    picker = EnginePicker(pool)
    for _ in range(4):
        prefill, decode = picker.pick_pair([1, 2, 3], adapter="sql")
        assert (prefill.key, decode.key) == (pre, dec_same)
    # No decode engine serves the prefill's version: no pair (the request runs colocated).
    serve(pool.by_key[dec_same], [])
    assert picker.pick_pair([1, 2, 3], adapter="sql") is None
    assert picker.pick_pair([1, 2, 3]) is not None  # the base model pairs as before


# ---- the dispatcher ------------------------------------------------------------------------------


def _generate(dispatcher, adapter: str | None, max_tokens: int = 6) -> list:
    async def go() -> list:
        return [d async for d in dispatcher.generate(
            "r", list(PROMPT), SamplingParams(max_tokens=max_tokens, temperature=0.0),
            adapter=adapter)]
    return asyncio.run(go())


def test_every_submit_carries_the_adapter_version_its_engine_serves() -> None:
    dispatcher, calls, _ = scripted_dispatcher({A: ("mixed", colocated),
                                                B: ("mixed", colocated)})
    serve(dispatcher.pool.by_key[A], [])
    serve(dispatcher.pool.by_key[B], ["sql@3"])
    deltas = _generate(dispatcher, "sql")
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert [(c.key, c.lora) for c in calls] == [(B, p.LoRARef("sql", "3"))]
    calls.clear()
    _generate(dispatcher, None)
    assert all(c.lora is None for c in calls)


def test_a_decode_engine_refusing_the_adapter_hands_the_choice_back_colocated() -> None:
    """The decode engine lost the adapter between pairing and the pull: it refuses (the
    engines' 503 for an adapter they do not serve), and the choice continues on the
    prefill engine, under the same version, resumed after the first token."""
    from test_router_disagg import DEC, PRE

    def refuses(request_id, prompt, sampling, pin, resume, pull):
        serve(dispatcher.pool.by_key[DEC], [])
        return [p.Reject(request_id, 503, "engine does not serve LoRA adapter sql@1")]

    dispatcher, calls, _ = scripted_dispatcher({PRE: ("prefill", colocated),
                                                DEC: ("decode", refuses)})
    for key in (PRE, DEC):
        serve(dispatcher.pool.by_key[key], ["sql@1"])
    deltas = _generate(dispatcher, "sql")
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert [(c.key, c.lora, c.pull is not None, c.resume) for c in calls] == [
        (PRE, p.LoRARef("sql", "1"), False, None),
        (DEC, p.LoRARef("sql", "1"), True, p.Resume(TARGET[:1], 1)),
        (PRE, p.LoRARef("sql", "1"), False, p.Resume(TARGET[:1], 1))]


def test_a_failover_keeps_the_adapter_version_of_the_tokens_so_far() -> None:
    from tandem_engine.router.engines import EngineLost

    def dies(request_id, prompt, sampling, pin, resume, pull):
        dispatcher.pool.by_key[A].connected = False
        return [p.Output(request_id, TARGET[:2], "xx"), EngineLost("gone")]

    dispatcher, calls, _ = scripted_dispatcher(
        {A: ("mixed", dies), B: ("mixed", colocated), C: ("mixed", colocated)},
        failover_timeout=0.2)
    serve(dispatcher.pool.by_key[A], ["sql@1"])
    serve(dispatcher.pool.by_key[B], ["sql@2"])  # another version: never continued on
    serve(dispatcher.pool.by_key[C], ["sql@1"])
    for key in (B, C):  # A first
        dispatcher.pool.by_key[key].load = msgspec.structs.replace(
            dispatcher.pool.by_key[key].load, num_running=5)
    deltas = _generate(dispatcher, "sql")
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert [(c.key, c.lora) for c in calls] == [(A, p.LoRARef("sql", "1")),
                                                (C, p.LoRARef("sql", "1"))]


def test_with_the_version_gone_everywhere_the_choice_recomputes_under_the_current() -> None:
    from tandem_engine.router.engines import EngineLost

    def dies(request_id, prompt, sampling, pin, resume, pull):
        dispatcher.pool.by_key[A].connected = False
        return [p.Output(request_id, TARGET[:2], "xx"), EngineLost("gone")]

    dispatcher, calls, _ = scripted_dispatcher({A: ("mixed", dies), B: ("mixed", colocated)},
                                               failover_timeout=0.2)
    serve(dispatcher.pool.by_key[A], ["sql@1"])
    serve(dispatcher.pool.by_key[B], ["sql@2"])
    dispatcher.pool.by_key[B].load = msgspec.structs.replace(
        dispatcher.pool.by_key[B].load, num_running=5)
    _generate(dispatcher, "sql")
    assert [(c.key, c.lora) for c in calls] == [(A, p.LoRARef("sql", "1")),
                                                (B, p.LoRARef("sql", "2"))]


# ---- the API -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.from_path(tiny_llama)


def _app(tokenizer: Tokenizer, loras: dict[str, list[str]], *, api_keys=(),
         admin_token: str | None = None):
    from fastapi.testclient import TestClient
    from tandem_engine.router.openai_api import build_app

    dispatcher, calls, _ = scripted_dispatcher({A: ("mixed", colocated),
                                                B: ("mixed", colocated)})
    for key, served in loras.items():
        serve(dispatcher.pool.by_key[key], served)
    app = build_app(dispatcher.pool, tokenizer, "tiny", dispatcher, api_keys=api_keys,
                    admin_token=admin_token)
    return TestClient(app, raise_server_exceptions=False), dispatcher, calls


def test_the_model_selects_the_adapter_and_models_lists_them(tokenizer: Tokenizer) -> None:
    client, _, calls = _app(tokenizer, {A: ["sql@1", "chat@2"], B: ["sql@1"]})
    r = client.post("/v1/completions", json={"model": "sql", "prompt": PROMPT,
                                             "max_tokens": 6})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"  # the response names the model asked for, as vLLM's
    assert calls[-1].lora == p.LoRARef("sql", "1")
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                             "max_tokens": 6})
    assert r.status_code == 200 and calls[-1].lora is None
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in models] == [
        ("tiny", None, "tiny"), ("chat", "tiny", "chat@2"), ("sql", "tiny", "sql@1")]
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "'tiny' and the LoRA adapters 'chat', 'sql'" in error["message"]
    assert client.post("/tokenize", json={"model": "chat", "prompt": "x"}).status_code == 200


# ---- admin calls ---------------------------------------------------------------------------------


def test_the_admin_calls_need_the_admin_token_and_no_api_key_opens_them(
        tokenizer: Tokenizer) -> None:
    body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    closed, _, _ = _app(tokenizer, {}, api_keys=("key",))
    r = closed.post("/v1/load_lora_adapter", json=body,
                    headers={"Authorization": "Bearer key"})
    assert r.status_code == 403 and "--admin-token-file" in r.json()["error"]["message"]
    client, _, _ = _app(tokenizer, {}, api_keys=("key",), admin_token="adm")
    for token in (None, "key", "wrong"):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        r = client.post("/v1/load_lora_adapter", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
    # The admin token is no API key either.
    assert client.post("/v1/completions", json={"model": "tiny", "prompt": "x"},
                       headers={"Authorization": "Bearer adm"}).status_code == 401
    admin = {"Authorization": "Bearer adm"}
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": "/x"},
                    headers=admin)
    assert r.status_code == 400 and "served model's name" in r.json()["error"]["message"]
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "sql"}, headers=admin)
    assert r.status_code == 400 and "lora_path" in r.json()["error"]["message"]
    r = client.post("/v1/load_lora_adapter", json={**body, "lora_name": "bad name"},
                    headers=admin)
    assert r.status_code == 400 and "invalid" in r.json()["error"]["message"]


def _answering(client: EngineClient, answers: dict[str, tuple[int, str]],
               received: list) -> None:
    """A scripted engine's LoRA calls: each kind answered with (status, message); status
    0: the engine does not answer."""

    async def lora_call(call, timeout: float = 1.0) -> p.LoRAReply:
        received.append((client.key, call))
        status, message = answers[type(call).__name__]
        if status == 0:
            raise EngineUnavailable(f"engine {client.key} did not answer")
        return p.LoRAReply(call.call_id, status, message)

    client.lora_call = lora_call  # type: ignore[method-assign]


def test_a_load_is_done_on_every_engine_and_answers_the_first_refusal(
        tokenizer: Tokenizer) -> None:
    client, dispatcher, _ = _app(tokenizer, {}, admin_token="adm")
    admin = {"Authorization": "Bearer adm"}
    received: list = []
    ok = {"LoadLoRA": (200, "loaded"), "UnloadLoRA": (200, "unloaded")}
    _answering(dispatcher.pool.by_key[A], ok, received)
    _answering(dispatcher.pool.by_key[B], ok, received)
    body = {"lora_name": "sql", "lora_path": "/adapters/sql", "lora_version": "3"}
    r = client.post("/v1/load_lora_adapter", json=body, headers=admin)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    assert sorted((key, c.name, c.path, c.version) for key, c in received) == [
        (A, "sql", "/adapters/sql", "3"), (B, "sql", "/adapters/sql", "3")]
    _answering(dispatcher.pool.by_key[B], {"LoadLoRA": (400, "rank 32 over 8"),
                                           "UnloadLoRA": (404, "not here")}, received)
    r = client.post("/v1/load_lora_adapter", json=body, headers=admin)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"engine {B}: rank 32 over 8 (loaded on {A})"
    # Unloaded where it was: done; nowhere: 404.
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=admin)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' removed "
                                            "successfully.")
    _answering(dispatcher.pool.by_key[A], {"UnloadLoRA": (404, "not here")}, received)
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=admin)
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_adapter_not_found"
    # An engine that does not answer: 503, naming it.
    _answering(dispatcher.pool.by_key[A], {"LoadLoRA": (0, "")}, received)
    r = client.post("/v1/load_lora_adapter", json=body, headers=admin)
    assert r.status_code == 503 and f"engine {A} did not answer" in r.text
    for key in (A, B):
        dispatcher.pool.by_key[key].connected = False
    r = client.post("/v1/load_lora_adapter", json=body, headers=admin)
    assert r.status_code == 503 and "no engine is connected" in r.text


def test_an_engine_client_takes_the_replys_load_and_fails_calls_of_a_lost_engine() -> None:
    async def scenario() -> None:
        pool = EnginePool([A])
        client = pool.clients[0]
        scripted(client, "mixed", colocated, [])
        sent: list = []
        client._send = sent.append  # type: ignore[method-assign]
        call = asyncio.create_task(client.lora_call(p.LoadLoRA("c1", "sql", "/x")))
        await asyncio.sleep(0)
        assert sent == [p.LoadLoRA("c1", "sql", "/x")]
        load = msgspec.structs.replace(client.load, loras=["sql@1"])
        client._handle(p.LoRAReply("c1", 200, "ok", load))
        assert (await call).status == 200
        assert client.view().loras == frozenset({"sql@1"})  # routes by it at once
        lost = asyncio.create_task(client.lora_call(p.UnloadLoRA("c2", "sql")))
        await asyncio.sleep(0)
        client._mark_dead("connection closed")
        with pytest.raises(EngineUnavailable, match="connection closed"):
            await lost
        with pytest.raises(EngineUnavailable, match="not connected"):
            await client.lora_call(p.UnloadLoRA("c3", "sql"))

    asyncio.run(scenario())
