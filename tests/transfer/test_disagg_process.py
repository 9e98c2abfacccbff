"""Prefill and decode engine processes handing KV over with real NIXL.

The test plays the router's part over real ZMQ: the prefill engine computes the
prompt and the first token and pins the prompt's blocks; the decode engine pulls the
blocks it lacks with a one-sided NIXL READ and decodes; its notification unpins them.
"""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from reference import random_prompts
from tandem_engine import LLM, SamplingParams
from tandem_engine import protocol as p
from test_engine_process import Client, EngineProcess

pytest.importorskip("nixl_cu12")
pytestmark = pytest.mark.slow
MAX_NEW = 12


@pytest.fixture(scope="module")
def pair(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("disagg")
    prefill = EngineProcess(tiny_llama, tmp, "--role", "prefill", "--engine-id", "pre")
    try:
        decode = EngineProcess(tiny_llama, tmp, "--role", "decode", "--pull-timeout", "5",
                               "--engine-id", "dec")
    except BaseException:
        prefill.close()
        raise
    yield prefill, decode
    decode.close()
    prefill.close()


@dataclass(frozen=True)
class Pinned:
    """A prefill engine's handoff: where the prompt's KV is pinned, and the first token."""

    source: p.PullSource
    first_token: int

    @property
    def block_ids(self) -> list[int]:
        return self.source.block_ids

    @property
    def agent(self) -> p.KVTransferInfo:
        return self.source.agent


def pin(pre: Client, rid: str, prompt: list[int], max_new: int = MAX_NEW,
        **sampling) -> Pinned:
    """The prefill step: the first token, and the pinned prompt KV as a pull source."""
    pre.sock.send(p.encode(p.Submit(rid, prompt, SamplingParams(
        max_tokens=max_new, temperature=0.0, ignore_eos=True, **sampling),
        pin_for_handoff=True)))
    while True:
        pre_out = pre.next((p.Output, p.Reject))
        assert not isinstance(pre_out, p.Reject), pre_out
        if pre_out.request_id == rid and pre_out.finished:
            break
    assert pre_out.handoff is not None and pre_out.finish_reason is None
    return Pinned(p.PullSource(pre.welcome.kv_transfer, pre_out.handoff.pin_id,
                               pre_out.handoff.block_ids), pre_out.token_ids[0])


def send_pull(dec: Client, rid: str, prompt: list[int], pinned: Pinned,
              max_new: int = MAX_NEW) -> None:
    dec.sock.send(p.encode(p.Submit(rid, prompt, SamplingParams(
        max_tokens=max_new, temperature=0.0, ignore_eos=True),
        resume=p.Resume([pinned.first_token]), pull=pinned.source)))


def pull(dec: Client, rid: str, prompt: list[int], pinned: Pinned,
         max_new: int = MAX_NEW, timeout: float = 30.0) -> list[int]:
    """The decode step: every token of the generation, the prefill engine's first one
    included (the decode stream starts after it)."""
    send_pull(dec, rid, prompt, pinned, max_new)
    return collect(dec, rid, pinned, timeout)


def collect(dec: Client, rid: str, pinned: Pinned, timeout: float = 30.0) -> list[int]:
    outs = []
    while not outs or not outs[-1].finished:
        msg = dec.next((p.Output, p.Reject), timeout)
        assert not isinstance(msg, p.Reject), msg
        if msg.request_id == rid:
            outs.append(msg)
    return [pinned.first_token] + [t for o in outs for t in o.token_ids]


def _handoff(pre: Client, dec: Client, rid: str, prompt: list[int]) -> list[int]:
    return pull(dec, rid, prompt, pin(pre, rid, prompt))


def test_disaggregated_output_equals_colocated(pair, tiny_llama: Path) -> None:
    prefill, decode = pair
    pre, dec = prefill.client(), decode.client()
    assert pre.welcome.role == "prefill" and pre.welcome.kv_transfer is not None
    prompts = random_prompts(2048, [7, 30, 64, 90], seed=40)
    expected = LLM(tiny_llama).generate(prompts, SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    for i, prompt in enumerate(prompts):
        assert _handoff(pre, dec, f"d{i}", prompt) == expected[i].outputs[0].token_ids
    state = decode.http("GET", "/v1/state")[1]
    assert state["kv_pulls"]["failed"] == 0
    assert state["kv_pulls"]["pulled_blocks"] == sum(-(-len(x) // 16) for x in prompts)
    # The decode engine's notifications unpinned every prompt on the prefill engine.
    for _ in range(50):
        if prefill.http("GET", "/v1/state")[1]["pinned_blocks"] == 0:
            break
        time.sleep(0.05)
    assert prefill.http("GET", "/v1/state")[1]["pinned_blocks"] == 0


def test_a_cached_prefix_on_the_decode_engine_is_not_pulled(pair, tiny_llama: Path) -> None:
    prefill, decode = pair
    pre, dec = prefill.client(), decode.client()
    shared, tail = random_prompts(2048, [48, 21], seed=41)
    warm = dec.run("warm", [*shared, 9], max_tokens=2, temperature=0.0)  # colocated run
    assert warm[-1].finished
    before = decode.http("GET", "/v1/state")[1]["kv_pulls"]
    tokens = _handoff(pre, dec, "suffix", shared + tail)
    after = decode.http("GET", "/v1/state")[1]["kv_pulls"]
    assert after["reused_blocks"] - before["reused_blocks"] == 3
    assert after["pulled_blocks"] - before["pulled_blocks"] == 2  # 69 tokens: 5 blocks
    expected = LLM(tiny_llama).generate([shared + tail], SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    assert tokens == expected


def _cycle(engine: EngineProcess, mode: str) -> None:
    """pause → suspend(mode) → resume → unpause over the admin API."""
    for path, body in (("/v1/pause", None), ("/v1/suspend", {"mode": mode}),
                       ("/v1/resume", None), ("/v1/unpause", None)):
        status, reply = engine.http("POST", path, body)
        assert status == 200, (path, status, reply)


@pytest.mark.parametrize("mode", ["offload", "recompute"])
def test_handoff_works_after_either_side_moved_its_kv_pool(pair, tiny_llama: Path,
                                                           mode: str) -> None:
    """An offload or recompute suspend replaces the KV pool tensor: both engines register
    the new pool with NIXL, the prefill engine re-announces its agent, and the decode
    engine re-adds it, so handoffs still pull (no failure, no recompute)."""
    prefill, decode = pair
    pre, dec = prefill.client(), decode.client()
    prompts = random_prompts(2048, [40, 52], seed=42 if mode == "offload" else 43)
    expected = LLM(tiny_llama).generate(prompts, SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    assert _handoff(pre, dec, f"{mode}-before", prompts[0]) == expected[0].outputs[0].token_ids
    _cycle(prefill, mode)
    _cycle(decode, mode)
    before = decode.http("GET", "/v1/state")[1]["kv_pulls"]
    pre = prefill.client()  # a router connecting now gets the re-registered pool's agent
    assert pre.welcome.kv_transfer is not None
    assert _handoff(pre, dec, f"{mode}-after", prompts[1]) == expected[1].outputs[0].token_ids
    after = decode.http("GET", "/v1/state")[1]["kv_pulls"]
    assert after["failed"] == before["failed"] and after["recomputed"] == before["recomputed"]
    assert after["pulled_blocks"] - before["pulled_blocks"] == 4


def test_handoff_metrics_are_exported(pair) -> None:
    prefill, decode = pair
    text = urllib.request.urlopen(
        f"http://127.0.0.1:{decode.admin_port}/metrics", timeout=10).read().decode()
    text = re.sub(r',(model_name|role)="[^"]*"', "", text)  # on every engine series
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("tandem_kv_handoff") or line.startswith("tandem_kv_pinned")}
    assert values['tandem_kv_handoff_bytes_total{engine_id="dec"}'] > 0
    assert values['tandem_kv_handoff_blocks_total{engine_id="dec",kind="pulled"}'] > 0
    assert values['tandem_kv_handoff_seconds_count{engine_id="dec"}'] >= 1
    assert 'tandem_kv_handoff_failures_total{cause="timeout",engine_id="dec"}' in values
    assert 'tandem_kv_handoff_recomputes_total{engine_id="dec"}' in values
    pre_text = urllib.request.urlopen(
        f"http://127.0.0.1:{prefill.admin_port}/metrics", timeout=10).read().decode()
    assert 'tandem_kv_pinned_blocks{engine_id="pre",model_name=' in pre_text
    assert 'role="prefill"} 0.0' in next(line for line in pre_text.splitlines()
                                         if line.startswith("tandem_kv_pinned_blocks"))
