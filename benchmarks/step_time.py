"""One engine step's time on a quantized CPU engine: short prefills and few-row decodes.

Short prefills run in the fused stack (a position a row), timed against the eager forward
pass; then decode steps of a few rows.

A step whose prefill chunks hold at most `runner.FUSED_PREFILL_ROWS` rows runs in the
fused native stack (`ModelRunner._prefills_as_rows`); longer ones eagerly. On a CPU an
eager step costs about 10 ms beyond its arithmetic (~600 torch calls on SmolLM2), which
is most of a short prompt's time to first token. For each prompt length this times the
step that prefills a fresh prompt of random tokens (no prefix-cache hit), with the row
limit at 0 (eager) and at the length (fused), medians of `--repeats`, and prints their
ratio. Then a decode step of `--decode-rows` rows in the fused stack, and its output head,
over a 40-token context (medians of 12). Run it alone.

    .venv/bin/python benchmarks/step_time.py            # SmolLM2's GGUF, one thread
    .venv/bin/python benchmarks/step_time.py --quantization int8
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
    p.add_argument("--lengths", default="4,8,16,32,64,128",
                   help="prompt lengths to prefill, comma-separated (default %(default)s)")
    p.add_argument("--repeats", type=int, default=9,
                   help="timed steps per length and path (default %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, as tandem serve's --threads (default %(default)s)")
    p.add_argument("--decode-rows", default="1,2,3,4,8,16",
                   help="decode step sizes to time, comma-separated (default %(default)s)")
    p.add_argument("--quantization", default=None, help="as tandem serve's (default: auto)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import tandem_engine.model.runner as runner
    from tandem_engine import LLM, SamplingParams

    model = args.model
    if model is None:
        from tandem_engine.cli.models import SMOLLM2_135M_INSTRUCT, pull

        model = str(pull(SMOLLM2_135M_INSTRUCT))  # the demo model, as `tandem serve` pulls it
    options = {} if args.quantization is None else {"quantization": args.quantization}
    llm = LLM(model, num_blocks=1024, max_num_seqs=8, max_num_batched_tokens=4096, **options)
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
    print(f"\nThe engine runs prefills of up to {limit} rows fused.\n")
    decode_steps(llm, [int(x) for x in args.decode_rows.split(",")])
    return 0


def decode_steps(llm, row_counts: list[int], context: int = 40) -> None:
    """The fused stack's decode step of each row count, and its head, over random KV."""
    from tandem_engine.model.attention import build_metadata
    from tandem_engine.model.quant import one_term_activations

    r = llm.engine.runner
    if r.fused is None:
        print("(this engine runs decode steps eagerly: no fused-stack rows to time)")
        return
    bs, per = r.block_size, -(-context // r.block_size)
    print("| decode rows | stack | head | step |")
    print("|---|---|---|---|")
    for rows in row_counts:
        tables = [list(range(i * per, (i + 1) * per)) for i in range(rows)]
        slots = [t[(context - 1) // bs] * bs + (context - 1) % bs for t in tables]
        ids = torch.randint(4, llm.engine.model_config.vocab_size, (rows,))
        positions = torch.full((rows,), context - 1)
        meta = build_metadata(tables, [context] * rows, [], slots, bs, r.device,
                              r.gather_buffers, r.native)
        stack, head = [], []
        with torch.inference_mode(), one_term_activations():
            for _ in range(15):
                a = time.perf_counter()
                hidden = r.fused(ids, positions, r.kv_cache, meta)
                b = time.perf_counter()
                r.fused.logits(hidden)
                stack.append(b - a)
                head.append(time.perf_counter() - b)
        s, h = 1000 * statistics.median(stack[3:]), 1000 * statistics.median(head[3:])
        print(f"| {rows} | {s:.2f} ms | {h:.2f} ms | {s + h:.2f} ms |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
