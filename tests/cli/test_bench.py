"""`tandem bench`: the pure parts (workloads, arrivals, percentiles, SLOs, sweeps,
summaries, the multi-adapter workload) in-process, then the command against one `tandem
serve --demo` per module, and a multi-adapter run against a stack serving two adapters."""

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
    summarize_by_model,
    timeline,
)
from tandem_engine.bench.schema import REPORT_SCHEMA
from tandem_engine.bench.sweep import SweepError, parse_sweep, sweep_points
from tandem_engine.bench.workloads import (
    BenchRequest,
    LengthSpec,
    TextSource,
    WorkloadError,
    assign_models,
    load_trace,
    model_names,
    random_workload,
    save_trace,
    shared_prefix_workload,
    sharegpt_workload,
)
from tandem_engine.cli.serve import free_port
from test_serve import start_serve, stop_serve

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


def test_a_multi_adapter_workload_draws_each_requests_model_by_the_seed() -> None:
    """vLLM's --lora-modules: a random name per request; the same seed gives request i the
    same name whatever the workload's lengths and words; a name given twice is drawn
    about twice as often."""
    assert model_names(["a,b", "base", " c "]) == ["a", "b", "base", "c"]
    with pytest.raises(WorkloadError, match="--lora-modules"):
        model_names(["a,,b"])
    source = TextSource()
    reqs = random_workload(600, source, LengthSpec(8, 4), LengthSpec(4, 2), seed=3)
    models = [r.model for r in assign_models(reqs, ["a", "b", "b"], seed=3)]
    assert Counter(models).keys() == {"a", "b"}
    assert 1.6 < Counter(models)["b"] / Counter(models)["a"] < 2.5
    other = random_workload(600, source, LengthSpec(50, 0), LengthSpec(9), seed=3, variant=2)
    assert [r.model for r in assign_models(other, ["a", "b", "b"], seed=3)] == models
    assert [r.model for r in assign_models(reqs, ["a", "b", "b"], seed=4)] != models
    assert [r.prompt for r in assign_models(reqs, ["a"], seed=3)] == [r.prompt for r in reqs]


def test_summaries_by_model_add_up_to_the_runs() -> None:
    records = [_record(0, 0.0, [0.1, 0.2, 0.3], 10, 3, 4),
               _record(1, 0.5, [1.5, 1.6, 2.5], 20, 3, 0),
               _record(2, 0.6, [0.7, 0.9], 5, 2, 0),
               RequestRecord(index=3, output_len=3, sent_s=0.2, error="HTTP 500: boom")]
    for r, model in zip(records, ["a", "b", "a", "b"], strict=True):
        r.model = model
    whole = summarize(records, 4.0, {"ttft": 500.0})
    parts = summarize_by_model(records, 4.0, {"ttft": 500.0})
    assert list(parts) == ["a", "b"]
    assert parts["a"]["requests"] == {"sent": 2, "completed": 2, "failed": 0}
    assert parts["b"]["requests"] == {"sent": 2, "completed": 1, "failed": 1}
    assert parts["a"]["latency_ms"]["ttft"]["count"] == 2
    _assert_parts_add_up(whole, parts)


def _assert_parts_add_up(whole: dict, parts: dict[str, dict]) -> None:
    """Counts, tokens and throughputs of the per-model summaries sum to the run's."""
    for key in ("sent", "completed", "failed"):
        assert sum(p["requests"][key] for p in parts.values()) == whole["requests"][key]
    for key in ("input", "output"):
        assert sum(p["tokens"][key] for p in parts.values()) == whole["tokens"][key]
    for key, value in whole["throughput"].items():
        assert sum(p["throughput"][key] for p in parts.values()) == pytest.approx(value)
    assert {p["duration_s"] for p in parts.values()} == {whole["duration_s"]}
    assert sum(p["latency_ms"]["ttft"]["count"] for p in parts.values()
               if p["latency_ms"]["ttft"]) == whole["latency_ms"]["ttft"]["count"]


def test_a_trace_keeps_each_requests_model(tmp_path: Path) -> None:
    reqs = [BenchRequest("one", 2, model="a"), BenchRequest("two", 3)]
    save_trace(tmp_path / "t.jsonl", reqs, [0.0, 0.1])
    assert [(r.prompt, r.model) for r in load_trace(tmp_path / "t.jsonl")] == [
        ("one", "a"), ("two", None)]
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 0, "prompt": "x", "output_len": 1, '
                                        '"model": 5}\n')
    with pytest.raises(WorkloadError, match=r"bad.jsonl:1: .*may name a model"):
        load_trace(tmp_path / "bad.jsonl")


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
    (["--lora-modules", "a,"], "--lora-modules 'a,': give served model names"),
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


# ---- a multi-adapter workload against a stack serving two adapters ---------------------


@pytest.fixture(scope="module")
def lora_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    """`tandem serve` of the tiny model as `tiny`: one engine serving adapters a and b.
    Yields the router's URL and the engine's metrics URL."""
    from test_lora import make_adapter

    tmp = tmp_path_factory.mktemp("bench-lora")
    a = make_adapter(tiny_llama, tmp / "adapters" / "a", 4, ["q_proj", "v_proj"], 1)
    b = make_adapter(tiny_llama, tmp / "adapters" / "b", 8, ["down_proj"], 2)
    port = free_port()
    proc, _ = start_serve(tmp, "--model", str(tiny_llama), "--served-model-name", "tiny",
                          "--port", str(port), "--engines", "1", "--threads", "1",
                          "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                          "--lora-modules", f"a={a}", f"b={b}")
    try:
        stack = json.loads((tmp / f"tandem-{port}" / "stack.json").read_text())
        yield f"http://127.0.0.1:{port}", stack["engines"][0]["metrics_url"]
    finally:
        stop_serve(proc)


def _adapter_requests(metrics_url: str) -> float:
    """Requests the engine ran under some adapter: each is a slot hit or a slot load."""
    text = httpx.get(metrics_url, timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("tandem_lora_hits_total", "tandem_lora_loads_total")))


@slow
def test_a_multi_adapter_run_reaches_every_adapter_and_its_rows_add_up(
        lora_server: tuple[str, str], tmp_path: Path) -> None:
    """`--lora-modules a b,tiny` (vLLM's flag; the base model named among them) spreads
    the requests over both adapters and the base model; the report's per-model summaries
    add up to the run's, and the engine ran exactly the adapters' requests under one."""
    url, metrics_url = lora_server
    before = _adapter_requests(metrics_url)
    got = _bench("--base-url", url, "--model", "tiny", "--lora-modules", "a", "b,tiny",
                 "--num-requests", "18", "--concurrency", "3", "--input-len", "16",
                 "--output-len", "6", "--output-spread", "0", "--warmup", "0", "--seed", "5",
                 "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html"),
                 "--save-trace", str(tmp_path / "t.jsonl"), "--quiet", timeout=120)
    assert got.returncode == 0, got.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["config"]["workload"]["lora_modules"] == ["a", "b", "tiny"]
    (run,) = report["runs"]
    rows, parts = run["requests"], run["by_model"]
    sent = Counter(r["model"] for r in rows)
    assert list(parts) == ["a", "b", "tiny"] and set(sent) == set(parts)
    for name, part in parts.items():
        assert part["requests"] == {"sent": sent[name], "completed": sent[name], "failed": 0}
        assert part["tokens"]["output"] == 6 * sent[name]
        assert part["latency_ms"]["ttft"]["count"] == sent[name]
    _assert_parts_add_up(run["summary"], parts)
    assert _adapter_requests(metrics_url) - before == sent["a"] + sent["b"]
    # the same seed sends the same request indices to the same adapters
    again = _bench("--base-url", url, "--model", "tiny", "--lora-modules", "a,b,tiny",
                   "--num-requests", "18", "--output-len", "2", "--warmup", "1", "--seed",
                   "5", "--json", str(tmp_path / "again.json"), "--quiet", timeout=120)
    assert again.returncode == 0, again.stderr
    assert [r["model"] for r in json.loads((tmp_path / "again.json").read_text())[
        "runs"][0]["requests"]] == [r["model"] for r in rows]
    assert [t.model for t in load_trace(tmp_path / "t.jsonl")] == [
        r["model"] for r in sorted(rows, key=lambda r: r["sent_s"])]
    table = got.stdout.splitlines()
    head = next(i for i, line in enumerate(table) if line.split()[:3] == ["model", "sent", "ok"])
    assert [line.split()[:3] for line in table[head + 1:head + 4]] == [
        [name, str(sent[name]), str(sent[name])] for name in ("a", "b", "tiny")]
    page = (tmp_path / "r.html").read_text()
    assert "per model (latencies in ms)" in page and "TTFT p50" in page


@slow
def test_an_adapter_the_server_lacks_is_named_before_any_request(
        lora_server: tuple[str, str]) -> None:
    got = _bench("--base-url", lora_server[0], "--model", "tiny", "--lora-modules", "a,zz",
                 "--quiet")
    assert got.returncode == 2
    assert "--lora-modules 'zz': not served at" in got.stderr and "a, b" in got.stderr
