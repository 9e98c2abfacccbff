"""Over-confident weights never serve: `tandem refit` of a real `tandem serve` of
SmolLM2-135M-Instruct (one engine) to its final norm x 1e36 is refused by the default
verification and rolled back, while the same model refitted to itself and to its own bf16
copy passes (fleet/verify.py, rule 5).

Weights scaled that way keep every greedy token, so the canary's tokens look right; what
gives them away is the distribution: the most likely token holds all the probability at
every position of the probe text (top-1 mass 1.0, where the model's own is about 0.45),
and the probe's real tokens get logprobs like -6.7e35.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import test_refit_local
from tandem_engine.cli.serve import free_port
from test_serve import spawn_serve, stop_serve, wait_for_url

pytestmark = pytest.mark.slow
MODEL = "smol"


class Stack(test_refit_local.Stack):
    """test_refit_local's handle on a `tandem serve` stack, here of one engine."""

    def serving(self) -> str:
        """The version the one engine serves, asserting it admits requests."""
        (engine,) = httpx.get(f"{self.router}/v1/engines", timeout=10).json()["engines"]
        assert engine["alive"] and engine["state"] == "RUNNING" and not engine["draining"]
        return engine["weight_version"]

    def canary(self) -> dict:
        """The engine's own canary reply (admin API, as a refit reads it)."""
        from tandem_engine.fleet.verify import canary_request

        stack = json.loads((self.tmp / f"tandem-{self.port}" / "stack.json").read_text())
        (engine,) = stack["engines"]
        token = stack.get("admin_token")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.post(f"{engine['admin_url']}/v1/canary", json=canary_request(),
                          headers=headers, timeout=60).json()

    def complete(self) -> str:
        reply = httpx.post(f"{self.router}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0.0})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def weights(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The real model as an HF checkpoint (float32, served), its bf16 copy (both in the
    model cache, beside each other), and the float32 one with its final norm x 1e36."""
    import torch
    from safetensors.torch import load_file, save_file
    from tandem_engine.cli.models import SMOLLM2_135M_INSTRUCT, pull

    f32 = pull(SMOLLM2_135M_INSTRUCT, fmt="hf", dtype="float32")
    bf16 = pull(SMOLLM2_135M_INSTRUCT, fmt="hf", dtype="bfloat16")
    sharp = tmp_path_factory.mktemp("over-confident") / "norm-x1e36"
    shutil.copytree(f32, sharp)
    tensors = load_file(sharp / "model.safetensors")
    tensors["model.norm.weight"].mul_(1e36)
    assert bool(torch.isfinite(tensors["model.norm.weight"]).all())  # loading accepts it
    save_file(tensors, sharp / "model.safetensors", metadata={"format": "pt"})
    return {"f32": f32, "bf16": bf16, "sharp": sharp}


@pytest.fixture(scope="module")
def stack(weights: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    tmp, port = tmp_path_factory.mktemp("confidence-stack"), free_port()
    proc = spawn_serve(tmp, "--model", str(weights["f32"]), "--engines", "1",
                       "--port", str(port), "--served-model-name", MODEL,
                       "--weights-root", str(weights["sharp"].parent))
    try:
        wait_for_url(proc, timeout=300)
        yield Stack(proc, port, tmp)
    finally:
        stop_serve(proc)


def test_the_real_model_refitted_to_itself_and_its_bf16_copy_passes(
        stack: Stack, weights: dict[str, Path]) -> None:
    before = stack.canary()
    assert 0.3 < before["top1_mass"] < 0.6, before  # a real model is unsure of real text
    for version, path in (("self", weights["f32"]), ("bf16", weights["bf16"])):
        done = stack.refit("--uri", path.as_uri(), "--version", version)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"refit succeeded: every engine serves {version}" in done.stdout
        assert re.search(r"RefitBaseline: \S+ on \S+: perplexity \S+ on the probe text, "
                         r"top-1 mass 0\.4\d+", done.stdout), done.stdout
        assert stack.serving() == version
    after = stack.canary()
    # bf16 rounding moves the numbers a little, the greedy canary not at all.
    assert after["token_ids"] == before["token_ids"]
    assert after["top1_mass"] == pytest.approx(before["top1_mass"], abs=0.01)
    assert after["mean_nll"] == pytest.approx(before["mean_nll"], abs=0.05)


def test_over_confident_weights_are_refused_by_default_and_rolled_back(
        stack: Stack, weights: dict[str, Path]) -> None:
    old = stack.serving()
    answer = stack.complete()
    done = stack.refit("--uri", weights["sharp"].as_uri(), "--version", "sharp")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "failed and was rolled back" in done.stderr
    assert re.search(
        r"failed at verify: over-confident canary: the most likely next token holds "
        r"100\.0000% of the probability on average over the probe text, leaving 0 to all "
        r"others, under 0\.25x the previous weights' 0\.5\d+ \(\S+\), while the probe text's "
        r"perplexity rose infx .*refit\.verify\.minUncertaintyRatio \(tandem refit "
        r"--min-uncertainty-ratio\) sets the limit, 0 turns the check off",
        done.stderr, re.S), done.stderr
    assert "RefitRolledBack" in done.stdout
    assert stack.serving() == old
    assert stack.complete() == answer  # still the old weights' answer
    assert stack.canary()["top1_mass"] < 0.6
