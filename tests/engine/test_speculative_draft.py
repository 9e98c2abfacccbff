"""Speculative decoding with a draft model (method "draft"): the same tokens as without it.

The drafts are cut from the tiny demo models by `tandem draft-model` (1 of their 2
layers: proposals often wrong, so verification rejects midway), and the target itself
used as its own draft: then every greedy proposal must be accepted (>= 95%, float
noise aside), which a draft that runs a token at the wrong position or over stale KV
would not manage. Each is checked against the same engine with speculation off:
greedy tokens and logprobs over the three architectures, mixed batches, chunked
prefill, preemption, stop conditions inside a verified block, seeded sampling,
suspend and refit; both KV pools are empty again at the end. Then the command itself
(transformers loads what it writes) and the errors of bad inputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from reference import assert_matches, hf_greedy, random_prompts
from tandem_engine.cli.draft_model import write_draft_model
from tandem_engine.cli.main import main as tandem_main
from tandem_engine.engine.llm import LLM
from tandem_engine.errors import CheckpointError
from tandem_engine.sampling_params import SamplingParams
from test_speculative import PROMPTS, VOCAB, _assert_same, _with_late_arrivals

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
MIXED = [*PROMPTS, *random_prompts(VOCAB, [3, 70], seed=21)]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory):
    """The 1-layer draft of a tiny model, written once per model."""
    made: dict[Path, Path] = {}

    def draft_of(model: Path) -> Path:
        if model not in made:
            made[model] = write_draft_model(model, tmp_path_factory.mktemp("draft"), 1)
        return made[model]

    return draft_of


def _spec(draft: Path, k: int = 4) -> dict:
    return {"method": "draft", "model": str(draft), "num_speculative_tokens": k}


def _assert_pools_empty(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    assert engine.draft.num_free_blocks == engine.draft.kv.num_blocks
    assert not engine.draft._states


def _rate(llm: LLM) -> float:
    return llm.engine.stats.speculative.acceptance_rate


def test_greedy_tokens_and_logprobs_equal_without_speculation(tiny_model: Path,
                                                              drafts) -> None:
    plain = LLM(tiny_model)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2)
              for m in (40, 7, 33, 1, 40, 19)]
    want = plain.generate(MIXED, params)
    small = LLM(tiny_model, speculative_config=_spec(drafts(tiny_model)))
    _assert_same(want, small.generate(MIXED, params), logprobs=True)
    stats = small.engine.stats.speculative
    # Rejections happen (the back-off pauses a request whose drafts keep failing, so a
    # poor 1-layer draft verifies fewer drafts than steps; acceptances: the draft below).
    assert stats.num_drafts > 10 and stats.num_accepted_tokens < stats.num_draft_tokens
    _assert_pools_empty(small)
    # The target as its own draft proposes exactly its greedy tokens: all accepted.
    itself = LLM(tiny_model, speculative_config=_spec(tiny_model))
    _assert_same(want, itself.generate(MIXED, params), logprobs=True)
    assert _rate(itself) >= 0.95
    assert len(itself.engine.step_timings) < len(plain.engine.step_timings) / 2
    _assert_pools_empty(itself)


def test_chunked_prefill_preemption_and_arrivals_during_decode(tiny_llama: Path) -> None:
    prompts = [*MIXED, *random_prompts(VOCAB, [90, 85], seed=22)]
    params = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)
    options = {"num_blocks": 24, "max_num_batched_tokens": 12}
    plain = LLM(tiny_llama, **options)
    want = plain.generate(prompts, params)
    spec = LLM(tiny_llama, speculative_config=_spec(tiny_llama), **options)
    _assert_same(want, spec.generate(prompts, params))
    assert spec.engine.num_preemptions > 0
    assert _rate(spec) >= 0.95
    assert max(t.num_prefill_tokens + t.num_decode_tokens
               for t in spec.engine.step_timings) <= 12
    _assert_pools_empty(spec)
    # Requests arriving while others verify drafts.
    _assert_same(want, _with_late_arrivals(spec.engine, prompts, params, every=4))
    _assert_pools_empty(spec)


def test_proposals_are_the_drafts_own_greedy_continuation(tiny_llama: Path, drafts) -> None:
    """Each step's proposals equal what the draft model alone generates greedily from
    the request's tokens: its cache holds exactly the accepted tokens (a rejected
    proposal's KV never leaks into a later proposal), through chunked prefill and
    preemption."""
    draft = drafts(tiny_llama)
    spec = LLM(tiny_llama, speculative_config=_spec(draft), num_blocks=24,
               max_num_batched_tokens=12)
    engine = spec.engine
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate([*MIXED, *random_prompts(VOCAB, [90], seed=23)]):
        engine.add_request(f"r{i}", prompt, params)
    asked: list[tuple[list[int], list[int]]] = []  # (tokens, proposals)
    while engine.has_unfinished_requests():
        before = {r.request_id: (r, list(r.token_ids)) for r in engine.scheduler.running}
        engine.step()
        asked += [(tokens, r.spec_token_ids) for r, tokens in before.values()
                  if r.spec_token_ids]
    assert engine.num_preemptions > 0 and len(asked) > 50
    alone = LLM(draft).generate(
        [tokens for tokens, _ in asked],
        [SamplingParams(max_tokens=len(p), temperature=0.0, ignore_eos=True)
         for _, p in asked])
    same = sum(o.outputs[0].token_ids == p for o, (_, p) in zip(alone, asked, strict=True))
    assert same >= 0.99 * len(asked), f"{len(asked) - same} of {len(asked)} differ"
    _assert_pools_empty(spec)


def test_stop_conditions_inside_a_verified_block(tiny_qwen2: Path) -> None:
    prompt = PROMPTS[0]
    plain = LLM(tiny_qwen2)
    spec = LLM(tiny_qwen2, speculative_config=_spec(tiny_qwen2, k=5))
    ref = plain.generate([prompt], GREEDY)[0].outputs[0]
    tokens, text = ref.token_ids, ref.text
    variants = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                for m in range(1, 9)]
    variants += [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                stop_token_ids=[tokens[i]], logprobs=1) for i in (2, 9, 17)]
    variants += [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                stop=[text[j:j + 3]]) for j in (5, 21, 40)]
    variants += [SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3,
                                ignore_eos=True)]
    prompts = [prompt] * len(variants)
    _assert_same(plain.generate(prompts, variants), spec.generate(prompts, variants),
                 logprobs=True)
    # EOS: one of the output's tokens made the end token, emitted mid-way.
    for llm in (plain, spec):
        llm.engine.outputs.eos_token_ids = frozenset({tokens[12]})
    eos = [SamplingParams(max_tokens=40, temperature=0.0)]
    got = spec.generate([prompt], eos)
    _assert_same(plain.generate([prompt], eos), got)
    assert got[0].outputs[0].finish_reason == "stop"
    _assert_pools_empty(spec)


def test_seeded_sampling_draws_the_same_tokens(tiny_qwen3: Path, drafts) -> None:
    prompts = PROMPTS
    params = [SamplingParams(max_tokens=24, temperature=t, top_p=0.9, seed=i,
                             ignore_eos=True, logprobs=1)
              for i, t in enumerate([0.3, 0.6, 1.0, 0.8])]
    want = LLM(tiny_qwen3).generate(prompts, params)
    for draft, accepted_at_least in ((tiny_qwen3, 10), (drafts(tiny_qwen3), 0)):
        spec = LLM(tiny_qwen3, speculative_config=_spec(draft))
        _assert_same(want, spec.generate(prompts, params), logprobs=True)
        stats = spec.engine.stats.speculative
        assert stats.num_drafts > 4 and stats.num_accepted_tokens >= accepted_at_least
        _assert_pools_empty(spec)


def test_suspend_and_refit_drop_the_draft_kv(tiny_llama: Path, drafts) -> None:
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = LLM(tiny_llama).generate([prompt], params)
    spec = LLM(tiny_llama, speculative_config=_spec(tiny_llama))
    engine = spec.engine
    for mode in ("recompute", "offload"):
        engine.add_request(mode, prompt, params)
        for _ in range(3):
            engine.step()
        engine.pause()
        assert engine.suspend(mode) > 0
        assert engine.draft.runner.kv_cache is None and not engine.draft._states
        engine.resume()
        engine.unpause()
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        _assert_same(want, outs)
        _assert_pools_empty(spec)
    # A refit with a new draft (the 1-layer one cannot replace the 2-layer draft; the
    # target's own checkpoint can): in-flight requests catch up under the new weights.
    engine.add_request("refit", prompt, params)
    for _ in range(3):
        engine.step()
    engine.pause()
    with pytest.raises(CheckpointError, match="shape"):
        engine.refit(tiny_llama, draft=drafts(tiny_llama))
    engine.refit(tiny_llama, "v2", uri="file:///v2", low_memory=False, draft=tiny_llama)
    assert engine.weight_version == "v2" and not engine.draft._states
    engine.unpause()
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    _assert_same(want, outs)
    assert _rate(spec) >= 0.95
    _assert_pools_empty(spec)


def test_refit_with_a_draft_needs_the_draft_method(tiny_llama: Path) -> None:
    for options in ({}, {"speculative_config": {"method": "ngram"}}):
        engine = LLM(tiny_llama, **options).engine
        engine.pause()
        with pytest.raises(ValueError, match=r"no draft model.*speculative method draft"):
            engine.refit(tiny_llama, draft=tiny_llama)
        assert engine.weight_epoch == 0  # nothing changed


def test_sized_by_memory_fraction_both_pools_fit_where_one_did(tiny_llama: Path,
                                                                 drafts) -> None:
    from tandem_engine.engine.draft_model import draft_kv_blocks
    from tandem_engine.model.family import ModelConfig

    target = ModelConfig.from_dir(tiny_llama)
    draft = ModelConfig.from_dir(drafts(tiny_llama))
    per_token = target.kv_bytes_per_token(4)
    for blocks in (7, 1000, 123_457):
        shared = draft_kv_blocks(blocks, target, draft)
        # 2 layers and 1 layer: two thirds of the blocks each, never more than fit.
        assert shared * (per_token + draft.kv_bytes_per_token(4)) <= blocks * per_token
        assert shared >= blocks * 2 // 3 - 1


# ---- the draft-model command and bad inputs ------------------------------------------------

def test_the_command_writes_a_draft_transformers_loads(tiny_qwen3: Path,
                                                       tmp_path: Path, capsys) -> None:
    out = tmp_path / "draft"
    assert tandem_main(["draft-model", str(tiny_qwen3), str(out), "--layers", "1"]) == 0
    assert "1-layer draft" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    prompt = tuple(PROMPTS[2])
    got = LLM(out).generate([list(prompt)], SamplingParams(max_tokens=16, temperature=0.0,
                                                           ignore_eos=True, logprobs=0))
    completion = got[0].outputs[0]
    logprobs = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids,
                                               strict=True)]
    assert assert_matches(hf_greedy(out, prompt, 16), completion.token_ids, logprobs) >= 12


def test_bad_inputs_name_the_input_the_limit_and_the_fix(tiny_llama: Path, tiny_qwen2: Path,
                                                         tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(CheckpointError, match=r"draft model: .*nowhere does not exist.*"
                       "tandem draft-model"):
        LLM(tiny_llama, speculative_config=_spec(missing))
    # Another tokenizer: the qwen2 demo has no BOS token; a copy with two tokens swapped.
    with pytest.raises(ValueError, match=rf"{tiny_qwen2}.*{tiny_llama}.*bos_token_id"):
        LLM(tiny_llama, speculative_config=_spec(tiny_qwen2))
    swapped = tmp_path / "swapped"
    shutil.copytree(tiny_qwen2, swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[200]], vocab[by_id[208]] = 208, 200
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=r"sampled token ids differ, e\.g\. id 200.*same "
                       "tokenizer"):
        LLM(tiny_qwen2, speculative_config=_spec(swapped))
    with pytest.raises(ValueError, match=r"model=None.*--speculative-model"):
        LLM(tiny_llama, speculative_config={"method": "draft"})
    for layers in ("0", "2"):
        assert tandem_main(["draft-model", str(tiny_llama), str(tmp_path / "d"),
                            "--layers", layers]) == 2
        err = capsys.readouterr().err
        assert f"--layers {layers}" in err and "has 2 decoder layers" in err
        assert "1 to 1" in err
    assert tandem_main(["draft-model", str(missing), str(tmp_path / "d"), "--layers",
                        "1"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_admin_refit_loads_the_draft_it_names_inside_the_weights_roots(
        tiny_llama: Path, tmp_path: Path) -> None:
    """POST /v1/refit with draft_uri (what the fleet's orchestrator sends): the draft is
    reloaded with the weights; one outside the weights roots is refused before either
    checkpoint loads."""
    from fastapi.testclient import TestClient
    from tandem_engine.server.admin import build_admin_app
    from tandem_engine.server.control import EngineControl
    from tandem_engine.server.weights_roots import REFUSED, WeightsRoots
    from tandem_engine.server.worker import EngineWorker

    roots = tmp_path / "weights"
    model = Path(shutil.copytree(tiny_llama, roots / "model"))
    first = write_draft_model(model, roots / "draft-v1", 1)
    second = write_draft_model(model, roots / "draft-v2", 1)
    outside = write_draft_model(model, tmp_path / "elsewhere", 1)
    llm = LLM(model, speculative_config=_spec(first))
    worker = EngineWorker(llm.engine, engine_id="e0", model_name="tiny")
    control = EngineControl(worker, WeightsRoots.of([roots], model))
    client = TestClient(build_admin_app(control))
    assert client.post("/v1/pause").status_code == 200
    refused = client.post("/v1/refit", json={"uri": model.as_uri(), "version": "v2",
                                             "draft_uri": outside.as_uri()})
    assert refused.status_code == 400 and REFUSED in refused.json()["error"]["message"]
    assert llm.engine.weight_epoch == 0 and llm.engine.draft.path == first
    ok = client.post("/v1/refit", json={"uri": model.as_uri(), "version": "v2",
                                        "draft_uri": second.as_uri()})
    assert ok.status_code == 200, ok.text
    assert llm.engine.weight_version == "v2" and llm.engine.draft.path == second
    assert client.post("/v1/unpause").status_code == 200
    want = LLM(tiny_llama).generate(PROMPTS[:2], GREEDY)
    _assert_same(want, llm.generate(PROMPTS[:2], GREEDY))
