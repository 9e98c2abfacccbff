"""What checking every weight for NaN/Inf costs when a checkpoint loads (startup and refit).

`load_checkpoint` refuses a checkpoint with any non-finite weight (`model/checkpoint.py`);
the check reads every loaded tensor once more. This benchmark loads the same checkpoint
three ways, alternating, best of `--repeats` each:

* `unchecked`: `load_checkpoint(check_finite=False)`. A float32 safetensors file is memory
  mapped, so this may not read the weights at all yet;
* `unchecked+read`: the same, then one plain `sum()` over every tensor: the cheapest full
  read, which any use of the weights (building the model) pays anyway — the reference;
* `checked`: `load_checkpoint()` as the engine calls it.

It prints the three times and checked/(unchecked+read): what the check adds over reading
the weights once. Run it alone (it reads hundreds of MB per load).

    tandem models pull smollm2-135m-instruct .smollm2 --format hf
    .venv/bin/python benchmarks/weights_check.py --model .smollm2
    .venv/bin/python benchmarks/weights_check.py --model ~/.cache/tandem/models/<...>.gguf
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_batch1 import cpu
from tandem_engine.model.checkpoint import load_checkpoint


def timed_load(model: str, dtype: str | None, check: bool, read: bool = False
               ) -> tuple[float, int]:
    start = time.perf_counter()
    _, tensors = load_checkpoint(model, dtype, check_finite=check)
    if read:
        for t in tensors.values():
            t.sum()
    elapsed = time.perf_counter() - start
    return elapsed, sum(t.numel() * t.element_size() for t in tensors.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder or .gguf file")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 "
                        "(default: the checkpoint's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("command:", " ".join(sys.argv))
    print(f"cpu: {cpu()}; torch threads {args.threads}")
    timed_load(args.model, args.dtype, True)  # warm the page cache
    times: dict[str, list[float]] = {"unchecked": [], "unchecked+read": [], "checked": []}
    size = 0
    for _ in range(args.repeats):
        for way, (check, read) in (("unchecked", (False, False)),
                                   ("unchecked+read", (False, True)),
                                   ("checked", (True, False))):
            t, size = timed_load(args.model, args.dtype, check, read)
            times[way].append(t)
    best = {way: min(ts) for way, ts in times.items()}
    print(f"weights: {size / 2**20:.0f} MiB loaded")
    for way, t in best.items():
        print(f"  {way:<15} {t * 1000:7.0f} ms (best of {args.repeats})")
    print(f"checked / (unchecked+read) = {best['checked'] / best['unchecked+read']:.3f}; "
          f"checked / unchecked = {best['checked'] / best['unchecked']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
