"""Speculative decoding with mtp heads: tokens/s and acceptance, on vs off, at batch 1.

Give it a checkpoint with heads (`tandem mtp-heads fit MODEL OUT --heads 3`). Six
plain-text prompts run one after another (batch 1), greedy, `--max-tokens` each, on one
engine with speculation off and one with method mtp (same process). Reported: generated
tokens/s of each, the acceptance rate and per-position accepted counts, and whether the
tokens were identical.

    .venv/bin/python benchmarks/speculative_mtp.py OUT [--tokens 3] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import time

import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The history of the printing press",
    "To make a cup of tea, first",
]


def main() -> None:
    from tandem_engine import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", help="a checkpoint with mtp heads")
    parser.add_argument("--tokens", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outputs = {}
    for name, options in (("off", {}), ("mtp", {"speculative_config": {
            "method": "mtp", "num_speculative_tokens": args.tokens}})):
        llm = LLM(args.model, **options)
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
        start, tokens = time.perf_counter(), []
        for prompt in prompts:
            tokens.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
        elapsed = time.perf_counter() - start
        outputs[name] = tokens
        total = sum(map(len, tokens))
        print(f"{name}: {total} tokens in {elapsed:.1f} s = {total / elapsed:.1f} tok/s",
              flush=True)
        stats = llm.engine.stats.speculative
        if stats is not None:
            print(f"  drafts {stats.num_drafts}, proposed {stats.num_draft_tokens}, accepted "
                  f"{stats.num_accepted_tokens} ({stats.acceptance_rate:.1%}), accepted per "
                  f"position {stats.accepted_per_position}")
    print("identical tokens:", outputs["off"] == outputs["mtp"])


if __name__ == "__main__":
    main()
