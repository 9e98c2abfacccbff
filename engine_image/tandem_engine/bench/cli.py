"""`tandem bench`: its flags and the command, from flags to a printed (and saved) report.

Every input is checked before the first request, so a bad flag costs nothing: errors
raise ValueError/RuntimeError subclasses whose message names the flag, the limit and the
fix (`tandem` prints them on one line and exits 2).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path

from tandem_engine.bench import runner
from tandem_engine.bench.arrivals import ArrivalError, Arrivals
from tandem_engine.bench.client import BenchClient, EndpointError, resolve_api_key
from tandem_engine.bench.metrics import parse_slo
from tandem_engine.bench.progress import Progress
from tandem_engine.bench.report import (
    build_report,
    command_line,
    console_table,
    run_entry,
    write_json,
)
from tandem_engine.bench.sweep import parse_sweep, sweep_points
from tandem_engine.bench.workloads import (
    DISTRIBUTIONS,
    WORKLOADS,
    BenchRequest,
    LengthSpec,
    TextSource,
    WorkloadError,
    assign_models,
    load_trace,
    model_names,
    random_workload,
    save_trace,
    shared_prefix_workload,
    sharegpt_workload,
)

DEFAULT_CONCURRENCY = 4
MAX_REQUESTS = 1_000_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True,
                   help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    p.add_argument("--model", required=True, help="the served model name to ask for")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY'; default: $TANDEM_API_KEY, "
                   "else $OPENAI_API_KEY, else none")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="random: lengths drawn per --length-dist; fixed: every request "
                   "--input-len/--output-len; shared-prefix: --prefix-groups system prompts "
                   "shared by the requests; sharegpt: --dataset; trace: --trace")
    w.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int,
                   default=64, metavar="N",
                   help="requests measured (a trace or sweep point sends this many too); "
                   "--num-prompts is vLLM's name for it")
    w.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens (mean); shared-prefix: each unique suffix")
    w.add_argument("--input-spread", type=int, default=64,
                   help="random: prompt length spread (uniform: +-, normal: stddev)")
    w.add_argument("--output-len", type=int, default=64,
                   help="max_tokens (mean); with --ignore-eos the exact output length")
    w.add_argument("--output-spread", type=int, default=32, help="random: output spread")
    w.add_argument("--length-dist", choices=DISTRIBUTIONS, default="uniform",
                   help="random: how lengths are drawn around their mean")
    w.add_argument("--prefix-groups", type=int, default=4,
                   help="shared-prefix: distinct system prompts (request i uses i %% groups)")
    w.add_argument("--prefix-len", type=int, default=256,
                   help="shared-prefix: tokens of each system prompt")
    w.add_argument("--dataset", type=Path, default=None,
                   help="sharegpt: a ShareGPT-format JSON file")
    w.add_argument("--trace", type=Path, default=None,
                   help="trace: a file written by --save-trace (replays prompts, lengths "
                   "and, without an arrival flag, arrival times)")
    w.add_argument("--save-trace", type=Path, default=None, metavar="FILE",
                   help="write what the (first) run sent, and when, as a replayable trace")
    w.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="vLLM's: each request asks for one of these served names (LoRA "
                   "adapters) at random, drawn by --seed; NAME NAME or NAME,NAME. Name "
                   "--model among them to mix in the base model, a name twice to send it "
                   "twice as often. The report breaks results down per name")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals")
    a = p.add_argument_group("arrivals (one of; default: a closed loop of "
                             f"{DEFAULT_CONCURRENCY}, or a trace's own times)")
    which = a.add_mutually_exclusive_group()
    which.add_argument("--rate", "--request-rate", dest="rate", type=float, default=None,
                       metavar="R",
                       help="open loop: Poisson arrivals at R requests/s; inf: every "
                       "request at once, as --burst (--request-rate is vLLM's name for it)")
    which.add_argument("--concurrency", type=int, default=None,
                       help="closed loop: keep this many requests in flight")
    which.add_argument("--burst", action="store_true",
                       help="open loop: send every request at once")
    a.add_argument("--max-concurrency", type=int, default=None,
                   help="with --rate/--burst/a trace: at most this many in flight")
    a.add_argument("--sweep", default=None, metavar="PARAM=V1,V2,...",
                   help="one run per value: rate=1,2,4 or concurrency=1,4,16")
    r = p.add_argument_group("requests")
    r.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly max_tokens (vLLM's ignore_eos; Tandem and vLLM "
                   "take it, other servers may not)")
    r.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    r.add_argument("--warmup", type=int, default=2,
                   help="unmeasured requests sent first (short outputs)")
    r.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take before it counts as failed")
    r.add_argument("--connect-deadline", type=float, default=30.0,
                   help="seconds to wait for the server to answer /v1/models at the start")
    r.add_argument("--version-poll", type=float, default=1.0,
                   help="seconds between polls of a Tandem router's serving weights "
                   "version (0: off)")
    o = p.add_argument_group("report")
    o.add_argument("--slo", default=None, metavar="KEY=VALUE,...",
                   help="goodput's SLOs: ttft, itl (a request's p99 gap), tpot, e2e; units "
                   "us/ms/s (default ms), e.g. ttft=500ms,itl=50ms,e2e=10s")
    o.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="write the report as JSON (schema: docs/bench.md)")
    o.add_argument("--plot", type=Path, default=None, metavar="DIR",
                   help="write PNG figures into DIR (needs the bench extra: matplotlib)")
    o.add_argument("--html", type=Path, default=None, metavar="FILE",
                   help="write one self-contained HTML page: tables and figures")
    o.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def _arrivals(args: argparse.Namespace) -> Arrivals:
    if args.rate is not None and args.rate != math.inf:
        return Arrivals("poisson", rate=args.rate, max_concurrency=args.max_concurrency)
    if args.burst or args.rate == math.inf:  # vLLM's --request-rate inf
        return Arrivals("burst", max_concurrency=args.max_concurrency)
    if args.concurrency is not None:
        if args.max_concurrency is not None:
            raise ArrivalError("--max-concurrency caps --rate, --burst or a trace; with "
                               "--concurrency drop it")
        return Arrivals("closed", concurrency=args.concurrency)
    if args.workload == "trace":
        return Arrivals("trace", max_concurrency=args.max_concurrency)
    return Arrivals("closed", concurrency=DEFAULT_CONCURRENCY)


def _check(args: argparse.Namespace) -> None:
    if not 1 <= args.num_requests <= MAX_REQUESTS:
        raise WorkloadError(f"--num-requests must be in [1, {MAX_REQUESTS}] "
                            f"(got {args.num_requests})")
    for flag in ("input_len", "output_len", "prefix_len", "prefix_groups"):
        if getattr(args, flag) < 1:
            raise WorkloadError(f"--{flag.replace('_', '-')} must be >= 1 "
                                f"(got {getattr(args, flag)})")
    for flag in ("input_spread", "output_spread", "warmup"):
        if getattr(args, flag) < 0:
            raise WorkloadError(f"--{flag.replace('_', '-')} must be >= 0")
    for flag in ("request_timeout", "connect_deadline"):
        if getattr(args, flag) <= 0:
            raise WorkloadError(f"--{flag.replace('_', '-')} must be > 0 seconds")
    if (args.workload == "trace") != (args.trace is not None):
        raise WorkloadError("--workload trace and --trace FILE go together: pass both "
                            "(or neither)")
    if (args.workload == "sharegpt") != (args.dataset is not None):
        raise WorkloadError("--workload sharegpt and --dataset FILE go together: pass both "
                            "(or neither)")
    if args.trace is not None and not args.trace.is_file():
        raise WorkloadError(f"--trace {args.trace}: no such file")
    if args.dataset is not None and not args.dataset.is_file():
        raise WorkloadError(f"--dataset {args.dataset}: no such file")
    if args.lora_modules is not None:
        model_names(args.lora_modules)  # raises naming the flag
    if (args.plot or args.html) and not _has("matplotlib"):
        raise RuntimeError("--plot/--html need matplotlib: pip install 'tandem[bench]'")


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def build_workload(args: argparse.Namespace, tokens_per_word: float, variant: int = 0
                   ) -> list[BenchRequest]:
    """The requests of one run; `variant` (a sweep point's index; -1: the warm-up) draws
    other words at the same lengths. A dataset or trace is the same every time. With
    `--lora-modules` each request gets its model, the same for an index every time."""
    requests = _requests(args, tokens_per_word, variant)
    if args.lora_modules:
        return assign_models(requests, model_names(args.lora_modules), args.seed)
    return requests


def _requests(args: argparse.Namespace, tokens_per_word: float, variant: int
              ) -> list[BenchRequest]:
    source = TextSource(tokens_per_word)
    dist = "fixed" if args.workload == "fixed" else args.length_dist
    inp = LengthSpec(args.input_len, args.input_spread, dist)
    out = LengthSpec(args.output_len, args.output_spread, dist)
    n = args.num_requests
    if args.workload in ("random", "fixed"):
        return random_workload(n, source, inp, out, args.seed, variant)
    if args.workload == "shared-prefix":
        return shared_prefix_workload(n, source, args.prefix_groups, args.prefix_len, inp,
                                      out, args.seed, variant)
    if args.workload == "sharegpt":
        return sharegpt_workload(args.dataset, n, None, args.seed, tokens_per_word)
    trace = load_trace(args.trace)
    return trace[:n]


def _config(args: argparse.Namespace, arrivals: Arrivals, slo: dict) -> dict:
    workload = {"kind": args.workload, "input_len": args.input_len,
                "input_spread": args.input_spread, "output_len": args.output_len,
                "output_spread": args.output_spread, "length_dist": args.length_dist}
    if args.workload == "shared-prefix":
        workload.update(prefix_groups=args.prefix_groups, prefix_len=args.prefix_len)
    if args.dataset:
        workload["dataset"] = str(args.dataset)
    if args.trace:
        workload["trace"] = str(args.trace)
    if args.lora_modules:
        workload["lora_modules"] = model_names(args.lora_modules)
    return {"workload": workload, "arrivals": arrivals.to_json(),
            "num_requests": args.num_requests, "seed": args.seed, "slo_ms": slo,
            "warmup": args.warmup, "ignore_eos": args.ignore_eos,
            "temperature": args.temperature}


async def _bench(args: argparse.Namespace, progress: Progress) -> dict:
    arrivals = _arrivals(args)
    slo = parse_slo(args.slo)
    sweep = parse_sweep(args.sweep) if args.sweep else None
    if sweep and sweep[0] == "rate" and args.rate is not None:
        raise ArrivalError("--sweep rate=... sets the rate of each run: drop --rate")
    if sweep and sweep[0] == "concurrency" and args.concurrency is not None:
        raise ArrivalError("--sweep concurrency=... sets each run's concurrency: drop "
                           "--concurrency")
    points = sweep_points(*sweep, arrivals) if sweep else [(None, arrivals)]
    client = BenchClient(args.base_url, args.model, api_key=resolve_api_key(args.api_key),
                         request_timeout_s=args.request_timeout, ignore_eos=args.ignore_eos,
                         temperature=args.temperature)
    try:
        progress.phase(f"waiting for {client.base_url} (up to {args.connect_deadline:g} s)")
        await client.probe(args.connect_deadline,
                           model_names(args.lora_modules) if args.lora_modules else ())
        version = await client.get_json("/version")
        measured = await client.tokens_per_word(TextSource.sample_text())
        if args.warmup:
            progress.phase(f"warming up: {args.warmup} request(s)")
            await runner.warm_up(client, build_workload(args, measured or 1.0, -1),
                                 args.warmup)
        runs = []
        for k, (point, point_arrivals) in enumerate(points):
            requests = build_workload(args, measured or 1.0, k)
            progress.phase(f"running {len(requests)} {args.workload} requests, "
                           f"{point_arrivals.describe()}")
            result = await runner.run(client, requests, point_arrivals, seed=args.seed,
                                      progress=progress, version_poll_s=args.version_poll)
            progress.phase(f"done in {result.duration_s:.1f} s, "
                           f"{sum(r.ok for r in result.records)}/{len(requests)} ok")
            if args.save_trace and not runs:
                save_trace(args.save_trace, requests, [r.sent_s for r in result.records])
            runs.append(run_entry(result, point_arrivals, slo, point,
                                  by_model=any(r.model is not None for r in requests)))
    finally:
        await client.aclose()
    server = {"base_url": client.base_url, "model": args.model, "version": version,
              "tokens_per_word": measured or 1.0,
              "tokens_per_word_source": "tokenize" if measured else "assumed"}
    return build_report(command=command_line(), server=server,
                        config=_config(args, arrivals, slo),
                        sweep={"parameter": sweep[0], "values": sweep[1]} if sweep else None,
                        runs=runs)


def bench(args: argparse.Namespace) -> int:
    """`tandem bench`: run, print the summary, write what was asked for."""
    _check(args)
    progress = Progress(quiet=args.quiet)
    if progress.tty and not args.quiet and not _has("tqdm"):
        progress.tty = False  # plain lines instead of a bar
        progress.phase("no progress bar: pip install 'tandem[bench]' for one")
    report = asyncio.run(_bench(args, progress))
    print(console_table(report), flush=True)
    if args.json:
        write_json(report, args.json)
        progress.phase(f"wrote {args.json}")
    figures = None
    if args.plot:
        from tandem_engine.bench.plots import write_plots

        figures = write_plots(report, args.plot)
        progress.phase(f"wrote {len(figures)} figure(s) into {args.plot}")
    if args.html:
        from tandem_engine.bench.html import write_html

        write_html(report, args.html, figures)
        progress.phase(f"wrote {args.html}")
    failed = sum(run["summary"]["requests"]["failed"] for run in report["runs"])
    return 1 if failed and failed == sum(run["summary"]["requests"]["sent"]
                                         for run in report["runs"]) else 0


__all__ = ["EndpointError", "add_arguments", "bench"]
