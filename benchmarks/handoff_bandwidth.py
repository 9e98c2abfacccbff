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

With `--engines MODEL_DIR` (the `small` demo model) it also measures the handoff path
itself: a real `--role prefill` and a real `--role decode` engine process, driven over
ZMQ as the router drives them. For each fresh random prompt the prefill engine computes
it and its first token (that is TTFT) and pins its blocks; the decode engine plans the
pull, READs the blocks over NIXL and admits the request. The decode engine's own
`tandem_kv_handoff_seconds` / `tandem_kv_handoff_bytes_total` metrics give the path's
time and bytes. The prompt is 2,040 tokens (128 blocks, as 2,048 would be) because the
`small` model's context is 2,048 tokens and a generated token must fit.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
import zmq
from tandem_engine import protocol as p
from tandem_engine.cli.serve import die_with_parent, free_port
from tandem_engine.sampling_params import SamplingParams
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


class _Engine:
    """One engine process and a router-side DEALER socket to it."""

    def __init__(self, model: Path, role: str, log: Path, threads: int,
                 extra: tuple[str, ...] | list[str] = ()) -> None:
        self.port, self.admin = free_port(), free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem_engine.server.main", "--model", str(model),
             "--role", role, "--engine-id", f"bench-{role}", "--port", str(self.port),
             "--admin-port", str(self.admin), "--threads", str(threads),
             "--num-blocks", "1024", "--max-num-batched-tokens", "2048", *extra],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/readyz", timeout=2)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{role} engine did not start; see {log}") from None
                time.sleep(0.2)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{self.port}")
        self.sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, socket.gethostname())))
        self.welcome = self.next(p.Welcome)

    def next(self, kind: Any, timeout: float = 120.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.send(p.encode(p.Ping(socket.gethostname())))  # alive: keep our requests
            if self.sock.poll(100):
                msg = p.decode(self.sock.recv())
                if isinstance(msg, p.Reject):
                    raise SystemExit(f"engine rejected the request: {msg.message}")
                if isinstance(msg, kind):
                    return msg
        raise SystemExit(f"no {kind} from the engine in {timeout} s")

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/metrics",
                                      timeout=10).read().decode()
        m = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def engine_path(model: Path, prompt_tokens: int, repeats: int, threads: int,
                logs: Path) -> list[tuple[float, float, int]]:
    """(TTFT s, handoff s, bytes) per prompt through real prefill and decode engines."""
    prefill = _Engine(model, "prefill", logs / "bench-prefill.log", threads)
    decode = _Engine(model, "decode", logs / "bench-decode.log", threads)
    rng = random.Random(0)
    rows = []
    try:
        for i in range(repeats + 1):  # the first one sets the NIXL connection up
            prompt = [rng.randrange(1, 2000) for _ in range(prompt_tokens)]
            rid = f"b{i}"
            start = time.perf_counter()
            prefill.sock.send(p.encode(p.Submit(rid, prompt, SamplingParams(
                max_tokens=2, temperature=0.0, ignore_eos=True), pin_for_handoff=True)))
            out = prefill.next(p.Output)
            while not out.finished:
                out = prefill.next(p.Output)
            ttft = time.perf_counter() - start
            seconds = decode.metric("tandem_kv_handoff_seconds_sum")
            nbytes = decode.metric("tandem_kv_handoff_bytes_total")
            decode.sock.send(p.encode(p.Submit(rid, prompt, SamplingParams(
                max_tokens=2, temperature=0.0, ignore_eos=True),
                resume=p.Resume([out.token_ids[0]]),
                pull=p.PullSource(prefill.welcome.kv_transfer, out.handoff.pin_id,
                                  out.handoff.block_ids))))
            done = decode.next(p.Output)
            while not done.finished:
                done = decode.next(p.Output)
            took = decode.metric("tandem_kv_handoff_seconds_sum") - seconds
            moved = int(decode.metric("tandem_kv_handoff_bytes_total") - nbytes)
            if moved == 0:
                raise SystemExit(f"prompt {i} was not pulled; see {logs}/bench-decode.log")
            if i:
                rows.append((ttft, took, moved))
    finally:
        decode.close()
        prefill.close()
    return rows


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
    p.add_argument("--engines", type=Path, default=None, metavar="MODEL_DIR",
                   help="also measure the handoff path through real engine processes")
    p.add_argument("--engine-repeats", type=int, default=5)
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
    if args.engines is not None:
        rows = engine_path(args.engines, args.prompt_tokens - 8, args.engine_repeats,
                           args.threads, Path(os.environ.get("TMPDIR", "/tmp")))
        for i, (t, h, b) in enumerate(rows):
            print(f"  prompt {i}: TTFT {t * 1e3:.0f} ms, handoff {h * 1e3:.2f} ms "
                  f"({b / h / 1e9:.2f} GB/s)")
        ttft = statistics.median(r[0] for r in rows)
        took = statistics.median(r[1] for r in rows)
        moved = rows[0][2]
        gbps = moved / took / 1e9
        print(f"handoff path (engines, {moved / 2**20:.1f} MiB per prompt, median of "
              f"{len(rows)}): {took * 1e3:.2f} ms = {gbps:.2f} GB/s; "
              f"{gbps / (nbytes / results['nixl scattered'] / 1e9):.2f}x raw NIXL scattered, "
              f"{gbps / (nbytes / results['nixl contiguous'] / 1e9):.2f}x raw NIXL contiguous")
        print(f"prefill TTFT (2,040-token prompt + first token) median {ttft * 1e3:.0f} ms; "
              f"the handoff is {took / ttft:.1%} of it, and runs after the first token was "
              "streamed (it delays the second token, not the first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
