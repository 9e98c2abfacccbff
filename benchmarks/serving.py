"""Online serving benchmark: an OpenAI-API load generator against `tandem serve`.

Run alone:

    .venv/bin/python benchmarks/serving.py --model bench-models/small-llama --engines 2

It starts the local stack (N engine processes + the router), then:
1. a load run: Poisson arrivals at --rate requests/s, prompt and output lengths uniform
   in the given ranges, at most --concurrency in flight, streamed with the official
   `openai` client; reports TTFT, inter-token latency and end-to-end p50/p99, tokens/s
   and requests/s, and the router's own added latency from its /metrics (HTTP arrival
   -> request on the engine socket; engine output -> bytes to the client);
2. the reference for (1): the same engines' summed offline throughput — N processes,
   each running `LLM.generate` on its share of the same workload at the same time;
3. the router's ceiling: requests/s with max_tokens=1 and short prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    tokens: int = 0
    ok: bool = False


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def workload(n: int, seed: int, prompt: tuple[int, int], output: tuple[int, int],
             vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(4, vocab) for _ in range(rng.randint(*prompt))],
             rng.randint(*output)) for _ in range(n)]


async def one_request(client, model: str, prompt: list[int], max_tokens: int) -> Result:
    r = Result()
    start = time.perf_counter()
    last = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                r.tokens = chunk.usage.completion_tokens
            if not chunk.choices or not chunk.choices[0].text:
                continue
            if last is None:
                r.ttft = now - start
            else:
                r.itl.append(now - last)
            last = now
        r.e2e = time.perf_counter() - start
        r.ok = True
    except Exception as exc:  # counted as a failure in the report
        print(f"request failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return r


async def load_run(base_url: str, model: str, items, rate: float, concurrency: int,
                   seed: int) -> tuple[list[Result], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="bench", timeout=600, max_retries=0)
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(seed + 1)

    async def guarded(prompt, n):
        async with sem:
            return await one_request(client, model, prompt, n)

    tasks = []
    start = time.perf_counter()
    for prompt, n in items:
        tasks.append(asyncio.create_task(guarded(prompt, n)))
        if rate > 0:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    await client.close()
    return results, elapsed


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
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT / "engine_image"))
    from tandem_engine.cli.serve import LocalStack

    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    items = workload(args.num_requests, args.seed, (args.min_prompt, args.max_prompt),
                     (args.min_output, args.max_output), vocab)
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
        base = stack.url
        name = stack.name
        asyncio.run(load_run(base, name, items[:4], 0, 4, args.seed))  # warm-up
        results, elapsed = asyncio.run(load_run(base, name, items, args.rate,
                                                args.concurrency, args.seed))
        ok = [r for r in results if r.ok]
        tokens = sum(r.tokens for r in ok)
        itl = [x for r in ok for x in r.itl]
        print(f"\nload: {len(ok)}/{len(results)} ok in {elapsed:.1f} s: "
              f"{tokens / elapsed:.1f} tok/s, {len(ok) / elapsed:.2f} req/s")
        for label, values in (("TTFT", [r.ttft for r in ok]), ("ITL", itl),
                              ("end-to-end", [r.e2e for r in ok])):
            print(f"  {label:<11} p50 {pct(values, 0.5) * 1e3:8.1f} ms   "
                  f"p99 {pct(values, 0.99) * 1e3:8.1f} ms")
        metrics = f"http://127.0.0.1:{args.port}/metrics"
        for name_, label in (("tandem_router_ingress_seconds", "HTTP arrival -> engine socket"),
                             ("tandem_router_egress_seconds", "engine output -> client bytes")):
            p50 = router_histogram_p50(metrics, name_)
            verdict = "n/a" if p50 is None else ("PASS" if p50 <= 1e-3 else "MISS")
            shown = "n/a" if p50 is None else f"<= {p50 * 1e3:.2f} ms"
            print(f"  router added, {label}: p50 {shown}  goal <= 1 ms  {verdict}")

        ceiling_items = [([5, 6, 7, 8], 1)] * args.ceiling_requests
        _, c_elapsed = asyncio.run(load_run(base, name, ceiling_items, 0, 64, args.seed))
        print(f"router ceiling (max_tokens=1, 64 concurrent): "
              f"{args.ceiling_requests / c_elapsed:.0f} req/s")
    finally:
        stack.stop()

    if not args.skip_offline:
        offline = offline_reference(args.model.resolve(), args.engines, items,
                                    args.max_num_seqs)
        served = tokens / elapsed
        ratio = served / offline
        print(f"served {served:.1f} tok/s vs the same {args.engines} engine(s) offline "
              f"{offline:.1f} tok/s -> {ratio:.0%}  goal >= 90%  "
              f"{'PASS' if ratio >= 0.9 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
