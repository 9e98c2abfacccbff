"""Structured outputs in the engine: what a JSON-schema constraint costs per token.

`benchmarks/grammar_backends.py` times the grammar libraries alone; this one times the
engine with them, in process (`tandem_engine.LLM` on SmolLM2-135M-Instruct, the pulled
GGUF), so the mask computation is seen next to the forward pass and sampling it shares
each step with. For each batch size (default 1 and 64), in the same run:

* constrained: chat prompts asking for a JSON description of a person (a different
  name and age per request), `max_tokens` 96, under a JSON schema (an object with name,
  age and 6-10 languages from an enum, `additionalProperties: false`; `WHITESPACE`
  between tokens); the grammar ends each request (about 40-85 tokens);
* unconstrained: the same prompts, no constraint, `ignore_eos=True` and `max_tokens`
  set to what the constrained run produced (each request its own length by default, so
  the batch shrinks the same way; `--match mean`: the mean of the requests run at once).

Batch 1 runs `--min-requests` requests one after another, greedy; a larger batch runs
that many requests at once, temperature 0.8 with a seed per request. Prefix caching is
off (both runs prefill every prompt). Each group of requests run at once runs
constrained and unconstrained in turn, `--repeats` times (the first of the two
alternating), and each keeps its fastest run: the machine may be shared, and a change
in its load should fall on both. Reported per configuration:
output tokens, wall seconds, tokens/s, the mean decode step (engine step timings with
no prefill tokens), the mean mask time per decode step (`StepTiming.grammar_s`), that
per running row, its share of the step, constrained/unconstrained tokens/s, and the
share of constrained outputs that `json.loads` accepts (should be all).

    .venv/bin/python benchmarks/structured_outputs.py [--batch 1 64] [--max-tokens 96] \
        [--json-out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from decode_batch1 import cpu  # the CPU's name and ISA flags, as every benchmark prints

LANGUAGES = ["English", "French", "German", "Spanish", "Italian", "Portuguese", "Dutch",
             "Polish", "Japanese", "Chinese", "Python", "Rust", "Go", "Java", "C++",
             "JavaScript"]
PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "languages": {"type": "array", "minItems": 6, "maxItems": 10,
                                       "items": {"enum": LANGUAGES}}},
          "required": ["name", "age", "languages"]}
# At most one newline and four spaces between JSON tokens: with the default (up to 32
# whitespace characters) sampling at 0.8 sometimes wanders into runs of newlines until
# max_tokens cuts the JSON off.
WHITESPACE = r"\n? {0,4}"
NAMES = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ines", "Jonas",
         "Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya"]
# SmolLM2's chat template, as tests/engine/test_structured_outputs.py writes it.
PROMPT = ("<|im_start|>user\nDescribe {name}, a {age} year old programmer who speaks many "
          "languages, as JSON with their name, age and all the languages they know."
          "<|im_end|>\n<|im_start|>assistant\n")


def prompts(llm, n: int) -> list[list[int]]:
    return [llm.tokenizer.encode(PROMPT.format(name=NAMES[i % len(NAMES)] + (
        f" {i // len(NAMES) + 1}" if i >= len(NAMES) else ""), age=22 + i % 40),
        add_special_tokens=False) for i in range(n)]


def sampling(batch: int, i: int, **kw):
    from tandem_engine import SamplingParams

    if batch == 1:
        return SamplingParams(temperature=0.0, **kw)
    return SamplingParams(temperature=0.8, seed=1000 + i, **kw)


def run(llm, ids: list[list[int]], params: list) -> tuple[float, list, list]:
    """One `generate` of requests at once: its wall seconds, its decode steps' timings
    (no prefill tokens), its outputs."""
    llm.engine.drain_step_timings()
    start = time.perf_counter()
    outputs = llm.generate(ids, params)
    wall = time.perf_counter() - start
    steps = [t for t in llm.engine.drain_step_timings() if t.num_prefill_tokens == 0]
    return wall, steps, outputs


def summary(groups: list[tuple[float, list, list]]) -> dict:
    wall = sum(g[0] for g in groups)
    steps = [t for g in groups for t in g[1]]
    outputs = [o.outputs[0] for g in groups for o in g[2]]
    tokens = sum(len(o.token_ids) for o in outputs)
    step_s = sum(t.total_s for t in steps)
    grammar_s = sum(t.grammar_s for t in steps)
    rows = sum(t.num_running for t in steps)
    return {"requests": len(outputs), "output_tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1), "decode_steps": len(steps),
            "decode_step_ms": round(1e3 * step_s / len(steps), 3),
            "grammar_ms_per_step": round(1e3 * grammar_s / len(steps), 4),
            "grammar_us_per_row": round(1e6 * grammar_s / rows, 2),
            "grammar_share": round(grammar_s / step_s, 4),
            "parse_share": round(sum(_parses(o.text) for o in outputs) / len(outputs), 4),
            "stopped_share": round(sum(o.finish_reason == "stop" for o in outputs)
                                   / len(outputs), 4)}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def measure(llm, batch: int, n: int, max_tokens: int, match: str, repeats: int) -> dict:
    """`n` requests, `batch` at a time; each group constrained and unconstrained in turn
    (so a change in the machine's load falls on both), the whole `repeats` times, the
    first of the two alternating; each group of each kind keeps its fastest run."""
    from tandem_engine.structured_outputs import StructuredOutputsParams

    ids = prompts(llm, n)
    spec = StructuredOutputsParams(json=PERSON, whitespace_pattern=WHITESPACE)
    constrained = [sampling(batch, i, max_tokens=max_tokens, structured_outputs=spec)
                   for i in range(n)]
    plain: dict[int, list] = {}  # a group's unconstrained params, once its lengths are known
    best: dict[str, dict[int, tuple]] = {"constrained": {}, "unconstrained": {}}
    for repeat in range(repeats):
        for lo in range(0, n, batch):
            group = slice(lo, lo + batch)
            order = ["constrained", "unconstrained"][::-1 if repeat % 2 else 1]
            for kind in order:
                if kind == "unconstrained" and lo not in plain:
                    lengths = [len(o.outputs[0].token_ids) for o in best["constrained"][lo][2]]
                    if match == "mean":
                        lengths = [round(sum(lengths) / len(lengths))] * len(lengths)
                    plain[lo] = [sampling(batch, lo + i, max_tokens=length, ignore_eos=True)
                                 for i, length in enumerate(lengths)]
                params = constrained[group] if kind == "constrained" else plain[lo]
                result = run(llm, ids[group], params)  # greedy or seeded: same tokens
                if lo not in best[kind] or result[0] < best[kind][lo][0]:
                    best[kind][lo] = result
    c, u = (summary(list(best[kind].values())) for kind in ("constrained", "unconstrained"))
    del u["parse_share"], u["stopped_share"]
    return {"batch": batch, "constrained": c, "unconstrained": u,
            "tok_s_ratio": round(c["tokens_per_s"] / u["tokens_per_s"], 3)}


def table(results: list[dict]) -> str:
    head = ("| batch | run | output tokens | wall s | tok/s | decode step ms | grammar ms/step "
            "| grammar µs/row | grammar share | constrained/unconstrained tok/s | parses |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        for name in ("constrained", "unconstrained"):
            m = r[name]
            ratio = f"{r['tok_s_ratio']:.3f}" if name == "constrained" else ""
            parses = f"{m['parse_share']:.0%}" if name == "constrained" else ""
            lines.append(
                f"| {r['batch']} | {name} | {m['output_tokens']} | {m['wall_s']:.2f} "
                f"| {m['tokens_per_s']:.1f} | {m['decode_step_ms']:.2f} "
                f"| {m['grammar_ms_per_step']:.3f} | {m['grammar_us_per_row']:.1f} "
                f"| {m['grammar_share']:.1%} | {ratio} | {parses} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="batch sizes")
    ap.add_argument("--max-tokens", type=int, default=96, help="constrained max_tokens")
    ap.add_argument("--min-requests", type=int, default=8,
                    help="requests per batch size when the batch is smaller")
    ap.add_argument("--match", choices=("request", "mean"), default="request",
                    help="unconstrained max_tokens: each request's constrained length, "
                    "or their mean over the requests run at once")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each group of requests; the fastest is kept")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--model", default=None,
                    help="checkpoint (default: the pulled SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--json-out", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)

    from tandem_engine import LLM, SamplingParams
    from tandem_engine.cli.models import SMOLLM2_135M_INSTRUCT, pull
    from tandem_engine.structured_outputs import StructuredOutputsParams

    torch.set_num_threads(args.threads)
    model = args.model or str(pull(SMOLLM2_135M_INSTRUCT))
    llm = LLM(model, enable_prefix_caching=False)  # the second run of a prompt prefills too
    load = os.getloadavg()[0]
    print(f"model {model}, CPU {cpu()}, {args.threads} threads, torch {torch.__version__}, "
          f"load average {load:.2f}", flush=True)
    # First-use costs out of the timings: kernels, the grammar tokenizer and compile, the
    # parallel mask executor (two constrained rows at once).
    warm = prompts(llm, 2)
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0))
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=(
        StructuredOutputsParams(json=PERSON, whitespace_pattern=WHITESPACE))))
    results = []
    start = time.perf_counter()
    for batch in args.batch:
        row = measure(llm, batch, max(batch, args.min_requests), args.max_tokens, args.match,
                      args.repeats)
        results.append(row)
        c, u = row["constrained"], row["unconstrained"]
        print(f"batch {batch}: constrained {c['tokens_per_s']} tok/s, unconstrained "
              f"{u['tokens_per_s']} tok/s (x{row['tok_s_ratio']}), grammar "
              f"{c['grammar_us_per_row']} µs/row/step, {c['grammar_share']:.1%} of a step, "
              f"{c['parse_share']:.0%} parse", flush=True)
    print(f"\n{table(results)}\n\nwhole run {time.perf_counter() - start:.0f} s, "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "model": model, "cpu": cpu(), "threads": args.threads, "torch": torch.__version__,
            "load_average_start": load, "schema": PERSON, "whitespace": WHITESPACE,
            "match": args.match, "repeats": args.repeats,
            "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
