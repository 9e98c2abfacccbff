"""Online serving benchmark: `tandem bench`'s load generator against `tandem serve`.

Run alone:

    .venv/bin/python benchmarks/serving.py --model bench-models/small-llama --engines 2

It starts the local stack (N engine processes + the router), then:
1. a load run with `tandem_engine.bench` (the load generator of `tandem bench`): Poisson
   arrivals at --rate requests/s (0: all at once), prompt and output lengths uniform in
   the given ranges, at most --concurrency in flight, streamed over /v1/completions;
   reports TTFT, inter-token latency and end-to-end p50/p99, tokens/s and requests/s (the
   server's usage counts), and the router's own added latency from its /metrics (HTTP
   arrival -> request on the engine socket; engine output -> bytes to the client);
2. the reference for (1): the same engines' summed offline throughput — N processes,
   each running `LLM.generate` on its share of the same prompts at the same time;
3. the router's ceiling: requests/s with max_tokens=1 and short prompts.
--json FILE keeps the load run's full `tandem bench` run entry (docs/bench.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "engine_image"))

from tandem_engine.bench.api import measure, text_source  # noqa: E402
from tandem_engine.bench.arrivals import Arrivals  # noqa: E402
from tandem_engine.bench.workloads import BenchRequest, LengthSpec, random_workload  # noqa: E402


def uniform(lo: int, hi: int) -> LengthSpec:
    """Lengths uniform in [lo, hi] (as the earlier flags meant them)."""
    if not 1 <= lo <= hi:
        raise SystemExit(f"lengths need 1 <= min <= max (got {lo}, {hi})")
    return LengthSpec((lo + hi) // 2, (hi - lo) // 2)


def arrivals(rate: float, concurrency: int) -> Arrivals:
    if rate > 0:
        return Arrivals("poisson", rate=rate, max_concurrency=concurrency)
    return Arrivals("burst", max_concurrency=concurrency)


def ms(summary: dict, metric: str, q: str) -> float:
    s = summary["latency_ms"][metric]
    return float("nan") if s is None else s[q]


def router_histogram_p50(metrics_url: str, name: str) -> float | None:
    """p50 (bucket upper bound) of a Prometheus histogram exposed by the router."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    buckets = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le),
                            float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    return next(le for le, count in buckets if count >= total / 2)


OFFLINE = """
import json, sys, time, torch
torch.set_num_threads(1)
from tandem_engine import LLM, SamplingParams
items = json.loads(sys.stdin.read())
llm = LLM(sys.argv[1], max_num_seqs=int(sys.argv[2]))
llm.generate([[5] * 8], SamplingParams(max_tokens=2))
start = time.perf_counter()
outs = llm.generate([p for p, _ in items], [SamplingParams(max_tokens=n, temperature=0.0,
                    ignore_eos=True) for _, n in items])
print(json.dumps({"tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                  "seconds": time.perf_counter() - start}))
"""


def offline_reference(model: Path, engines: int, items, max_num_seqs: int) -> float:
    """Summed throughput of N concurrent offline engines, each on its share."""
    shares = [items[i::engines] for i in range(engines)]
    procs = [subprocess.Popen([sys.executable, "-c", OFFLINE, str(model), str(max_num_seqs)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in shares]
    for proc, share in zip(procs, shares, strict=True):
        proc.stdin.write(json.dumps(share))
        proc.stdin.close()
    results = [json.loads(proc.stdout.read()) for proc in procs]
    for proc in procs:
        proc.wait()
    return sum(r["tokens"] / r["seconds"] for r in results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=0.0, help="requests/s (0 = all at once)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--ceiling-requests", type=int, default=300)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--port", type=int, default=18000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--json", type=Path, default=None,
                    help="write the load run's `tandem bench` run entry here")
    args = ap.parse_args(argv)

    from tandem_engine.cli.serve import LocalStack

    print("command:", " ".join(sys.orig_argv))
    print(f"model {args.model}, {args.engines} engine(s) x 1 thread, {args.num_requests} "
          f"requests, prompts {args.min_prompt}-{args.max_prompt}, outputs "
          f"{args.min_output}-{args.max_output}, rate {args.rate or 'all at once'}, "
          f"concurrency {args.concurrency}")

    stack = LocalStack(args.model.resolve(), engines=args.engines, port=args.port,
                       engine_args=["--threads", "1", "--max-num-seqs",
                                    str(args.max_num_seqs)])
    stack.start()
    try:
        base, name = stack.url, stack.name
        items = random_workload(args.num_requests, text_source(base, name),
                                uniform(args.min_prompt, args.max_prompt),
                                uniform(args.min_output, args.max_output), args.seed)
        run = measure(base, name, items, arrivals(args.rate, args.concurrency),
                      warmup=4, seed=args.seed)
        s = run["summary"]
        elapsed, tokens = s["duration_s"], s["tokens"]["output"]
        print(f"\nload: {s['requests']['completed']}/{s['requests']['sent']} ok in "
              f"{elapsed:.1f} s: {s['throughput']['output_tokens_per_s']:.1f} tok/s, "
              f"{s['throughput']['requests_per_s']:.2f} req/s")
        for metric, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "end-to-end")):
            print(f"  {label:<11} p50 {ms(s, metric, 'p50'):8.1f} ms   "
                  f"p99 {ms(s, metric, 'p99'):8.1f} ms")
        if args.json:
            args.json.write_text(json.dumps(run, indent=1))
        metrics = f"http://127.0.0.1:{args.port}/metrics"
        for name_, label in (("tandem_router_ingress_seconds", "HTTP arrival -> engine socket"),
                             ("tandem_router_egress_seconds", "engine output -> client bytes")):
            p50 = router_histogram_p50(metrics, name_)
            verdict = "n/a" if p50 is None else ("PASS" if p50 <= 1e-3 else "MISS")
            shown = "n/a" if p50 is None else f"<= {p50 * 1e3:.2f} ms"
            print(f"  router added, {label}: p50 {shown}  goal <= 1 ms  {verdict}")

        ceiling_items = [BenchRequest("one two three", 1)] * args.ceiling_requests
        ceiling = measure(base, name, ceiling_items, Arrivals("closed", concurrency=64))
        print(f"router ceiling (max_tokens=1, 64 concurrent): "
              f"{ceiling['summary']['throughput']['requests_per_s']:.0f} req/s")
    finally:
        stack.stop()

    if not args.skip_offline:
        offline = offline_reference(args.model.resolve(), args.engines,
                                    [(r.prompt, r.output_len) for r in items],
                                    args.max_num_seqs)
        served = tokens / elapsed
        ratio = served / offline
        print(f"served {served:.1f} tok/s vs the same {args.engines} engine(s) offline "
              f"{offline:.1f} tok/s -> {ratio:.0%}  goal >= 90%  "
              f"{'PASS' if ratio >= 0.9 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
