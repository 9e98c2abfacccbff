"""Offline throughput: Tandem against HF transformers on one checkpoint and one workload.

What it measures, in one process and one run, for each system in `--systems`:

* **tandem** — `tandem_engine.LLM.generate` (paged KV cache, continuous batching);
* **hf-static** — `model.generate` on static batches of `--hf-batch-size` requests in arrival
  (FCFS) order, left padded, greedy, run to the longest requested output of the batch;
* **hf-cb** — transformers' own continuous batching (`ContinuousBatchingManager`), one
  `add_request` per request with that request's own `max_new_tokens`.

Every system gets the same seeded workload: random prompts drawn from the tokenizer's
non-special vocabulary, prompt lengths uniform in [min, max] prompt, output lengths uniform in
[min, max] output, greedy decoding with EOS disabled. Throughput counts only the tokens each
request asked for, divided by the wall time of the whole workload; model loading, KV cache
allocation and one tiny warm-up request per system are outside the timed region. The paged
systems get the same KV budget, concurrency limit and per-step token budget.

It prints tokens/s per system, the ratios tandem/hf-static (goal >= 3x) and tandem/hf-cb
(goal >= 1.5x), the share of Tandem's step time spent outside forward + sample at steps with
>= 32 running requests (goal <= 15%), and how many requests' greedy tokens agree with
hf-static (informational: near-flat logits of random weights can flip a few).

Run it alone on the machine (it is CPU bound and uses `--threads` cores):

    tandem demo-model .demo-small --size small
    .venv/bin/python benchmarks/offline_throughput.py --model .demo-small --json bench.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SYSTEMS = ("tandem", "hf-static", "hf-cb")
REFERENCE_SYSTEM = "hf-static"  # greedy agreement is measured against this one
GOALS = {"hf-static": 3.0, "hf-cb": 1.5}  # tandem tokens/s must be at least this multiple
OVERHEAD_GOAL = 0.15  # scheduler + bookkeeping share of step time ...
OVERHEAD_AT_RUNNING = 32  # ... at steps with at least this many running requests
KV_BLOCK_TOKENS = 16  # Tandem's default block_size; HF's page_size is set to match
KV_HEADROOM = 1.25  # KV budget = headroom x (max_num_seqs longest possible sequences)
WARMUP_PROMPT_TOKENS = 8
WARMUP_OUTPUT_TOKENS = 4
FP32_BYTES = 4


@dataclass(frozen=True)
class Checkpoint:
    """What the benchmark needs to know about the model folder, read without loading weights."""

    path: Path
    vocab_size: int  # min(config.json vocab, tokenizer.json vocab incl. added tokens)
    special_ids: frozenset[int]
    pad_id: int
    max_positions: int
    kv_bytes_per_token: int  # fp32 K and V of every layer
    summary: str


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def requested_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class KVBudget:
    """One KV budget for both paged systems, large enough that neither has to preempt."""

    tokens: int
    blocks: int
    bytes: int


@dataclass
class SystemResult:
    name: str
    wall_s: float
    tokens: list[list[int]]  # each request's generated tokens, cut to its requested length
    useful_tokens: int
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    overhead: dict[str, OverheadShare | None] = field(default_factory=dict)  # tandem only

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class OverheadShare:
    """Where Tandem's step time went, summed over a set of engine steps."""

    steps: int
    total_s: float
    forward_s: float
    sample_s: float
    schedule_s: float
    prepare_s: float
    postprocess_s: float

    @property
    def share(self) -> float:
        outside = self.total_s - self.forward_s - self.sample_s
        return outside / self.total_s if self.total_s > 0 else 0.0


# --------------------------------------------------------------------------- checkpoint, workload


def read_checkpoint(model_dir: Path) -> Checkpoint:
    from tokenizers import Tokenizer

    config_file, tokenizer_file = model_dir / "config.json", model_dir / "tokenizer.json"
    for file in (config_file, tokenizer_file):
        if not file.is_file():
            sys.exit(f"error: {file} is missing; --model must be a HF checkpoint folder "
                     "(config.json, *.safetensors, tokenizer.json)")
    raw = json.loads(config_file.read_text())
    if "vocab_size" not in raw:  # multimodal configs nest the language model's fields
        raw = raw.get("text_config", raw)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    vocab = min(int(raw["vocab_size"]), tokenizer.get_vocab_size(with_added_tokens=True))
    special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = raw.get(key)
        special.update(value if isinstance(value, list) else [] if value is None else [value])
    heads = int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
    layers = int(raw["num_hidden_layers"])
    pad = raw.get("pad_token_id")
    summary = (f"{raw.get('architectures', ['?'])[0]}: {layers} layers, hidden "
               f"{raw['hidden_size']}, heads {heads}/{kv_heads}, vocab {raw['vocab_size']}")
    return Checkpoint(
        path=model_dir,
        vocab_size=vocab,
        special_ids=frozenset(special),
        pad_id=pad if isinstance(pad, int) else 0,
        max_positions=int(raw.get("max_position_embeddings", 2**31)),
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * FP32_BYTES,
        summary=summary,
    )


def build_workload(ckpt: Checkpoint, args: argparse.Namespace) -> Workload:
    """Seeded prompts of random non-special token ids and per-request output lengths."""
    allowed = [i for i in range(ckpt.vocab_size) if i not in ckpt.special_ids]
    if not allowed:
        sys.exit(f"error: {ckpt.path}/tokenizer.json has no non-special tokens to draw from")
    rng = random.Random(args.seed)
    prompts, output_lens = [], []
    for _ in range(args.num_requests):
        prompt_len = rng.randint(args.min_prompt, args.max_prompt)
        output_lens.append(rng.randint(args.min_output, args.max_output))
        prompts.append(rng.choices(allowed, k=prompt_len))
    return Workload(prompts=prompts, output_lens=output_lens)


def warmup_workload(workload: Workload) -> Workload:
    """One tiny request, excluded from timing: first-call allocations and kernel selection."""
    return Workload(prompts=[workload.prompts[0][:WARMUP_PROMPT_TOKENS]],
                    output_lens=[WARMUP_OUTPUT_TOKENS])


def kv_budget(ckpt: Checkpoint, args: argparse.Namespace) -> KVBudget:
    longest = args.max_prompt + args.max_output
    blocks = math.ceil(KV_HEADROOM * args.max_num_seqs * longest / KV_BLOCK_TOKENS)
    tokens = blocks * KV_BLOCK_TOKENS
    return KVBudget(tokens=tokens, blocks=blocks, bytes=tokens * ckpt.kv_bytes_per_token)


def cut_to_request(tokens: Sequence[int], requested: int) -> list[int]:
    return [int(t) for t in tokens[:requested]]


def useful_token_count(tokens: list[list[int]], workload: Workload) -> int:
    return sum(min(len(t), n) for t, n in zip(tokens, workload.output_lens, strict=True))


def short_outputs(tokens: list[list[int]], workload: Workload) -> list[int]:
    pairs = zip(tokens, workload.output_lens, strict=True)
    return [i for i, (t, n) in enumerate(pairs) if len(t) < n]


# --------------------------------------------------------------------------- tandem


def run_tandem(ckpt: Checkpoint, workload: Workload, budget: KVBudget,
               args: argparse.Namespace) -> SystemResult:
    import torch
    from tandem_engine import LLM

    llm = LLM(model=str(ckpt.path), max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=None,
              kv_cache_memory_bytes=budget.bytes, dtype="float32")
    torch.set_num_threads(args.threads)

    tandem_generate(llm, warmup_workload(workload))
    first_step = len(llm.engine.step_timings)
    start = time.perf_counter()
    tokens = tandem_generate(llm, workload)
    wall = time.perf_counter() - start
    timings = list(llm.engine.step_timings[first_step:])

    result = SystemResult("tandem", wall, tokens, useful_token_count(tokens, workload))
    result.notes.append(f"LLM.generate, all requests at once; max_num_seqs {args.max_num_seqs}, "
                        f"max_num_batched_tokens {args.max_num_batched_tokens}, "
                        f"kv_cache_memory_bytes {budget.bytes} ({budget.blocks} blocks of "
                        f"{KV_BLOCK_TOKENS})")
    result.extra["steps"] = len(timings)
    result.extra["max_running"] = max((t.num_running for t in timings), default=0)
    result.overhead["at_goal_running"] = overhead_share(timings, OVERHEAD_AT_RUNNING)
    result.overhead["all_steps"] = overhead_share(timings, 0)
    if (overall := result.overhead["all_steps"]) is not None:
        # Time outside engine.step (request intake, the generate loop) is in no StepTiming.
        result.notes.append(f"engine steps account for {overall.total_s / wall:.1%} of wall time")
    return result


def tandem_generate(llm: Any, w: Workload) -> list[list[int]]:
    from tandem_engine import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in w.output_lens]
    outs = llm.generate(w.prompts, params)
    return [cut_to_request(o.outputs[0].token_ids, n)
            for o, n in zip(outs, w.output_lens, strict=True)]


def overhead_share(timings: Sequence[Any], min_running: int) -> OverheadShare | None:
    """Sum the StepTimings with at least `min_running` running requests (None: no such step)."""
    steps = [t for t in timings if t.num_running >= min_running]
    if not steps:
        return None
    parts = {name: sum(getattr(t, name) for t in steps)
             for name in ("schedule_s", "prepare_s", "forward_s", "sample_s", "postprocess_s")}
    return OverheadShare(steps=len(steps), total_s=sum(parts.values()), **parts)


# --------------------------------------------------------------------------- HF transformers


def load_hf_model(ckpt: Checkpoint, threads: int) -> Any:
    """A fresh fp32 model per system, so one system's settings never leak into the next."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(ckpt.path), dtype=torch.float32).eval()
    # generate(eos_token_id=None) does not disable EOS; clearing the model's default does.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = ckpt.pad_id
    model.generation_config.do_sample = False
    torch.set_num_threads(threads)
    return model


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Any, Any]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def hf_static_generate(model: Any, ckpt: Checkpoint, w: Workload,
                       batch_size: int) -> tuple[list[list[int]], int]:
    """FCFS static batches; returns each request's tokens and the number of tokens decoded."""
    import torch

    tokens: list[list[int]] = []
    decoded = 0
    for start in range(0, len(w.prompts), batch_size):
        prompts = w.prompts[start:start + batch_size]
        wanted = w.output_lens[start:start + batch_size]
        ids, mask = left_pad(prompts, ckpt.pad_id)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(wanted),
                                 do_sample=False, pad_token_id=ckpt.pad_id)
        generated = out[:, ids.shape[1]:].tolist()
        decoded += len(prompts) * max(wanted)
        tokens.extend(cut_to_request(g, n) for g, n in zip(generated, wanted, strict=True))
    return tokens, decoded


def run_hf_static(ckpt: Checkpoint, workload: Workload, budget: KVBudget,
                  args: argparse.Namespace) -> SystemResult:
    model = load_hf_model(ckpt, args.threads)
    hf_static_generate(model, ckpt, warmup_workload(workload), args.hf_batch_size)
    start = time.perf_counter()
    tokens, decoded = hf_static_generate(model, ckpt, workload, args.hf_batch_size)
    wall = time.perf_counter() - start
    del model

    useful = useful_token_count(tokens, workload)
    result = SystemResult("hf-static", wall, tokens, useful)
    result.notes.append(f"batches of {args.hf_batch_size} in FCFS order (not sorted by length), "
                        "left padded, each batch runs to its longest requested output")
    result.notes.append(f"only requested tokens count: {useful} of {decoded} decoded "
                        f"({useful / decoded:.0%})")
    result.extra["decoded_tokens"] = decoded
    return result


def hf_cb_config(budget: KVBudget, args: argparse.Namespace) -> Any:
    from transformers import ContinuousBatchingConfig

    # Every size is explicit: left unset, HF sizes the cache to 60% of RAM on CPU.
    return ContinuousBatchingConfig(
        page_size=KV_BLOCK_TOKENS,
        num_blocks=budget.blocks,
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
        scheduler_type="fifo",
    )


def hf_cb_generate(manager: Any, w: Workload, tag: str) -> list[list[int]]:
    """Submit every request with its own max_new_tokens, then collect them all."""
    ids = [f"{tag}-{i}" for i in range(len(w.prompts))]
    for request_id, prompt, wanted in zip(ids, w.prompts, w.output_lens, strict=True):
        # eos_token_id=-1 is HF's "no EOS": every request runs to its own max_new_tokens.
        manager.add_request(input_ids=prompt, request_id=request_id, max_new_tokens=wanted,
                            eos_token_id=-1)
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"hf-cb: generation thread stopped with "
                                   f"{len(ids) - len(done)} requests unfinished")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"hf-cb: request {result.request_id} failed: {result.error}")
            done[result.request_id] = list(result.generated_tokens)
    return [cut_to_request(done[i], n) for i, n in zip(ids, w.output_lens, strict=True)]


def run_hf_cb(ckpt: Checkpoint, workload: Workload, budget: KVBudget,
              args: argparse.Namespace) -> SystemResult:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = load_hf_model(ckpt, args.threads)
    config = hf_cb_config(budget, args)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in workload.prompts),
                          max_generated_length=max(workload.output_lens),
                          num_requests=len(workload.prompts))
    with model.continuous_batching_context_manager(
        generation_config=model.generation_config, continuous_batching_config=config,
        workload_hints=hints, block=True, timeout=30,
    ) as manager:
        hf_cb_generate(manager, warmup_workload(workload), "warmup")
        start = time.perf_counter()
        tokens = hf_cb_generate(manager, workload, "req")
        wall = time.perf_counter() - start
    del manager, model

    result = SystemResult("hf-cb", wall, tokens, useful_token_count(tokens, workload))
    result.notes.append(f"ContinuousBatchingManager.add_request with per-request max_new_tokens; "
                        f"page_size {config.page_size}, num_blocks {config.num_blocks}, "
                        f"max_batch_tokens {config.max_batch_tokens}, max_requests_per_batch "
                        f"{config.max_requests_per_batch}")
    result.extra["cb_config"] = {k: config.__dict__.get(k) for k in (
        "page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch",
        "allow_block_sharing", "scheduler_type")}
    return result


# --------------------------------------------------------------------------- report

RUNNERS: dict[str, Callable[[Checkpoint, Workload, KVBudget, argparse.Namespace], SystemResult]]
RUNNERS = {"tandem": run_tandem, "hf-static": run_hf_static, "hf-cb": run_hf_cb}


def agreement(results: dict[str, SystemResult]) -> dict[str, dict[str, Any]]:
    """Per system: how many requests' greedy tokens equal the reference system's exactly."""
    ref = results.get(REFERENCE_SYSTEM)
    if ref is None:
        return {}
    out = {}
    for name, res in results.items():
        if name == REFERENCE_SYSTEM:
            continue
        differ = [i for i, (a, b) in enumerate(zip(res.tokens, ref.tokens, strict=True)) if a != b]
        out[name] = {"equal": len(ref.tokens) - len(differ), "of": len(ref.tokens),
                     "differing_requests": differ}
    return out


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def format_report(results: dict[str, SystemResult], workload: Workload,
                  agree: dict[str, dict[str, Any]]) -> list[str]:
    lines = [f"{'system':<10} {'requests':>8} {'tokens':>8} {'wall s':>9} {'tokens/s':>10}"]
    for res in results.values():
        lines.append(f"{res.name:<10} {len(res.tokens):>8} {res.useful_tokens:>8} "
                     f"{res.wall_s:>9.2f} {res.tokens_per_s:>10.1f}")
    lines.append("")
    for res in results.values():
        lines.extend(f"  {res.name}: {note}" for note in res.notes)
        if short := short_outputs(res.tokens, workload):
            lines.append(f"  {res.name}: WARNING {len(short)} requests got fewer tokens than "
                         f"requested: {short[:10]}")
    lines.append("")
    tandem = results.get("tandem")
    for other, goal in GOALS.items():
        if tandem is not None and other in results and results[other].tokens_per_s > 0:
            ratio = tandem.tokens_per_s / results[other].tokens_per_s
            lines.append(f"tandem / {other:<9}: {ratio:5.2f}x   goal >= {goal:.1f}x   "
                         f"{verdict(ratio >= goal)}")
    if tandem is not None:
        lines.extend(format_overhead(tandem))
    for name, a in agree.items():
        lines.append(f"greedy agreement {name} vs {REFERENCE_SYSTEM}: {a['equal']}/{a['of']} "
                     "requests token-identical (informational)")
    return lines


def format_overhead(tandem: SystemResult) -> list[str]:
    at_goal, overall = tandem.overhead["at_goal_running"], tandem.overhead["all_steps"]
    label = f"tandem scheduler + bookkeeping share of step time at >= {OVERHEAD_AT_RUNNING} running"
    if at_goal is None:
        lines = [f"{label}: n/a (max running was {tandem.extra['max_running']})   "
                 f"goal <= {OVERHEAD_GOAL:.0%}   MISS (not measured)"]
    else:
        ms_per_step = 1000 * at_goal.total_s / at_goal.steps
        lines = [f"{label}: {at_goal.share:.1%} over {at_goal.steps} steps "
                 f"({ms_per_step:.1f} ms/step)   goal <= {OVERHEAD_GOAL:.0%}"
                 f"   {verdict(at_goal.share <= OVERHEAD_GOAL)}"]
    if overall is not None:
        parts = ", ".join(f"{name} {1000 * getattr(overall, f'{name}_s'):.1f} ms" for name in (
            "schedule", "prepare", "postprocess", "forward", "sample"))
        lines.append(f"  all {overall.steps} steps: {overall.share:.1%} outside forward + sample "
                     f"({parts})")
    return lines


def environment(args: argparse.Namespace) -> dict[str, str]:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": str(args.threads),
            "cpus": str(os.cpu_count()), "machine": platform.machine()}


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path, help="HF checkpoint folder")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--json", type=Path, help="write all results to this file")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems:
        p.error(f"--systems {','.join(args.systems)!r}: choose from {','.join(SYSTEMS)}")
    for name in ("num_requests", "min_prompt", "min_output", "threads", "hf_batch_size",
                 "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.min_prompt > args.max_prompt or args.min_output > args.max_output:
        p.error("--min-prompt/--min-output must not exceed --max-prompt/--max-output")
    if "tandem" in args.systems:
        try:
            from tandem_engine import LLM  # noqa: F401  (fail before any system runs)
        except ImportError as exc:
            p.error(f"--systems includes tandem, but tandem_engine.LLM does not import ({exc}); "
                    "install the engine (make venv) or leave tandem out of --systems")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    ckpt = read_checkpoint(args.model)
    if args.max_prompt + args.max_output > ckpt.max_positions:
        sys.exit(f"error: --max-prompt + --max-output = {args.max_prompt + args.max_output} "
                 f"exceeds the model's max_position_embeddings ({ckpt.max_positions})")
    workload = build_workload(ckpt, args)
    budget = kv_budget(ckpt, args)

    print("command:", shlex.join(sys.orig_argv))
    print("model:", ckpt.path, "-", ckpt.summary)
    print(f"workload: {len(workload.prompts)} requests, seed {args.seed}, prompts "
          f"{args.min_prompt}-{args.max_prompt} tokens ({sum(map(len, workload.prompts))} total), "
          f"outputs {args.min_output}-{args.max_output} ({workload.requested_tokens} total), "
          "greedy, EOS ignored, FCFS order")
    print(f"paged KV budget (tandem and hf-cb): {budget.tokens} tokens = {budget.blocks} blocks "
          f"of {KV_BLOCK_TOKENS} = {budget.bytes / 2**20:.1f} MiB fp32")
    env = environment(args)
    print("env:", ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)

    results: dict[str, SystemResult] = {}
    for name in args.systems:
        print(f"running {name} ...", flush=True)
        results[name] = RUNNERS[name](ckpt, workload, budget, args)
        gc.collect()
        print(f"  {name}: {results[name].tokens_per_s:.1f} tokens/s", flush=True)

    agree = agreement(results)
    print()
    print("\n".join(format_report(results, workload, agree)))
    if args.json:
        dump_json(args, env, workload, budget, results, agree)
    return 0


def overhead_json(result: SystemResult) -> dict[str, Any]:
    return {f"overhead_{label}": None if s is None else {**asdict(s), "share": s.share}
            for label, s in result.overhead.items()}


def dump_json(args: argparse.Namespace, env: dict[str, str], workload: Workload,
              budget: KVBudget, results: dict[str, SystemResult],
              agree: dict[str, dict[str, Any]]) -> None:
    tandem = results.get("tandem")
    ratios = {f"tandem/{o}": tandem.tokens_per_s / results[o].tokens_per_s
              for o in GOALS if tandem and o in results and results[o].tokens_per_s > 0}
    doc = {
        "command": shlex.join(sys.orig_argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": env,
        "workload": {"prompt_lens": [len(p) for p in workload.prompts],
                     "output_lens": workload.output_lens},
        "kv_budget": asdict(budget),
        "systems": {name: {"wall_s": r.wall_s, "useful_tokens": r.useful_tokens,
                           "tokens_per_s": r.tokens_per_s, "notes": r.notes, **r.extra,
                           **overhead_json(r)}
                    for name, r in results.items()},
        "ratios": ratios,
        "goals": {**{f"tandem/{o}": g for o, g in GOALS.items()},
                  "overhead_share_max": OVERHEAD_GOAL, "overhead_at_running": OVERHEAD_AT_RUNNING},
        "agreement_vs_" + REFERENCE_SYSTEM: agree,
    }
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nresults written to {args.json}")


if __name__ == "__main__":
    raise SystemExit(main())
