"""A prefill step's time: short prompts in the fused stack, a position a row, against the
eager forward pass, on the same engine in one run.

A step whose prefill chunks hold at most `runner.FUSED_PREFILL_ROWS` rows runs in the
fused native stack (`ModelRunner._prefills_as_rows`); longer ones eagerly. On a CPU an
eager step costs about 10 ms beyond its arithmetic (~600 torch calls on SmolLM2), which
is most of a short prompt's time to first token. For each prompt length this times the
step that prefills a fresh prompt of random tokens (no prefix-cache hit), with the row
limit at 0 (eager) and at the length (fused), medians of `--repeats`, and prints their
ratio. Run it alone.

    .venv/bin/python benchmarks/prefill_step.py            # SmolLM2's GGUF, one thread
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_batch1 import cpu  # this folder's


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="a checkpoint or GGUF (default: SmolLM2-135M-Instruct's GGUF, "
                        "pulled like `tandem serve` does)")
    p.add_argument("--lengths", default="4,8,16,32,64,128")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import tandem_engine.model.runner as runner
    from tandem_engine import LLM, SamplingParams

    model = args.model
    if model is None:
        from tandem_engine.cli.models import SMOLLM2_135M_INSTRUCT, pull

        model = str(pull(SMOLLM2_135M_INSTRUCT))  # the demo model, as `tandem serve` pulls it
    llm = LLM(model, num_blocks=1024, max_num_seqs=8, max_num_batched_tokens=4096)
    engine = llm.engine
    limit = runner.FUSED_PREFILL_ROWS
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def step_ms(n: int, limit: int) -> float:
        runner.FUSED_PREFILL_ROWS = limit
        times = []
        for r in range(args.repeats + 2):
            ids = [rng.randrange(100, 30000) for _ in range(n)]  # fresh: no cached prefix
            engine.add_request(f"prefill-{n}-{limit}-{r}", ids, params)
            started = time.perf_counter()
            engine.step()
            times.append(1000 * (time.perf_counter() - started))
            while engine.stats.has_unfinished_requests:
                engine.step()
        return statistics.median(times[2:])  # the first two warm up

    print(f"CPU: {cpu()}, {args.threads} thread(s); model {Path(model).name}")
    print("| prompt tokens | eager step | fused rows | fused / eager |")
    print("|---|---|---|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        eager, fused = step_ms(n, 0), step_ms(n, n)
        print(f"| {n} | {eager:.1f} ms | {fused:.1f} ms | {fused / eager:.2f}x |", flush=True)
    print(f"\nThe engine runs prefills of up to {limit} rows fused.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
