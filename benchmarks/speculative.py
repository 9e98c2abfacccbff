"""Speculative decoding (n-gram): tokens/s and latency with it on vs off, in one run.

Two workloads on the real model (SmolLM2-135M-Instruct, GGUF, greedy):

* copy-heavy: chat prompts whose answers quote their input ("Repeat this list with one
  item changed: ...", "Fix the typo in this function: <code>"), where prompt lookup
  finds the next tokens in the prompt;
* random: prompts of random ordinary tokens and random lengths, where it rarely does
  (the back-off must keep this no slower).

Each workload runs at batch 1 (requests one after another) and batch 4 (four at once),
with speculation off and on, on one engine each (same weights, same process). Reported:
generated tokens/s, mean per-request latency, the speed-up, whether the tokens were
identical, and for the speculative runs the acceptance rate per draft position.

    .venv/bin/python benchmarks/speculative.py [--tokens 4] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

COPY_TASKS = [
    "Repeat this list with one item changed (replace 'pears' by 'plums'): apples, "
    "bananas, cherries, dates, elderberries, figs, grapes, pears, quinces, raspberries, "
    "strawberries, tangerines.",
    "Fix the typo in this function and print the whole function:\n\n"
    "def average(values):\n    total = 0\n    for value in values:\n        total += valeu\n"
    "    return total / len(values)\n",
    "Repeat the following sentence exactly, then repeat it once more: The quick brown fox "
    "jumps over the lazy dog while the cat sleeps on the warm windowsill.",
    "Fix the typo in this function and print the whole function:\n\n"
    "def greet(name):\n    message = 'Hello, ' + nmae + '!'\n    print(message)\n"
    "    return message\n",
    "Rewrite this list in the same order, adding a number before each item: red, orange, "
    "yellow, green, blue, indigo, violet.",
    "Copy this JSON and change the age to 31: {\"name\": \"Ada\", \"age\": 30, \"city\": "
    "\"London\", \"languages\": [\"English\", \"French\"]}",
    "Fix the typo in this function and print the whole function:\n\n"
    "def is_even(n):\n    if n % 2 == 0:\n        return Ture\n    return False\n",
    "Repeat this list with one item changed (replace 'Tuesday' by 'Holiday'): Monday, "
    "Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.",
    "Quote this paragraph word for word, then give it a title: Bees visit flowers to "
    "collect nectar and pollen. While they move from flower to flower, they carry pollen "
    "with them, which helps plants make seeds and fruit.",
    "Fix the typo in this function and print the whole function:\n\n"
    "def count_words(text):\n    words = text.split()\n    return lenn(words)\n",
]


def chat(llm, text: str) -> list[int]:
    from tandem_engine.router.chat import ChatTemplate

    template = ChatTemplate.from_tokenizer(llm.tokenizer)
    return llm.tokenizer.encode(template.render([{"role": "user", "content": text}]),
                                add_special_tokens=False)


def random_workload(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids (special tokens) so prompts are ordinary text tokens.
    return [[rng.randrange(300, vocab) for _ in range(rng.randint(16, 200))] for _ in range(n)]


def run(llm, prompts: list[list[int]], params, batch: int) -> dict:
    """Requests `batch` at a time; tokens/s over the whole run and mean latency."""
    engine = llm.engine
    before = engine.stats.speculative
    start = time.perf_counter()
    latencies, outputs = [], []
    for i in range(0, len(prompts), batch):
        t = time.perf_counter()
        outs = llm.generate(prompts[i:i + batch], params)
        latencies += [time.perf_counter() - t] * len(outs)
        outputs += outs
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"tokens": tokens, "seconds": round(elapsed, 3),
              "tokens_per_s": round(tokens / elapsed, 1),
              "mean_latency_s": round(statistics.mean(latencies), 3),
              "token_ids": [o.outputs[0].token_ids for o in outputs]}
    after = engine.stats.speculative
    if after is not None:
        drafts = after.num_drafts - before.num_drafts
        per_position = [a - (before.accepted_per_position[i]
                             if i < len(before.accepted_per_position) else 0)
                        for i, a in enumerate(after.accepted_per_position)]
        proposed = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        result["drafts"] = drafts
        result["acceptance"] = round(accepted / proposed, 3) if proposed else None
        result["accepted_per_position"] = [round(a / drafts, 3) if drafts else None
                                           for a in per_position]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--random-requests", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)

    from tandem_engine.cli.models import SMOLLM2_135M_INSTRUCT, pull
    from tandem_engine.engine.llm import LLM
    from tandem_engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    model = pull(SMOLLM2_135M_INSTRUCT)
    spec = {"method": "ngram", "num_speculative_tokens": args.tokens,
            "prompt_lookup_min": args.ngram_min, "prompt_lookup_max": args.ngram_max}
    engines = {"off": LLM(str(model)), "on": LLM(str(model), speculative_config=spec)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    workloads = {
        "copy-heavy": [chat(engines["off"], t) for t in COPY_TASKS],
        "random": random_workload(engines["off"].engine.model_config.vocab_size,
                                  args.random_requests),
    }
    warm = workloads["random"][:1]
    for llm in engines.values():  # first-use costs (kernel load, buffers) out of the timing
        llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0))
    results = {}
    for name, prompts in workloads.items():
        for batch in (1, 4):
            row = {mode: run(llm, prompts, params, batch) for mode, llm in engines.items()}
            same = row["on"].pop("token_ids") == row["off"].pop("token_ids")
            speedup = row["on"]["tokens_per_s"] / row["off"]["tokens_per_s"]
            results[f"{name} batch {batch}"] = {**row, "speedup": round(speedup, 2),
                                                "same_tokens": same}
            on, off = row["on"], row["off"]
            print(f"{name:10s} batch {batch}: off {off['tokens_per_s']:7.1f} tok/s "
                  f"({off['mean_latency_s']:.2f} s/request), on {on['tokens_per_s']:7.1f} "
                  f"tok/s ({on['mean_latency_s']:.2f} s/request): x{speedup:.2f}, "
                  f"acceptance {on['acceptance']}, per position "
                  f"{on['accepted_per_position']}, same tokens: {same}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
