"""Clients sending completions back to back until SIGTERM: the admission tests' load, run
as a process of its own (`python benchmarks/load_clients.py URL ...`). In the measuring process its
ten client threads would hold the GIL that the measured client needs for every line it
reads (a switch interval is 5 ms): the light tenant's time to first token then measured
the heavy tenant's client, not the router and engine. On exit it prints
{"done": N, "errors": [...]} on stdout.

`ttft` is the one request both use: stream a completion, return the seconds to its first
text. Each thread keeps one `httpx.Client` (its connections kept alive), as an OpenAI SDK
client does: building a client costs about 15 ms of CPU (its TLS context), which on a busy
2-core machine would be most of what a light tenant's measured TTFT is."""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time

import httpx

MODEL = "tiny"  # the tests' served name (test_router_e2e.MODEL)
_local = threading.local()


def client() -> httpx.Client:
    """This thread's client (made once, connections kept alive)."""
    c = getattr(_local, "client", None)
    if c is None:
        c = _local.client = httpx.Client(timeout=120)
    return c


def ttft(url: str, prompt: str, max_tokens: int = 8, headers: dict | None = None,
         model: str = MODEL, **extra) -> float:
    http = client()
    started = time.monotonic()
    with http.stream("POST", f"{url}/v1/completions", headers=headers or {},
                     json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                           "stream": True, "ignore_eos": True, "temperature": 0,
                           **extra}) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"text"' in line:
                first = time.monotonic() - started
        return first if first is not None else time.monotonic() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--header", action="append", default=[], metavar="NAME=VALUE")
    args = p.parse_args()
    headers = dict(h.split("=", 1) for h in args.header)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    done: list[int] = [0] * args.threads
    errors: list[str] = []

    def run(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                ttft(args.url, f"Background {i}.{n}: once upon a time", args.max_tokens,
                     headers, args.model)
                done[i] += 1
            except Exception as exc:  # reported to the test
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(i,), daemon=True)
               for i in range(args.threads)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(120)
    print(json.dumps({"done": sum(done), "errors": errors[:20]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
