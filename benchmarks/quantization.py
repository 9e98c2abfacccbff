"""Quantized engines against the dequantized float32 model on the same GGUF, in one run:
quality, memory and decode time at batch 1 (docs/benchmarks.md's quantization table).

For each `--quantization` (none = the float32 reference, auto = the GGUF's own types,
int8 = every projection requantized to int8 rows) and kernel choice (native: the
engine's CPU kernels, csrc/quant_matvec.cpp; torch: torch's weight-only kernels):

* perplexity on the packaged corpus (`data/corpus.txt`, windows of 256 tokens) and the
  ratio to the reference's; the median, p99 and largest shift of a token's logprob;
* greedy text on test_real_model.py's prompts (32 tokens): equal, or where it first
  differs and the reference's top-two gap there (`bench/quality.py`);
* the weights' bytes and the process's RSS with the engine loaded (each configuration in
  its own process, so one's memory does not count in another's);
* decode ms/token at batch 1: (time of 129 greedy tokens - time of 1) / 128, a 64-token
  prompt, best of 3, with the weights-read bound (weights / the read bandwidth measured
  in the same run).

    .venv/bin/python benchmarks/quantization.py [--model FILE] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = (("none", "native"), ("auto", "native"), ("auto", "torch"), ("int8", "native"))
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
]


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(model: str, quantization: str, kernels: str, threads: int) -> dict:
    """Measure one configuration in this process (the child's side)."""
    import torch
    from tandem_engine import LLM, SamplingParams
    from tandem_engine.bench.quality import corpus_windows, greedy_agreement, perplexity

    torch.set_num_threads(threads)
    llm = LLM(model, dtype="float32", quantization=quantization, kernels=kernels)
    out: dict = {"quantization": quantization, "kernels": kernels,
                 "weight_bytes": llm.engine.runner.weight_bytes, "rss_mib": _rss_mib()}
    windows = corpus_windows(llm, 256)
    scores = [lp for s in llm.score(windows) for lp in s.logprobs]
    out["logprobs"] = scores
    out["perplexity"] = perplexity(llm, windows)
    text = " ".join(["The lighthouse keeper wrote in the log every evening."] * 12)
    ids = llm.engine.tokenizer.encode(text)[:64]
    times = []
    for i in range(3):
        prompt = [(t + 97 * i) % 40000 + 100 for t in ids]  # no prefix-cache hits
        for n in (1, 129):
            started = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0,
                                                  ignore_eos=True))
            times.append((n, time.perf_counter() - started))
    one_tok = min(t for n, t in times if n == 1)
    out["decode_ms"] = (min(t for n, t in times if n == 129) - one_tok) / 128 * 1000
    if quantization != "none":
        ref = LLM(model, dtype="float32", quantization="none")
        out["greedy"] = [
            (c.first_difference, c.reference_gap)
            for c in greedy_agreement(ref, llm, PROMPTS, 32)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", nargs=2, metavar=("QUANTIZATION", "KERNELS"),
                   help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    model = args.model or subprocess.run(
        [str(Path(sys.executable).parent / "tandem"), "models", "pull",
         "smollm2-135m-instruct"], check=True, capture_output=True,
        text=True).stdout.strip().splitlines()[-1].split()[-1]
    if args.child:
        print(json.dumps(one(model, *args.child, args.threads)))
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from decode_batch1 import cpu, read_bandwidth

    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    print(f"CPU: {cpu()}; {args.threads} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"model {model}", flush=True)
    results = []
    for quantization, kernels in CONFIGS:
        run = subprocess.run([sys.executable, __file__, "--model", model, "--threads",
                              str(args.threads), "--child", quantization, kernels],
                             capture_output=True, text=True, timeout=1800)
        if run.returncode != 0:
            print(f"{quantization}/{kernels} failed:\n{run.stderr[-2000:]}", flush=True)
            continue
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
    reference = results[0]
    ref_lp = torch.tensor(reference["logprobs"])
    print("\n| quantization | kernels | weights MB | RSS MB | perplexity (ratio) | logprob shift "
          "median / p99 / max | greedy: first difference (reference gap) | decode ms/token "
          "| weights-read bound ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        shift = (torch.tensor(r["logprobs"]) - ref_lp).abs()
        greedy = ", ".join("equal" if first is None else f"{first} ({gap:.3f})"
                           for first, gap in r.get("greedy", [])) or "(reference)"
        bound = r["weight_bytes"] / bandwidth * 1000
        print(f"| {r['quantization']} | {r['kernels']} | {r['weight_bytes'] / 1e6:.0f} | "
              f"{r['rss_mib'] * 1.048576:.0f} | {r['perplexity']:.3f} "
              f"({r['perplexity'] / reference['perplexity']:.4f}) | "
              f"{shift.median():.3f} / {shift.quantile(0.99):.3f} / {shift.max():.3f} | "
              f"{greedy} | {r['decode_ms']:.1f} | {bound:.1f} |")
    if args.json:
        for r in results:
            r.pop("logprobs")
        args.json.write_text(json.dumps({"cpu": cpu(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
