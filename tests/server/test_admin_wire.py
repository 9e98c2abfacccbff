"""The typed admin wire (`tandem_engine.admin_wire`): the engine's status round-trips as the
struct both sides share, an older engine's reply still decodes, and the real admin HTTP app
refuses a malformed body with a message naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest
from tandem_engine.admin_wire import (
    DeviceStatus,
    EngineStatus,
    LoadingProgress,
    RefitRequest,
    decode_status,
    encode_status,
)
from tandem_engine.lifecycle import EngineRole, EngineState

# Every key `GET /v1/state` has had, in order: the wire older clients read.
RUNNING_KEYS = ["engine_id", "incarnation", "role", "model", "state", "weight_version",
                "weight_epoch", "weight_uri", "num_running", "num_waiting", "kv_usage",
                "draining", "unhealthy", "pinned_blocks", "quarantined_blocks", "kv_pulls",
                "device", "weight_bytes", "kv_cache_bytes", "kv_cache_dtype",
                "last_refit_peak_bytes", "cached_blocks",
                "kv_event_seq"]
LOADING_KEYS = ["engine_id", "role", "model", "state", "weight_version", "weight_epoch",
                "weight_uri", "num_running", "num_waiting", "kv_usage", "draining",
                "unhealthy", "loading"]


def _running() -> EngineStatus:
    return EngineStatus(
        engine_id="e0", incarnation="abc", role=EngineRole.DECODE, model="tiny",
        state=EngineState.PAUSED, weight_version="v2", weight_epoch=3,
        weight_uri="file:///models/v2", num_running=1, num_waiting=2, kv_usage=0.25,
        draining=True, unhealthy=None, pinned_blocks=4, quarantined_blocks=0,
        kv_pulls={"pulled_blocks": 7, "reused_blocks": 1, "bytes": 4096, "failed": 1,
                  "failed_timeout": 1, "recomputed": 1},
        device=DeviceStatus(type="cpu", index=None, name="x86_64", memory_total_bytes=2**33,
                            memory_used_bytes=2**28, memory_source="cpu: rss"),
        weight_bytes=123456, kv_cache_bytes=1 << 20, kv_cache_dtype="float16",
        last_refit_peak_bytes=None, cached_blocks=9, kv_event_seq=12)


def test_the_status_round_trips_with_the_keys_it_always_had() -> None:
    for status, keys in ((_running(), RUNNING_KEYS), (EngineStatus(
            engine_id="e1", role=EngineRole.PREFILL, model="tiny", state=EngineState.LOADING,
            weight_version="initial", weight_epoch=0, num_running=0, num_waiting=0,
            loading=LoadingProgress(phase="reading the checkpoint", bytes_done=5,
                                    bytes_total=10, files_done=1, files_total=2,
                                    seconds=1.5)), LOADING_KEYS)):
        wire = json.dumps(encode_status(status))
        assert list(json.loads(wire)) == keys  # unset fields are left out, never null
        assert decode_status(wire.encode()) == status
        assert decode_status(json.loads(wire)) == status
    running = json.loads(json.dumps(encode_status(_running())))
    assert running["role"] == "decode" and running["state"] == "PAUSED"
    assert running["last_refit_peak_bytes"] is None and running["device"]["index"] is None


def test_an_older_or_newer_engines_state_decodes() -> None:
    older = {"state": "RUNNING", "weight_version": "v1", "weight_epoch": 1, "num_running": 0,
             "num_waiting": 0}
    status = decode_status({**older, "a_field_from_the_future": {"x": 1}})
    assert (status.state, status.weight_uri, status.draining) == (EngineState.RUNNING, "",
                                                                  False)
    assert status.num_pinned_blocks == 0 and status.weight_bytes is msgspec.UNSET
    with pytest.raises(msgspec.ValidationError, match=r"\$\.weight_epoch"):
        decode_status({**older, "weight_epoch": "one"})
    with pytest.raises(msgspec.ValidationError, match="weight_version"):
        decode_status({k: v for k, v in older.items() if k != "weight_version"})


def test_the_refit_body_is_what_it_always_was() -> None:
    request = RefitRequest(uri="file:///v2", version="v2", epoch=2)
    assert request.to_body() == {"uri": "file:///v2", "version": "v2", "epoch": 2,
                                 "low_memory": False}
    drafted = RefitRequest(uri="file:///v2", draft_uri="file:///d2")
    assert msgspec.json.decode(msgspec.json.encode(drafted.to_body()),
                               type=RefitRequest) == drafted


@pytest.fixture(scope="module")
def admin(tiny_llama: Path):
    from fastapi.testclient import TestClient
    from tandem_engine.engine.llm import LLM
    from tandem_engine.server.admin import build_admin_app
    from tandem_engine.server.control import EngineControl
    from tandem_engine.server.worker import EngineWorker

    llm = LLM(tiny_llama)
    worker = EngineWorker(llm.engine, engine_id="e0", model_name="tiny", role="decode")
    with TestClient(build_admin_app(EngineControl(worker))) as client:
        yield client, llm


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/refit", {"uri": "file:///x", "epoch": -1}, r"\$\.epoch"),
    ("/v1/refit", {"uri": 5}, r"\$\.uri"),
    ("/v1/refit", {"uri": ""}, r"\$\.uri"),
    ("/v1/refit", {"uri": "file:///x", "low_memory": "maybe"}, r"\$\.low_memory"),
    ("/v1/refit", {"uri": "file:///x", "draft_uri": "a" * 5000}, r"\$\.draft_uri"),
    ("/v1/refit", {"version": "v2"}, "uri"),
    ("/v1/suspend", {"mode": "nope"}, r"\$\.mode"),
    ("/v1/canary", {"max_tokens": 100000}, r"\$\.max_tokens"),
    ("/v1/canary", {"prompt_token_ids": [1]}, r"\$\.prompt_token_ids"),
    ("/v1/canary", {"timeout": 0}, r"\$\.timeout"),
])
def test_a_malformed_admin_body_is_refused_naming_the_field(admin, path: str, body: dict,
                                                           field: str) -> None:
    client, llm = admin
    assert client.post("/v1/pause").status_code == 200
    try:
        r = client.post(path, json=body)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == 422 and error["message"].startswith(f"POST {path}: ")
        assert re.search(field, error["message"]), error["message"]
        assert llm.engine.stats.state is EngineState.PAUSED  # nothing reached the engine
    finally:
        assert client.post("/v1/unpause").status_code == 200


def test_bodies_that_are_not_json_objects_are_refused(admin) -> None:
    client, _ = admin
    for path in ("/v1/refit", "/v1/suspend", "/v1/canary"):
        for raw in (b"{", b"[]", b'"text"'):
            r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 422 and path in r.json()["error"]["message"], r.text
    assert client.post("/v1/refit").status_code == 422  # a refit needs a body
    # suspend and canary without a body take their defaults
    assert client.post("/v1/pause").status_code == 200
    suspended = client.post("/v1/suspend")
    assert suspended.status_code == 200 and suspended.json()["state"] == "SUSPENDED"
    assert client.post("/v1/resume").status_code == 200
    assert client.post("/v1/unpause").status_code == 200


def test_the_admin_app_answers_the_status_struct(admin, tiny_llama: Path) -> None:
    client, llm = admin
    state = client.get("/v1/state").json()
    assert list(state) == RUNNING_KEYS
    status = decode_status(state)
    assert (status.role, status.state, status.weight_bytes) == (
        EngineRole.DECODE, EngineState.RUNNING, llm.engine.stats.weight_bytes)
    pool = llm.engine.runner.kv_cache
    assert (status.kv_cache_bytes, status.kv_cache_dtype) == (
        pool.numel() * pool.element_size(), str(pool.dtype).removeprefix("torch."))
    # A refit request as the fleet sends it travels to the engine: name, version, epoch.
    assert client.post("/v1/pause").status_code == 200
    body = RefitRequest(uri=tiny_llama.as_uri(), version="v9", epoch=7).to_body()
    refitted = decode_status(client.post("/v1/refit", json=body).json())
    assert (refitted.weight_uri, refitted.weight_version, refitted.weight_epoch) == (
        tiny_llama.as_uri(), "v9", 7)
    assert isinstance(refitted.last_refit_peak_bytes, int)
    assert refitted.last_refit_peak_bytes == llm.engine.runner.last_refit_peak_bytes
    assert llm.engine.stats.weight_bytes == llm.engine.runner.weight_bytes > 0
    assert client.post("/v1/unpause").status_code == 200
