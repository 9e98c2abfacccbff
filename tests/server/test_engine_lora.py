"""LoRA adapters in the engine process, as routers and operators see them: `--lora-modules`
preloads (a bad one ends the start, exit 2), a SUBMIT under an adapter decodes as the
offline engine does with it, one under an adapter or version the engine does not serve is
refused (never decoded with other weights), vLLM's admin endpoints with the admin token
and the weights roots, the routers' LORA_LOAD / LORA_UNLOAD calls, heartbeats listing the
adapters, and the metrics."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tandem_engine import LLM, SamplingParams
from tandem_engine import protocol as p
from tandem_engine.cli.serve import free_port
from tandem_engine.lora_request import LoRARequest
from test_engine_process import Client, EngineProcess
from test_lora import make_adapter

pytestmark = pytest.mark.slow
TOKEN = "adm1n"
TARGETS = ["q_proj", "v_proj", "down_proj"]
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 300, 12, 8, 8, 41, 77, 5, 19, 23]
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(tiny_llama, root / "a", 4, TARGETS, 21),
            "b": make_adapter(tiny_llama, root / "b", 8, TARGETS, 22),
            "wide": make_adapter(tiny_llama, root / "wide", 16, TARGETS, 23)}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("lora-engine")
    (folder / "token").write_text(TOKEN)
    proc = EngineProcess(tiny_llama, folder, "--admin-token-file", str(folder / "token"),
                         "--role", "decode", "--enable-lora", "--max-loras", "2",
                         "--max-lora-rank", "8", "--weights-root", str(adapters["a"].parent),
                         "--lora-modules", f"a={adapters['a']}")
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, adapters: dict[str, Path]):
    """Greedy tokens of PROMPT in this process: the base model and each adapter."""
    llm = LLM(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(**GREEDY)
    out = {None: llm.generate([PROMPT], params)[0].outputs[0].token_ids}
    for name in ("a", "b"):
        out[name] = llm.generate([PROMPT], params, lora_request=LoRARequest(
            name, str(adapters[name])))[0].outputs[0].token_ids
    assert len({tuple(v) for v in out.values()}) == 3  # each adapter changes the output
    return out


def run(client: Client, rid: str, lora: p.LoRARef | None,
        pull: p.PullSource | None = None) -> list:
    client.sock.send(p.encode(p.Submit(rid, PROMPT, GREEDY, lora=lora, pull=pull,
                                       resume=p.Resume([7]) if pull else None)))
    outs: list = []
    while not outs or not (isinstance(outs[-1], p.Reject) or outs[-1].finished):
        msg = client.next((p.Output, p.Reject))
        if msg.request_id == rid:
            outs.append(msg)
    return outs


def tokens(outs: list) -> list[int]:
    assert all(isinstance(o, p.Output) for o in outs), outs
    return [t for o in outs for t in o.token_ids]


def metrics(engine: EngineProcess) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{engine.admin_port}/metrics",
                                  timeout=5).read().decode()


def test_preloaded_adapters_decode_as_the_offline_engine_does(engine: EngineProcess,
                                                              reference) -> None:
    client = engine.client()
    assert client.welcome.load.loras == ["a@1"]
    code, state = engine.http("GET", "/v1/state")
    assert code == 200 and state["loras"] == ["a@1"]
    assert tokens(run(client, "base", None)) == reference[None]
    assert tokens(run(client, "a", p.LoRARef("a", "1"))) == reference["a"]
    heartbeat = client.next(p.Heartbeat, timeout=5)
    assert heartbeat.load.loras == ["a@1"] and heartbeat.load.resident_loras == ["a@1"]


def test_an_adapter_or_version_not_served_is_refused(engine: EngineProcess) -> None:
    client = engine.client()
    for lora in (p.LoRARef("a", "2"), p.LoRARef("zz", "1")):
        [reject] = run(client, f"no-{lora.name}", lora)
        assert isinstance(reject, p.Reject) and reject.status == 503  # another engine may
        assert f"does not serve LoRA adapter {lora.identity}" in reject.message
        assert "it serves: a@1" in reject.message
    # A decode engine's pull of KV computed under another version: refused the same way,
    # before any transfer.
    agent = client.welcome.kv_transfer
    assert agent is not None
    [reject] = run(client, "pull", p.LoRARef("a", "2"), p.PullSource(agent, "pin", [0]))
    assert isinstance(reject, p.Reject) and reject.status == 503


def test_the_admin_api_loads_and_unloads_with_vllms_calls(
        engine: EngineProcess, adapters: dict[str, Path], reference, tmp_path: Path) -> None:
    load = {"lora_name": "b", "lora_path": str(adapters["b"])}
    assert engine.http("POST", "/v1/load_lora_adapter", load)[0] == 401  # the admin token
    client = engine.client()
    code, body = engine.http("POST", "/v1/load_lora_adapter", load, TOKEN)
    assert code == 200 and body["loras"] == ["a@1", "b@1"]
    assert body["message"] == "Success: LoRA adapter 'b' added successfully."
    assert client.next(p.StateChange, timeout=5).load.loras == ["a@1", "b@1"]  # at once
    assert tokens(run(client, "b", p.LoRARef("b", "1"))) == reference["b"]
    refusals = [
        ({"lora_name": "w", "lora_path": str(adapters["wide"])}, "over --max-lora-rank 8"),
        ({"lora_name": "x", "lora_path": str(tmp_path)}, "weights roots"),  # outside
        ({"lora_name": "bad name", "lora_path": str(adapters["b"])}, "name"),
    ]
    for body, why in refusals:
        code, answer = engine.http("POST", "/v1/load_lora_adapter", body, TOKEN)
        assert code == 400 and why in answer["error"]["message"], answer
    code, answer = engine.http("POST", "/v1/load_lora_adapter", {"lora_name": "b"}, TOKEN)
    assert code == 422 and "lora_path" in answer["error"]["message"]
    code, answer = engine.http("POST", "/v1/unload_lora_adapter", {"lora_name": "nope"},
                               TOKEN)
    assert code == 404 and "'nope' cannot be found" in answer["error"]["message"]
    code, body = engine.http("POST", "/v1/unload_lora_adapter", {"lora_name": "b"}, TOKEN)
    assert code == 200 and body["loras"] == ["a@1"]
    [reject] = run(client, "b-gone", p.LoRARef("b", "1"))
    assert isinstance(reject, p.Reject) and reject.status == 503


def test_routers_load_and_unload_over_zmq(engine: EngineProcess, adapters: dict[str, Path],
                                          reference) -> None:
    client = engine.client()
    client.sock.send(p.encode(p.LoadLoRA("c1", "b", str(adapters["b"]), "7")))
    reply = client.next(p.LoRAReply, timeout=30)
    assert (reply.call_id, reply.status) == ("c1", 200) and "b@7" in reply.load.loras
    assert tokens(run(client, "b7", p.LoRARef("b", "7"))) == reference["b"]
    client.sock.send(p.encode(p.LoadLoRA("c2", "w", str(adapters["wide"]))))
    reply = client.next(p.LoRAReply, timeout=30)
    assert reply.status == 400 and "over --max-lora-rank 8" in reply.message
    for call_id, status in (("c3", 200), ("c4", 404)):
        client.sock.send(p.encode(p.UnloadLoRA(call_id, "b")))
        reply = client.next(p.LoRAReply, timeout=30)
        assert (reply.call_id, reply.status) == (call_id, status)
        assert reply.load.loras == ["a@1"]


def test_metrics_say_which_adapters_run_and_how_the_slots_do(engine: EngineProcess) -> None:
    client = engine.client()
    for rid in ("m1", "m2"):  # the second finds it in its slot
        run(client, rid, p.LoRARef("a", "1"))
    text = metrics(engine)
    info = next(line for line in text.splitlines()
                if line.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in info and 'running_lora_adapters=""' in info
    assert abs(float(info.split()[-1]) - time.time()) < 60  # a timestamp, as vLLM's
    for name in ("loads", "hits"):
        line = next(x for x in text.splitlines() if x.startswith(f"tandem_lora_{name}_total"))
        assert float(line.split()[-1]) >= 1
    assert "tandem_lora_evictions_total{" in text


@pytest.mark.parametrize("flags, error", [
    (["--enable-lora", "--lora-modules", "a=/no/such/adapter"],
     "--lora-modules a@1=/no/such/adapter"),
    (["--lora-modules", "a=/no/such/adapter"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a=/x", "a@2=/y"], "names a more than once"),
])
def test_a_bad_lora_module_ends_the_start(tiny_llama: Path, flags: list[str],
                                          error: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tandem_engine.server.main", "--model", str(tiny_llama),
         "--port", str(free_port()), "--admin-port", str(free_port()), *flags],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert error in proc.stderr


def test_an_engine_without_lora_refuses_loads_and_exports_no_lora_series(
        tiny_llama: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    proc = EngineProcess(tiny_llama, tmp_path, "--weights-root", str(adapters["a"].parent))
    try:
        code, answer = proc.http("POST", "/v1/load_lora_adapter",
                                 {"lora_name": "a", "lora_path": str(adapters["a"])})
        assert code == 400 and "--enable-lora" in answer["error"]["message"]
        code, state = proc.http("GET", "/v1/state")
        assert code == 200 and "loras" not in state
        assert "lora" not in metrics(proc)
        assert proc.client().welcome.load.loras == []
    finally:
        proc.close()


def test_a_canary_runs_under_an_adapter_the_engine_serves(engine: EngineProcess) -> None:
    """An adapter transaction's verification: `/v1/canary` with `lora_name` (and
    `lora_version`) runs under that adapter, says so, and is refused for one not served."""
    body = {"prompt_token_ids": PROMPT, "max_tokens": 8}
    code, base = engine.http("POST", "/v1/canary", body, TOKEN)
    assert code == 200 and base["lora"] == ""
    code, under = engine.http("POST", "/v1/canary", {**body, "lora_name": "a",
                                                     "lora_version": "1"}, TOKEN)
    assert code == 200 and under["lora"] == "a@1"
    assert under["token_ids"] != base["token_ids"] and under["mean_nll"] != base["mean_nll"]
    for lora, words in (({"lora_name": "nope"}, "nope"),
                        ({"lora_name": "a", "lora_version": "9"}, "not 9")):
        code, answer = engine.http("POST", "/v1/canary", {**body, **lora}, TOKEN)
        assert code == 400 and words in answer["error"]["message"], answer
