"""Exact prefix routing (the engines' KV events) against the routers' memory of what each
sent (approximate), shedding under overload, and fairness between tenants. Real
processes: engines and routers on this machine, SmolLM2-135M-Instruct (its GGUF, as
`tandem serve` serves it).

1. **Shared prefixes**: two engines, two routers. Each of `--prefixes` prefixes of
   `--prefix-tokens` tokens is sent once through router 0, then `--repeats` times through
   router 1 with a new suffix, one request at a time. Reported per mode: the repeats that
   found the whole prefix in their engine's cache (`usage.prompt_tokens_details
   .cached_tokens`), and their TTFT (a repeat on the engine holding the prefix prefills
   only its suffix). The two modes run on the same engines, each under its own
   `cache_salt` (so neither finds the other's KV).
2. **Overload**: one engine (`--max-num-seqs 4`, `--max-queued-requests 8`) behind one
   router (`--max-num-requests 32`); `--streams` streamed requests at once. Reported: how
   many were accepted and completed, how many got 429 and how fast, and each process's
   RSS before and after.
3. **Fairness**: one engine (`--max-num-seqs 2`: any load queues) behind one router. A
   light tenant (`X-Tandem-Tenant: light`) sends `--samples` requests one after another,
   alone, then beside a heavy tenant keeping 10 streams in flight (load_clients.py, a
   process of its own). Reported: the light tenant's TTFT p90 each time and their ratio
   (the issue's goal: at most 1.5x), and the heavy tenant's own p90 and completed
   requests. Measured twice in one run: with the engine's seat reservation off
   (`--seat-reserve-ms 0`, the reference) and at its default.

    .venv/bin/python benchmarks/prefix_routing.py [--prefixes 8] [--repeats 3]
        [--parts shared,overload,fairness] [--samples 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tandem_engine.cli.models import SMOLLM2_135M_INSTRUCT, pull
from tandem_engine.cli.serve import free_port

MODEL = "smollm2"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Procs:
    def __init__(self, model: Path, folder: Path) -> None:
        self.model, self.folder = model, folder
        self.procs: list[subprocess.Popen] = []

    def _spawn(self, cmd: list[str], name: str, ready: str) -> subprocess.Popen:
        log = (self.folder / f"{name}.log").open("wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                tail = (self.folder / f"{name}.log").read_text()[-2000:]
                raise RuntimeError(f"{name} exited: {tail}")
            try:
                if httpx.get(ready, timeout=1).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready")
            time.sleep(0.2)

    def engine(self, name: str, *flags: str) -> tuple[str, subprocess.Popen]:
        port, admin = free_port(), free_port()
        proc = self._spawn([sys.executable, "-m", "tandem_engine.server.main", "--model",
                            str(self.model), "--served-model-name", MODEL, "--port", str(port),
                            "--admin-port", str(admin), "--threads", "1",
                            "--heartbeat-interval", "0.2", *flags], name,
                           f"http://127.0.0.1:{admin}/readyz")
        return f"127.0.0.1:{port}", proc

    def router(self, name: str, engines: list[str], *flags: str) -> tuple[str, subprocess.Popen]:
        port = free_port()
        cmd = [sys.executable, "-m", "tandem_engine.router.main", "--model", str(self.model),
               "--served-model-name", MODEL, "--port", str(port), *flags]
        for e in engines:
            cmd += ["--engine", e]
        url = f"http://127.0.0.1:{port}"
        return url, self._spawn(cmd, name, f"{url}/readyz")

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def complete(router: str, prompt: list[int], salt: str, stream: bool = True
             ) -> tuple[int, float]:
    """(cached prompt tokens, time to first token) of one streamed completion."""
    started = time.monotonic()
    ttft = None
    cached = 0
    with httpx.stream("POST", f"{router}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "cache_salt": salt}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None and '"text"' in line:
                ttft = time.monotonic() - started
            if '"usage"' in line and '"prompt_tokens_details"' in line:
                usage = json.loads(line[6:]).get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return cached, ttft or (time.monotonic() - started)


def shared_prefixes(procs: Procs, args: argparse.Namespace) -> dict[str, dict]:
    engines = [procs.engine(f"engine{i}")[0] for i in range(2)]
    out = {}
    for mode in ("exact", "approximate"):
        routers = [procs.router(f"{mode}-router{r}", engines, "--prefix-routing", mode)[0]
                   for r in range(2)]
        rng = random.Random(1)
        salt = f"bench-{mode}"
        complete(routers[1], [rng.randrange(3, 40000) for _ in range(16)], salt)
        hits, total, ttfts = 0, 0, []
        for _ in range(args.prefixes):
            prefix = [rng.randrange(3, 40000) for _ in range(args.prefix_tokens)]
            complete(routers[0], prefix + [rng.randrange(3, 40000) for _ in range(8)], salt)
            time.sleep(0.2)
            for _ in range(args.repeats):
                cached, ttft = complete(routers[1], prefix + [rng.randrange(3, 40000)
                                                              for _ in range(8)], salt)
                hits += cached >= args.prefix_tokens - 16
                total += 1
                ttfts.append(ttft)
        out[mode] = {"hits": hits, "repeats": total, "ttft_mean_ms": 1000 * statistics.mean(ttfts),
                     "ttft_p50_ms": 1000 * statistics.median(ttfts)}
    return out


@dataclass(frozen=True)
class Answer:
    """One request of a burst: its HTTP status, the seconds from sending it to its status
    line, whether a 200 stream ran to `[DONE]`, its Retry-After, and what came back."""

    status: int
    seconds: float
    completed: bool
    retry_after: str | None
    text: str


async def burst(port: int, n: int, max_tokens: int, model: str = MODEL) -> list[Answer]:
    """`n` streamed completions sent at once to the router on `port`, each on its own
    connection opened before the burst: what is timed is the router's answer, not this
    process opening connections."""
    answers: list[Answer] = []

    async def one(i: int, go: asyncio.Event) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"model": model, "prompt": f"Request {i}: tell me a story",
                           "max_tokens": max_tokens, "stream": True,
                           "ignore_eos": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close"
                "\r\n\r\n").encode()
        await go.wait()
        started = time.monotonic()
        writer.write(head + body)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        elapsed = time.monotonic() - started
        text = (await reader.read()).decode(errors="replace")
        writer.close()
        retry = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                      if line.lower().startswith("retry-after:")), None)
        answers.append(Answer(status, elapsed, status == 200 and "data: [DONE]" in text,
                              retry, text))

    go = asyncio.Event()
    tasks = [asyncio.create_task(one(i, go)) for i in range(n)]
    await asyncio.sleep(1.0)  # every connection open
    go.set()
    await asyncio.gather(*tasks)
    return answers


async def overload(procs: Procs, args: argparse.Namespace) -> dict:
    engine, eproc = procs.engine("overload-engine", "--max-num-seqs", "4",
                                 "--max-queued-requests", "8")
    router, rproc = procs.router("overload-router", [engine], "--max-num-requests", "32")
    before = {"router": rss_mib(rproc.pid), "engine": rss_mib(eproc.pid)}
    results = await burst(int(router.rsplit(":", 1)[1]), args.streams, 32)
    after = {"router": rss_mib(rproc.pid), "engine": rss_mib(eproc.pid)}
    shed = [a.seconds for a in results if a.status == 429]
    ok = [a.completed for a in results if a.status == 200]
    # The router's own bound refuses on the headers; past it, the engines' queues refuse
    # what the router sent them (after tokenizing and one round trip).
    full = [a.seconds for a in results if a.status == 429 and "too_many_requests" in a.text]
    busy = [a.seconds for a in results if a.status == 429 and "engines_busy" in a.text]

    def ms(xs: list[float], f) -> float | None:
        return round(1000 * f(xs), 1) if xs else None

    return {"streams": args.streams, "accepted": len(ok), "completed": sum(ok),
            "shed_429": len(shed), "other": len(results) - len(shed) - len(ok),
            "time_to_429_p50_ms": ms(shed, statistics.median),
            "time_to_429_max_ms": ms(shed, max),
            "router_full": len(full), "router_full_p50_ms": ms(full, statistics.median),
            "router_full_max_ms": ms(full, max),
            "engines_full": len(busy), "engines_full_max_ms": ms(busy, max),
            "rss_mib_before": before, "rss_mib_after": after}


def fairness(procs: Procs, args: argparse.Namespace, *engine_flags: str) -> dict:
    from load_clients import ttft  # this folder's

    engine, _ = procs.engine("fairness-engine", "--max-num-seqs", "2", *engine_flags)
    router, _ = procs.router("fairness-router", [engine])

    def p90(tenant: str, n: int) -> float:
        samples = [ttft(router, f"{tenant} {i}: once upon a time", 8,
                        {"X-Tandem-Tenant": tenant}, MODEL) for i in range(n)]
        return 1000 * statistics.quantiles(samples, n=10)[-1]

    p90("light", 3)  # warm
    solo = p90("light", args.samples)
    load = subprocess.Popen([sys.executable, str(Path(__file__).with_name("load_clients.py")),
                             router, "--threads", "10", "--max-tokens", "64", "--model",
                             MODEL, "--header", "X-Tandem-Tenant=heavy"],
                            stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(2)  # saturated
        loaded = p90("light", args.samples)
        heavy = p90("heavy", 8)
    finally:
        load.terminate()
        out, _ = load.communicate(timeout=150)
    report = json.loads(out.strip().splitlines()[-1])
    return {"light_solo_p90_ms": solo, "light_loaded_p90_ms": loaded,
            "heavy_p90_ms": heavy, "ratio": loaded / solo, "heavy_done": report["done"],
            "heavy_errors": len(report["errors"])}


PARTS = ("shared", "overload", "fairness")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, default=8, metavar="N",
                        help="shared: distinct long prefixes (default %(default)s)")
    parser.add_argument("--prefix-tokens", type=int, default=384, metavar="N",
                        help="shared: tokens of each prefix (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, metavar="N",
                        help="shared: requests per prefix through the second router "
                        "(default %(default)s)")
    parser.add_argument("--streams", type=int, default=200, metavar="N",
                        help="overload: streamed requests sent at once (default %(default)s)")
    parser.add_argument("--samples", type=int, default=200, metavar="N",
                        help="fairness: the light tenant's requests per p90 "
                        "(default %(default)s)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {', '.join(sorted(set(parts) - set(PARTS)))}; "
                     f"choose from {', '.join(PARTS)}")
    model = pull(SMOLLM2_135M_INSTRUCT)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; model {model.name}")
    shared = shed = None
    fair: dict[str, dict] = {}
    runs = [(part, ()) for part in parts if part != "fairness"]
    if "fairness" in parts:  # the reference (no seat reservation), then the default
        runs += [("fairness", ("--seat-reserve-ms", "0")), ("fairness", ())]
    with tempfile.TemporaryDirectory() as tmp:
        for part, flags in runs:
            procs = Procs(model, Path(tmp))
            try:
                if part == "shared":
                    shared = shared_prefixes(procs, args)
                elif part == "overload":
                    shed = asyncio.run(overload(procs, args))
                else:
                    fair[" ".join(flags) or "default"] = fairness(procs, args, *flags)
            finally:
                procs.stop()
    if shared is not None:
        print_shared(shared)
    if shed is not None:
        print(f"\noverload: {shed['streams']} streams at once: {shed['accepted']} accepted, "
              f"{shed['completed']} completed, {shed['shed_429']} got 429 (p50 "
              f"{shed['time_to_429_p50_ms']:.1f} ms, max {shed['time_to_429_max_ms']:.1f} "
              f"ms), {shed['other']} other. The router's bound: {shed['router_full']} "
              f"refused on their headers, p50 {shed['router_full_p50_ms']} ms, max "
              f"{shed['router_full_max_ms']} ms (goal <= 100 ms); the engines' queues: "
              f"{shed['engines_full']}, max {shed['engines_full_max_ms']} ms. RSS MiB before "
              f"{shed['rss_mib_before']}, after {shed['rss_mib_after']}")
    if fair:
        print("\nfairness: the light tenant's TTFT p90 alone and beside a tenant with 10 "
              "streams in flight (goal: at most 1.5x)")
        print("| engine | light alone p90 | light beside heavy p90 | ratio | heavy p90 | "
              "heavy done | heavy errors |")
        print("|---|---|---|---|---|---|---|")
        for name, f in fair.items():
            print(f"| {name} | {f['light_solo_p90_ms']:.0f} ms | "
                  f"{f['light_loaded_p90_ms']:.0f} ms | {f['ratio']:.2f}x | "
                  f"{f['heavy_p90_ms']:.0f} ms | {f['heavy_done']} | {f['heavy_errors']} |")
    return 0


def print_shared(shared: dict[str, dict]) -> None:
    print("\n| routing | repeats on the prefix's engine | TTFT mean | TTFT p50 |")
    print("|---|---|---|---|")
    for mode, r in shared.items():
        print(f"| {mode} | {r['hits']}/{r['repeats']} | {r['ttft_mean_ms']:.1f} ms | "
              f"{r['ttft_p50_ms']:.1f} ms |")
    e, a = shared["exact"], shared["approximate"]
    print(f"\nexact / approximate: hit rate {e['hits'] / max(1, a['hits']):.2f}x, "
          f"TTFT mean {e['ttft_mean_ms'] / a['ttft_mean_ms']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
