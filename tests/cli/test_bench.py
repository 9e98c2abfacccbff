"""`tandem bench`: the pure parts (workloads, arrivals, percentiles, SLOs, sweeps,
summaries) in-process, then the command against one `tandem serve --demo` per module."""

from __future__ import annotations

import base64
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import pytest
from tandem_engine.bench.arrivals import ArrivalError, Arrivals, send_offsets
from tandem_engine.bench.client import EndpointError, RequestRecord, normalize_base_url
from tandem_engine.bench.metrics import (
    SLOError,
    parse_slo,
    percentile,
    stats,
    summarize,
    timeline,
)
from tandem_engine.bench.schema import REPORT_SCHEMA
from tandem_engine.bench.sweep import SweepError, parse_sweep, sweep_points
from tandem_engine.bench.workloads import (
    BenchRequest,
    LengthSpec,
    TextSource,
    WorkloadError,
    load_trace,
    random_workload,
    save_trace,
    shared_prefix_workload,
    sharegpt_workload,
)
from tandem_engine.cli.serve import free_port
from test_serve import start_serve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# ---- pure parts -------------------------------------------------------------------------


@pytest.mark.parametrize("q", [0, 1, 37.5, 50, 90, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = [random.Random(i).expovariate(0.1) for i in range(57)]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_stats_orders_percentiles_and_is_none_when_empty() -> None:
    s = stats([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s is not None
    assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    assert (s["count"], s["mean"], s["p50"]) == (5, 3.0, 3.0)
    assert stats([]) is None
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_parse_slo_units_and_errors() -> None:
    assert parse_slo("ttft=500ms,itl=50,e2e=2s,tpot=1500us") == {
        "ttft": 500.0, "itl": 50.0, "e2e": 2000.0, "tpot": 1.5}
    assert parse_slo(None) == {}
    for bad, words in (("ttft", "KEY=VALUE"), ("latency=5ms", "unknown key 'latency'"),
                       ("ttft=5ms,ttft=6ms", "twice"), ("ttft=0", "> 0"),
                       ("ttft=5min", "KEY=VALUE")):
        with pytest.raises(SLOError, match=words):
            parse_slo(bad)


def test_length_specs() -> None:
    rng = random.Random(0)
    assert {LengthSpec(7, 5, "fixed").sample(rng) for _ in range(20)} == {7}
    uniform = [LengthSpec(10, 4).sample(rng) for _ in range(500)]
    assert min(uniform) == 6 and max(uniform) == 14
    normal = [LengthSpec(3, 50, "normal").sample(rng) for _ in range(500)]
    assert min(normal) >= 1 and len(set(normal)) > 20
    with pytest.raises(WorkloadError, match="unknown length distribution 'zipf'"):
        LengthSpec(5, 1, "zipf")
    with pytest.raises(WorkloadError, match="mean >= 1"):
        LengthSpec(0)


def test_random_workload_is_deterministic_and_sized_in_words() -> None:
    source = TextSource(tokens_per_word=2.0)
    a = random_workload(20, source, LengthSpec(100, 0), LengthSpec(8, 2), seed=4)
    b = random_workload(20, source, LengthSpec(100, 0), LengthSpec(8, 2), seed=4)
    assert a == b
    assert a != random_workload(20, source, LengthSpec(100, 0), LengthSpec(8, 2), seed=5)
    assert {len(r.prompt.split()) for r in a} == {50}  # 100 tokens at 2 tokens per word
    other = random_workload(20, source, LengthSpec(100, 0), LengthSpec(8, 2), 4, variant=1)
    assert [r.output_len for r in other] == [r.output_len for r in a]  # same lengths ...
    assert not {r.prompt for r in other} & {r.prompt for r in a}  # ... other words
    assert all(6 <= r.output_len <= 10 for r in a)


def test_shared_prefix_workload_shares_one_prompt_per_group() -> None:
    reqs = shared_prefix_workload(9, TextSource(), groups=3, prefix_len=40,
                                  suffix=LengthSpec(10, 0), output=LengthSpec(4), seed=0)
    prefixes = [r.prompt.split("\n\n")[0] for r in reqs]
    assert [r.group for r in reqs] == [0, 1, 2] * 3
    for g in range(3):
        assert len({p for p, r in zip(prefixes, reqs, strict=True) if r.group == g}) == 1
    assert len(set(prefixes)) == 3 and len({r.prompt for r in reqs}) == 9
    with pytest.raises(WorkloadError, match="--prefix-groups"):
        shared_prefix_workload(2, TextSource(), 0, 5, LengthSpec(1), LengthSpec(1), 0)


def test_sharegpt_workload(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hello there"},
                           {"from": "gpt", "value": "one two three four"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"id": "no conversations"}]))
    reqs = sharegpt_workload(path, 3, None, seed=0)
    assert reqs == [BenchRequest("hello there", 4)] * 3
    assert sharegpt_workload(path, 1, LengthSpec(9), seed=0)[0].output_len == 9
    path.write_text("[]")
    with pytest.raises(WorkloadError, match="no conversation with a prompt and a reply"):
        sharegpt_workload(path, 1, None, 0)
    with pytest.raises(WorkloadError, match=r"--dataset .*cannot read"):
        sharegpt_workload(tmp_path / "missing.json", 1, None, 0)


def test_trace_round_trip_and_errors(tmp_path: Path) -> None:
    reqs = [BenchRequest(f"prompt {i}\nwith \"quotes\"", i + 1) for i in range(4)]
    path = tmp_path / "t.jsonl"
    save_trace(path, reqs, [0.3, 0.1, 0.2, 0.0])
    back = load_trace(path)
    assert [(r.prompt, r.output_len, r.arrival_s) for r in back] == [
        (reqs[i].prompt, reqs[i].output_len, t) for i, t in ((3, 0.0), (1, 0.1), (2, 0.2),
                                                             (0, 0.3))]
    path.write_text('{"arrival_s": 0, "prompt": "x"}\n')
    with pytest.raises(WorkloadError, match=r"t.jsonl:1: a row needs .*output_len"):
        load_trace(path)
    path.write_text('{"tandem_bench_trace": 99}\n')
    with pytest.raises(WorkloadError, match="trace version 99"):
        load_trace(path)


def test_arrivals() -> None:
    offsets = send_offsets(Arrivals("poisson", rate=4.0), 4000, seed=1)
    assert offsets is not None and offsets == sorted(offsets) and offsets[0] == 0
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() == pytest.approx(0.25, rel=0.08)  # exponential: std == mean
    assert offsets == send_offsets(Arrivals("poisson", rate=4.0), 4000, seed=1)
    assert send_offsets(Arrivals("burst"), 3, 0) == [0.0, 0.0, 0.0]
    assert send_offsets(Arrivals("closed", concurrency=2), 3, 0) is None
    assert send_offsets(Arrivals("trace"), 2, 0, [0.5, 0.1]) == [0.5, 0.1]
    with pytest.raises(ArrivalError, match="--workload trace"):
        send_offsets(Arrivals("trace"), 2, 0, [None, None])
    with pytest.raises(ArrivalError, match="--rate must be > 0"):
        Arrivals("poisson", rate=0)
    with pytest.raises(ArrivalError, match="--concurrency must be >= 1"):
        Arrivals("closed", concurrency=0)
    assert Arrivals("burst", max_concurrency=3).in_flight_limit == 3
    assert Arrivals("closed", concurrency=5).in_flight_limit == 5


def test_parse_sweep() -> None:
    assert parse_sweep("rate=1,2.5,4") == ("rate", [1.0, 2.5, 4.0])
    param, values = parse_sweep("concurrency=1,8")
    points = sweep_points(param, values, Arrivals("closed", concurrency=3))
    assert [(p, a.kind, a.concurrency) for p, a in points] == [
        ({"concurrency": 1}, "closed", 1), ({"concurrency": 8}, "closed", 8)]
    for bad, words in (("qps=1,2", "expected rate="), ("rate=1,x", "numbers"),
                       ("rate=0,1", "> 0"), ("concurrency=1.5", "whole numbers")):
        with pytest.raises(SweepError, match=words):
            parse_sweep(bad)


def _record(i: int, sent: float, times: list[float], prompt: int, out: int,
            cached: int | None = None) -> RequestRecord:
    return RequestRecord(index=i, output_len=out, sent_s=sent, first_token_s=times[0],
                         done_s=times[-1], chunk_times=times, prompt_tokens=prompt,
                         completion_tokens=out, cached_tokens=cached)


def test_summarize_on_known_records() -> None:
    records = [_record(0, 0.0, [0.1, 0.2, 0.3], 10, 3, 4),
               _record(1, 0.5, [1.5, 1.6, 2.5], 20, 3, 0),
               RequestRecord(index=2, output_len=3, sent_s=0.2, error="HTTP 500: boom")]
    s = summarize(records, 4.0, {"ttft": 500.0, "itl": 200.0})
    assert s["requests"] == {"sent": 3, "completed": 2, "failed": 1}
    assert s["tokens"] == {"input": 30, "output": 6, "cached": 4}
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(6 / 4.0)
    assert s["throughput"]["requests_per_s"] == pytest.approx(2 / 4.0)
    assert s["latency_ms"]["ttft"]["max"] == pytest.approx(1000.0)
    assert s["latency_ms"]["tpot"]["p50"] == pytest.approx((100 + 500) / 2)
    # request 0 meets both; request 1's TTFT (1 s) misses
    assert s["goodput"]["good_requests"] == 1
    assert s["goodput"]["requests_per_s"] <= s["throughput"]["requests_per_s"]
    assert s["prefix_cache"]["hit_rate"] == pytest.approx(4 / 30)
    assert summarize(records, 4.0, {})["goodput"] is None
    tl = timeline(records, 4.0, bin_s=0.5)
    assert sum(tl["output_tokens_per_s"]) * 0.5 == pytest.approx(6)
    assert tl["running_requests"][0] == 2  # at 0.25 s: requests 0 and 2 (never finished)


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere() -> None:
    import io

    from tandem_engine.bench.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, bar in ((Terminal(), True), (io.StringIO(), False)):
        progress = Progress(stream=stream)
        progress.phase("running")
        progress.start(2, "requests")
        progress.advance()
        progress.close()
        assert stream.getvalue().startswith("tandem bench: running\n")
        assert ("0/2" in stream.getvalue()) is bar
    quiet = io.StringIO()
    progress = Progress(quiet=True, stream=quiet)
    progress.phase("running")
    progress.start(2, "requests")
    progress.advance()
    progress.close()
    assert quiet.getvalue() == ""


def test_normalize_base_url() -> None:
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    assert normalize_base_url("https://h") == "https://h"
    with pytest.raises(EndpointError, match="needs http:// or https://"):
        normalize_base_url("localhost:8000")


def _bench_args(*flags: str):
    from tandem_engine.cli.main import build_parser

    return build_parser().parse_args(["bench", "--base-url", "http://127.0.0.1:1",
                                      "--model", "m", *flags])


@pytest.mark.parametrize(("vllm", "tandem"), [
    (["--num-prompts", "5", "--request-rate", "2.5"], ["--num-requests", "5", "--rate", "2.5"]),
    (["--request-rate", "inf"], ["--burst"]),
    (["--request-rate", "inf", "--max-concurrency", "3"], ["--burst", "--max-concurrency", "3"]),
])
def test_vllm_bench_serve_flag_names_mean_the_same(vllm: list[str], tandem: list[str]) -> None:
    """`vllm bench serve --num-prompts N --request-rate R` (R = inf: all at once) works
    as written: the same workload size and arrivals as Tandem's own flags."""
    from tandem_engine.bench.cli import _arrivals

    theirs, ours = _bench_args(*vllm), _bench_args(*tandem)
    assert theirs.num_requests == ours.num_requests
    assert _arrivals(theirs) == _arrivals(ours)


def test_bench_help_names_the_vllm_spellings(capsys) -> None:
    with pytest.raises(SystemExit):
        _bench_args("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--num-requests N, --num-prompts N" in text
    assert "--rate R, --request-rate R" in text and "inf: every request at once" in text


# ---- the command against `tandem serve --demo` -----------------------------------------


def _bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem_engine.cli.main", "bench", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(("args", "words"), [
    (["--workload", "poisson"], "argument --workload: invalid choice: 'poisson'"),
    (["--slo", "ttft:5"], "--slo 'ttft:5': cannot read"),
    (["--sweep", "qps=1"], "--sweep 'qps=1': expected rate="),
    (["--workload", "trace"], "--workload trace and --trace FILE go together"),
    (["--trace", "/nonexistent.jsonl", "--workload", "trace"], "no such file"),
    (["--num-requests", "0"], "--num-requests must be in [1, "),
    (["--base-url", "localhost:1"], "needs http:// or https://"),
])
def test_bad_input_gives_one_clear_line(args: list[str], words: str) -> None:
    port = free_port()
    got = _bench("--base-url", f"http://127.0.0.1:{port}", "--model", "m",
                 "--connect-deadline", "1", "--quiet", *args)
    assert got.returncode == 2, got.stderr
    last = got.stderr.strip().splitlines()[-1]  # argparse prints its usage above
    assert last.startswith("tandem bench: error: ") and words in last
    assert "Traceback" not in got.stderr


def test_unreachable_server_fails_within_its_deadline() -> None:
    start = time.monotonic()
    got = _bench("--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m",
                 "--connect-deadline", "1.5", "--quiet")
    assert got.returncode == 2
    assert "no OpenAI API answered within 1.5 s" in got.stderr
    assert "--connect-deadline" in got.stderr
    assert time.monotonic() - start < 15


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory):
    """One `tandem serve --demo` (one engine) for the module's end-to-end tests."""
    tmp = tmp_path_factory.mktemp("bench-serve")
    port = free_port()
    proc, _ = start_serve(tmp, "--demo", "--demo-dir", str(tmp / "demo"), "--port", str(port),
                          "--engines", "1", "--threads", "1")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def first_run(demo_server: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench-out")
    got = _bench("--base-url", demo_server + "/v1", "--model", "demo-model",
                 "--num-requests", "12", "--concurrency", "3", "--input-len", "48",
                 "--input-spread", "24", "--output-len", "12", "--output-spread", "6",
                 "--slo", "ttft=2s,itl=1s", "--json", str(out / "r.json"),
                 "--plot", str(out / "plots"), "--html", str(out / "r.html"),
                 "--save-trace", str(out / "t.jsonl"), "--warmup", "1")
    assert got.returncode == 0, got.stderr
    assert "TTFT ms mean / p50 / p90 / p99" in got.stdout
    assert "goodput (ttft<=2000ms, itl<=1000ms)" in got.stdout
    return out


def _tokenize(base: str, prompt: str) -> int:
    return httpx.post(f"{base}/tokenize", json={"model": "demo-model", "prompt": prompt},
                      timeout=10).json()["count"]


slow = pytest.mark.slow


@slow
def test_report_is_valid_and_consistent(first_run: Path, demo_server: str) -> None:
    report = json.loads((first_run / "r.json").read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["server"]["tokens_per_word_source"] == "tokenize"
    assert report["server"]["version"] == {"version": report["environment"]["tandem_version"]}
    assert "--slo" in report["command"]
    (run,) = report["runs"]
    s, rows = run["summary"], run["requests"]
    assert s["requests"] == {"sent": 12, "completed": 12, "failed": 0}
    # token counts are the server's: exact outputs (ignore_eos), prompts as /tokenize says
    assert all(r["completion_tokens"] == r["output_len"] for r in rows)
    trace = load_trace(first_run / "t.jsonl")
    assert Counter(r["prompt_tokens"] for r in rows) == Counter(
        _tokenize(demo_server, t.prompt) for t in trace)
    assert s["tokens"]["input"] == sum(r["prompt_tokens"] for r in rows)
    assert s["tokens"]["output"] == sum(r["completion_tokens"] for r in rows)
    assert s["tokens"]["cached"] == sum(r["cached_tokens"] for r in rows)
    d = s["duration_s"]
    assert d >= max(r["sent_s"] + r["e2e_ms"] / 1e3 for r in rows) - 1e-3
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(s["tokens"]["output"] / d)
    assert s["throughput"]["input_tokens_per_s"] == pytest.approx(s["tokens"]["input"] / d)
    assert s["throughput"]["requests_per_s"] == pytest.approx(12 / d)
    for name in ("ttft", "itl", "tpot", "e2e"):
        st = s["latency_ms"][name]
        assert 0 <= st["min"] <= st["p50"] <= st["p90"] <= st["p99"] <= st["max"], name
    assert s["latency_ms"]["itl"]["count"] == sum(len(r["itl_ms"]) for r in rows)
    assert all(r["ttft_ms"] <= r["e2e_ms"] for r in rows)
    assert s["goodput"]["requests_per_s"] <= s["throughput"]["requests_per_s"]
    assert s["prefix_cache"]["reported"] is True
    assert [c["versions"] for c in run["weight_versions"]] == [["initial"]]
    tl = run["timeline"]
    assert sum(tl["output_tokens_per_s"]) * tl["bin_s"] == pytest.approx(s["tokens"]["output"])


@slow
def test_plots_and_html(first_run: Path) -> None:
    pngs = sorted((first_run / "plots").glob("*.png"))
    assert [p.name for p in pngs] == ["latency_cdf.png", "timeline.png"]
    page = (first_run / "r.html").read_text()
    for png in pngs:
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    assert page.count("src='data:image/png;base64,") == 2
    for chunk in page.split("base64,")[1:]:
        assert base64.b64decode(chunk.split("'")[0]).startswith(PNG_MAGIC)
    assert "requests completed / sent" in page and "<script" not in page


@slow
def test_trace_replays_the_same_requests(first_run: Path, demo_server: str,
                                         tmp_path: Path) -> None:
    got = _bench("--base-url", demo_server, "--model", "demo-model", "--workload", "trace",
                 "--trace", str(first_run / "t.jsonl"), "--num-requests", "12",
                 "--save-trace", str(tmp_path / "again.jsonl"), "--json",
                 str(tmp_path / "r.json"), "--quiet", "--warmup", "0")
    assert got.returncode == 0, got.stderr
    assert got.stderr == ""  # --quiet
    first, again = load_trace(first_run / "t.jsonl"), load_trace(tmp_path / "again.jsonl")
    assert [(r.prompt, r.output_len) for r in again] == [
        (r.prompt, r.output_len) for r in first]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["runs"][0]["arrivals"]["kind"] == "trace"
    before = json.loads((first_run / "r.json").read_text())["runs"][0]["requests"]
    assert Counter(r["prompt_tokens"] for r in report["runs"][0]["requests"]) == Counter(
        r["prompt_tokens"] for r in before)


@slow
def test_sweep_and_shared_prefix_cache_hits(demo_server: str, tmp_path: Path) -> None:
    got = _bench("--base-url", demo_server, "--model", "demo-model", "--workload",
                 "shared-prefix", "--prefix-groups", "2", "--prefix-len", "64",
                 "--input-len", "8", "--output-len", "4", "--num-requests", "8",
                 "--sweep", "concurrency=1,4", "--json", str(tmp_path / "s.json"),
                 "--plot", str(tmp_path / "p"), "--warmup", "0")
    assert got.returncode == 0, got.stderr
    assert "== sweep (latencies in ms)" in got.stdout
    report = json.loads((tmp_path / "s.json").read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["sweep"] == {"parameter": "concurrency", "values": [1.0, 4.0]}
    assert [r["point"] for r in report["runs"]] == [{"concurrency": 1}, {"concurrency": 4}]
    # each group's system prompt is computed once; every later request hits the cache
    cached = report["runs"][0]["summary"]["prefix_cache"]["cached_tokens"]
    assert cached >= 6 * 48
    assert (tmp_path / "p" / "sweep.png").read_bytes().startswith(PNG_MAGIC)


@slow
def test_model_not_served_is_named(demo_server: str) -> None:
    got = _bench("--base-url", demo_server, "--model", "gpt-9", "--quiet")
    assert got.returncode == 2
    assert "--model 'gpt-9' is not served at" in got.stderr
    assert "demo-model" in got.stderr


@slow
def test_a_vllm_style_burst_runs(demo_server: str, tmp_path: Path) -> None:
    got = _bench("--base-url", demo_server, "--model", "demo-model", "--num-prompts", "3",
                 "--request-rate", "inf", "--output-len", "4", "--output-spread", "0",
                 "--warmup", "0", "--quiet", "--json", str(tmp_path / "r.json"))
    assert got.returncode == 0, got.stderr
    (run,) = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert run["arrivals"]["kind"] == "burst"
    assert run["summary"]["requests"] == {"sent": 3, "completed": 3, "failed": 0}
