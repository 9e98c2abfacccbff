"""Speculative decoding with multi-token-prediction heads (method mtp): the same tokens
as without it, proposals from the right hidden state, clear errors for missing heads.

The tiny demo models have random weights, so no head predicts their next tokens in
general (random heads, or heads fitted on held-out text, are almost always rejected).
To exercise accepted proposals, `tandem mtp-heads fit` is given a few prompts of our own
and a tiny ridge (its heads read the emitted token's embedding too; the random demo
heads do not, so both kinds run): with fewer positions than unknowns it memorizes the
target's greedy continuations of those prompts, so every proposal made on them is right
if, and only if, the engine feeds the heads the hidden state of the row that produced the
request's last token (an off-by-one position accepts nothing). Other prompts mix in rejections.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from reference import random_prompts
from safetensors.torch import load_file, save_file
from tandem_engine.cli.demo_model import write_demo_model
from tandem_engine.cli.mtp_heads import fit_checkpoint
from tandem_engine.engine.llm import LLM
from tandem_engine.errors import CheckpointError
from tandem_engine.model.checkpoint import load_checkpoint
from tandem_engine.sampling_params import SamplingParams
from test_speculative import (
    PROMPTS,
    VOCAB,
    _accepted,
    _assert_same,
    _repeating,
    _with_late_arrivals,
)

MTP = {"method": "mtp", "num_speculative_tokens": 2}
# What the memorized heads know: 3 prompts x 20 tokens = 60 positions, fewer than the
# 65 unknowns per output of a tiny model's head (hidden 64 + bias).
KNOWN = PROMPTS[:3]
KNOWN_TOKENS = 20
GREEDY = SamplingParams(max_tokens=KNOWN_TOKENS, temperature=0.0, ignore_eos=True)


def _with_heads(tmp_path_factory: pytest.TempPathFactory, arch: str) -> tuple[Path, Path]:
    """(demo model with 2 random heads, a copy whose heads memorized KNOWN)."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp(f"mtp-{arch}")
    random = write_demo_model(folder / "random", arch=arch, size="tiny", mtp_heads=2)
    fit_checkpoint(random, folder / "fitted", 2, prompts=KNOWN, tokens=KNOWN_TOKENS,
                   ridge=1e-6, log=lambda *_: None)
    return random, folder / "fitted"


@pytest.fixture(scope="session", params=("llama", "qwen2", "qwen3"))
def mtp_models(request: pytest.FixtureRequest, tmp_path_factory) -> tuple[Path, Path]:
    return _with_heads(tmp_path_factory, request.param)


@pytest.fixture(scope="session")
def mtp_llama(tmp_path_factory) -> tuple[Path, Path]:
    return _with_heads(tmp_path_factory, "llama")


def _pair(model: Path, **options) -> tuple[LLM, LLM]:
    return LLM(model, **options), LLM(model, speculative_config=MTP, **options)


def _no_leak(llm: LLM) -> None:
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_greedy_tokens_and_logprobs_equal_without_speculation(mtp_models) -> None:
    random, fitted = mtp_models
    params = [SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True, logprobs=2,
                             repetition_penalty=r) for r in (1.0, 0.01)]
    prompts = [p for p in PROMPTS for _ in params]
    for model in (random, fitted):
        plain, spec = _pair(model)
        _assert_same(plain.generate(prompts, params * len(PROMPTS)),
                     spec.generate(prompts, params * len(PROMPTS)), logprobs=True)
        assert spec.engine.stats.speculative.num_drafts > 0
        _no_leak(spec)
    # The memorized continuations: every proposal on them is accepted.
    plain, spec = _pair(fitted)
    _assert_same(plain.generate(KNOWN, GREEDY), spec.generate(KNOWN, GREEDY), logprobs=True)
    stats = spec.engine.stats.speculative
    assert stats.num_accepted_tokens == stats.num_draft_tokens > len(KNOWN) * 10
    assert len(spec.engine.step_timings) < len(plain.engine.step_timings) / 2


def test_mixed_batches_chunked_prefill_preemption_and_arrivals(mtp_llama) -> None:
    _, fitted = mtp_llama
    prompts = [*KNOWN, _repeating(4, 9, 6), *random_prompts(VOCAB, [70, 3], seed=5), KNOWN[1]]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
              for m in (2, 20, 17, 25, 1, 33, 9)]
    for options in ({}, {"max_num_batched_tokens": 8},
                    {"num_blocks": 12, "max_num_batched_tokens": 48}):
        plain, spec = _pair(fitted, **options)
        _assert_same(plain.generate(prompts, params), spec.generate(prompts, params))
        # A budget of 8 leaves few steps room for a draft beside the prefill chunks.
        assert _accepted(spec) > (2 if "max_num_batched_tokens" in options else 20)
        _no_leak(spec)
        if "num_blocks" in options:
            assert spec.engine.num_preemptions > 0
    # Requests arriving while others verify drafts.
    _assert_same(plain.generate(prompts, params),
                 _with_late_arrivals(spec.engine, prompts, params))
    _no_leak(spec)


def test_stop_eos_and_max_tokens_inside_a_verified_block(mtp_llama) -> None:
    _, fitted = mtp_llama
    prompt = KNOWN[0]
    plain, spec = _pair(fitted)
    ref = plain.generate([prompt], GREEDY)[0].outputs[0]
    tokens, text = ref.token_ids, ref.text
    variants = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                for m in range(1, 9)]
    variants += [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                stop_token_ids=[tokens[i]], logprobs=1) for i in range(2, 18, 3)]
    variants += [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                stop=[text[j:j + 3]], include_stop_str_in_output=inc)
                 for j in range(4, min(len(text) - 3, 40), 9) for inc in (False, True)]
    prompts = [prompt] * len(variants)
    _assert_same(plain.generate(prompts, variants), spec.generate(prompts, variants),
                 logprobs=True)
    assert _accepted(spec) > 40
    for llm in (plain, spec):
        llm.engine.outputs.eos_token_ids = frozenset({tokens[9]})
    eos = [SamplingParams(max_tokens=20, temperature=0.0),
           SamplingParams(max_tokens=20, temperature=0.0, min_tokens=12, logprobs=0)]
    got = spec.generate([prompt, prompt], eos)
    _assert_same(plain.generate([prompt, prompt], eos), got, logprobs=True)
    assert got[0].outputs[0].finish_reason == "stop"
    _no_leak(spec)


def test_seeded_sampling_draws_the_same_tokens(mtp_llama) -> None:
    _, fitted = mtp_llama
    params = [SamplingParams(max_tokens=20, temperature=t, seed=i, ignore_eos=True,
                             logprobs=1) for i, t in enumerate((0.05, 0.5, 1.0))]
    plain, spec = _pair(fitted)
    _assert_same(plain.generate(KNOWN, params), spec.generate(KNOWN, params), logprobs=True)
    assert _accepted(spec) > 10


def test_a_refit_reloads_the_heads_and_refuses_a_checkpoint_without_them(
        mtp_llama, tiny_llama: Path) -> None:
    random, fitted = mtp_llama
    llm = LLM(random, speculative_config=MTP)
    llm.generate(KNOWN, GREEDY)
    assert _accepted(llm) < 5  # random heads
    llm.engine.pause()
    with pytest.raises(CheckpointError) as info:
        llm.engine.refit(tiny_llama)
    assert "refit refused" in str(info.value) and "no mtp heads" in str(info.value)
    assert str(tiny_llama) in str(info.value)
    assert llm.engine.weight_epoch == 0  # nothing changed
    llm.engine.refit(fitted)  # the same model, memorized heads
    llm.engine.unpause()
    llm.generate(KNOWN, GREEDY)
    stats = llm.engine.stats.speculative
    assert stats.num_accepted_tokens > 30


def test_starting_without_heads_or_with_too_few_is_a_clear_error(
        mtp_llama, tiny_llama: Path) -> None:
    with pytest.raises(ValueError) as info:
        LLM(tiny_llama, speculative_config=MTP)
    message = str(info.value)
    assert str(tiny_llama) in message and "no mtp heads" in message
    assert "tandem mtp-heads fit" in message and "--mtp-heads" in message
    with pytest.raises(ValueError, match=r"num_speculative_tokens=3 exceeds the 2 mtp heads"):
        LLM(mtp_llama[0], speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    # Served without method mtp, a checkpoint's heads are simply not used.
    assert LLM(mtp_llama[0]).generate(KNOWN[:1], GREEDY)[0].outputs[0].token_ids == \
        LLM(tiny_llama).generate(KNOWN[:1], GREEDY)[0].outputs[0].token_ids


def _copy_with(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    if edit_config is not None:
        raw = json.loads((dst / "config.json").read_text())
        edit_config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_bad_heads_are_refused_at_load_naming_the_tensor(mtp_llama, tmp_path: Path) -> None:
    random, fitted = mtp_llama
    config, tensors = load_checkpoint(random)
    assert config.num_mtp_heads == 2 and tensors["mtp.1.weight"].shape == (64, 64)
    assert not config.mtp_token_input and config.mtp_hidden_act == "silu"
    config, tensors = load_checkpoint(fitted)  # what `mtp-heads fit` writes
    assert config.mtp_token_input and config.mtp_hidden_act == "identity"
    assert tensors["mtp.1.token_weight"].shape == (64, 64)
    cases = [
        (lambda t: t.update({"mtp.0.weight": torch.zeros(64, 32)}), None,
         ["'mtp.0.weight'", "(64, 32)", "expected (64, 64)"]),
        (lambda t: t.update({"mtp.1.bias": torch.zeros(3)}), None,
         ["'mtp.1.bias'", "expected (64,)"]),
        (lambda t: t.pop("mtp.1.weight"), None, ["missing tensor 'mtp.1.weight'",
                                                 "num_mtp_heads=2"]),
        (None, lambda c: c.update(num_mtp_heads=1), ["unexpected tensor 'mtp.1.weight'",
                                                     "num_mtp_heads=1"]),
        (None, lambda c: c.update(num_mtp_heads=-1), ["num_mtp_heads", "-1"]),
        (None, lambda c: c.update(mtp_hidden_act="gelu"), ["mtp_hidden_act 'gelu'",
                                                           "silu, identity"]),
        (None, lambda c: c.update(mtp_token_input=True),
         ["missing tensor 'mtp.0.token_weight'", "mtp_token_input=true"]),
        (lambda t: t.update({"mtp.0.token_weight": torch.zeros(64, 64)}), None,
         ["unexpected tensor 'mtp.0.token_weight'", "mtp_token_input=false"]),
    ]
    for i, (tensors_edit, config_edit, needles) in enumerate(cases):
        bad = _copy_with(random, tmp_path / f"bad{i}", tensors_edit, config_edit)
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(bad)
        for needle in needles:
            assert needle in str(info.value), (needle, str(info.value))
    # Without biases the heads still load (zero bias).
    nobias = _copy_with(random, tmp_path / "nobias",
                        lambda t: [t.pop(f"mtp.{i}.bias") for i in range(2)])
    assert "mtp.0.bias" not in load_checkpoint(nobias)[1]
    LLM(nobias, speculative_config=MTP).generate(KNOWN[:1], GREEDY)


def test_the_demo_model_with_heads_still_loads_in_transformers(mtp_llama) -> None:
    transformers = pytest.importorskip("transformers")
    random, _ = mtp_llama
    model = transformers.AutoModelForCausalLM.from_pretrained(random, dtype=torch.float32)
    prompt = KNOWN[0]
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=KNOWN_TOKENS,
                             do_sample=False)
    want = out[0, len(prompt):].tolist()
    assert LLM(random, speculative_config=MTP).generate([prompt], GREEDY)[0] \
        .outputs[0].token_ids == want


def test_cli_writes_heads_and_the_method_reaches_every_command(tmp_path: Path) -> None:
    from tandem_engine.cli.main import build_parser, serve_engine_args
    from tandem_engine.cli.main import main as tandem_main
    from tandem_engine.config import SpeculativeConfig
    from tandem_engine.server import main as engine_main

    assert tandem_main(["demo-model", str(tmp_path / "m"), "--mtp-heads", "3"]) == 0
    config, tensors = load_checkpoint(tmp_path / "m")
    assert config.num_mtp_heads == 3 and "mtp.2.weight" in tensors
    parser = build_parser()
    serve = parser.parse_args(["serve", "--demo", "--speculative-method", "mtp",
                               "--speculative-tokens", "3"])
    args = engine_main.build_parser().parse_args(
        ["--model", "m", "--port", "1", "--admin-port", "2", *serve_engine_args(serve)])
    assert engine_main.engine_config(args).speculative == SpeculativeConfig("mtp", 3)
    fit = parser.parse_args(["mtp-heads", "fit", "M", "OUT", "--heads", "2", "--tokens", "8"])
    assert (fit.heads, fit.tokens, fit.model, fit.out) == (2, 8, "M", "OUT")


def test_fit_heads_recovers_linear_dynamics_in_closed_form() -> None:
    from tandem_engine.model.mtp import MtpHeads, fit_heads

    gen = torch.Generator().manual_seed(0)
    a = torch.linalg.qr(torch.randn(8, 8, generator=gen))[0]  # h_{t+1} = A h_t + c
    c = torch.randn(8, generator=gen) * 0.1
    sequences = []
    for _ in range(6):
        h = [torch.randn(8, generator=gen)]
        for _ in range(30):
            h.append(a @ h[-1] + c)
        sequences.append(torch.stack(h))
    heads = fit_heads(sequences, 2, ridge=1e-9)
    eye = torch.eye(8)
    assert torch.allclose(heads.weight[0], a - eye, atol=1e-4)
    assert torch.allclose(heads.weight[1], a @ a - eye, atol=1e-4)
    assert torch.allclose(heads.bias[1], a @ c + c, atol=1e-4)
    assert heads.token_weight is None and heads.act == "identity"
    # Applied, head i maps h_t to h_{t+1+i}; a SiLU head is h + silu(W h + b).
    s = sequences[0]
    assert torch.allclose(heads.hidden(s[:5], 2)[1], s[2:7], atol=1e-4)
    silu = MtpHeads(heads.weight, heads.bias)
    want = s[:5] + torch.nn.functional.silu(s[:5] @ heads.weight[0].t() + heads.bias[0])
    assert torch.allclose(silu.hidden(s[:5], 1)[0], want, atol=1e-6)


def test_a_handoff_carries_the_prefill_engines_proposals_to_the_decode_engine(
        mtp_llama) -> None:
    """Disaggregated: the prefill engine proposes from its last hidden state as it hands
    off, the decode engine verifies those proposals in its first step (3 tokens at once
    with memorized heads, k = 2), and the tokens are a colocated run's."""
    from test_handoff_engine import _copy_blocks, _finish

    _, fitted = mtp_llama
    plain = LLM(fitted).generate(KNOWN, GREEDY)
    prefill = LLM(fitted, speculative_config=MTP).engine
    decode = LLM(fitted, speculative_config=MTP).engine
    for i, (prompt, want) in enumerate(zip(KNOWN, plain, strict=True)):
        rid = f"h{i}"
        prefill.add_request(rid, prompt, GREEDY, pin_for_handoff=True)
        out = _finish(prefill)[rid]
        first, remote = out.outputs[0].token_ids[0], out.pinned_blocks
        assert out.handoff_proposals == want.outputs[0].token_ids[1:3]
        plan = decode.add_pulled_request(rid, prompt, GREEDY, [first],
                                         proposals=out.handoff_proposals)
        _copy_blocks(prefill, decode, remote, plan)
        decode.complete_pull(rid, ok=True)
        assert prefill.unpin(rid)
        (step,) = decode.step()
        assert step.outputs[0].token_ids == want.outputs[0].token_ids[:4]
        rest = _finish(decode)[rid].outputs[0]
        assert rest.token_ids == want.outputs[0].token_ids
    assert prefill.stats.speculative.num_drafts == 0  # it proposes, never verifies
    for engine in (prefill, decode):
        assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_carried_proposals_for_other_tokens_are_not_used(mtp_llama) -> None:
    """Proposals are verified only while the request still has the tokens they follow
    (a stale or wrong list costs nothing but is never trusted: the target verifies)."""
    from test_handoff_engine import _copy_blocks, _finish

    _, fitted = mtp_llama
    want = LLM(fitted).generate(KNOWN[:1], GREEDY)[0].outputs[0].token_ids
    prefill = LLM(fitted, speculative_config=MTP).engine
    decode = LLM(fitted, speculative_config=MTP).engine
    prefill.add_request("w", KNOWN[0], GREEDY, pin_for_handoff=True)
    out = _finish(prefill)["w"]
    wrong = [(t + 1) % VOCAB for t in out.handoff_proposals]
    plan = decode.add_pulled_request("w", KNOWN[0], GREEDY, [want[0]], proposals=wrong)
    _copy_blocks(prefill, decode, out.pinned_blocks, plan)
    decode.complete_pull("w", ok=True)
    (step,) = decode.step()
    assert step.outputs[0].token_ids == want[:2]  # both rejected: the target's own token
    assert _finish(decode)["w"].outputs[0].token_ids == want
