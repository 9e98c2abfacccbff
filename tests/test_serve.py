"""`tandem serve`: the one-command local stack, as a user runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from tandem_engine import LLM, SamplingParams
from tandem_engine.cli.serve import free_port

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _start_serve(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, list[str]]:
    """`tandem serve ARGS`, once it has printed its URL; returns the process and its lines."""
    proc = subprocess.Popen([sys.executable, "-m", "tandem_engine.cli.main", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("Tandem is serving" in line for line in lines):
            assert time.monotonic() < deadline, "".join(lines)
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, lines


def test_serve_answers_openai_and_stops_cleanly(tiny_qwen3: Path, tmp_path: Path) -> None:
    port = free_port()
    proc, lines = _start_serve(tmp_path, "--model", str(tiny_qwen3), "--engines", "2",
                               "--port", str(port), "--served-model-name", "tiny")
    try:
        assert f"http://127.0.0.1:{port}/v1" in lines[-1]
        assert sum("ready" in line for line in lines) == 3  # two engines + the router
        children = _children(proc.pid)
        assert len(children) == 3

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
    proc, lines = _start_serve(tmp_path, "--model", str(tiny_llama), "--prefill", "1",
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
