"""The report a run produces: the JSON document (`--json`) and the console table.

`build_report` is pure: it takes what the run measured and what the command was, and
returns the document described by `schema.REPORT_SCHEMA` (docs/bench.md).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

from tandem_engine.bench.arrivals import Arrivals
from tandem_engine.bench.metrics import (
    request_rows,
    summarize,
    summarize_by_model,
    timeline,
)
from tandem_engine.bench.runner import RunResult
from tandem_engine.bench.schema import SCHEMA_VERSION


def _tandem_version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def run_entry(result: RunResult, arrivals: Arrivals, slo: dict[str, float],
              point: dict | None, by_model: bool = False) -> dict:
    """One run of the report; `by_model` (a multi-adapter workload) adds the summary of
    each model's requests."""
    return {"point": point, "arrivals": arrivals.to_json(),
            "summary": summarize(result.records, result.duration_s, slo),
            "by_model": summarize_by_model(result.records, result.duration_s, slo)
            if by_model else None,
            "timeline": timeline(result.records, result.duration_s),
            "weight_versions": result.weight_versions,
            "requests": request_rows(result.records)}


def build_report(*, command: list[str], server: dict, config: dict, sweep: dict | None,
                 runs: list[dict]) -> dict:
    return {"schema_version": SCHEMA_VERSION, "tool": "tandem bench",
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command,
            "environment": {"tandem_version": _tandem_version(),
                            "python_version": platform.python_version(),
                            "platform": platform.platform()},
            "server": server, "config": config, "sweep": sweep, "runs": runs}


def write_json(report: dict, path: Path) -> None:
    # NaN/inf never appear (empty stats are null); allow_nan=False keeps the file strict.
    Path(path).write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.1f}"


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """(label, value) rows of one run's summary: the console table and the HTML page."""
    req, thr, tok = summary["requests"], summary["throughput"], summary["tokens"]
    rows = [("requests completed / sent", f"{req['completed']} / {req['sent']}"),
            ("duration", f"{summary['duration_s']:.2f} s"),
            ("requests/s", f"{thr['requests_per_s']:.3f}"),
            ("input tokens/s", f"{thr['input_tokens_per_s']:,.1f}"),
            ("output tokens/s", f"{thr['output_tokens_per_s']:,.1f}"),
            ("tokens in / out", f"{tok['input']:,} / {tok['output']:,}")]
    for name, label in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"),
                        ("e2e", "E2E")):
        s = summary["latency_ms"][name]
        rows.append((f"{label} ms mean / p50 / p90 / p99",
                     "-" if s is None else " / ".join(_ms(s[k]) for k in
                                                       ("mean", "p50", "p90", "p99"))))
    cache = summary["prefix_cache"]
    rows.append(("prefix cache hits", "not reported by the server" if not cache["reported"]
                 else f"{cache['cached_tokens']:,} tokens ({cache['hit_rate']:.1%})"))
    good = summary["goodput"]
    if good is not None:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in good["slo_ms"].items())
        rows.append((f"goodput ({slo})", f"{good['requests_per_s']:.3f} req/s "
                     f"({good['good_requests']}/{req['sent']} within SLO)"))
    return rows


def console_table(report: dict) -> str:
    lines = []
    for run in report["runs"]:
        point = run["point"]
        title = (f"{report['server']['model']} at {report['server']['base_url']}: "
                 + (", ".join(f"{k}={v:g}" for k, v in point.items()) if point
                    else _arrivals_text(run["arrivals"])))
        rows = summary_rows(run["summary"])
        width = max(len(label) for label, _ in rows)
        lines.append(f"== {title}")
        lines.extend(f"  {label:<{width}}  {value}" for label, value in rows)
        if run["weight_versions"]:
            changes = "; ".join(f"{c['t_s']:.1f}s {'+'.join(c['versions'])}"
                                for c in run["weight_versions"])
            lines.append(f"  {'serving weights':<{width}}  {changes}")
        if run.get("by_model"):
            lines.extend("  " + line for line in model_table(run["by_model"]))
    if report["sweep"]:
        lines.append(sweep_table(report))
    return "\n".join(lines)


def model_table(by_model: dict[str, dict]) -> list[str]:
    """One line per model (adapter) of a multi-adapter run: its requests, throughput and
    TTFT and ITL percentiles (ms); the console table and the HTML page."""
    width = max(len("model"), *(len(name) for name in by_model))
    out = [f"{'model':<{width}} {'sent':>5} {'ok':>5} {'req/s':>7} {'out tok/s':>10} "
           f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"]
    for name, s in by_model.items():
        ttft, itl = s["latency_ms"]["ttft"] or {}, s["latency_ms"]["itl"] or {}
        out.append(f"{name:<{width}} {s['requests']['sent']:>5} "
                   f"{s['requests']['completed']:>5} "
                   f"{s['throughput']['requests_per_s']:>7.3f} "
                   f"{s['throughput']['output_tokens_per_s']:>10.1f} "
                   f"{_ms(ttft.get('p50')):>9} {_ms(ttft.get('p99')):>9} "
                   f"{_ms(itl.get('p50')):>8} {_ms(itl.get('p99')):>8}")
    return out


def sweep_table(report: dict) -> str:
    param = report["sweep"]["parameter"]
    head = (f"{param:>11} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8} {'goodput':>8}")
    out = ["== sweep (latencies in ms)", head]
    for run in report["runs"]:
        s = run["summary"]
        ttft, itl, good = s["latency_ms"]["ttft"] or {}, s["latency_ms"]["itl"] or {}, \
            s["goodput"]
        out.append(f"{run['point'][param]:>11g} {s['throughput']['requests_per_s']:>8.2f} "
                   f"{s['throughput']['output_tokens_per_s']:>10.1f} "
                   f"{_ms(ttft.get('p50')):>9} {_ms(ttft.get('p99')):>9} "
                   f"{_ms(itl.get('p50')):>8} {_ms(itl.get('p99')):>8} "
                   f"{'-' if good is None else format(good['requests_per_s'], '.2f'):>8}")
    return "\n".join(out)


def _arrivals_text(arrivals: dict) -> str:
    return Arrivals(**arrivals).describe()


def command_line() -> list[str]:
    return [Path(sys.argv[0]).name, *sys.argv[1:]]
