"""What the engine image's portable builds of the decode-attention kernel cost against a
-march=native build of the same source.

The image prebuilds `csrc/paged_decode_attention.cpp` for portable instruction sets
(`PREBUILT_MARCHES` in `tandem_engine/model/native.py`) because it cannot know the nodes'
CPUs; `TANDEM_NATIVE_JIT=1` compiles for the node instead. This builds the kernel for each
instruction set given and for `native` (one build process each, as the image does), then
times decode attention over a paged cache, SmolLM2-135M's shape (9 heads, 3 KV heads,
dim 64), `--seqs` sequences of `--context` tokens, float32 and bfloat16. Each library is
timed in its own process (one module name per process), rounds interleaved; it prints the
median per library and dtype and the ratio to `native`. Run it alone.

    .venv/bin/python benchmarks/native_march.py                      # x86-64-v3, x86-64-v2
    .venv/bin/python benchmarks/native_march.py --march armv8-a      # on aarch64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NATIVE_PY = ROOT / "engine_image" / "tandem_engine" / "model" / "native.py"

TIMER = """
import importlib.util, json, math, sys, time
import torch
path, name, seqs, context = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
spec = importlib.util.spec_from_file_location(name, path)
kernel = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel)
torch.manual_seed(0)
heads, kv_heads, dim, block = 9, 3, 64, 16
width = context // block
q = torch.randn(seqs, heads, dim)
k = torch.randn(seqs * width, block, kv_heads, dim)
v = torch.randn(seqs * width, block, kv_heads, dim)
tables = torch.randperm(seqs * width).reshape(seqs, width)
lens = torch.full((seqs,), context, dtype=torch.long)
out = {}
for dtype in (torch.float32, torch.bfloat16):
    args = (q.to(dtype), k.to(dtype), v.to(dtype), tables, lens, 1 / math.sqrt(dim))
    for _ in range(5):
        kernel.paged_decode_attention(*args)
    runs = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(20):
            kernel.paged_decode_attention(*args)
        runs.append((time.perf_counter() - start) / 20)
    out[str(dtype).removeprefix("torch.")] = sorted(runs)[3]
print(json.dumps(out))
"""


def build(folder: Path, march: str) -> Path:
    """Compile with native.py's own build (`prebuild`), in a process of its own."""
    done = subprocess.run([sys.executable, str(NATIVE_PY), "prebuild", str(folder),
                           "--march", march], capture_output=True, text=True, check=True)
    return Path(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--march", action="append",
                        help="instruction set, repeatable (default: x86-64-v3, x86-64-v2)")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    marches = ["native", *(args.march or ["x86-64-v3", "x86-64-v2"])]
    times: dict[str, dict[str, list[float]]] = {m: {} for m in marches}
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {m: build(Path(tmp), m) for m in marches}
        name = libraries["native"].name.split(".", 1)[0]
        for _ in range(args.rounds):
            for march, path in libraries.items():
                done = subprocess.run([sys.executable, "-c", TIMER, str(path), name,
                                       str(args.seqs), str(args.context)],
                                      capture_output=True, text=True, check=True)
                for dtype, seconds in json.loads(done.stdout).items():
                    times[march].setdefault(dtype, []).append(seconds)
    print(f"decode attention, {args.seqs} seqs x {args.context} tokens, median of "
          f"{args.rounds} rounds")
    for march in marches:
        row = []
        for dtype, runs in times[march].items():
            median = statistics.median(runs)
            ratio = median / statistics.median(times["native"][dtype])
            row.append(f"{dtype} {median * 1e3:.2f} ms ({ratio:.2f}x native)")
        print(f"{march:>10}: " + "; ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
