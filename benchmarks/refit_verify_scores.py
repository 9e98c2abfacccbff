"""What a refit's default verification scores on real weights (fleet/verify.py, rule 5).

A refit is refused as over-confident when the new weights keep less than
`min_uncertainty_ratio` (default 0.25) of the previous weights' uncertainty on the probe
text (1 - the mean top-1 probability) while the probe text's perplexity rises. This
benchmark measures, on SmolLM2-135M-Instruct served in float32, the two ratios the rule
reads for weights that must pass and weights that must fail, and the rule's verdict:

* the model refitted to itself, and to its own bfloat16 copy (rounded weights);
* every weight plus Gaussian noise of 1 % and 3 % of that tensor's standard deviation
  (perturbations the size of a fine-tuning step, and several);
* the final norm scaled x 2, x 4, x 10 and x 1e36 (scaled-up logits: over-confident).

Each variant is written as a checkpoint and loaded with `LLM.refit`, as an engine loads
one; the canary's numbers come from the same code the engine's `/v1/canary` uses
(`mean_top1_mass`, `PromptScore`). Run it alone (it writes ~0.5 GB per variant):

    .venv/bin/python benchmarks/refit_verify_scores.py
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_batch1 import cpu
from safetensors.torch import load_file, save_file
from tandem_engine import LLM
from tandem_engine.cli.models import SMOLLM2_135M_INSTRUCT, pull
from tandem_engine.engine.outputs import PromptScore, mean_top1_mass
from tandem_engine.fleet.verify import (
    DEFAULT_MIN_UNCERTAINTY_RATIO,
    PROBE_TEXT,
    CanaryReading,
    problem,
)
from tandem_engine.sampling_params import SamplingParams

Edit = Callable[[dict[str, torch.Tensor]], None]


def noise(fraction: float, seed: int = 0) -> Edit:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        g = torch.Generator().manual_seed(seed)
        for t in tensors.values():
            if t.is_floating_point() and t.numel() > 1:
                t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * (fraction * t.std()))
    return edit


def norm_times(factor: float) -> Edit:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.norm.weight"].mul_(factor)
    return edit


def reading(llm: LLM, version: str) -> CanaryReading:
    (out,) = llm.generate([PROBE_TEXT], SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=1))
    score = PromptScore.of(out)
    return CanaryReading("bench", version, [], -score.total_logprob / len(score.logprobs),
                         mean_top1_mass(out))


def write_variant(base: Path, folder: Path, edit: Edit) -> Path:
    shutil.copytree(base, folder)
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("command:", " ".join(sys.argv))
    print(f"cpu: {cpu()}; torch threads {args.threads}; rule: refused when uncertainty "
          f"ratio < {DEFAULT_MIN_UNCERTAINTY_RATIO} and perplexity ratio > 1")
    f32 = pull(SMOLLM2_135M_INSTRUCT, fmt="hf", dtype="float32")
    bf16 = pull(SMOLLM2_135M_INSTRUCT, fmt="hf", dtype="bfloat16")
    llm = LLM(f32)
    baseline = reading(llm, "f32")
    print(f"baseline (float32): perplexity {baseline.perplexity:.4g}, top-1 mass "
          f"{baseline.top1_mass:.4f}, uncertainty {baseline.uncertainty:.4f}")
    variants: list[tuple[str, Path | Edit]] = [
        ("itself", f32), ("its bf16 copy", bf16),
        ("noise 1% of std", noise(0.01)), ("noise 3% of std", noise(0.03)),
        *((f"final norm x {f:g}", norm_times(f)) for f in (2.0, 4.0, 10.0, 1e36))]
    print("| weights | perplexity ratio | top-1 mass | uncertainty ratio | verdict |\n"
          "|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="refit-verify-") as tmp:
        for i, (name, source) in enumerate(variants):
            path = source if isinstance(source, Path) else write_variant(
                f32, Path(tmp) / f"v{i}", source)
            llm.pause()
            llm.refit(path, f"v{i}")
            llm.unpause()
            got = reading(llm, f"v{i}")
            if path.parent == Path(tmp):
                shutil.rmtree(path)
            why = problem(got, baseline, None)
            ppl = got.mean_nll - baseline.mean_nll
            ppl_ratio = f"{torch.tensor(ppl).exp().item():.4g}" if ppl < 700 else f"e^{ppl:.3g}"
            print(f"| {name} | {ppl_ratio} | {got.top1_mass:.4f} | "
                  f"{got.uncertainty / baseline.uncertainty:.4g} | "
                  f"{'refused: ' + why.split(':')[0] if why else 'passes'} |")
    llm.pause()
    llm.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
