"""A refit's verification rules (fleet/verify.py), the finite-weights check at load, and
where a user sets the perplexity and uncertainty limits (the CRD, `tandem refit`). The rules
run against real engines in tests/fleet/test_refit_local.py and
tests/fleet/test_refit_confidence.py; here each rule and each input error alone."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from tandem_engine.cli import main as cli
from tandem_engine.errors import CheckpointError
from tandem_engine.fleet.verify import (
    CANARY_TOKENS,
    DEFAULT_MIN_UNCERTAINTY_RATIO,
    CanaryReading,
    problem,
)
from tandem_engine.model.checkpoint import load_checkpoint
from tandem_operator.spec import SpecError, parse_pool

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def reading(tokens: list[int], perplexity: float, version: str = "v2") -> CanaryReading:
    return CanaryReading("e-0", version, tokens, math.log(perplexity))


VARIED = list(range(100, 100 + CANARY_TOKENS))
BASELINE = reading(VARIED, 20.0, version="v1")


def test_a_canary_as_good_as_the_baseline_passes() -> None:
    assert problem(reading(VARIED, 20.0), BASELINE, 1.5) is None
    assert problem(reading(VARIED, 29.9), BASELINE, 1.5) is None  # under the limit
    assert problem(reading(VARIED, 1e9), BASELINE, None) is None  # no limit: no check


def test_a_single_repeated_token_fails_unless_the_old_weights_did_the_same() -> None:
    stuck = reading([7] * CANARY_TOKENS, 20.0)
    why = problem(stuck, BASELINE, None)
    assert why is not None and why.startswith(f"degenerate canary: {CANARY_TOKENS} greedy "
                                              "tokens are all token 7")
    assert "previous weights (v1) gave [100, 101" in why
    assert problem(stuck, reading([7] * CANARY_TOKENS, 20.0, "v1"), None) is None
    assert problem(stuck, None, None) is not None  # nothing shows it was normal before


def test_a_perplexity_above_the_limit_fails_and_says_by_how_much() -> None:
    why = problem(reading(VARIED, 40.0), BASELINE, 1.5)
    assert why == ("perplexity 40 on the probe text is 2x the previous weights' 20 (v1), "
                   "above refit.verify.maxPerplexityRatio 1.5")
    # Far beyond what a float holds: still a clear message, no overflow.
    huge = CanaryReading("e-0", "v2", VARIED, 5000.0)
    assert "perplexity inf on the probe text is infx" in problem(huge, BASELINE, 1.5)
    assert "not finite" in problem(CanaryReading("e-0", "v2", VARIED, math.nan), BASELINE, None)


# SmolLM2-135M-Instruct's canary on its own weights, on its bf16 copy and with its final
# norm x 1e36 (docs/benchmarks.md: mean NLL, top-1 mass; tests/fleet/test_refit_confidence.py
# measures them on the real engine).
SMOLLM2 = CanaryReading("e-0", "v1", VARIED, 3.38651, 0.4463)
SMOLLM2_BF16 = CanaryReading("e-0", "v2", VARIED, 3.39719, 0.4465)
SMOLLM2_NORM_X1E36 = CanaryReading("e-0", "v2", VARIED, 2.4196e36, 1.0)


def test_over_confident_weights_fail_by_default_and_say_how_to_tune_it() -> None:
    why = problem(SMOLLM2_NORM_X1E36, SMOLLM2, None)
    assert why == ("over-confident canary: the most likely next token holds 100.0000% of the "
                   "probability on average over the probe text, leaving 0 to all others, "
                   "under 0.25x the previous weights' 0.554 (v1), while the probe text's "
                   "perplexity rose infx (inf against 29.56): scaled-up logits (every sample "
                   "would be the greedy text); refit.verify.minUncertaintyRatio (tandem refit "
                   "--min-uncertainty-ratio) sets the limit, 0 turns the check off")
    assert problem(SMOLLM2_NORM_X1E36, SMOLLM2, None, 0.0) is None  # turned off
    # Its final norm x 4: 0.28 of the uncertainty left; caught only by a stricter limit.
    x4 = CanaryReading("e-0", "v2", VARIED, 9.86891, 0.8458)
    assert problem(x4, SMOLLM2, None) is None
    assert "over-confident canary" in problem(x4, SMOLLM2, None, 0.5)


def test_real_weights_pass_the_default_rule() -> None:
    assert DEFAULT_MIN_UNCERTAINTY_RATIO == 0.25
    assert problem(SMOLLM2, SMOLLM2, None) is None  # refit to itself
    assert problem(SMOLLM2_BF16, SMOLLM2, None) is None  # to its bf16 copy
    assert problem(SMOLLM2_BF16, SMOLLM2, None, 0.99) is None  # as unsure: 0.9997 of it


def test_sharper_weights_pass_when_they_fit_the_text_better_or_were_unsure_before() -> None:
    # Certain and right (they learnt the text): not over-confident.
    learnt = CanaryReading("e-0", "v2", VARIED, 0.01, 0.999)
    assert problem(learnt, SMOLLM2, None) is None
    # The previous weights were as sure already: nothing collapsed.
    assert problem(SMOLLM2_NORM_X1E36, SMOLLM2_NORM_X1E36, None) is None
    # Worse on the text, but as unsure as before (another domain): rule 4's business.
    assert problem(CanaryReading("e-0", "v2", VARIED, 6.0, 0.40), SMOLLM2, None) is None


def test_the_uncertainty_rule_is_skipped_without_a_top1_mass_or_baseline() -> None:
    # An engine of an older release reports no top-1 mass; a pool's status from before has
    # none in its baseline: neither fails.
    assert problem(SMOLLM2_NORM_X1E36, BASELINE, None) is None
    old = CanaryReading.from_reply("e-0", "v2", {"token_ids": VARIED, "mean_nll": 3.0})
    assert old.top1_mass is None and problem(old, SMOLLM2, None) is None
    assert CanaryReading.from_dict({k: v for k, v in SMOLLM2.to_dict().items()
                                    if k != "top1_mass"}).top1_mass is None
    assert problem(SMOLLM2_NORM_X1E36, None, None) is None  # no baseline: nothing to compare


def test_a_perplexity_limit_without_a_baseline_cannot_pass() -> None:
    why = problem(reading(VARIED, 20.0), None, 2.0)
    assert why is not None and "no baseline perplexity" in why


def test_the_baseline_survives_the_pools_status() -> None:
    from tandem_engine.fleet.transaction import Transaction
    from tandem_engine.weights import WeightsRef

    tx = Transaction(WeightsRef("file:///b", "v2"), WeightsRef("file:///a", "v1"), epoch=2,
                     baseline=SMOLLM2, max_perplexity_ratio=1.5, min_uncertainty_ratio=0.5)
    back = Transaction.from_dict(yaml.safe_load(yaml.safe_dump(tx.to_dict())))
    assert back.baseline == SMOLLM2 and back.max_perplexity_ratio == 1.5
    assert back.min_uncertainty_ratio == 0.5
    # A status written before the uncertainty rule existed: the default applies.
    data = tx.to_dict()
    del data["min_uncertainty_ratio"], data["baseline"]["top1_mass"]
    older = Transaction.from_dict(data)
    assert older.min_uncertainty_ratio == DEFAULT_MIN_UNCERTAINTY_RATIO
    assert older.baseline.top1_mass is None


def test_weights_that_are_not_finite_are_refused_at_load(tiny_llama: Path,
                                                         tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = math.inf
    tensors["model.norm.weight"][0] = math.nan
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(bad)
    message = str(caught.value)
    assert "weights that are not finite numbers" in message
    assert "model.layers.1.mlp.down_proj.weight: 1 of" in message
    assert "model.norm.weight: 1 of 64 values are NaN or Inf" in message
    assert "Fix: export the checkpoint again" in message
    _, loaded = load_checkpoint(tiny_llama)  # the good one loads
    assert all(bool(torch.isfinite(t).all()) for t in loaded.values())


def pool(verify: dict) -> dict:
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "p", "namespace": "default", "uid": "u"},
            "spec": {"model": {"name": "m", "weights": {"uri": "file:///w", "version": "1"}},
                     "decode": {"replicas": 1}, "refit": {"verify": verify}}}


def test_the_pool_spec_reads_the_limit_and_refuses_a_bad_one() -> None:
    assert parse_pool(pool({})).refit.max_perplexity_ratio is None
    assert parse_pool(pool({"maxPerplexityRatio": "1.5"})).refit.max_perplexity_ratio == 1.5
    for value, says in (("0.5", "outside 1..1e+06"), ("fast", "not a decimal number"),
                        (1.5, "must be a string")):
        with pytest.raises(SpecError, match=re.escape(says)) as caught:
            parse_pool(pool({"maxPerplexityRatio": value}))
        assert "spec.refit.verify.maxPerplexityRatio" in str(caught.value)


def test_the_pool_spec_reads_the_uncertainty_limit_and_refuses_a_bad_one() -> None:
    assert parse_pool(pool({})).refit.min_uncertainty_ratio == DEFAULT_MIN_UNCERTAINTY_RATIO
    assert parse_pool(pool({"minUncertaintyRatio": "0"})).refit.min_uncertainty_ratio == 0.0
    assert parse_pool(pool({"minUncertaintyRatio": "0.5"})).refit.min_uncertainty_ratio == 0.5
    for value, says in (("1.5", "outside 0..1"), ("sure", "not a decimal number"),
                        (0.5, "must be a string")):
        with pytest.raises(SpecError, match=re.escape(says)) as caught:
            parse_pool(pool({"minUncertaintyRatio": value}))
        assert "spec.refit.verify.minUncertaintyRatio" in str(caught.value)


def test_the_rl_example_turns_the_perplexity_check_on() -> None:
    manifest = yaml.safe_load((EXAMPLES / "inferencepool-rl.yaml").read_text())
    manifest["metadata"].update(namespace="default", uid="u")
    assert parse_pool(manifest).refit.max_perplexity_ratio == 1.5
    other = yaml.safe_load((EXAMPLES / "inferencepool.yaml").read_text())
    other["metadata"].update(namespace="default", uid="u")
    assert parse_pool(other).refit.max_perplexity_ratio is None  # off by default


@pytest.mark.parametrize(("flag", "value", "limit"), [
    ("--max-perplexity-ratio", "0.9", "outside 1..1e+06"),
    ("--max-perplexity-ratio", "nan", "outside 1..1e+06"),
    ("--max-perplexity-ratio", "inf", "outside 1..1e+06"),
    ("--min-uncertainty-ratio", "1.5", "outside 0..1"),
    ("--min-uncertainty-ratio", "-0.1", "outside 0..1"),
    ("--min-uncertainty-ratio", "nan", "outside 0..1")])
def test_tandem_refit_refuses_a_bad_limit_by_name(flag: str, value: str, limit: str,
                                                  tiny_llama: Path, capsys) -> None:
    code = cli.main(["refit", "--uri", tiny_llama.as_uri(), "--version", "v2", "--port", "1",
                     flag, value])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}" in err and limit in err


def test_the_pool_spec_reads_low_memory_refits() -> None:
    manifest = pool({})
    assert parse_pool(manifest).refit.low_memory is False  # off by default
    manifest["spec"]["refit"]["lowMemory"] = True
    assert parse_pool(manifest).refit.low_memory is True
    manifest["spec"]["refit"]["lowMemory"] = "yes"
    with pytest.raises(SpecError, match=r"spec\.refit\.lowMemory"):
        parse_pool(manifest)
