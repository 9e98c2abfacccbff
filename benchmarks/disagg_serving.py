"""Disaggregated vs colocated serving on the same two cores: 1 prefill + 1 decode engine
against 2 mixed engines, under a mixed workload of long prompts and long generations.

Run alone:

    .venv/bin/python benchmarks/disagg_serving.py --model bench-models/small-llama

Both setups run the same requests (Poisson arrivals, the same seed) through `tandem serve`
and `tandem bench`'s load generator (`tandem_engine.bench`), with one torch thread per
engine and each engine's threads pinned to its own core (engine 0 → CPU 0, engine 1 →
CPU 1), so the only difference is who computes what. A mixed engine interleaves chunks of
long prompts with the decode steps of running requests, so a prompt arriving stalls every
stream on that engine for a chunk's compute; a decode engine never computes a prompt (it
pulls the KV), so its inter-token latency stays flat. Reported per setup: TTFT and
inter-token latency p50/p99, throughput, and goodput — requests/s whose TTFT and whose own
p99 inter-token latency both meet the SLO given on the command line (`tandem bench --slo
ttft=..,itl=..`). The goal is 1P+1D ITL p99 ≤ 0.5× of 2 mixed. --json FILE keeps both
setups' `tandem bench` run entries (docs/bench.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "engine_image"))

from serving import arrivals, ms, uniform  # noqa: E402
from tandem_engine.bench.api import measure, text_source  # noqa: E402
from tandem_engine.bench.workloads import random_workload  # noqa: E402
from tandem_engine.cli.serve import LocalStack  # noqa: E402


def pin_process(pid: int, cpu: int) -> None:
    """Pin every thread of `pid` (threads it starts later inherit the mask)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})


def run_setup(label: str, model: Path, args, **roles: int) -> dict:
    stack = LocalStack(model, port=args.port, **roles,
                       engine_args=["--threads", "1", "--max-num-seqs", "16",
                                    "--max-num-batched-tokens", str(args.chunk)])
    stack.start()
    try:
        cpus = os.sched_getaffinity(0)
        engines = [c.process.pid for c in stack.children if c.name != "router"]
        for i, pid in enumerate(engines):
            pin_process(pid, sorted(cpus)[i % len(cpus)])
        # the same text for both setups: same seed, same tokenizer
        items = random_workload(args.num_requests, text_source(stack.url, stack.name),
                                uniform(args.min_prompt, args.max_prompt),
                                uniform(args.min_output, args.max_output), args.seed)
        run = measure(stack.url, stack.name, items, arrivals(args.rate, args.concurrency),
                      slo={"ttft": args.slo_ttft * 1e3, "itl": args.slo_itl * 1e3},
                      warmup=2, seed=args.seed)
    finally:
        stack.stop()
    s = run["summary"]
    good = s["goodput"]
    row = {"setup": label, "ok": s["requests"]["completed"], "n": s["requests"]["sent"],
           "elapsed": s["duration_s"], "tok_s": s["throughput"]["output_tokens_per_s"],
           "ttft_p50": ms(s, "ttft", "p50") / 1e3, "ttft_p99": ms(s, "ttft", "p99") / 1e3,
           "itl_p50": ms(s, "itl", "p50") / 1e3, "itl_p99": ms(s, "itl", "p99") / 1e3,
           "goodput": good["requests_per_s"], "good": good["good_requests"], "run": run}
    print(f"{label:>12}: {row['ok']}/{row['n']} ok in {row['elapsed']:.1f} s, "
          f"{row['tok_s']:.1f} tok/s | TTFT p50 {row['ttft_p50']:.2f} s p99 "
          f"{row['ttft_p99']:.2f} s | ITL p50 {row['itl_p50'] * 1e3:.0f} ms p99 "
          f"{row['itl_p99'] * 1e3:.0f} ms | goodput {row['goodput']:.3f} req/s "
          f"({row['good']} within SLO)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--rate", type=float, default=0.2, help="Poisson arrivals, requests/s")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=384)
    ap.add_argument("--max-prompt", type=int, default=768)
    ap.add_argument("--min-output", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=160)
    ap.add_argument("--chunk", type=int, default=256,
                    help="--max-num-batched-tokens of every engine (the prefill chunk)")
    ap.add_argument("--slo-ttft", type=float, default=15.0, help="seconds")
    ap.add_argument("--slo-itl", type=float, default=0.25,
                    help="seconds: a request's own p99 inter-token latency")
    ap.add_argument("--port", type=int, default=18100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None,
                    help="write both setups' `tandem bench` run entries here")
    args = ap.parse_args(argv)

    model = args.model.resolve()
    print("command:", " ".join(sys.orig_argv))
    print(f"model {model.name}; {args.num_requests} requests, prompts {args.min_prompt}-"
          f"{args.max_prompt}, outputs {args.min_output}-{args.max_output}, Poisson "
          f"{args.rate} req/s; 2 engines x 1 thread pinned to CPUs "
          f"{sorted(os.sched_getaffinity(0))[:2]}; chunk {args.chunk} tokens; SLO: TTFT <= "
          f"{args.slo_ttft} s and per-request ITL p99 <= {args.slo_itl * 1e3:.0f} ms",
          flush=True)
    mixed = run_setup("2 mixed", model, args, engines=2)
    disagg = run_setup("1P + 1D", model, args, prefill=1, decode=1)
    if args.json:
        args.json.write_text(json.dumps({"2 mixed": mixed["run"], "1P + 1D": disagg["run"]},
                                        indent=1))
    ratio = disagg["itl_p99"] / mixed["itl_p99"]
    print(f"ITL p99: 1P+1D / 2 mixed = {ratio:.2f}x  goal <= 0.5x  "
          f"{'PASS' if ratio <= 0.5 else 'MISS'}")
    print(f"TTFT p50: 1P+1D / 2 mixed = {disagg['ttft_p50'] / mixed['ttft_p50']:.2f}x; "
          f"goodput 1P+1D / 2 mixed = "
          f"{disagg['goodput'] / mixed['goodput'] if mixed['goodput'] else float('inf'):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
