"""Speculative decoding: tokens/s and latency with it on vs off, in one run.

Three workloads on the real model (SmolLM2-135M-Instruct, GGUF, greedy):

* copy-heavy (`COPY_TASKS`): chat prompts that hand the model a text of 20-80 words (a
  paragraph, an email, a function, HTML, a config file, a recipe, a list) and ask for it
  back with at most one small change, so the answer quotes its input;
* short-edits (`SHORT_EDITS`): the same kind of request over short inputs (a list of
  fruit, a four-line function), where this small model more often paraphrases;
* random: prompts of random ordinary tokens and random lengths, where prompt lookup
  rarely finds anything (the back-off must keep this no slower).

Each workload runs at batch 1 (requests one after another), 4 and 16 (that many at
once; a workload with fewer prompts than the batch cycles through them), with
speculation off and on, on one engine each (same weights, same process; each batch runs
on one engine, then on the other, so a change in load falls on both). Reported:
generated tokens/s, mean per-request latency, the speed-up, whether the tokens were
identical, and for the speculative runs the acceptance rate per draft position.

    .venv/bin/python benchmarks/speculative.py [--method ngram] [--tokens 12]
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
from decode_batch1 import cpu  # the CPU's name and ISA flags, as every benchmark prints

COPY_TASKS = [
    'Repeat the following text exactly, word for word:\n\nThe river '
    'starts high in the mountains, where snow melts in the spring. '
    'It runs through forests and small villages, past farms and old '
    'stone bridges, until it reaches the wide green valley. There '
    'it slows down, bends around the town, and finally flows into '
    'the sea.',
    'Here is a Python function with a typo. Print the corrected function '
    'in full, with no explanation:\n\ndef merge(a, b):\n    result = '
    '[]\n    i = 0\n    j = 0\n    while i < len(a) and j < len(b):\n'
    '        if a[i] <= b[j]:\n            result.append(a[i])\n   '
    '         i += 1\n        else:\n            result.append(b[j])\n'
    '            j += 1\n    result.extend(a[i:])\n    result.extend(b[jj:])\n'
    '    return result\n',
    "Copy this shopping list, but change 'milk' to 'oat milk':\n- "
    'bread\n- butter\n- milk\n- eggs\n- cheese\n- apples\n- rice\n- tomatoes\n'
    '- onions\n- coffee',
    'Rewrite this email exactly as it is, only changing the name '
    'Tom to Anna:\n\nHi Tom,\n\nThanks for sending the report yesterday. '
    'I read it this morning and I think the numbers look good. Could '
    'you send me the slides before the meeting on Friday? Let me '
    'know if you need any help.\n\nBest,\nSam',
    'Correct the spelling mistake in this sentence and write the '
    'whole sentence again: The committee will meet on Thursday afternoon '
    'to disscuss the new budget for the library and the park.',
    "Print this HTML again with the title changed to 'Welcome':\n\n"
    '<html>\n  <head>\n    <title>Home</title>\n  </head>\n  <body>\n '
    '   <h1>Hello</h1>\n    <p>This is my page.</p>\n  </body>\n</html>',
    'Write this recipe again exactly, but use 3 eggs instead of 2:\n'
    '\nPancakes\n- 200 g flour\n- 2 eggs\n- 300 ml milk\n- 1 tablespoon '
    'sugar\n- a pinch of salt\n\nMix the flour, sugar and salt in a '
    'bowl. Add the eggs and the milk and whisk until smooth. Heat '
    'a pan with a little butter and cook each pancake for about one '
    'minute on each side.',
    'Repeat this configuration file exactly, changing only the port '
    'from 8080 to 9090:\n\nserver:\n  host: 0.0.0.0\n  port: 8080\n  workers: '
    '4\nlogging:\n  level: info\n  file: /var/log/app.log\ndatabase:\n'
    '  url: postgres://localhost:5432/app\n  pool_size: 10',
    'Quote this paragraph word for word: Bees visit flowers to collect '
    'nectar and pollen. While they move from flower to flower, they '
    'carry pollen with them, which helps plants make seeds and fruit. '
    'Without bees, many of the foods we eat every day would be much '
    'harder to grow.',
]

SHORT_EDITS = [
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


def run(engines: dict, prompts: list[list[int]], params, batch: int) -> dict:
    """Requests `batch` at a time, each batch on every engine in turn (so a change in the
    machine's load falls on all of them alike); per engine: tokens/s over its own time
    and the mean latency of its requests."""
    before = {mode: llm.engine.stats.speculative for mode, llm in engines.items()}
    elapsed = dict.fromkeys(engines, 0.0)
    latencies: dict[str, list[float]] = {mode: [] for mode in engines}
    outputs: dict[str, list] = {mode: [] for mode in engines}
    for i in range(0, len(prompts), batch):
        for mode, llm in engines.items():
            t = time.perf_counter()
            outs = llm.generate(prompts[i:i + batch], params)
            took = time.perf_counter() - t
            elapsed[mode] += took
            latencies[mode] += [took] * len(outs)
            outputs[mode] += outs
    return {mode: _summary(llm, before[mode], elapsed[mode], latencies[mode], outputs[mode])
            for mode, llm in engines.items()}


def _summary(llm, before, elapsed: float, latencies: list[float], outputs: list) -> dict:
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"tokens": tokens, "seconds": round(elapsed, 3),
              "tokens_per_s": round(tokens / elapsed, 1),
              "mean_latency_s": round(statistics.mean(latencies), 3),
              "token_ids": [o.outputs[0].token_ids for o in outputs]}
    after = llm.engine.stats.speculative
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
    ap.add_argument("--method", default="ngram", choices=("ngram", "draft", "mtp"))
    ap.add_argument("--draft-model", default=None, help="method draft: the draft checkpoint")
    ap.add_argument("--model", default=None,
                    help="the served checkpoint (default: the pulled SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=12, help="num_speculative_tokens")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="no proposals in a step with more running requests than this")
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--random-requests", type=int, default=8)
    ap.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes")
    ap.add_argument("--workloads", default="copy-heavy,short-edits,random")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)

    from tandem_engine.cli.models import SMOLLM2_135M_INSTRUCT, pull
    from tandem_engine.engine.llm import LLM
    from tandem_engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    model = args.model or str(pull(SMOLLM2_135M_INSTRUCT))
    spec: dict = {"method": args.method, "num_speculative_tokens": args.tokens}
    if args.method == "ngram":
        spec.update(prompt_lookup_min=args.ngram_min, prompt_lookup_max=args.ngram_max)
    if args.method == "draft":
        spec["model"] = args.draft_model
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    engines = {"off": LLM(model), "on": LLM(model, speculative_config=spec)}
    print(f"model {model}, speculative {spec}, {args.threads} threads, "
          f"CPU {cpu()}", flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    all_workloads = {
        "copy-heavy": lambda: [chat(engines["off"], t) for t in COPY_TASKS],
        "short-edits": lambda: [chat(engines["off"], t) for t in SHORT_EDITS],
        "random": lambda: random_workload(engines["off"].engine.model_config.vocab_size,
                                          args.random_requests),
    }
    workloads = {name: all_workloads[name]() for name in args.workloads.split(",")}
    warm = random_workload(engines["off"].engine.model_config.vocab_size, 1)
    for llm in engines.values():  # first-use costs (kernel load, buffers) out of the timing
        llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0))
    results = {}
    for name, prompts in workloads.items():
        for batch in (int(b) for b in args.batches.split(",")):
            requests = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
            row = run(engines, requests, params, batch)
            same = row["on"].pop("token_ids") == row["off"].pop("token_ids")
            speedup = row["on"]["tokens_per_s"] / row["off"]["tokens_per_s"]
            results[f"{name} batch {batch}"] = {**row, "speedup": round(speedup, 2),
                                                "same_tokens": same}
            on, off = row["on"], row["off"]
            print(f"{name:11s} batch {batch:2d}: off {off['tokens_per_s']:7.1f} tok/s "
                  f"({off['mean_latency_s']:.2f} s/request), on {on['tokens_per_s']:7.1f} "
                  f"tok/s ({on['mean_latency_s']:.2f} s/request): x{speedup:.2f}, "
                  f"acceptance {on['acceptance']}, per position "
                  f"{on['accepted_per_position']}, same tokens: {same}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"speculative": spec, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
