"""Fleet refit benchmark: a local 2 prefill + 2 decode stack refitted in place under load.

Run alone (it measures wall time on a 2-core machine):

    .venv/bin/tandem demo-model bench-models/small-llama --size small
    .venv/bin/tandem demo-model bench-models/small-llama-v2 --size small --seed 1
    .venv/bin/python benchmarks/refit_fleet.py

It starts `tandem serve`'s stack (`LocalStack`) on the first checkpoint, runs a closed-loop
streaming load through the router (the `openai` client), and drives the same refit
transaction `tandem refit` runs (`tandem_engine.fleet.run`): a Rolling refit to the second
checkpoint, then an AllAtOnce refit (Recompute) back, then (load stopped) a Rolling
refit again, for each engine's refit time without serving beside it. It prints, with
the goal and PASS/MISS where the issue sets one:
* time from starting each refit to every engine verified on the new version;
* each engine's refit (its POST /v1/refit, as the orchestrator timed it) over reading
  the same safetensors bytes from the page cache, measured in the same run before the
  stack starts (goal <= 1.2x), and under the load;
* generated tokens/s during the rolling refit over the steady state before it
  (goal >= 1 - engines away per wave / engines);
* the AllAtOnce unavailable window (`tandem_engine.cli.refit.unavailable_window`);
* by model: waves (from the transaction's own `choose_wave`) and the time they would take
  for larger pools at the measured time per wave.
Zero failed requests is checked too: any failure is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lifecycle import read_bytes_s
from tandem_engine.cli.refit import RecordingAdmin, unavailable_window
from tandem_engine.cli.serve import LocalStack, free_port
from tandem_engine.fleet import (
    EngineObs,
    EngineRecord,
    Transaction,
    choose_wave,
    new_transaction,
    observe,
    run,
)
from tandem_engine.lifecycle import EngineState
from tandem_engine.refit_policy import InFlight, RefitStrategy
from tandem_engine.weights import WeightsRef

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class LoadStats:
    stamps: list[float] = field(default_factory=list)  # one per generated token
    requests: int = 0
    failures: list[str] = field(default_factory=list)

    def tokens_per_s(self, start: float, end: float) -> float:
        return sum(1 for t in self.stamps if start <= t < end) / (end - start)


async def load_worker(client, model: str, rng: random.Random, vocab: int, prompt_len: int,
                      max_tokens: int, stats: LoadStats, stop: asyncio.Event) -> None:
    import openai

    while not stop.is_set():
        prompt = [rng.randrange(4, vocab) for _ in range(prompt_len)]
        stats.requests += 1
        try:
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
            got = 0
            async for chunk in stream:
                ids = chunk.choices[0].model_extra.get("token_ids") or []
                now = time.monotonic()
                stats.stamps += [now] * len(ids)
                got += len(ids)
            if got != max_tokens:
                stats.failures.append(f"{got} of {max_tokens} tokens")
        except openai.OpenAIError as exc:
            stats.failures.append(f"{type(exc).__name__}: {exc}")


@dataclass
class RefitResult:
    tx: Transaction
    seconds: float
    start: float  # monotonic
    end: float
    refit_s: dict[str, float]  # engine -> its POST /v1/refit round trip
    window: float | None


async def refit(engines: list[tuple[str, str, str]], target: WeightsRef,
                **options) -> RefitResult:
    admin = RecordingAdmin()
    try:
        tx = new_transaction(target, await observe(admin, engines), **options)
        start = time.monotonic()
        tx = await run(tx, engines, admin, interval=0.05, timeout=1800)
        end = time.monotonic()
    finally:
        await admin.close()
    refit_s = {c.engine: c.ended - c.started for c in admin.calls if c.path == "/v1/refit"}
    window = unavailable_window(admin.calls, [n for n, _, _ in engines])
    return RefitResult(tx, end - start, start, end, refit_s, window)


def waves_for(prefill: int, decode: int, max_unavailable: int,
              strategy: RefitStrategy) -> int:
    """How many waves the transaction's own rule takes for a pool of this shape."""
    names = [(f"p{i}", "prefill") for i in range(prefill)] + [(f"d{i}", "decode")
                                                              for i in range(decode)]
    engines = [EngineObs(n, role, "", EngineState.RUNNING, "v1", 1) for n, role in names]
    tx = Transaction(target=WeightsRef("new", "v2"), previous=WeightsRef("old", "v1"), epoch=2,
                     strategy=strategy, max_unavailable=max_unavailable)
    waves = 0
    while wave := choose_wave(tx, engines):
        waves += 1
        tx.engines.update({n: EngineRecord(verified=True) for n in wave})
        engines = [EngineObs(e.name, e.role, "", EngineState.RUNNING, "v2", 2)
                   if e.name in wave else e for e in engines]
    return waves


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


async def bench(args: argparse.Namespace, stack: LocalStack, vocab: int) -> int:
    import openai

    engines = [(e["name"], e["role"], e["admin_url"]) for e in stack.engines]
    client = openai.AsyncOpenAI(base_url=stack.url, api_key="x", max_retries=0, timeout=600)
    stats, stop = LoadStats(), asyncio.Event()
    workers = [asyncio.create_task(load_worker(
        client, stack.name, random.Random(args.seed + i), vocab, args.prompt_len,
        args.max_tokens, stats, stop)) for i in range(args.concurrency)]
    try:
        await asyncio.sleep(args.warmup)
        before_start = time.monotonic()
        await asyncio.sleep(args.before)
        before = stats.tokens_per_s(before_start, time.monotonic())
        # The same read under the same load: how much of a refit's time is the machine's.
        loaded_read_s, _, _ = await asyncio.to_thread(read_bytes_s, args.refit_to)
        await asyncio.sleep(args.settle)

        v1, v2 = (WeightsRef(p.resolve().as_uri(), name) for p, name in
                  ((args.model, "v1"), (args.refit_to, "v2")))
        rolling = await refit(engines, v2, strategy=RefitStrategy.ROLLING,
                              inflight=InFlight.DRAIN,
                              max_unavailable=args.max_unavailable)
        during = stats.tokens_per_s(rolling.start, rolling.end)
        await asyncio.sleep(args.settle)
        at_once = await refit(engines, v1, strategy=RefitStrategy.ALL_AT_ONCE,
                              inflight=InFlight.RECOMPUTE)
        during_at_once = stats.tokens_per_s(at_once.start, at_once.end)
        await asyncio.sleep(args.settle)
    finally:
        stop.set()
        await asyncio.gather(*workers)
        await client.close()
    # Each engine's refit with no load beside it (still two at a time).
    quiet = await refit(engines, v2, strategy=RefitStrategy.ROLLING, inflight=InFlight.DRAIN,
                        max_unavailable=args.max_unavailable)

    read_s, nbytes = args.read_s, args.read_bytes
    print(f"load: {args.concurrency} closed-loop streams, {args.prompt_len}-token prompts, "
          f"{args.max_tokens} tokens each; {stats.requests} requests, "
          f"{len(stats.failures)} failed")
    status = 0 if not stats.failures else 1
    for f in stats.failures[:5]:
        print(f"  FAILED: {f}")
    print(f"reference: read() of {args.refit_to.name}'s safetensors from page cache: "
          f"{read_s * 1e3:.0f} ms idle, {loaded_read_s * 1e3:.0f} ms under the load")
    for label, r in (("Rolling (Drain, maxUnavailable "
                      f"{args.max_unavailable})", rolling),
                     ("AllAtOnce (Recompute)", at_once),
                     ("Rolling again with the load stopped", quiet)):
        print(f"{label}: {r.tx.phase} in {r.seconds:.2f} s ({r.tx.wave} wave(s)), from "
              "start to every engine verified on the new version")
        if str(r.tx.phase) != "Succeeded":
            status = 1
        for name, seconds in sorted(r.refit_s.items()):
            ratio = seconds / read_s
            print(f"  {name}: refit {seconds * 1e3:6.0f} ms vs read() of its "
                  f"{nbytes / 2**20:.0f} MiB {read_s * 1e3:.0f} ms -> {ratio:.2f}x  "
                  f"goal <= 1.2x  {verdict(ratio <= 1.2)}  (under load: "
                  f"{seconds / loaded_read_s:.2f}x)")
    away = 2 * args.max_unavailable  # one of each role per unit of maxUnavailable
    goal = 1 - away / len(engines)
    ratio = during / before if before else 0.0
    print(f"throughput before: {before:.1f} tok/s; during the rolling refit: {during:.1f} "
          f"tok/s -> {ratio:.2f}x  goal >= {goal:.2f}x (1 - {away}/{len(engines)} engines "
          f"away per wave)  {verdict(ratio >= goal)}")
    print(f"throughput during the AllAtOnce refit: {during_at_once:.1f} tok/s "
          f"({during_at_once / before if before else 0:.2f}x of before)")
    window = "n/a" if at_once.window is None else f"{at_once.window * 1e3:.0f} ms"
    print(f"AllAtOnce unavailable window (last engine out -> first engine verified and "
          f"admitting): {window}")
    per_wave = rolling.seconds / max(1, rolling.tx.wave)
    print("machine load average (1 min) at the start / the end: "
          f"{args.load_start:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"by model: {per_wave:.2f} s per rolling wave measured here (2 engines refitting "
          "at once on 2 cores); pools of N prefill + N decode:")
    for n in (2, 4, 8, 16):
        cells = []
        for m in (1, 2, 4):
            if m < n:
                w = waves_for(n, n, m, RefitStrategy.ROLLING)
                cells.append(f"maxUnavailable {m}: {w} waves ~{w * per_wave:.0f} s")
        print(f"  N={n:<2} " + "; ".join(cells))
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "bench-models" / "small-llama")
    p.add_argument("--refit-to", type=Path, default=ROOT / "bench-models" / "small-llama-v2")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-unavailable", type=int, default=1)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--before", type=float, default=10.0, help="seconds of steady state")
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for path, seed in ((args.model, 0), (args.refit_to, 1)):
        if not (path / "config.json").is_file():
            print(f"{path}: no checkpoint there; create it with `.venv/bin/tandem demo-model "
                  f"{path} --size small --seed {seed}`", file=sys.stderr)
            return 2

    print("command:", " ".join(sys.orig_argv))
    args.load_start = os.getloadavg()[0]
    print(f"stack: 2 prefill + 2 decode engines ({args.threads} torch thread(s) each) + "
          f"router; {args.model} (v1) <-> {args.refit_to} (v2)")
    # The reference, measured in this run while the machine is idle (page cache warm).
    args.read_s, _, args.read_bytes = read_bytes_s(args.refit_to)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory() as logs:
        stack = LocalStack(args.model.resolve(), prefill=2, decode=2, port=free_port(),
                           served_model_name="bench", log_dir=Path(logs),
                           engine_args=["--threads", str(args.threads)], out=sys.stderr)
        stack.start(timeout=600)
        try:
            return asyncio.run(bench(args, stack, vocab))
        finally:
            stack.stop()


if __name__ == "__main__":
    sys.exit(main())
