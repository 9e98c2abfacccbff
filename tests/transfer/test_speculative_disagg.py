"""Speculative decoding behind disaggregation, as users run it: a prefill engine and a
decode engine (both `--speculative-method ngram`, NIXL between them) behind a router.

The prefill engine computes the prompt and the first token and hands off without
proposing anything (a handoff request never speculates); the decode engine's request
is prompt + first token, so prompt lookup proposes from its first step. Greedy tokens
through the router must equal a colocated engine's with speculation off, token for
token; the decode engine's metrics show proposals accepted; and the router's request
log reports, per request, what the decode engine accepted of what it verified, summing
to the decode engine's counters.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from reference import random_prompts
from tandem_engine import LLM, SamplingParams
from tandem_engine import protocol as p
from test_router_disagg import DEC, PRE, PROMPT, TARGET, _run, colocated, scripted_dispatcher
from test_router_e2e import MODEL, Cluster, run_cluster

VOCAB = 2048  # the demo tokenizer's
SPEC_FLAGS = ["--speculative-method", "ngram", "--speculative-tokens", "4",
              "--speculative-ngram-min", "1", "--speculative-ngram-max", "3"]
MAX_TOKENS = 32
# The request log's line for a finished request (router/dispatch.py `finished_line`).
FINISHED = re.compile(r"request (\S+) finished \((\w+)\) in [\d.]+ s on (\S+) -> (\S+): "
                      r"(\d+) prompt \+ (\d+) output tokens"
                      r"(?:, spec accepted (\d+)/(\d+) \((\d+)%\))?$")


def _repeating(seed: int, period: int, repeats: int) -> list[int]:
    unit = random_prompts(VOCAB, [period], seed=seed)[0]
    return unit * repeats + unit[:period // 2]


# Repetitive prompts (prompt lookup finds them at once) and plain ones. The tiny demo
# model has random weights and does not copy its prompt by itself: a repetition
# "penalty" below 1 makes it loop over what it has seen, so proposals get accepted.
PROMPTS = [_repeating(1, 12, 3), _repeating(2, 7, 5), *random_prompts(VOCAB, [20, 45],
                                                                       seed=3)]
PENALTIES = (1.0, 0.01)


# ---- the router's request log, over scripted engines ----------------------------------------

def _speculating(proposed: int, accepted: int):
    """The `colocated` script, its final output carrying speculative decoding's totals
    (as an engine's does) where the engine decodes more than the first token."""

    def script(request_id: str, prompt: list[int], sampling: SamplingParams, pin: bool,
               resume: p.Resume | None, pull: p.PullSource | None) -> list[Any]:
        outs = colocated(request_id, prompt, sampling, pin, resume, pull)
        if not pin:
            outs[-1] = msgspec.structs.replace(outs[-1], num_spec_proposed=proposed,
                                               num_spec_accepted=accepted)
        return outs

    return script


def test_the_request_log_line_reports_the_decode_engines_acceptance(
        caplog: pytest.LogCaptureFixture) -> None:
    dispatcher, _, _ = scripted_dispatcher(
        {PRE: ("prefill", _speculating(0, 0)), DEC: ("decode", _speculating(6, 4))})
    with caplog.at_level(logging.INFO, logger="tandem_engine.router.dispatch"):
        deltas = _run(dispatcher, SamplingParams(max_tokens=6, temperature=0.0))
    assert [t for d in deltas for t in d.token_ids] == TARGET
    (line,) = [r.getMessage() for r in caplog.records if "finished" in r.getMessage()]
    m = FINISHED.search(line)
    assert m is not None, line
    assert m.groups() == ("r", "stop", PRE, DEC, str(len(PROMPT)), str(len(TARGET)), "4", "6",
                          "67")


def test_the_router_passes_the_prefill_engines_proposals_to_the_decode_engine() -> None:
    seen: list[list[int]] = []

    def prefill(*args: Any) -> list[Any]:
        outs = colocated(*args)
        handoff = outs[-1].handoff
        assert handoff is not None
        outs[-1] = msgspec.structs.replace(
            outs[-1], handoff=msgspec.structs.replace(handoff, proposals=TARGET[1:3]))
        return outs

    def decode(request_id: str, prompt: list[int], sampling: SamplingParams, pin: bool,
               resume: p.Resume | None, pull: p.PullSource | None) -> list[Any]:
        assert pull is not None
        seen.append(list(pull.proposals))
        return colocated(request_id, prompt, sampling, pin, resume, pull)

    dispatcher, _, _ = scripted_dispatcher({PRE: ("prefill", prefill),
                                            DEC: ("decode", decode)})
    deltas = _run(dispatcher, SamplingParams(max_tokens=6, temperature=0.0))
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert seen == [TARGET[1:3]]


def test_no_spec_figures_without_proposals(caplog: pytest.LogCaptureFixture) -> None:
    dispatcher, _, _ = scripted_dispatcher({PRE: ("mixed", colocated)})
    with caplog.at_level(logging.INFO, logger="tandem_engine.router.dispatch"):
        _run(dispatcher, SamplingParams(max_tokens=3, temperature=0.0))
    (line,) = [r.getMessage() for r in caplog.records if "finished" in r.getMessage()]
    assert line.startswith("request r finished (length) in ")
    assert line.endswith(f" s on {PRE}: {len(PROMPT)} prompt + 3 output tokens")


# ---- a real stack --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """1 prefill + 1 decode engine, both speculating (ngram), behind one router."""
    pytest.importorskip("nixl_cu12")
    yield from run_cluster(tiny_llama, tmp_path_factory.mktemp("spec-disagg"),
                           ("prefill", "decode"), SPEC_FLAGS)


def _engine_metrics(admin_url: str) -> dict[str, float]:
    """name{label=value,...} (engine labels left out) -> value."""
    text = httpx.get(f"{admin_url}/metrics", timeout=5).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = {k: v for k, v in s.labels.items()
                     if k not in ("engine_id", "model_name", "role")}
            out[s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(extra.items()))] = s.value
    return out


@pytest.mark.slow
def test_decode_engine_speculates_after_the_handoff_with_identical_tokens(
        stack: Cluster, tiny_llama: Path) -> None:
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                             repetition_penalty=r) for r in PENALTIES]
    cases = [(prompt, sampling) for prompt in PROMPTS for sampling in params]
    plain = LLM(tiny_llama)  # colocated, speculation off
    assert plain.engine.stats.speculative is None
    expected = plain.generate([c[0] for c in cases], [c[1] for c in cases])

    client = stack.client()
    ids = []
    for i, ((prompt, sampling), ref) in enumerate(zip(cases, expected, strict=True)):
        # Each case its own cache salt: a prompt sent again would otherwise find its KV
        # on the decode engine and run there alone (P/D bypass), with no handoff to test.
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True,
                        "repetition_penalty": sampling.repetition_penalty,
                        "cache_salt": f"case-{i}"})
        assert r.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
        assert r.choices[0].text == ref.outputs[0].text
        # usage is OpenAI's, nothing of speculation added
        assert set(r.usage.model_dump(exclude_none=True)) <= {
            "prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
        ids.append(r.id)
    assert stack.metric("tandem_router_disaggregated_requests_total",
                        outcome="handoff") == len(cases)

    prefill, decode = (_engine_metrics(url) for url in stack.admin_urls)
    # The prefill engine proposes nothing: its part ends at the first token.
    assert prefill["vllm:spec_decode_num_drafts_total"] == 0
    drafts = decode["vllm:spec_decode_num_drafts_total"]
    proposed = decode["vllm:spec_decode_num_draft_tokens_total"]
    accepted = decode["vllm:spec_decode_num_accepted_tokens_total"]
    per_pos = [decode.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}",
                          0) for i in range(4)]
    assert 0 < accepted < proposed and drafts > 0
    assert sum(per_pos) == accepted and per_pos[0] <= drafts
    assert per_pos == sorted(per_pos, reverse=True)  # position i+1 needs position i
    assert decode["tandem_spec_decode_steps_total{kind=verify}"] > 0
    assert decode["tandem_spec_decode_step_seconds_total{kind=verify}"] > 0

    # The router logs every request once, with what its decode engine accepted.
    lines = [m for line in (stack.logs / "router.log").read_text().splitlines()
             if (m := FINISHED.search(line))]
    assert len(lines) == len(cases)
    prefill_key, decode_key = stack.engine_keys
    for m, (prompt, _) in zip(lines, cases, strict=True):
        assert m.group(2) == "length" and (m.group(3), m.group(4)) == (prefill_key,
                                                                         decode_key)
        assert (int(m.group(5)), int(m.group(6))) == (len(prompt), MAX_TOKENS)
    logged = [(int(m.group(7)), int(m.group(8))) for m in lines if m.group(7) is not None]
    assert sum(a for a, _ in logged) == accepted and sum(p for _, p in logged) == proposed
    assert any(a > 0 for a, _ in logged)
    assert all(m.group(1).startswith(tuple(ids)) for m in lines)


@pytest.mark.slow
def test_mtp_proposals_travel_with_the_handoff(tmp_path_factory: pytest.TempPathFactory
                                               ) -> None:
    """Method mtp: the prefill engine proposes from its last hidden state as it hands
    off, the proposals ride the handoff through the router, and the decode engine
    verifies them in its first step. With max_tokens 3 that first step is the only one
    that may propose (afterwards at most 0 tokens may follow), so the decode engine
    verifies a draft per request only if the proposals arrived; the tokens are a
    colocated run's either way."""
    from test_speculative_mtp import KNOWN, _with_heads

    _, fitted = _with_heads(tmp_path_factory, "llama")  # heads that memorized KNOWN
    flags = ["--speculative-method", "mtp", "--speculative-tokens", "2"]
    plain = LLM(fitted)
    pytest.importorskip("nixl_cu12")
    for c in run_cluster(fitted, tmp_path_factory.mktemp("mtp-disagg"), ("prefill", "decode"),
                         flags):
        client = c.client()
        for max_tokens in (3, 20):
            want = plain.generate(KNOWN, SamplingParams(max_tokens=max_tokens,
                                                        temperature=0.0, ignore_eos=True))
            for prompt, ref in zip(KNOWN, want, strict=True):
                r = client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                    extra_body={"return_token_ids": True, "ignore_eos": True})
                assert r.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
            prefill, decode = (_engine_metrics(url) for url in c.admin_urls)
            if max_tokens == 3:
                assert decode["vllm:spec_decode_num_drafts_total"] == len(KNOWN)
                assert decode["vllm:spec_decode_num_accepted_tokens_total"] == len(KNOWN)
        assert prefill["vllm:spec_decode_num_drafts_total"] == 0
        assert decode["vllm:spec_decode_num_accepted_tokens_total"] > 2 * len(KNOWN)
