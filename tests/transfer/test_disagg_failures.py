"""KV handoff failures between real engine processes over real NIXL: the request always
completes, pins never strand prefill memory, and a frozen, killed or restarted prefill
engine never wedges a decode engine.

The test plays the router's part over real ZMQ (`pin` on the prefill engine, `pull` on
the decode engine, from test_disagg_process).
"""

from __future__ import annotations

import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from reference import random_prompts
from tandem_engine import LLM, SamplingParams
from test_disagg_process import MAX_NEW, collect, pin, pull, send_pull
from test_engine_process import EngineProcess

pytest.importorskip("nixl_cu12")
pytestmark = pytest.mark.slow


def _state(engine: EngineProcess) -> dict:
    status, body = engine.http("GET", "/v1/state")
    assert status == 200, (status, body)
    return body


def _wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


def _greedy(model: Path, prompts: list[list[int]], **kw) -> list[list[int]]:
    outs = LLM(model, **kw).generate(prompts, SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _pair(model: Path, tmp: Path, engines: list, pull_timeout: float, *decode_args: str):
    """A prefill engine "pre" and a decode engine "dec", with a router-side client each."""
    engines.append(prefill := EngineProcess(model, tmp, "--role", "prefill",
                                            "--engine-id", "pre"))
    engines.append(decode := EngineProcess(model, tmp, "--role", "decode", "--engine-id",
                                           "dec", "--pull-timeout", str(pull_timeout),
                                           *decode_args))
    return prefill, decode, prefill.client(), decode.client()


@pytest.fixture
def engines(tmp_path: Path):
    """Start engines with `engines.append(EngineProcess(...))`; killed at teardown."""
    started: list[EngineProcess] = []
    yield started
    for e in started:
        e.proc.send_signal(signal.SIGCONT)  # a stopped process cannot die of SIGKILL late
        e.close()


def test_pins_of_a_dead_decode_engine_expire_after_the_ttl(
        tiny_llama: Path, tmp_path: Path, engines: list) -> None:
    engines.append(prefill := EngineProcess(tiny_llama, tmp_path, "--role", "prefill",
                                            "--engine-id", "pre", "--kv-pin-ttl", "2"))
    engines.append(decode := EngineProcess(tiny_llama, tmp_path, "--role", "decode",
                                           "--engine-id", "dec"))
    prompt = random_prompts(2048, [40], seed=60)[0]
    dec = decode.client()
    source = pin(prefill.client(), "r", prompt)
    pinned_at = time.monotonic()
    assert _state(prefill)["pinned_blocks"] == len(source.block_ids) == 3
    # The decode engine is sent the request but dies before it could pull.
    decode.proc.send_signal(signal.SIGSTOP)
    send_pull(dec, "r", prompt, source)
    decode.proc.kill()
    decode.proc.wait()
    _wait_for(lambda: _state(prefill)["pinned_blocks"] == 0, 10, "pins released")
    assert time.monotonic() - pinned_at >= 1.5  # by the TTL, not by a notification
    assert _state(prefill)["kv_usage"] == 0.0


def test_frozen_then_thawed_prefill_engine(tiny_llama: Path, tmp_path: Path,
                                           engines: list) -> None:
    """SIGSTOP the prefill engine while the decode engine pulls: the pull's deadline fires,
    the decode engine recomputes the prompt and the request completes with the right
    tokens; after SIGCONT the pair hands off again without a failure."""
    prefill, decode, pre, dec = _pair(tiny_llama, tmp_path, engines, pull_timeout=1.5)
    prompts = random_prompts(2048, [33, 70, 50], seed=61)
    expected = _greedy(tiny_llama, prompts)
    assert pull(dec, "warm", prompts[0], pin(pre, "warm", prompts[0])) == expected[0]

    source = pin(pre, "frozen", prompts[1])
    prefill.proc.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    assert pull(dec, "frozen", prompts[1], source, timeout=30) == expected[1]
    took = time.monotonic() - started
    assert 1.5 <= took < 15, took
    pulls = _state(decode)["kv_pulls"]
    assert pulls["failed_timeout"] == 1 and pulls["recomputed"] == 1

    prefill.proc.send_signal(signal.SIGCONT)
    assert pull(dec, "thawed", prompts[2], pin(pre, "thawed", prompts[2])) == expected[2]
    pulls = _state(decode)["kv_pulls"]
    assert pulls["failed"] == 1 and pulls["pulled_blocks"] == 3 + 4  # warm, thawed
    # The frozen request's pin expired or was released; the rest were notified.
    _wait_for(lambda: _state(prefill)["pinned_blocks"] <= len(source.block_ids), 10,
              "pins of finished pulls released")


@pytest.mark.parametrize("drained_by", ["sigcont", "ttl"])
def test_a_timed_out_pull_quarantines_its_blocks_until_the_transfer_ends(
        tiny_llama: Path, tmp_path: Path, engines: list, drained_by: str) -> None:
    """A READ that timed out may still land: its destination blocks stay quarantined on
    the decode engine while the peer is frozen (the request still completes, recomputed
    in other blocks), until the thawed peer ends the transfer or the quarantine TTL."""
    ttl = 60 if drained_by == "sigcont" else 4
    prefill, decode, pre, dec = _pair(tiny_llama, tmp_path, engines, 1.0,
                                      "--kv-quarantine-ttl", str(ttl))
    prompts = random_prompts(2048, [40, 60], seed=64)
    expected = _greedy(tiny_llama, prompts)
    source = pin(pre, "frozen", prompts[0])
    prefill.proc.send_signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    assert pull(dec, "frozen", prompts[0], source, timeout=30) == expected[0]
    state = _state(decode)
    assert state["kv_pulls"]["failed_timeout"] == 1 and state["kv_pulls"]["recomputed"] == 1
    assert state["quarantined_blocks"] == len(source.block_ids) > 0
    metrics = urllib.request.urlopen(
        f"http://127.0.0.1:{decode.admin_port}/metrics", timeout=10).read().decode()
    metrics = re.sub(r',(model_name|role)="[^"]*"', "", metrics)  # on every engine series
    assert f'tandem_kv_quarantined_blocks{{engine_id="dec"}} {len(source.block_ids)}.0' \
        in metrics
    if drained_by == "sigcont":
        time.sleep(1.0)  # still frozen: the transfer's state is still unknown
        assert _state(decode)["quarantined_blocks"] == len(source.block_ids)
        prefill.proc.send_signal(signal.SIGCONT)
        _wait_for(lambda: _state(decode)["quarantined_blocks"] == 0, 15,
                  "quarantine released when the transfer ended")
        assert time.monotonic() - frozen_at < ttl
    else:
        _wait_for(lambda: _state(decode)["quarantined_blocks"] == 0, ttl + 10,
                  "quarantine released by the TTL")
        assert time.monotonic() - frozen_at >= ttl
        prefill.proc.send_signal(signal.SIGCONT)
    # The pool is whole again: the next handoff pulls and decodes correctly.
    assert pull(dec, "after", prompts[1], pin(pre, "after", prompts[1])) == expected[1]
    assert _state(decode)["quarantined_blocks"] == 0


def test_killed_prefill_during_a_pull_then_restarted(tiny_llama: Path, tmp_path: Path,
                                                     engines: list) -> None:
    """kill -9 the prefill engine during a pull: the request completes by recompute. The
    engine restarted on the same address (a new incarnation, a new NIXL agent under the
    same name) replaces the stale peer: the next handoff pulls from it."""
    prefill, decode, pre, dec = _pair(tiny_llama, tmp_path, engines, pull_timeout=3)
    prompts = random_prompts(2048, [20, 64, 45], seed=62)
    expected = _greedy(tiny_llama, prompts)
    assert pull(dec, "warm", prompts[0], pin(pre, "warm", prompts[0])) == expected[0]

    source = pin(pre, "killed", prompts[1])
    prefill.proc.send_signal(signal.SIGSTOP)  # hold the pull in flight ...
    send_pull(dec, "killed", prompts[1], source)
    time.sleep(0.5)
    prefill.close()  # ... and kill it there
    assert collect(dec, "killed", source) == expected[1]
    assert _state(decode)["kv_pulls"]["recomputed"] == 1

    engines.append(again := EngineProcess(tiny_llama, tmp_path, "--role", "prefill",
                                          "--engine-id", "pre", port=prefill.port,
                                          admin_port=prefill.admin_port))
    old_incarnation = pre.welcome.incarnation
    pre = again.client()
    assert pre.welcome.incarnation != old_incarnation  # a new process, the same agent name
    assert pre.welcome.kv_transfer.agent_name == source.agent.agent_name == "pre"
    before = _state(decode)["kv_pulls"]
    assert pull(dec, "restarted", prompts[2], pin(pre, "restarted", prompts[2])) == expected[2]
    after = _state(decode)["kv_pulls"]
    assert after["failed"] == before["failed"] and after["pulled_blocks"] > before[
        "pulled_blocks"]
    assert "restarted (new metadata)" in decode.log.read_text()
    _wait_for(lambda: _state(again)["pinned_blocks"] == 0, 10, "pins released")


def test_a_geometry_mismatched_pair_falls_back_with_a_clear_log_line(
        tiny_llama: Path, tmp_path: Path, engines: list) -> None:
    """A float32 prefill engine and a bfloat16 decode engine cannot share KV blocks: the
    decode engine sees it from the descriptor, moves no byte, says so, and recomputes."""
    engines.append(prefill := EngineProcess(tiny_llama, tmp_path, "--role", "prefill",
                                            "--engine-id", "pre-f32", "--kv-pin-ttl", "3"))
    engines.append(decode := EngineProcess(tiny_llama, tmp_path, "--role", "decode",
                                           "--engine-id", "dec-bf16", "--dtype", "bfloat16"))
    prompt = random_prompts(2048, [37], seed=63)[0]
    source = pin(prefill.client(), "mismatch", prompt)
    tokens = pull(decode.client(), "mismatch", prompt, source)
    # Correct output: the prefill engine's first token, then the decode engine's own
    # continuation of prompt + that token (it recomputed everything it decodes from).
    rest = LLM(tiny_llama, dtype="bfloat16").generate(
        [[*prompt, source.first_token]],
        SamplingParams(max_tokens=MAX_NEW - 1, temperature=0.0, ignore_eos=True))
    assert tokens == [source.first_token, *rest[0].outputs[0].token_ids]
    pulls = _state(decode)["kv_pulls"]
    assert pulls["failed_geometry"] == 1 and pulls["bytes"] == 0 and pulls["recomputed"] == 1
    log = decode.log.read_text()
    assert "pull of" in log and "(geometry)" in log and "dtype" in log, log[-2000:]
    _wait_for(lambda: _state(prefill)["pinned_blocks"] == 0, 10, "pins released by the TTL")
