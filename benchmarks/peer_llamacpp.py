"""Tandem against llama.cpp's `llama-server` on the same GGUF, the same threads, in one run.

The peer is built here from the llama.cpp sources vendored in PyPI's `llama-cpp-python`
sdist (never committed): `pip download --no-deps --no-binary :all:
llama-cpp-python==VERSION`, its `vendor/llama.cpp` extracted under
`~/.cache/tandem/llamacpp/VERSION/`, CMake Release with the flags printed (GGML_NATIVE=ON;
`--amx off` by default: the issue's Intel machine crashed in llama.cpp's AMX tiles, and
its notes find AVX-512 VNNI as fast at batch 1), only `llama-server` and `llama-bench`
built. A build with the same version and flags is reused.

Then, one server at a time (never two up at once), each system answers:

* **batch 1**: one streamed `/v1/completions` request, a 64-token prompt from the
  packaged corpus, exactly 128 new tokens (`ignore_eos`), greedy; a warm-up, then
  `--repeats` runs: tokens/s over the whole request and decode tokens/s after the first;
* **64 at once**: the offline benchmark's workload (64 prompts of 32-512 tokens, outputs
  of 16-256, seed 0, `bench/workloads.py`), all sent together; generated tokens/s (the
  servers' own `usage` counts) over the wall time.

`llama-bench -p 64 -n 128` is printed too. Tandem runs as `tandem serve --model FILE
--engines 1 --threads T` plus each `--tandem-config NAME=ARGS`. It prints the CPU
(model, avx2/avx512/amx flags) and a table of tok/s with the ratio Tandem / llama.cpp.

    .venv/bin/python benchmarks/peer_llamacpp.py \\
        --tandem-config 'f32=--dtype float32 --quantization none' \\
        --tandem-config 'int4=--dtype float32 --quantization auto'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from decode_batch1 import cpu
from tandem_engine.bench.workloads import LengthSpec, TextSource, random_workload

VERSION = "0.3.36"
CACHE = Path.home() / ".cache" / "tandem" / "llamacpp"
TARGETS = ("llama-server", "llama-bench")
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 900.0


def cmake_flags(amx: bool) -> list[str]:
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DBUILD_SHARED_LIBS=OFF"]
    return flags + ([] if amx else ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                                    "-DGGML_AMX_BF16=OFF"])


def build_llamacpp(amx: bool, jobs: int) -> Path:
    """The folder holding llama-server and llama-bench, built once per version and flags."""
    flags = cmake_flags(amx)
    root = CACHE / VERSION
    build = root / f"build-{'amx' if amx else 'noamx'}"
    stamp = build / "flags.txt"
    if all((build / "bin" / t).is_file() for t in TARGETS) and stamp.is_file() and \
            stamp.read_text() == " ".join(flags):
        print(f"llama.cpp {VERSION}: reusing {build} (cmake {' '.join(flags)})", flush=True)
        return build / "bin"
    src = root / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"llama-cpp-python=={VERSION}", "-d", str(root)], check=True,
                       timeout=600)
        sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = "llama.cpp/" + m.name[len(prefix):]
            tar.extractall(root, members=members, filter="data")
    print(f"building llama.cpp {VERSION} in {build}: cmake {' '.join(flags)}", flush=True)
    started = time.monotonic()
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), *flags], check=True,
                   stdout=subprocess.DEVNULL, timeout=600)
    subprocess.run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(jobs)],
                   check=True, stdout=subprocess.DEVNULL, timeout=3600)
    (build / "flags.txt").write_text(" ".join(flags))
    print(f"built in {time.monotonic() - started:.0f} s", flush=True)
    return build / "bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(argv: list[str], health: str, log: Path) -> Iterator[None]:
    """A server process up until the block ends (its /health or /readyz answering 200)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{argv[0]} exited with {proc.returncode}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[0]} not ready after {START_TIMEOUT_S:.0f} s "
                                   f"(log: {log})")
            time.sleep(0.5)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def batch1(base: str, model: str, prompt: str, repeats: int) -> dict[str, float]:
    """One streamed request at a time: tok/s over the request and after the first token."""
    body = {"model": model, "prompt": prompt, "max_tokens": 128, "temperature": 0,
            "ignore_eos": True, "stream": True}
    runs = []
    for i in range(repeats + 1):
        started, stamps = time.perf_counter(), []
        with httpx.stream("POST", f"{base}/v1/completions", json=body,
                          timeout=REQUEST_TIMEOUT_S) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if any(c.get("text") for c in chunk.get("choices", [])):
                        stamps.append(time.perf_counter())
        if i == 0:
            continue  # warm-up
        n = len(stamps)
        runs.append((n / (stamps[-1] - started), (n - 1) / (stamps[-1] - stamps[0]),
                     stamps[0] - started))
    return {"tok_s": statistics.median(r[0] for r in runs),
            "tok_s_min": min(r[0] for r in runs), "tok_s_max": max(r[0] for r in runs),
            "decode_tok_s": statistics.median(r[1] for r in runs),
            "ttft_s": statistics.median(r[2] for r in runs), "chunks": len(stamps)}


def concurrent(base: str, model: str, requests: list) -> dict[str, float]:
    def one(r) -> int:
        reply = httpx.post(f"{base}/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
            "model": model, "prompt": r.prompt, "max_tokens": r.output_len,
            "temperature": 0, "ignore_eos": True})
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"])

    started = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        tokens = sum(pool.map(one, requests))
    wall = time.perf_counter() - started
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall}


WORKLOADS = ("batch1", "concurrent64")


def measure(base: str, model: str, prompt: str, requests: list, repeats: int,
            workloads: tuple[str, ...] = WORKLOADS) -> dict:
    """The workloads asked for; a workload the server fails (an HTTP error, a timeout) is
    reported as its error, and the others still measured."""
    out: dict = {}
    runs = {"batch1": lambda: batch1(base, model, prompt, repeats),
            "concurrent64": lambda: concurrent(base, model, requests)}
    for name, run in ((w, runs[w]) for w in workloads):
        try:
            out[name] = run()
        except httpx.HTTPError as exc:
            detail = exc.response.text[:300] if isinstance(exc, httpx.HTTPStatusError) else ""
            out[name] = {"error": f"{type(exc).__name__}: {exc} {detail}".strip()}
            print(f"  {name} failed: {out[name]['error']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="the GGUF (default: tandem's default model, pulled)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--amx", choices=("off", "on"), default="off")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tandem-config", action="append", default=[], metavar="NAME=ARGS",
                   help="a Tandem configuration: its name and extra `tandem serve` flags")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    workloads = tuple(w for w in args.workloads.split(",") if w)
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        p.error(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    bins = build_llamacpp(args.amx == "on", jobs=os.cpu_count() or 2)
    if args.build_only:
        return 0
    model = args.model or subprocess.run(
        [str(Path(sys.executable).parent / "tandem"), "models", "pull",
         "smollm2-135m-instruct"], check=True, capture_output=True,
        text=True).stdout.strip().splitlines()[-1].split()[-1]
    configs = [c.split("=", 1) for c in args.tandem_config] or [["int4", ""]]
    print(f"CPU: {cpu()}; {args.threads} threads; model {model}", flush=True)
    source = TextSource(1.15)  # SmolLM2's tokens per corpus word: 64-token prompts
    prompt = source.text(64, random.Random(1))
    requests = random_workload(args.requests, source, LengthSpec(272, 240),
                               LengthSpec(136, 120), seed=0)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    results: dict[str, dict] = {}
    bench = subprocess.run([str(bins / "llama-bench"), "-m", model, "-t", str(args.threads),
                            "-p", "64", "-n", "128", "-o", "json"], capture_output=True,
                           text=True, timeout=900)
    for row in json.loads(bench.stdout or "[]"):
        kind = "pp64" if row.get("n_prompt") else "tg128"
        print(f"llama-bench {kind}: {row['avg_ts']:.1f} tok/s", flush=True)
        results[f"llama-bench {kind}"] = {"tok_s": row["avg_ts"]}
    port = free_port()
    with server([str(bins / "llama-server"), "-m", model, "-t", str(args.threads), "-tb",
                 str(args.threads), "--port", str(port), "-np", str(args.requests), "-c",
                 str(args.requests * 800), "--no-webui"],
                f"http://127.0.0.1:{port}/health", logs / "peer-llama-server.log"):
        results["llama.cpp"] = measure(f"http://127.0.0.1:{port}", "m", prompt, requests,
                                       args.repeats, workloads)
    for name, extra in configs:
        port = free_port()
        argv = [str(Path(sys.executable).parent / "tandem"), "serve", "--model", model,
                "--engines", "1", "--threads", str(args.threads), "--port", str(port),
                *shlex.split(extra)]
        try:
            with server(argv, f"http://127.0.0.1:{port}/readyz",
                        logs / f"peer-tandem-{name}.log"):
                served = httpx.get(f"http://127.0.0.1:{port}/v1/models",
                                   timeout=10).json()["data"][0]["id"]
                results[f"tandem {name}"] = measure(f"http://127.0.0.1:{port}", served,
                                                    prompt, requests, args.repeats, workloads)
        except RuntimeError as exc:
            print(f"tandem {name} ({extra}): {exc}", flush=True)
    peer = results["llama.cpp"]
    print("\n| system | batch 1 tok/s (range) | decode tok/s | TTFT s | 64 at once tok/s |"
          " batch 1 / llama.cpp | 64 / llama.cpp |")
    print("|---|---|---|---|---|---|---|")
    def ratio(r: dict, workload: str) -> str:
        if workload not in r:
            return "-"
        mine, theirs = r[workload].get("tok_s"), peer[workload].get("tok_s")
        return "failed" if mine is None or theirs is None else f"{mine / theirs:.2f}x"

    for name, r in results.items():
        if not any(w in r for w in WORKLOADS):
            continue
        b, c = r.get("batch1"), r.get("concurrent64")
        one = ("- | - | -" if b is None else "failed | - | -" if "error" in b else
               f"{b['tok_s']:.1f} ({b['tok_s_min']:.1f}-{b['tok_s_max']:.1f}) | "
               f"{b['decode_tok_s']:.1f} | {b['ttft_s']:.3f}")
        many = "-" if c is None else "failed" if "error" in c else f"{c['tok_s']:.1f}"
        print(f"| {name} | {one} | {many} | {ratio(r, 'batch1')} | "
              f"{ratio(r, 'concurrent64')} |")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu(), "cmake": cmake_flags(args.amx == "on"),
                                         "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
