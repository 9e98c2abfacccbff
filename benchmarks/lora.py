"""What LoRA adapters cost a decode step: 64 requests over 4 adapters against the base model
alone, in one engine, same run (issue 31's goal: at most 1.3x the base step).

The model is SmolLM2-135M-Instruct's GGUF, its projections kept int4 (`tandem serve`'s
default). Every configuration decodes the same 64 requests (one shared prompt length,
`--max-tokens` each, greedy, `ignore_eos`), all admitted at once, and the engine's own
step timings give the mean decode step (steps without prefill tokens):

* base: no adapter, the engine as it runs without LoRA (decode steps in one native call);
* base, eager: the same with the native decode stack off, which a step with an adapter
  cannot use (its hooks are on the eager path's projections);
* 4 adapters: the same 64 requests spread over 4 random adapters of rank `--rank` on all
  seven projections, in one batch: one masked matmul pair per projection.

    .venv/bin/python benchmarks/lora.py [--requests 64] [--adapters 4] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tandem_engine import LLM, SamplingParams
from tandem_engine.cli.models import SMOLLM2_135M_INSTRUCT, pull
from tandem_engine.lora_request import LoRARequest
from tandem_engine.model.lora import TARGETS, projection_shape


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def write_adapter(folder: Path, config, rank: int, seed: int) -> Path:
    """A PEFT adapter folder with random weights on every projection of every layer."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target, owner in TARGETS.items():
            fan_in, fan_out = projection_shape(config, target)
            key = f"base_model.model.model.layers.{layer}.{owner}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
         "target_modules": list(TARGETS)}))
    return folder


def decode_step_ms(llm: LLM, prompts: list[list[int]], max_tokens: int,
                   loras: list[LoRARequest | None]) -> tuple[float, float]:
    """(mean decode step ms, tokens/s) of one run of every prompt at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.engine.drain_step_timings()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    wall = time.perf_counter() - start
    steps = [t.total_s for t in llm.engine.drain_step_timings() if t.num_prefill_tokens == 0]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return 1000 * statistics.fmean(steps), tokens / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration, best kept")
    args = p.parse_args()
    model = pull(SMOLLM2_135M_INSTRUCT)
    llm = LLM(model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              max_num_seqs=args.requests, enable_prefix_caching=False)
    config = llm.engine.model_config
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"adapter{i}", str(write_adapter(Path(tmp) / f"a{i}", config,
                                                               args.rank, i)))
                 for i in range(args.adapters)]
        prompts = [[(7 * i + j) % 2000 + 100 for j in range(args.prompt_tokens)]
                   for i in range(args.requests)]
        spread = [loras[i % len(loras)] for i in range(args.requests)]
        fused = llm.engine.runner.fused
        rows = {}
        for name, mix, native in (("base", [None] * args.requests, True),
                                  ("base, eager", [None] * args.requests, False),
                                  (f"{args.adapters} adapters", spread, True)):
            llm.engine.runner.fused = fused if native else None
            runs = [decode_step_ms(llm, prompts, args.max_tokens, mix)
                    for _ in range(args.repeats)]
            rows[name] = min(runs)
        llm.engine.runner.fused = fused
    base = rows["base"][0]
    print(f"\n{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.requests} requests, {args.prompt_tokens}-token prompts, {args.max_tokens} "
          f"new tokens each; adapters of rank {args.rank} on all 7 projections\n")
    print("| configuration | decode step ms | tok/s | step / base |")
    print("|---|---|---|---|")
    for name, (ms, tps) in rows.items():
        print(f"| {name} | {ms:.1f} | {tps:.0f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
