"""`tandem bench`'s own cost: the load generator against a server that costs nothing.

Run alone:

    .venv/bin/python benchmarks/bench_overhead.py

A no-op OpenAI endpoint (this file with --serve PORT, in its own process so its CPU is
not counted) answers GET /v1/models and streams every POST /v1/completions at once:
`max_tokens` SSE chunks of one token each, the usage chunk and [DONE], over keep-alive
HTTP/1.1 with chunked encoding. `tandem_engine.bench` then sends --num-requests requests
to it, closed loop at each --concurrency, and this prints per point: requests/s reached
(the generator's ceiling on this machine), the client's CPU per request and per token
(process time of this process over the run), and the TTFT / ITL it measured (what the
client adds to every latency it reports, plus loopback and the no-op server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "engine_image"))

MODEL = "noop"


def _event(body: dict) -> bytes:
    data = f"data: {json.dumps(body)}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.lower(): v.strip() for k, v in
                       (line.split(":", 1) for line in lines[1:] if ":" in line)}
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            if method == "GET" and path == "/v1/models":
                payload = json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
            elif method == "POST" and path == "/v1/completions":
                n = int(json.loads(body).get("max_tokens", 16))
                out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                       b"transfer-encoding: chunked\r\n\r\n"]
                for i in range(n):
                    out.append(_event({"id": "x", "object": "text_completion", "choices": [
                        {"index": 0, "text": " tok", "finish_reason":
                         "length" if i == n - 1 else None}]}))
                out.append(_event({"id": "x", "choices": [], "usage": {
                    "prompt_tokens": 8, "completion_tokens": n, "total_tokens": n + 8,
                    "prompt_tokens_details": {"cached_tokens": 0}}}))
                data = b"data: [DONE]\n\n"
                out.append(f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n")
                writer.write(b"".join(out))
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def serve(port: int) -> None:
    async def main() -> None:
        server = await asyncio.start_server(_handle, "127.0.0.1", port, backlog=1024)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=500)
    ap.add_argument("--output-len", type=int, default=64, help="tokens per request")
    ap.add_argument("--concurrency", default="1,16,64",
                    help="comma-separated closed-loop concurrencies, one run each")
    ap.add_argument("--port", type=int, default=0, help="the no-op server's port (0: free)")
    ap.add_argument("--serve", type=int, default=None, metavar="PORT",
                    help="only run the no-op server on PORT (used by this script)")
    args = ap.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0

    from tandem_engine.bench.api import measure
    from tandem_engine.bench.arrivals import Arrivals
    from tandem_engine.bench.workloads import BenchRequest
    from tandem_engine.cli.serve import free_port

    port = args.port or free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        print("command:", " ".join(sys.orig_argv))
        print(f"{args.num_requests} requests x {args.output_len} tokens against a no-op "
              f"server; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(f"{'concurrency':>11} {'req/s':>8} {'client CPU/req':>15} {'CPU/token':>10} "
              f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")
        requests = [BenchRequest("one two three four", args.output_len)] * args.num_requests
        for c in (int(x) for x in args.concurrency.split(",")):
            cpu0 = time.process_time()
            run = measure(f"http://127.0.0.1:{port}", MODEL, requests,
                          Arrivals("closed", concurrency=c))
            cpu = time.process_time() - cpu0
            s = run["summary"]
            assert s["requests"]["failed"] == 0, s["requests"]
            lat = s["latency_ms"]
            print(f"{c:>11} {s['throughput']['requests_per_s']:>8.0f} "
                  f"{cpu / args.num_requests * 1e3:>12.2f} ms "
                  f"{cpu / s['tokens']['output'] * 1e6:>7.0f} µs "
                  f"{lat['ttft']['p50']:>6.2f} ms {lat['ttft']['p99']:>6.2f} ms "
                  f"{lat['itl']['p50']:>5.3f} ms {lat['itl']['p99']:>5.3f} ms")
    finally:
        server.terminate()
        server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
