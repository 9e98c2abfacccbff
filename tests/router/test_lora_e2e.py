"""LoRA adapters through the serving stack as users run it: `tandem-engine` processes
started with vLLM's `--lora-modules`, a `tandem-router` in front, and the official
`openai` client naming an adapter in `model`.

* Two colocated engines on the tiny demo model serving adapters `a` and `b`: greedy
  tokens under each adapter and the base equal the offline engine's with the same
  adapter; `/v1/models` lists the adapters with their parent; an unknown model is a 404;
  an adapter loaded through the router's `POST /v1/load_lora_adapter` (the admin token)
  serves at once and is a 404 again once unloaded; loads and unloads under streaming load
  fail no request.
* A prefill and a decode engine (NIXL) serving `a`, only the prefill engine serving `b`:
  `a` goes disaggregated with the colocated tokens; `b` never reaches the decode engine,
  which lacks it, and still gets its right tokens (colocated on the prefill engine).
* The real model (SmolLM2's GGUF, quantized weights) with a random adapter written as a
  PEFT folder: the router's tokens equal the offline engine's on the same GGUF.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tandem_engine import LLM, SamplingParams
from tandem_engine.lora_request import LoRARequest
from test_lora import make_adapter, write_random_adapter
from test_router_e2e import (
    MODEL,
    Cluster,
    _engine_cmd,
    _free_port,
    _router_cmd,
    _spawn,
    _stop,
    _wait_ready,
    run_cluster,
)

pytestmark = pytest.mark.slow

TOKEN = "lora-admin"
TARGETS = ["q_proj", "v_proj", "down_proj"]
PROMPTS = ["Once upon a time", [5, 17, 42, 99, 7, 3, 250, 11, 300, 12, 8, 41, 77, 5, 19]]
MAX_TOKENS = 16
LORA_FLAGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(tiny_llama, root / name, rank, TARGETS, seed)
            for name, rank, seed in (("a", 4, 31), ("b", 8, 32), ("c", 8, 33))}


def _loras(adapters: dict[str, Path], *names: str) -> list[str]:
    return ["--weights-root", str(adapters["a"].parent), "--lora-modules",
            *(f"{name}={adapters[name]}" for name in names)]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, adapters: dict[str, Path]) -> dict[str | None, list]:
    """Greedy tokens of each prompt in this process, under each adapter and the base."""
    import torch

    torch.set_num_threads(1)
    llm = LLM(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out: dict[str | None, list] = {}
    for name in (None, "a", "b", "c"):
        lora = LoRARequest(name, str(adapters[name])) if name else None
        out[name] = [o.outputs[0].token_ids
                     for o in llm.generate(PROMPTS, params, lora_request=lora)]
    assert len({tuple(v[0]) for v in out.values()}) == 4  # every adapter changes the output
    return out


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, adapters: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with pytest.MonkeyPatch.context() as env:  # the admin token of engines and router
        env.setenv("TANDEM_ADMIN_TOKEN", TOKEN)
        yield from run_cluster(tiny_llama, tmp_path_factory.mktemp("lora-e2e"),
                               ("mixed", "mixed"),
                               [*LORA_FLAGS, *_loras(adapters, "a", "b")])


def _tokens(client: openai.OpenAI, model: str, prompt, **kw) -> list[int]:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body={"return_token_ids": True,
                                                             "ignore_eos": True}, **kw)
    assert r.model == model
    return r.choices[0].model_extra["token_ids"]


def _admin(cluster: Cluster, call: str, body: dict) -> httpx.Response:
    return httpx.post(f"{cluster.router_url}/v1/{call}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {TOKEN}"})


def test_the_model_selects_the_adapter(cluster: Cluster, reference) -> None:
    client = cluster.client()
    for model, adapter in ((MODEL, None), ("a", "a"), ("b", "b")):
        for prompt, want in zip(PROMPTS, reference[adapter], strict=True):
            assert _tokens(client, model, prompt) == want, model
    models = {m.id: m.model_extra for m in client.models.list().data}
    assert list(models) == [MODEL, "a", "b"]
    assert models["a"]["parent"] == MODEL and models["a"]["root"] == "a@1"
    assert models[MODEL]["parent"] is None
    with pytest.raises(openai.NotFoundError, match="'a', 'b'"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_an_adapter_loaded_through_the_router_serves_until_unloaded(
        cluster: Cluster, adapters: dict[str, Path], reference) -> None:
    client = cluster.client()
    body = {"lora_name": "c", "lora_path": str(adapters["c"])}
    r = httpx.post(f"{cluster.router_url}/v1/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 401  # an admin call
    r = _admin(cluster, "load_lora_adapter", body)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'c' added successfully.")
    for engine in cluster.engine_view().values():  # both engines, at once
        assert engine["loras"] == ["a@1", "b@1", "c@1"]
    assert _tokens(client, "c", PROMPTS[1]) == reference["c"][1]
    r = _admin(cluster, "load_lora_adapter", {"lora_name": "d", "lora_path": "/etc"})
    assert r.status_code == 400 and "weights roots" in r.json()["error"]["message"]
    r = _admin(cluster, "unload_lora_adapter", {"lora_name": "c"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'c' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        _tokens(client, "c", PROMPTS[1])
    r = _admin(cluster, "unload_lora_adapter", {"lora_name": "c"})
    assert r.status_code == 404


def test_loads_and_unloads_under_streaming_load_fail_no_request(
        cluster: Cluster, adapters: dict[str, Path], reference) -> None:
    """Streams under the base model and both adapters while adapter `c` is loaded and
    unloaded over and over: every stream completes with the right tokens."""
    jobs = [(model, i) for i in range(len(PROMPTS)) for model in (MODEL, "a", "b")] * 2
    body = {"lora_name": "c", "lora_path": str(adapters["c"])}

    async def stream(client: openai.AsyncOpenAI, model: str, i: int) -> list[int]:
        chunks = await client.completions.create(
            model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
            stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
        return [t async for chunk in chunks
                for t in chunk.choices[0].model_extra.get("token_ids") or []]

    async def churn(admin: httpx.AsyncClient) -> list[int]:
        statuses = []
        for call in ("load", "unload") * 3:
            r = await admin.post(f"/v1/{call}_lora_adapter",
                                 json=body if call == "load" else {"lora_name": "c"})
            statuses.append(r.status_code)
        return statuses

    async def run() -> tuple[list, list[int]]:
        client = openai.AsyncOpenAI(base_url=f"{cluster.router_url}/v1", api_key="x",
                                    max_retries=0, timeout=120)
        async with httpx.AsyncClient(base_url=cluster.router_url, timeout=60, headers={
                "Authorization": f"Bearer {TOKEN}"}) as admin:
            streams = [asyncio.create_task(stream(client, m, i)) for m, i in jobs]
            statuses = await churn(admin)
            return await asyncio.gather(*streams, return_exceptions=True), statuses

    results, statuses = asyncio.run(run())
    assert statuses == [200] * 6
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed
    for (model, i), got in zip(jobs, results, strict=True):
        assert got == reference[None if model == MODEL else model][i], (model, i)


# ---- prefill and decode ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def disagg(tiny_llama: Path, adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A prefill engine serving `a` and `b`, a decode engine serving `a` only."""
    pytest.importorskip("nixl_cu12")
    logs = tmp_path_factory.mktemp("lora-disagg")
    engines = [("prefill", _loras(adapters, "a", "b")), ("decode", _loras(adapters, "a"))]
    ports = [(_free_port(), _free_port()) for _ in engines]
    router_port = _free_port()
    c = Cluster(tiny_llama, f"http://127.0.0.1:{router_port}",
                [f"127.0.0.1:{zp}" for zp, _ in ports],
                [f"http://127.0.0.1:{ap}" for _, ap in ports], logs=logs)
    try:
        for (zp, ap), (role, flags) in zip(ports, engines, strict=True):
            c.engines.append(_spawn([*_engine_cmd(tiny_llama, zp, ap), "--role", role,
                                     *LORA_FLAGS, *flags], logs / f"{role}.log"))
        c.procs += c.engines
        c.router = _spawn(_router_cmd(tiny_llama, c.engine_keys, router_port),
                          logs / "router.log")
        c.procs.append(c.router)
        for url, engine, (role, _) in zip(c.admin_urls, c.engines, engines, strict=True):
            _wait_ready(f"{url}/readyz", engine, logs / f"{role}.log")
        _wait_ready(f"{c.router_url}/readyz", c.router, logs / "router.log")
        for key in c.engine_keys:
            c.wait_view(key, "RUNNING")
        yield c
    finally:
        _stop(c.procs)


def test_a_disaggregated_pair_serves_an_adapter_both_engines_serve(disagg: Cluster,
                                                                     reference) -> None:
    client = disagg.client()
    handoffs = disagg.metric("tandem_router_disaggregated_requests_total", outcome="handoff")
    for prompt, want in zip(PROMPTS, reference["a"], strict=True):
        assert _tokens(client, "a", prompt) == want
    assert disagg.metric("tandem_router_disaggregated_requests_total",
                         outcome="handoff") == handoffs + len(PROMPTS)
    decode_admin = disagg.admin_urls[1]
    assert httpx.get(f"{decode_admin}/v1/state", timeout=5).json()["kv_pulls"][
        "pulled_blocks"] > 0


def test_a_decode_engine_without_the_adapter_never_decodes_it(disagg: Cluster,
                                                              reference) -> None:
    """`b` is only on the prefill engine: the router never pairs it with the decode
    engine, which lacks it; the request runs colocated on the prefill engine, with b's
    tokens (and were it sent there, the decode engine would refuse it: test_engine_lora)."""
    client = disagg.client()
    decode_admin = disagg.admin_urls[1]
    before = httpx.get(f"{decode_admin}/metrics", timeout=5).text
    handoffs = disagg.metric("tandem_router_disaggregated_requests_total", outcome="handoff")
    for prompt, want in zip(PROMPTS, reference["b"], strict=True):
        assert _tokens(client, "b", prompt) == want
    assert disagg.metric("tandem_router_disaggregated_requests_total",
                         outcome="handoff") == handoffs
    prompt_tokens = "vllm:prompt_tokens_total"
    assert _value(before, prompt_tokens) == _value(
        httpx.get(f"{decode_admin}/metrics", timeout=5).text, prompt_tokens)


def _value(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{"))


# ---- the real model -----------------------------------------------------------------------------


def test_the_real_model_with_a_random_adapter_through_the_router(
        smollm2_gguf: Path, tmp_path: Path) -> None:
    """SmolLM2's GGUF stays quantized; an adapter of random weights over its attention
    and MLP, written as a PEFT folder, through the router with the openai SDK: the
    offline engine's tokens on the same GGUF with the same adapter."""
    import torch

    torch.set_num_threads(1)
    llm = LLM(smollm2_gguf, enable_lora=True, max_lora_rank=8)
    folder = write_random_adapter(tmp_path / "adapters" / "smol", llm.engine.model_config, 8,
                                  ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                   "down_proj"], 7)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    lora = LoRARequest("smol", str(folder))
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=lora)]
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert want != base
    del llm
    stack = run_cluster(smollm2_gguf, tmp_path, ("mixed",), [
        *LORA_FLAGS, "--weights-root", str(folder.parent), "--lora-modules",
        f"smol={folder}"])
    cluster = next(stack)
    try:
        client = cluster.client()
        assert [m.id for m in client.models.list().data] == [MODEL, "smol"]
        for prompt, tokens in zip(prompts, want, strict=True):
            assert _tokens(client, "smol", prompt) == tokens
        assert _tokens(client, MODEL, prompts[0]) == base[0]
    finally:
        stack.close()
