"""The GPU check: one run on a machine with one NVIDIA GPU, one table at the end.

GPU time is short, so every check Tandem needs on a GPU runs from this one script
(`make gpu-check`, which `scripts/gpu-check.sh` drives after installing the wheel bundle):

* environment: torch, CUDA, the GPU, and which of Tandem's dependencies import;
* greedy-float32 / greedy-bfloat16: the engine against transformers on the same device
  and dtype, tokens equal up to the first step whose reference top-two logit gap is below
  the near-tie threshold (tests/reference.py's rule; bf16 noise needs a wider one);
* throughput-small / throughput-1b: offline throughput, `LLM.generate` against HF
  `generate` in static batches, on the small demo model and a ~1B one made on the spot;
* handoff: prefill and decode engine processes on the one device, the decode engine
  pulling the prompt's KV over NIXL (GB/s against a device-to-device copy in the same
  run), and its tokens against one colocated engine's;
* lifecycle: suspend (persist/offload/recompute) and resume, and refit, timed;
* quantized-int8 / quantized-int4: the weight-only kernels against the dequantized
  weights' float32 product, and the demo model quantized at load against its dense
  engine (weights' bytes, batch-1 decode step time).

Each step runs in a forked child with its own timeout; a step that fails, crashes or times
out is a row in the table and the next one runs. `--cpu-dry-run` runs the same steps on the
CPU with what needs a GPU skipped, each skip named; `--quick` shrinks every workload to the
tiny demo model (the test suite runs `--cpu-dry-run --quick`).

    scripts/gpu-check.sh                       # on the GPU machine (make gpu-check)
    .venv/bin/python benchmarks/gpu_check.py --cpu-dry-run --json gpu-check.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# torch.cuda.is_available() through NVML: asking never initialises CUDA in this process.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests")]
from reference import GAP_TIE  # noqa: E402  (tests/reference.py: the one near-tie rule)

# Near-tie thresholds of the greedy comparison: fp32 as tests/reference.py; bf16 logits
# differ between implementations by ~0.05 (ENVIRONMENT.md), and are themselves rounded to
# 8 bits (a logit of 64 has steps of 0.5), so a gap under 2 of those steps is a tie too.
TIE = {"float32": GAP_TIE, "bfloat16": 0.25}
TIE_STEPS = 2
RUNTIME_MODULES = ("zmq", "msgspec", "fastapi", "uvicorn", "httpx", "safetensors",
                   "tokenizers", "transformers", "prometheus_client", "jinja2")


@dataclass
class StepResult:
    step: str
    status: str  # ok | fail | skip
    seconds: float = 0.0
    summary: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


class Skip(Exception):  # a step's outcome, not an error
    """Raised by a step that cannot run here; its message names why."""


@dataclass(frozen=True)
class Plan:
    device: str  # cuda | cpu
    quick: bool
    workdir: Path

    @property
    def dry_run(self) -> bool:
        return self.device == "cpu"

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def demo(plan: Plan, size: str, seed: int = 0) -> Path:
    """A demo checkpoint in the work folder, written once (the 1b one takes a while)."""
    from tandem_engine.cli.demo_model import write_demo_model

    path = plan.workdir / f"demo-{size}-{seed}"
    if not (path / "model.safetensors").is_file():
        write_demo_model(path, size=size, seed=seed)
    return path


def engine_options(plan: Plan) -> dict[str, Any]:
    """`LLM` options of every step: the device, and an explicit KV budget, so no step
    depends on the engine's memory-fraction sizing. The quick rehearsal keeps to the
    portable torch kernels: a native CPU kernel build (~30 s) is nothing a GPU runs."""
    options: dict[str, Any] = {"device": plan.device,
                               "kv_cache_memory_bytes": 2**20 * (256 if plan.quick else
                                                                 1024 if plan.dry_run else 4096)}
    if plan.quick:
        options["kernels"] = "torch"
    return options


# ---------------------------------------------------------------------------- steps


def step_environment(plan: Plan) -> StepResult:
    import importlib

    detail: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                              "torch_cuda": torch.version.cuda, "cpu": platform.processor()}
    missing = []
    for name in (*RUNTIME_MODULES, nixl_module()):
        try:
            importlib.import_module(name)
        except Exception as exc:  # reported, not raised
            missing.append(f"{name} ({type(exc).__name__})")
    detail["missing"] = missing
    if plan.dry_run:
        summary = f"torch {torch.__version__} on the CPU (dry run: no GPU asked)"
    else:
        if not torch.cuda.is_available():
            return StepResult("environment", "fail", summary=f"torch {torch.__version__} "
                              "sees no CUDA device: every GPU step will fail")
        props = torch.cuda.get_device_properties(0)
        detail.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                      capability=f"{props.major}.{props.minor}")
        summary = (f"{props.name}, {detail['memory_gib']} GiB, torch {torch.__version__} "
                   f"(CUDA {torch.version.cuda})")
    if missing:
        summary += f"; missing: {', '.join(missing)}"
    return StepResult("environment", "fail" if missing else "ok", summary=summary,
                      detail=detail)


def nixl_module() -> str:
    """The NIXL build the engine tries first for this torch (its CUDA major)."""
    from tandem_engine.transfer.nixl import nixl_packages

    return f"{nixl_packages(torch.version.cuda)[0]}._api"


def hf_greedy_on(path: Path, prompts: list[list[int]], new: int, dtype: torch.dtype,
                 device: str) -> list[tuple[list[int], list[float], list[bool], list[float]]]:
    """Per prompt: transformers' greedy tokens, each step's top-two logit gap, whether that
    gap is a near tie, and each step's layout noise.

    The layout noise is how far transformers' own top-two gap moves when the same tokens
    are computed in another layout: one forward over prompt + generated tokens (every
    matmul M rows tall) against the step-by-step decode (M = 1), the most it moved over
    the prompt's steps. Kernels may pick another
    accumulation order by M (oneDNN's AMX brgemm does, in bf16), and the engine batches
    differently from either, so a gap that twice this noise can close is a tie too, as is
    a gap under TIE or under TIE_STEPS rounding steps of `dtype` at the top logit's size."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    rows = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=new,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            stepwise = torch.stack(out.logits)[:, 0].float()
            whole = model(out.sequences[:, :-1]).logits[0, len(prompt) - 1:].float()
            top2 = stepwise.topk(2, dim=-1)
            gap = top2.values[:, 0] - top2.values[:, 1]
            # How far the same two tokens' gap moves with the layout, at its worst over
            # this prompt's steps (one step's own movement may be zero by chance).
            moved = whole.gather(1, top2.indices)
            noise = (gap - (moved[:, 0] - moved[:, 1])).abs().amax().expand_as(gap)
            tie = torch.clamp(TIE_STEPS * torch.finfo(dtype).eps * top2.values[:, 0].abs(),
                              min=TIE[str(dtype).removeprefix("torch.")])
            tie = torch.maximum(tie, 2 * noise)
            rows.append((out.sequences[0, len(prompt):].tolist(), gap.tolist(),
                         (gap < tie).tolist(), noise.tolist()))
    return rows


def step_greedy(plan: Plan, dtype: str) -> StepResult:
    from reference import random_prompts
    from tandem_engine import LLM, SamplingParams

    name = f"greedy-{dtype}"
    # A CPU without bf16 instructions (no AVX-512-BF16, no AMX) emulates every bf16 matmul:
    # the small model's workload took 5+ minutes there, so a dry run on one keeps the quick
    # workload and says so.
    emulated = (plan.dry_run and dtype == "bfloat16"
                and not torch.ops.mkldnn._is_mkldnn_bf16_supported())
    small = not (plan.quick or emulated)
    path = demo(plan, "small" if small else "tiny")
    lengths, new = ([17, 64, 200, 511], 48) if small else ([9, 23], 8)
    prompts = random_prompts(2048, lengths, seed=5)
    hf = hf_greedy_on(path, prompts, new, getattr(torch, dtype), plan.device)
    llm = LLM(str(path), dtype=dtype, **engine_options(plan))
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0,
                                                ignore_eos=True))
    compared, mismatches, diverged = 0, [], []
    noise = max(max(row[3]) for row in hf)
    for i, ((ref, gaps, ties, _), out) in enumerate(zip(hf, outs, strict=True)):
        n = next((s for s, tie in enumerate(ties) if tie), len(ref))
        compared += n
        ours = list(out.outputs[0].token_ids[:n])
        if ours != ref[:n]:
            mismatches.append(i)
            step = next(s for s, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
            diverged.append({"prompt": i, "step": step, "hf_gap": gaps[step]})
    total = len(prompts) * new
    status = "fail" if mismatches or compared == 0 else "ok"
    rule = (f"< {TIE[dtype]}" + (f" or {TIE_STEPS} bf16 steps" if dtype == "bfloat16" else "")
            + f" or 2x layout noise, at most {noise:.2g}")
    summary = (f"{len(prompts) - len(mismatches)}/{len(prompts)} prompts equal; "
               f"{compared}/{total} tokens compared (near tie: gap {rule})"
               + ("; tiny model: this CPU emulates bf16" if emulated and not plan.quick
                  else ""))
    return StepResult(name, status, summary=summary,
                      detail={"model": path.name, "compared": compared, "total": total,
                              "max_layout_noise": noise,
                              "mismatched_prompts": mismatches, "diverged": diverged})


def hf_static_on(path: Path, prompts: list[list[int]], wanted: list[int], batch: int,
                 dtype: torch.dtype, plan: Plan) -> tuple[float, int]:
    """HF `generate` in FCFS static batches on the device: (seconds, useful tokens)."""
    from offline_throughput import left_pad
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(plan.device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def run(ps: list[list[int]], ws: list[int]) -> int:
        useful = 0
        for start in range(0, len(ps), batch):
            ids, mask = left_pad(ps[start:start + batch], 0)
            with torch.inference_mode():
                model.generate(input_ids=ids.to(plan.device), attention_mask=mask.to(plan.device),
                               max_new_tokens=max(ws[start:start + batch]), do_sample=False)
            useful += sum(ws[start:start + batch])
        return useful

    run([prompts[0][:8]], [4])  # warm-up, untimed
    plan.sync()
    t0 = time.perf_counter()
    useful = run(prompts, wanted)
    plan.sync()
    return time.perf_counter() - t0, useful


def step_throughput(plan: Plan, size: str) -> StepResult:
    from tandem_engine import LLM, SamplingParams

    name = f"throughput-{size}"
    if size == "1b" and plan.dry_run:
        raise Skip("GPU only: a ~1B model on the CPU takes minutes")
    path = demo(plan, "tiny" if plan.quick else size)
    if plan.quick:
        count, prompt_range, out_range, batch = 4, (8, 32), (4, 8), 2
    elif plan.dry_run:
        count, prompt_range, out_range, batch = 8, (16, 64), (8, 16), 4
    else:
        count, prompt_range, out_range, batch = (64 if size == "small" else 32), (64, 512), \
            (64, 256), 16
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 2048) for _ in range(rng.randint(*prompt_range))]
               for _ in range(count)]
    wanted = [rng.randint(*out_range) for _ in range(count)]
    dtype = "float32" if plan.dry_run else "bfloat16"
    llm = LLM(str(path), dtype=dtype, max_num_seqs=max(batch, 32), **engine_options(plan))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in wanted]
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))
    plan.sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    plan.sync()
    tandem_s = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    decode = [t.forward_s + t.sample_s for t in llm.engine.step_timings
              if t.num_running == 1 and t.num_prefill_tokens == 0]
    del llm
    hf_s, useful = hf_static_on(path, prompts, wanted, batch, getattr(torch, dtype), plan)
    tandem_tps, hf_tps = produced / tandem_s, useful / hf_s
    ratio = tandem_tps / hf_tps
    # Batch-1 decode floor: the weights read once (bytes in `dtype`; the demo checkpoints
    # are fp32 on disk) at the read bandwidth (a copy moves each byte twice).
    weights = (path / "model.safetensors").stat().st_size * (2 if dtype == "bfloat16" else 4) / 4
    bound_ms = weights / (2 * copy_bandwidth(plan) * 1e9) * 1e3
    step_ms = statistics.median(decode) * 1e3 if decode else None
    floor = (f"; batch-1 decode step {step_ms:.2f} ms = {step_ms / bound_ms:.1f}x the "
             f"weights-read bound {bound_ms:.2f} ms (goal <= 2x)") if step_ms else ""
    return StepResult(name, "ok", summary=(
        f"{dtype}: tandem {tandem_tps:,.0f} tok/s, hf static (batch {batch}) "
        f"{hf_tps:,.0f} tok/s: {ratio:.2f}x (goal >= 3x on a GPU){floor}"),
        detail={"model": path.name, "requests": count, "tandem_tok_s": tandem_tps,
                "hf_static_tok_s": hf_tps, "ratio": ratio, "dtype": dtype,
                "batch1_decode_step_ms": step_ms, "weights_read_bound_ms": bound_ms})


# A quantized projection against the float32 product with its dequantized weight: the
# activations' own rounding bounds the difference (bfloat16 on a GPU, int8 per group of 32
# in the CPU's native kernels), relative to the product's RMS. A kernel reading its
# packing wrong is off by the product's own size.
QUANT_TOLERANCE = 0.05
QUANT_SHAPES = ((576, 1536), (1536, 576), (4096, 4096))  # (in, out): SmolLM2's and a 7B's


def step_quantized(plan: Plan, kind: str) -> StepResult:
    """Weight-only int8 or int4 (`--quantization`, model/quant.py) on the device: each
    projection kernel against the dequantized weight's float32 product, and the demo model
    quantized at load against its dense engine on the same device: weights' bytes and
    batch-1 decode step time."""
    from tandem_engine import LLM, SamplingParams
    from tandem_engine.model.native import paged_decode_kernel
    from tandem_engine.model.quant import QuantLinear, quantize

    dtype = "float32" if plan.dry_run else "bfloat16"
    device = torch.device(plan.device)
    native = paged_decode_kernel() if plan.dry_run and not plan.quick else None
    g = torch.Generator().manual_seed(3)
    errors = {}
    for k, n in QUANT_SHAPES[:2] if plan.quick else QUANT_SHAPES:
        weight = quantize(torch.randn(n, k, generator=g) * 0.05, kind)
        layer = QuantLinear(weight, None, device, getattr(torch, dtype), native)
        x = torch.randn(17, k, generator=g)
        want = x @ weight.dequantize().float().T
        got = layer(x.to(device=device, dtype=getattr(torch, dtype))).float().cpu()
        errors[f"{k}x{n}"] = float((got - want).pow(2).mean().sqrt()
                                   / want.pow(2).mean().sqrt())
    path = demo(plan, "tiny" if plan.quick else "small")
    prompt = list(range(100, 164))
    timings = {}
    for quantization in ("none", kind):
        llm = LLM(str(path), dtype=dtype, quantization=quantization, **engine_options(plan))
        llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
        llm.engine.drain_step_timings()
        llm.generate([prompt[1:]], SamplingParams(max_tokens=33, temperature=0.0,
                                                  ignore_eos=True))
        plan.sync()
        decode = [t.forward_s + t.sample_s for t in llm.engine.drain_step_timings()
                  if t.num_prefill_tokens == 0]
        timings[quantization] = (llm.engine.runner.weight_bytes,
                                 statistics.median(decode) * 1e3)
        del llm
    worst = max(errors.values())
    (dense_bytes, dense_ms), (bytes_, ms) = timings["none"], timings[kind]
    status = "ok" if worst <= QUANT_TOLERANCE and bytes_ < dense_bytes else "fail"
    return StepResult(f"quantized-{kind}", status, summary=(
        f"{dtype}: projections within {worst:.2%} of the dequantized product (tolerance "
        f"{QUANT_TOLERANCE:.0%}); demo model weights {bytes_ / 2**20:.1f} MiB against "
        f"{dense_bytes / 2**20:.1f} dense, batch-1 decode step {ms:.2f} ms against "
        f"{dense_ms:.2f}"),
        detail={"relative_rms_error": errors, "weight_bytes": bytes_,
                "dense_weight_bytes": dense_bytes, "decode_step_ms": ms,
                "dense_decode_step_ms": dense_ms, "dtype": dtype, "model": path.name})


def copy_bandwidth(plan: Plan) -> float:
    """GB/s of one same-device copy (the handoff's ceiling), best of five."""
    n = (64 if plan.quick else 1024) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        plan.sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        plan.sync()
        best = min(best, time.perf_counter() - t0)
    return n / best / 1e9


def step_handoff(plan: Plan) -> StepResult:
    if plan.quick:
        raise Skip("--quick: no engine processes are started")
    import handoff_bandwidth as hb
    from tandem_engine import LLM, SamplingParams
    from tandem_engine import protocol as p

    path = demo(plan, "small")
    extra = ["--device", plan.device]  # _Engine sizes each pool: 1024 blocks
    logs = plan.workdir
    prefill = hb._Engine(path, "prefill", logs / "handoff-prefill.log", 1, extra)
    decode = hb._Engine(path, "decode", logs / "handoff-decode.log", 1, extra)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    rows, tokens, prompts = [], [], []
    try:
        for i in range(4):  # the first sets the NIXL connection up: not timed
            prompt = [rng.randrange(4, 2048) for _ in range(1536)]
            prefill.sock.send(p.encode(p.Submit(f"h{i}", prompt, params,
                                                pin_for_handoff=True)))
            out = prefill.next(p.Output)
            while not out.finished:
                out = prefill.next(p.Output)
            seconds = decode.metric("tandem_kv_handoff_seconds_sum")
            moved = decode.metric("tandem_kv_handoff_bytes_total")
            decode.sock.send(p.encode(p.Submit(
                f"h{i}", prompt, params, resume=p.Resume([out.token_ids[0]]),
                pull=p.PullSource(prefill.welcome.kv_transfer, out.handoff.pin_id,
                                  out.handoff.block_ids))))
            done = decode.next(p.Output)
            generated = list(done.token_ids)
            while not done.finished:
                done = decode.next(p.Output)
                generated += done.token_ids
            took = decode.metric("tandem_kv_handoff_seconds_sum") - seconds
            nbytes = decode.metric("tandem_kv_handoff_bytes_total") - moved
            if nbytes == 0:
                return StepResult("handoff", "fail", summary=f"prompt {i} was not pulled; "
                                  f"see {logs}/handoff-decode.log")
            if i:
                rows.append((took, nbytes))
            tokens.append([out.token_ids[0], *generated])
            prompts.append(prompt)
    finally:
        decode.close()
        prefill.close()
    llm = LLM(str(path), **engine_options(plan))
    colocated = [o.outputs[0].token_ids[:16] for o in llm.generate(prompts, params)]
    equal = sum(t[:16] == c for t, c in zip(tokens, colocated, strict=True))
    gbps = statistics.median(b / s for s, b in rows) / 1e9
    ceiling = copy_bandwidth(plan)
    memory = "device memory (VRAM)" if plan.device == "cuda" else "host memory (dry run: no VRAM)"
    status = "ok" if equal == len(prompts) else "fail"
    return StepResult("handoff", status, summary=(
        f"{memory}: {gbps:.2f} GB/s for {rows[0][1] / 2**20:.0f} MiB, {gbps / ceiling:.0%} of a "
        f"same-device copy ({ceiling:.1f} GB/s); tokens equal colocated {equal}/{len(prompts)}"),
        detail={"gb_s": gbps, "copy_gb_s": ceiling, "bytes": rows[0][1],
                "equal": equal, "prompts": len(prompts)})


def step_lifecycle(plan: Plan) -> StepResult:
    import lifecycle
    from tandem_engine import LLM

    path = demo(plan, "tiny" if plan.quick else "small")
    target = demo(plan, "tiny" if plan.quick else "small", seed=1)
    llm = LLM(str(path), **engine_options(plan))
    suspend = lifecycle.bench_suspend(llm, 2048)
    refit = lifecycle.bench_refit(llm, [target, path])
    cells = ", ".join(f"{r['mode']} {r['suspend_s'] * 1e3:.0f}/{r['resume_s'] * 1e3:.0f} ms"
                      for r in suspend)
    return StepResult("lifecycle", "ok", summary=(
        f"suspend/resume {cells}; refit {refit['refit_s'] * 1e3:.0f} ms "
        f"({refit['bytes'] / 2**20:.0f} MiB, read floor {refit['floor_s'] * 1e3:.0f} ms)"),
        detail={"suspend": suspend, "refit": refit})


# Name, function, timeout on a GPU (s). The dry run scales them (the CPU is slower).
STEPS: list[tuple[str, Callable[[Plan], StepResult], float]] = [
    ("environment", step_environment, 30),
    ("greedy-float32", lambda plan: step_greedy(plan, "float32"), 60),
    ("greedy-bfloat16", lambda plan: step_greedy(plan, "bfloat16"), 45),
    ("throughput-small", lambda plan: step_throughput(plan, "small"), 75),
    ("throughput-1b", lambda plan: step_throughput(plan, "1b"), 120),
    ("handoff", step_handoff, 75),
    ("lifecycle", step_lifecycle, 45),
    ("quantized-int8", lambda plan: step_quantized(plan, "int8"), 60),
    ("quantized-int4", lambda plan: step_quantized(plan, "int4"), 60),
]


# ---------------------------------------------------------------------------- driver


def _child(name: str, fn: Callable[[Plan], StepResult], plan: Plan, conn: Any) -> None:
    torch.set_num_threads(1 if plan.quick else max(1, (os.cpu_count() or 2) // 2))
    try:
        result = fn(plan)
    except Skip as why:
        result = StepResult(name, "skip", summary=str(why))
    except BaseException as exc:  # the table reports it
        last = traceback.format_exception(exc)[-1].strip()
        result = StepResult(name, "fail", summary=last[:300],
                            detail={"traceback": traceback.format_exc()[-3000:]})
    conn.send(asdict(result))


def run_step(name: str, fn: Callable[[Plan], StepResult], plan: Plan,
             timeout: float) -> StepResult:
    """The step in a forked child (torch imported, CUDA not yet initialised), so a hang or
    a crash costs that step only."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    start = time.perf_counter()
    proc = ctx.Process(target=_child, args=(name, fn, plan, send), daemon=True)
    proc.start()
    send.close()
    result = None
    if recv.poll(timeout):
        with contextlib.suppress(EOFError):  # the child died before answering
            result = StepResult(**recv.recv())
    proc.join(5 if result is not None else 0.5)  # a hung step is not waited for
    if proc.is_alive():
        proc.kill()
        proc.join()
    took = time.perf_counter() - start
    if result is None:
        why = (f"timed out after {timeout:.0f} s" if took >= timeout
               else f"the step's process died (exit code {proc.exitcode})")
        result = StepResult(name, "fail", summary=why)
    result.seconds = took
    return result


def format_table(results: Sequence[StepResult]) -> str:
    width = max(len(r.step) for r in results)
    lines = [f"{'step':<{width}}  status  seconds  result", "-" * (width + 60)]
    lines += [f"{r.step:<{width}}  {r.status:<6}  {r.seconds:7.1f}  {r.summary}"
              for r in results]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run on the CPU, skipping (and naming) what needs a GPU")
    p.add_argument("--quick", action="store_true",
                   help="tiny demo model and tiny workloads (for the test suite)")
    p.add_argument("--json", type=Path, default=Path("gpu-check.json"),
                   help="write the table here (default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=Path(".gpu-check"),
                   help="demo models and engine logs (default: %(default)s)")
    p.add_argument("--steps", default=",".join(n for n, _, _ in STEPS),
                   help="comma-separated subset of the steps")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    wanted = args.steps.split(",")
    unknown = set(wanted) - {n for n, _, _ in STEPS}
    if unknown:
        raise SystemExit(f"--steps: unknown {sorted(unknown)}; the steps are "
                         f"{', '.join(n for n, _, _ in STEPS)}")
    plan = Plan("cpu" if args.cpu_dry_run else "cuda", args.quick, args.workdir.resolve())
    plan.workdir.mkdir(parents=True, exist_ok=True)
    scale = 1.0 if not plan.dry_run else (2.0 if plan.quick else 4.0)
    if plan.dry_run:  # imported once here, shared by every forked step
        from tandem_engine import LLM  # noqa: F401
        from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401
    # On a GPU the parent touches nothing that could initialise CUDA (a forked child
    # cannot use a CUDA its parent initialised): each step imports what it needs.

    results = []
    for name, fn, timeout in STEPS:
        if name in wanted:
            results.append(run_step(name, fn, plan, timeout * scale))
            print(f"[gpu-check] {name}: {results[-1].status} ({results[-1].seconds:.1f} s)",
                  flush=True)
    table = format_table(results)
    print(table)
    args.json.write_text(json.dumps({
        "device": plan.device, "quick": plan.quick, "host": platform.node(),
        "steps": [asdict(r) for r in results]}, indent=2) + "\n")
    print(f"[gpu-check] wrote {args.json}")
    return 1 if any(r.status == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
