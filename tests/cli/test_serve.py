"""`tandem serve`: the one-command local stack, as a user runs it."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tandem_engine import LLM, SamplingParams
from tandem_engine.cli.serve import LocalStack, free_port

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def spawn_serve(tmp_path: Path, *args: str) -> subprocess.Popen:
    """`tandem serve ARGS` started, its output piped, its log folder under `tmp_path`."""
    return subprocess.Popen([sys.executable, "-m", "tandem_engine.cli.main", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})


def wait_for_url(proc: subprocess.Popen, timeout: float = 180) -> list[str]:
    """The lines `serve` printed up to its "Tandem is serving" line; fails (with them) on
    an exit or after `timeout` seconds."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while not any("Tandem is serving" in line for line in lines):
        assert time.monotonic() < deadline, "".join(lines)
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "".join(lines)
        lines.append(line)
    return lines


def start_serve(tmp_path: Path, *args: str, timeout: float = 180
                ) -> tuple[subprocess.Popen, list[str]]:
    """`tandem serve ARGS`, once it has printed its URL; returns the process and its lines
    (killed if it never gets there)."""
    proc = spawn_serve(tmp_path, *args)
    try:
        return proc, wait_for_url(proc, timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def stop_serve(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Ctrl-C a `tandem serve` still running and wait for it (killed after `timeout`)."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_serve_answers_openai_and_stops_cleanly(tiny_qwen3: Path, tmp_path: Path) -> None:
    port = free_port()
    proc, lines = start_serve(tmp_path, "--model", str(tiny_qwen3), "--engines", "2",
                               "--port", str(port), "--served-model-name", "tiny",
                               "--max-num-requests", "48", "--prefix-routing", "approximate")
    try:
        assert f"http://127.0.0.1:{port}/v1" in lines[-1]
        # the router flags reach the router
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert "tandem_router_max_num_requests 48.0" in metrics
        # two engines + the router, each once (a busy machine may add "not ready yet" lines)
        assert sum(re.search(r": ready \(", line) is not None for line in lines) == 3, lines
        children = _children(proc.pid)
        assert len(children) == 3
        router = [Path(f"/proc/{pid}/cmdline").read_text().split("\0") for pid in children]
        router = next(argv for argv in router if "tandem_engine.router.main" in argv)
        assert router[router.index("--prefix-routing") + 1] == "approximate"

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        got = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                        temperature=0)
        expected = LLM(tiny_qwen3).generate(["Hello there"], SamplingParams(
            max_tokens=8, temperature=0.0))[0].outputs[0]
        assert got.choices[0].text == expected.text
        assert got.usage.completion_tokens == len(expected.token_ids)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
            temperature=0, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in chat if c.choices]
        assert "".join(pieces)

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        for pid in children:  # no orphan left behind
            assert not Path(f"/proc/{pid}").exists() or \
                "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_reports_a_bad_model_and_leaves_nothing(tmp_path: Path) -> None:
    def serve(model: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tandem_engine.cli.main", "serve", "--model", str(model),
             "--port", str(free_port())], capture_output=True, text=True, timeout=120,
            env={**os.environ, "TMPDIR": str(tmp_path)})

    # A path that does not exist (and is no known model name): said before anything starts.
    proc = serve(tmp_path / "nope")
    assert proc.returncode == 2
    assert "no such file or folder, and not a known model name" in proc.stderr
    assert "engine-0" not in proc.stderr
    # A folder that is no checkpoint: the engine says why.
    (tmp_path / "empty").mkdir()
    proc = serve(tmp_path / "empty")
    assert proc.returncode == 2
    assert "engine-0 exited with code 2" in proc.stderr
    assert "config.json" in proc.stderr


def test_serve_disaggregated_prefill_and_decode(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    proc, lines = start_serve(tmp_path, "--model", str(tiny_llama), "--prefill", "1",
                               "--decode", "1", "--port", str(port),
                               "--served-model-name", "t")
    try:
        assert any("prefill-0: ready" in line for line in lines)
        assert any("decode-1: ready" in line for line in lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        prompts = ["A long way from the harbour", "Seven bridges"]
        expected = LLM(tiny_llama).generate(prompts, SamplingParams(max_tokens=10,
                                                                    temperature=0.0))
        for prompt, exp in zip(prompts, expected, strict=True):
            got = client.completions.create(model="t", prompt=prompt, max_tokens=10,
                                            temperature=0)
            assert got.choices[0].text == exp.outputs[0].text
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'tandem_router_disaggregated_requests_total{outcome="handoff"} 2.0' in metrics
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_restarts_a_killed_engine_while_the_router_fails_over(tmp_path: Path) -> None:
    """kill -9 of one engine: no request fails (failover), and every answer, streamed
    across the kill or served after the restart, is the greedy answer the stack gave the
    same request before it; `serve` keeps running and restarts the engine (same id and
    ports), records it in stack.json, and serves on."""
    port = free_port()
    proc, _ = start_serve(tmp_path, "--demo", "--demo-dir", str(tmp_path / "demo"),
                           "--engines", "2", "--port", str(port))
    try:
        stack_file = tmp_path / f"tandem-{port}" / "stack.json"
        stack = json.loads(stack_file.read_text())
        victim = stack["engines"][0]
        pid = stack["children"][victim["name"]]["pid"]
        assert pid in _children(proc.pid)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=60)

        def stream(i: int) -> str:
            chunks = client.completions.create(model="demo-model", prompt=f"Hello {i}",
                                               max_tokens=24, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        def once(prompt: str, max_tokens: int) -> str:
            return client.completions.create(model="demo-model", prompt=prompt,
                                             max_tokens=max_tokens,
                                             temperature=0).choices[0].text

        # The reference: each request's greedy text from the healthy stack.
        with ThreadPoolExecutor(4) as pool:
            expected = list(pool.map(lambda i: once(f"Hello {i}", 24), range(24)))
        again = once("Again", 8)
        assert all(expected) and again

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(stream, i) for i in range(16)]
            time.sleep(0.3)
            os.kill(pid, signal.SIGKILL)
            futures += [pool.submit(stream, i) for i in range(16, 24)]
            texts = [f.result(timeout=120) for f in futures]
        assert texts == expected  # failed over mid-stream, resumed: the same tokens
        assert proc.poll() is None  # still serving

        deadline = time.monotonic() + 60
        while True:
            child = json.loads(stack_file.read_text())["children"][victim["name"]]
            if child["restarts"] == 1 and child["pid"] != pid:
                try:
                    if httpx.get(f"{victim['admin_url']}/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            assert time.monotonic() < deadline, child
            time.sleep(0.2)
        assert child["last_exit"] == "SIGKILL"
        assert child["pid"] in _children(proc.pid)
        assert stack["engines"] == json.loads(stack_file.read_text())["engines"]
        # The restarted engine serves the same greedy answers (requests reach it).
        address = next(e["address"] for e in httpx.get(
            f"http://127.0.0.1:{port}/v1/engines", timeout=10).json()["engines"]
            if e["engine_id"] == victim["name"])

        def served_by_victim() -> float:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            return sum(s.value for f in text_string_to_metric_families(text)
                       if f.name == "tandem_router_engine_requests" for s in f.samples
                       if s.labels.get("engine") == address)

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda i: once(f"Hello {i}", 24), range(24))) == expected
        assert once("Again", 8) == again
        # Those prompts' KV sits on the survivor (it served them all after the kill), so
        # prefix-aware routing rightly keeps them there. Prompts no engine has seen go by
        # load: some reach the restarted engine, and answer as the offline engine does.
        # Rounds of new prompts until one reaches it (the router learns of the restart
        # from its heartbeats, so the first round may still all go to the survivor).
        before = served_by_victim()
        offline_llm = LLM(tmp_path / "demo")
        deadline = time.monotonic() + 30
        for round_ in itertools.count():
            fresh = [f"Fresh words {round_} {i}" for i in range(16)]
            offline = [o.outputs[0].text for o in offline_llm.generate(
                fresh, SamplingParams(max_tokens=24, temperature=0.0))]
            with ThreadPoolExecutor(8) as pool:
                assert list(pool.map(lambda p: once(p, 24), fresh)) == offline
            if served_by_victim() > before:
                break
            assert time.monotonic() < deadline, "the restarted engine served no request"
        assert proc.poll() is None

        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "engine-0 exited unexpectedly (SIGKILL)" in out
        assert "engine-0: restarted (restart 1" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_gives_up_on_a_crash_looping_child(tmp_path: Path) -> None:
    """A child that keeps dying is restarted with growing back-off, then stops the stack."""
    stack = LocalStack(tmp_path, log_dir=tmp_path, restart_limit=3, backoff_base=0.2,
                       out=open(os.devnull, "w"))  # noqa: SIM115
    child = stack._spawn("engine-0", ["tandem_engine.no_such_module"], "http://127.0.0.1:1/")
    delays, seen = [], None
    deadline = time.monotonic() + 30
    while (reason := stack.supervise()) is None:
        assert time.monotonic() < deadline
        if child.restart_at is not None and child.restart_at != seen:
            seen = child.restart_at
            delays.append(seen - time.monotonic())
        time.sleep(0.01)
    assert "engine-0 exited (exit code 1) after 3 restarts within 60 s" in reason
    assert "crash-looping" in reason and "no_such_module" in reason
    assert child.restarts == 3 and child.last_exit == "exit code 1"
    assert len(delays) == 3  # the back-off doubles
    assert all(0 < want - d < 0.1 for d, want in zip(delays, [0.2, 0.4, 0.8], strict=True))
    stack.stop()
