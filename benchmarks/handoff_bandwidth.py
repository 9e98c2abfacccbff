"""KV handoff bandwidth: a NIXL READ of one prompt's blocks between two processes, against
copying the same bytes inside one process with torch.

Run alone (it measures memory bandwidth on a 2-core machine):

    .venv/bin/python benchmarks/handoff_bandwidth.py

Geometry of the `small` demo model (16 layers, 4 KV heads, head_dim 64, blocks of 16
tokens, float32): a 2,048-token prompt is 128 blocks of 512 KiB (32 chunks of 16 KiB, one
per layer and K/V), 64 MiB in all. A "prefill" process owns a pool and polls its
notifications as an engine loop would; this process is the "decode" side and READs the
blocks through `NixlBackend` (start_read + wait, a notification on each read), into
destination blocks different from the source ones. Two layouts: `scattered` (random block
ids on both sides, as a long-running engine's pool looks) and `contiguous` (ids in a run,
so the transport can merge descriptors). The reference is the same block copy in one
process: `index_copy_` from `index_select` (what a same-process handoff would do, reading
the bytes twice), and a per-block `copy_` loop. GB/s counts the prompt's bytes once.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shlex
import statistics
import sys
import time
from typing import Any

import torch
from tandem_engine.transfer import KVGeometry, NixlBackend


def _prefill_main(conn: Any, geometry: dict, poll_s: float, threads: int) -> None:
    torch.set_num_threads(threads)
    g = KVGeometry.from_dict(geometry)
    backend = NixlBackend("bench-prefill")
    pool = torch.randn(g.shape, generator=torch.Generator().manual_seed(0)).to(
        getattr(torch, g.dtype))
    backend.register(pool, g)
    conn.send(backend.agent_metadata())
    while not conn.poll(poll_s):
        backend.new_notifications()
    backend.close()


def _median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--pool-blocks", type=int, default=512, help="blocks in each side's pool")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    p.add_argument("--poll-ms", type=float, default=1.0,
                   help="how often the prefill side polls notifications")
    args = p.parse_args(argv)
    print("command:", shlex.join(sys.orig_argv))
    torch.set_num_threads(args.threads)

    geometry = KVGeometry(num_layers=16, num_blocks=args.pool_blocks, block_size=16,
                          num_kv_heads=4, head_dim=64, dtype="float32")
    n = -(-args.prompt_tokens // geometry.block_size)
    nbytes = n * geometry.block_bytes
    print(f"geometry: {geometry.describe()}; prompt {args.prompt_tokens} tokens = {n} blocks "
          f"= {nbytes / 2**20:.1f} MiB ({n * geometry.chunks_per_block} chunks of "
          f"{geometry.chunk_bytes // 1024} KiB); torch threads {args.threads}; "
          f"prefill polls every {args.poll_ms} ms; UCX_TLS={os.environ.get('UCX_TLS', 'unset')}")

    gen = torch.Generator().manual_seed(1)
    layouts = {
        "scattered": (torch.randperm(geometry.num_blocks, generator=gen)[:n].tolist(),
                      torch.randperm(geometry.num_blocks, generator=gen)[:n].tolist()),
        "contiguous": (list(range(n)), list(range(n, 2 * n))),
    }

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    prefill = ctx.Process(target=_prefill_main, daemon=True,
                          args=(child, geometry.to_dict(), args.poll_ms / 1000, args.threads))
    prefill.start()
    results: dict[str, float] = {}
    try:
        backend = NixlBackend("bench-decode")
        pool = torch.zeros(geometry.shape)
        backend.register(pool, geometry)
        if not conn.poll(60):
            raise SystemExit("prefill process did not start within 60 s")
        backend.add_peer("bench-prefill", conn.recv(), geometry)

        def read(remote: list[int], local: list[int]) -> None:
            backend.wait(backend.start_read("bench-prefill", remote, local, b"done"), 10.0)

        start = time.perf_counter()
        read([0], [0])
        print(f"first READ (connection setup): {(time.perf_counter() - start) * 1e3:.1f} ms")

        src = torch.randn(geometry.shape, generator=gen)
        for name, (remote, local) in layouts.items():
            t = _median_s(lambda r=remote, dst=local: read(r, dst), args.repeats)
            results[f"nixl {name}"] = t
            ri, li = torch.tensor(remote), torch.tensor(local)
            results[f"torch index_copy {name}"] = _median_s(
                lambda ri=ri, li=li: pool.index_copy_(2, li, src.index_select(2, ri)),
                args.repeats)

            def per_block(remote: list[int] = remote, local: list[int] = local) -> None:
                for r, dst in zip(remote, local, strict=True):
                    pool[:, :, dst].copy_(src[:, :, r])

            results[f"torch copy_ loop {name}"] = _median_s(per_block, args.repeats)
        backend.close()
    finally:
        conn.send("stop")
        prefill.join(10)
        if prefill.is_alive():
            prefill.kill()

    print(f"{'what':32} {'median ms':>10} {'GB/s':>8}")
    for what, t in results.items():
        print(f"{what:32} {t * 1e3:10.2f} {nbytes / t / 1e9:8.2f}")
    for name in layouts:
        best = min(results[f"torch index_copy {name}"], results[f"torch copy_ loop {name}"])
        print(f"{name}: NIXL READ reaches {best / results[f'nixl {name}']:.2f}x the bandwidth "
              "of the faster same-process torch copy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
