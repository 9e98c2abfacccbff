"""Decode at batch 1: Tandem's tokens/s against the weights-read bound and transformers.

At batch 1 a decode step reads every weight once and does little else, so its floor is
(bytes of weights read per token) / (memory read bandwidth). This benchmark measures,
in one process and one run:

* the CPU (model name and the ISA flags that matter: avx512f, avx512_bf16, amx_bf16);
* the read bandwidth: summing a tensor far larger than the caches, best of several runs;
* the weights read per decode step: every parameter of the decoder layers, the final
  norm and the LM head (with tied embeddings the embedding matrix is read once, as the
  head; the embedding lookup itself reads one row);
* Tandem: one greedy request, `--prompt` tokens then `--new` generated tokens, timed
  per decode step (the engine's own step timings, prefill excluded);
* transformers on the same checkpoint: `generate` with the same prompt and length,
  decode time = total - time to the first token.

It prints tokens/s for both, the bound, and the ratios tandem/bound and tandem/hf.
Run it alone: it is memory-bandwidth bound and shares nothing well.

    tandem models pull smollm2-135m-instruct .smollm2 --format hf
    .venv/bin/python benchmarks/decode_batch1.py --model .smollm2
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu() -> str:
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return f"{name} [{' '.join(f for f in FLAGS if f in flags) or 'no avx2'}]"


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s summing a float32 tensor of `gib` GiB (far past every cache); best run."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def weights_read_per_token(llm) -> int:
    """Bytes of weights a batch-1 decode step reads: every tensor of the checkpoint but
    the embedding matrix, plus the LM head (the embedding matrix itself when tied); the
    embedding lookup reads one row."""
    config = llm.engine.model_config
    itemsize = torch.empty((), dtype=llm.engine.runner.dtype).element_size()
    shapes = config.expected_tensors()
    numel = sum(math.prod(shape) for name, shape in shapes.items()
                if name != "model.embed_tokens.weight")
    if "lm_head.weight" not in shapes:  # tied: the head reads the embedding matrix
        numel += math.prod(shapes["model.embed_tokens.weight"])
    return numel * itemsize


def tandem_decode(llm, prompt: list[int], new: int) -> float:
    from tandem_engine import SamplingParams

    llm.generate([prompt[:8]], SamplingParams(max_tokens=4, temperature=0.0))  # warm up
    llm.engine.drain_step_timings()
    llm.generate([prompt], SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    steps = [t for t in llm.engine.drain_step_timings() if t.num_prefill_tokens == 0]
    return len(steps) / sum(t.total_s for t in steps)


def hf_decode(path: Path, prompt: list[int], new: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False)  # warm up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new, do_sample=False)
        total = time.perf_counter() - t0
    return (new - 1) / (total - first)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path,
                   help="HF checkpoint folder (also read by transformers)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--new", type=int, default=128, help="generated tokens")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--repeats", type=int, default=3, help="runs per system (median)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--json", type=Path, help="write the results to this file")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from tandem_engine import LLM

    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    llm = LLM(args.model)
    weights = weights_read_per_token(llm)
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, vocab, (args.prompt,), generator=g).tolist()
    tandem = statistics.median(tandem_decode(llm, prompt, args.new)
                               for _ in range(args.repeats))
    del llm
    hf = None if args.no_hf else statistics.median(
        hf_decode(args.model, prompt, args.new) for _ in range(args.repeats))
    bound = bandwidth / weights
    result = {"cpu": cpu(), "threads": args.threads, "torch": torch.__version__,
              "model": str(args.model), "weights_read_mb": weights / 1e6,
              "read_bandwidth_gbs": bandwidth / 1e9, "bound_tok_s": bound,
              "tandem_tok_s": tandem, "hf_tok_s": hf}
    print(f"cpu: {result['cpu']}, {args.threads} threads, torch {torch.__version__}")
    print(f"model: {args.model}, weights read per decode step {weights / 1e6:.0f} MB")
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s -> weights-read bound "
          f"{bound:.1f} tok/s ({1000 / bound:.1f} ms/token)")
    print(f"tandem decode at batch 1: {tandem:.1f} tok/s ({1000 / tandem:.1f} ms/token), "
          f"{tandem / bound:.0%} of the bound")
    if hf is not None:
        print(f"transformers decode at batch 1: {hf:.1f} tok/s ({1000 / hf:.1f} ms/token); "
              f"tandem/hf = {tandem / hf:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
