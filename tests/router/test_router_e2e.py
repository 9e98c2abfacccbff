"""The router as users run it: real `tandem-engine` processes, a real `tandem-router`
process, and the official `openai` client.

One cluster (two engines on the tiny demo model, one router) serves the whole module;
the test that kills an engine runs last. Greedy output through the router must equal
`LLM(model).generate(...)` token for token, including when an engine is killed
mid-stream and its requests continue on the other one.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from tandem_engine import SamplingParams
from tandem_engine.cli.serve import die_with_parent, free_port

pytestmark = pytest.mark.slow

MODEL = "tiny"  # served model name


def _free_port() -> int:
    return free_port()


@dataclass
class Cluster:
    model_dir: Path
    router_url: str
    engine_keys: list[str]
    admin_urls: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    engines: list[subprocess.Popen] = field(default_factory=list)
    router: subprocess.Popen | None = None
    logs: Path | None = None  # where the processes log (run_cluster)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.router_url}/v1", api_key="x", max_retries=0,
                             timeout=60, **kw)

    def engine_view(self) -> dict[str, dict]:
        engines = httpx.get(f"{self.router_url}/v1/engines", timeout=5).json()["engines"]
        return {e["address"]: e for e in engines}

    def wait_view(self, key: str, state: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            e = self.engine_view()[key]
            if e["alive"] and e["state"] == state:
                return
            time.sleep(0.05)
        raise AssertionError(f"router never saw engine {key} in {state}: {e}")

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.router_url}/metrics", timeout=5).text
        return _metric(text, name, labels)


def _metric(text: str, name: str, labels: dict[str, str]) -> float:
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=die_with_parent)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args[2]} exited with {proc.returncode}:\n"
                                 f"{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not ready after {timeout} s:\n{log.read_text()[-3000:]}")


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _engine_cmd(model: Path, port: int, admin_port: int) -> list[str]:
    return [sys.executable, "-m", "tandem_engine.server.main", "--model", str(model),
            "--served-model-name", MODEL, "--port", str(port), "--admin-port",
            str(admin_port), "--threads", "1", "--heartbeat-interval", "0.2",
            "--num-blocks", "512", "--max-num-seqs", "16", "--shutdown-grace", "1"]


def _router_cmd(model: Path, engines: list[str], port: int) -> list[str]:
    cmd = [sys.executable, "-m", "tandem_engine.router.main", "--model", str(model),
           "--served-model-name", MODEL, "--port", str(port), "--heartbeat-deadline", "1.0",
           "--shutdown-grace", "2", "--log-level", os.environ.get("ROUTER_LOG", "info")]
    for e in engines:
        cmd += ["--engine", e]
    return cmd


def run_cluster(model: Path, logs: Path, roles: tuple[str, ...],
                engine_flags: Sequence[str] = ()) -> Iterator[Cluster]:
    """Engines with `roles` (and `engine_flags`) plus one router over them, logging into
    `logs` (`Cluster.logs`), torn down when the caller is done."""
    ports = [(_free_port(), _free_port()) for _ in roles]
    router_port = _free_port()
    c = Cluster(model, f"http://127.0.0.1:{router_port}",
                [f"127.0.0.1:{zp}" for zp, _ in ports],
                [f"http://127.0.0.1:{ap}" for _, ap in ports])
    engine_logs = [logs / f"engine{i}-{role}.log" for i, role in enumerate(roles)]
    try:
        for (zp, ap), role, log in zip(ports, roles, engine_logs, strict=True):
            c.engines.append(_spawn([*_engine_cmd(model, zp, ap), "--role", role,
                                     *engine_flags], log))
        c.procs += c.engines
        c.router = _spawn(_router_cmd(model, c.engine_keys, router_port), logs / "router.log")
        c.procs.append(c.router)
        for url, engine, log in zip(c.admin_urls, c.engines, engine_logs, strict=True):
            _wait_ready(f"{url}/readyz", engine, log)
        _wait_ready(f"{c.router_url}/readyz", c.router, logs / "router.log")
        for key in c.engine_keys:
            c.wait_view(key, "RUNNING")
        c.logs = logs
        yield c
    finally:
        _stop(c.procs)


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_cluster(tiny_llama, tmp_path_factory.mktemp("router-e2e"),
                           ("mixed", "mixed"))


@pytest.fixture(scope="module")
def llm(tiny_llama: Path):
    import torch
    from tandem_engine import LLM

    torch.set_num_threads(1)
    return LLM(tiny_llama, max_num_seqs=16)


def _greedy(llm, prompts, max_tokens: int, **kw) -> list:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))
    return [o.outputs[0] for o in outs]


# ---- correctness --------------------------------------------------------------------------------


def test_greedy_completions_match_the_offline_engine(cluster: Cluster, llm) -> None:
    client = cluster.client()
    ids_prompt = llm.tokenizer.encode("A prompt given as token ids")
    prompts = ["Hello there", "Once upon a time", ids_prompt]
    refs = _greedy(llm, prompts, 24)
    for prompt, ref in zip(prompts, refs, strict=True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                      temperature=0, extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == ref.token_ids
        assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
        assert r.usage.completion_tokens == len(ref.token_ids)
    # A batch of prompts: one choice per prompt, in order.
    r = client.completions.create(model=MODEL, prompt=["Hello there", "Once upon a time"],
                                  max_tokens=24, temperature=0)
    assert [c.text for c in r.choices] == [refs[0].text, refs[1].text]
    assert [c.index for c in r.choices] == [0, 1]


def test_streaming_equals_non_streaming(cluster: Cluster, llm) -> None:
    client = cluster.client()
    ref = _greedy(llm, ["The engine"], 20)[0]
    chunks = list(client.completions.create(
        model=MODEL, prompt="The engine", max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == ref.text
    ids = [t for c in chunks[:-1] for t in c.choices[0].model_extra["token_ids"]]
    assert ids == ref.token_ids
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    for overhead in ("ingress", "egress"):  # the router's own latency is measured
        assert cluster.metric(f"tandem_router_{overhead}_seconds_bucket", le="+Inf") > 0


def test_chat_uses_the_checkpoints_template(cluster: Cluster, llm) -> None:
    from tandem_engine.router.chat import ChatTemplate

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me a story"}]
    text = ChatTemplate.from_tokenizer(llm.tokenizer).render(messages)
    prompt_ids = llm.tokenizer.encode(text, add_special_tokens=False)
    ref = _greedy(llm, [prompt_ids], 16)[0]
    client = cluster.client()
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                       temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(prompt_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages,
                                            max_completion_tokens=16, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_stop_strings(cluster: Cluster, llm) -> None:
    ref = _greedy(llm, ["Once upon a time"], 40)[0]
    text = ref.text
    stop = next(text[i:i + 3] for i in range(8, len(text) - 3)
                if text[i:i + 3].strip() and text.find(text[i:i + 3]) == i)
    client = cluster.client()
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40,
                                  temperature=0, stop=[stop, "never-appears"])
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time",
                                         max_tokens=40, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[:text.index(stop)]


def test_logprobs(cluster: Cluster) -> None:
    client = cluster.client()
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(chosen)  # greedy picks the top token
    assert lp.text_offset[0] == 0
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)


def test_n_and_seeds_are_reproducible(cluster: Cluster) -> None:
    client = cluster.client()

    def sample(n: int, seed: int) -> list[str]:
        r = client.completions.create(model=MODEL, prompt="The engine", max_tokens=12,
                                      temperature=1.0, n=n, seed=seed)
        assert [c.index for c in r.choices] == list(range(n))
        assert 0 < r.usage.completion_tokens <= 12 * n
        return [c.text for c in r.choices]

    first = sample(3, 11)
    assert sample(3, 11) == first
    assert sample(1, 12) == [first[1]]  # choice i uses seed + i
    assert len(set(first)) > 1
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, seed=1,
        stream=True)
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_errors_name_the_parameter_and_the_limit(cluster: Cluster) -> None:
    client = cluster.client()
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="x")
    assert err.value.body["code"] == "model_not_found"
    cases = [
        (dict(prompt="x", temperature=3), "temperature", "[0, 2]"),
        (dict(prompt="x", max_tokens=2000), "max_tokens", "1024"),
        (dict(prompt=[5] * 1100), "prompt", "context limit of 1024"),
        (dict(prompt="x", n=50), "n", "between 1 and 16"),
        # The engine's own Reject (400) comes back in the OpenAI shape.
        (dict(prompt=[10**6]), "prompt", "outside the model's vocabulary"),
    ]
    for kwargs, param, limit in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, **kwargs)
        body = err.value.body
        assert body["param"] == param and limit in body["message"], body
        assert body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "bot", "content": "x"}])
    assert err.value.body["param"] == "messages[0].role"


def _engine_aborts(cluster: Cluster) -> float:
    total = 0.0
    for url in cluster.admin_urls:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        total += _metric(text, "tandem_requests_finished_total", {"reason": "abort"})
    return total


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_client_disconnect_aborts_the_engine_request(cluster: Cluster) -> None:
    before = _engine_aborts(cluster)
    body = {"model": MODEL, "prompt": "Go on", "max_tokens": 1000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{cluster.router_url}/v1/completions", json=body,
                      timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)  # one chunk arrived, then the client goes away
    _wait_for(lambda: _engine_aborts(cluster) == before + 1, 5, "the streamed abort")
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster.router_url}/v1/completions", json=body, timeout=0.5)
    _wait_for(lambda: _engine_aborts(cluster) == before + 2, 5, "the non-streamed abort")
    assert all(e["inflight"] == 0 for e in cluster.engine_view().values())


# ---- the pool ------------------------------------------------------------------------------------


def test_pause_drains_new_traffic_to_the_other_engine(cluster: Cluster) -> None:
    a, b = cluster.engine_keys
    client = cluster.client()

    def served() -> tuple[float, float]:
        return tuple(cluster.metric("tandem_router_engine_requests_total", engine=k)
                     for k in (a, b))

    httpx.post(f"{cluster.admin_urls[0]}/v1/pause", timeout=10).raise_for_status()
    cluster.wait_view(a, "PAUSED")
    before = served()
    for i in range(4):  # short, distinct prompts: no prefix affinity either way
        r = client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=3,
                                      temperature=0)
        assert r.choices[0].finish_reason == "length"
    after = served()
    assert after == (before[0], before[1] + 4)
    httpx.post(f"{cluster.admin_urls[0]}/v1/unpause", timeout=10).raise_for_status()
    cluster.wait_view(a, "RUNNING")
    for i in range(4):
        client.completions.create(model=MODEL, prompt=f"q{i}", max_tokens=3, temperature=0)
    assert served()[0] > after[0]  # engine a is back in rotation


def test_router_sigterm_exits_cleanly(cluster: Cluster, tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "router.log"
    proc = _spawn(_router_cmd(cluster.model_dir, cluster.engine_keys, port), log)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/readyz", proc, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log.read_text()
    finally:
        _stop([proc])


def _streams_through(cluster: Cluster, prompts: list, max_tokens: int, disrupt,
                     extra_body: dict | None = None,
                     ) -> list[tuple[list[int], str, str | None]]:
    """Stream greedy completions of every prompt at once; call `disrupt()` when each has
    received a few tokens; return every stream's (token ids, text, finish reason).
    `extra_body`: besides return_token_ids (default: ignore_eos)."""
    progress = [0] * len(prompts)
    extra = {"return_token_ids": True, **(extra_body or {"ignore_eos": True})}

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[list[int], str, str | None]:
        stream = await client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=max_tokens, temperature=0, stream=True,
            extra_body=extra)
        ids, text, finish = [], [], None
        async for chunk in stream:
            choice = chunk.choices[0]
            ids += choice.model_extra.get("token_ids") or []
            text.append(choice.text)
            finish = choice.finish_reason or finish
            progress[i] = len(ids)
        return ids, "".join(text), finish

    async def run() -> list[tuple[list[int], str, str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{cluster.router_url}/v1", api_key="x",
                                    max_retries=0, timeout=60)
        tasks = [asyncio.create_task(one(client, i)) for i in range(len(prompts))]
        deadline = time.monotonic() + 30
        while min(progress) < 3:
            assert time.monotonic() < deadline, f"streams did not start: {progress}"
            await asyncio.sleep(0.01)
        disrupt()
        results = await asyncio.gather(*tasks)
        await client.close()
        return results

    return asyncio.run(run())


def _failovers(cluster: Cluster) -> float:
    return sum(cluster.metric("tandem_router_failovers_total", reason=r)
               for r in ("engine_lost", "engine_aborted", "rejected", "unavailable", "stalled"))


def _assert_uninterrupted(results, refs) -> None:
    for (ids, text, finish), ref in zip(results, refs, strict=True):
        assert ids == ref.token_ids
        assert text == ref.text
        assert finish == ref.finish_reason


def test_frozen_engine_misses_its_heartbeat_deadline(cluster: Cluster, llm) -> None:
    """SIGSTOP one engine under load: its connection stays open, only the heartbeat
    deadline (1 s here) tells. Its requests continue on the other engine; after SIGCONT
    it rejoins, and its orphaned copies of those requests are aborted."""
    key, engine = cluster.engine_keys[0], cluster.engines[0]
    prompts = [f"Tale {i} starts" for i in range(6)]
    refs = _greedy(llm, prompts, 160, ignore_eos=True)
    aborts, failovers = _engine_aborts(cluster), _failovers(cluster)

    def freeze() -> None:
        assert cluster.engine_view()[key]["inflight"] > 0
        engine.send_signal(signal.SIGSTOP)

    try:
        results = _streams_through(cluster, prompts, 160, freeze)
    finally:
        engine.send_signal(signal.SIGCONT)
    _assert_uninterrupted(results, refs)
    assert cluster.metric("tandem_router_failovers_total", reason="engine_lost") > 0
    assert _failovers(cluster) > failovers
    cluster.wait_view(key, "RUNNING")  # the same incarnation says WELCOME again
    _wait_for(lambda: _engine_aborts(cluster) > aborts, 10, "the orphans' aborts")
    _wait_for(lambda: httpx.get(f"{cluster.admin_urls[0]}/v1/state").json()["num_running"]
              == 0, 10, "the frozen engine to drop its orphans")


def test_killed_engine_loses_no_request(cluster: Cluster, llm) -> None:
    """kill -9 one engine under concurrent streaming load: every stream completes with
    exactly the greedy tokens of an uninterrupted run."""
    prompts = [f"Story number {i} begins" for i in range(8)]
    refs = _greedy(llm, prompts, 200, ignore_eos=True)
    failovers = cluster.metric("tandem_router_failovers_total", reason="engine_lost")

    def kill() -> None:
        assert cluster.engine_view()[cluster.engine_keys[0]]["inflight"] > 0
        cluster.engines[0].send_signal(signal.SIGKILL)

    _assert_uninterrupted(_streams_through(cluster, prompts, 200, kill), refs)
    assert cluster.metric("tandem_router_failovers_total", reason="engine_lost") > failovers
    assert cluster.engine_view()[cluster.engine_keys[0]]["alive"] is False
    assert httpx.get(f"{cluster.router_url}/readyz", timeout=5).status_code == 200


def test_restarted_engine_rejoins_and_its_drain_loses_nothing(cluster: Cluster, llm,
                                                             tmp_path: Path) -> None:
    """Engine 0 comes back as a new process on the same port; the router reconnects to
    it. Then SIGTERM drains it under load with no grace, so it aborts what it holds (a
    grace of 0.2 s let a fast CPU finish all 200 tokens first), and every stream still
    completes with the right tokens on engine 1."""
    key, admin = cluster.engine_keys[0], cluster.admin_urls[0]
    old = cluster.engines[0]
    if old.poll() is None:
        old.kill()
        old.wait(timeout=10)
    zmq_port, admin_port = int(key.rsplit(":", 1)[1]), int(admin.rsplit(":", 1)[1])
    cmd = _engine_cmd(cluster.model_dir, zmq_port, admin_port)
    cmd[cmd.index("--shutdown-grace") + 1] = "0"
    log = tmp_path / "engine0-again.log"
    new = _spawn(cmd, log)
    cluster.procs.append(new)
    cluster.engines[0] = new
    _wait_ready(f"{admin}/readyz", new, log)
    incarnation = httpx.get(f"{admin}/v1/state", timeout=5).json()["incarnation"]
    _wait_for(lambda: cluster.engine_view()[key]["incarnation"] == incarnation, 10,
              "the router to reconnect")
    cluster.wait_view(key, "RUNNING")

    prompts = [f"Chapter {i} opens" for i in range(8)]
    refs = _greedy(llm, prompts, 200, ignore_eos=True)
    failovers = _failovers(cluster)

    def drain() -> None:
        assert cluster.engine_view()[key]["inflight"] > 0
        new.send_signal(signal.SIGTERM)

    _assert_uninterrupted(_streams_through(cluster, prompts, 200, drain), refs)
    assert new.wait(timeout=15) == 0
    assert _failovers(cluster) > failovers
