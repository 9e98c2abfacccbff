"""`--html FILE`: one self-contained page, the summary tables and every figure inline
(base64 PNG), so it can be mailed or attached to an issue as one file."""

from __future__ import annotations

import base64
import html
import tempfile
from pathlib import Path

from tandem_engine.bench.plots import write_plots
from tandem_engine.bench.report import model_table, summary_rows, sweep_table

_STYLE = ("body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}"
          "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;"
          "padding:3px 8px;text-align:left}img{max-width:100%}pre{background:#f6f6f6;"
          "padding:8px;overflow-x:auto}")


def render(report: dict, figures: list[Path]) -> str:
    e = html.escape
    server = report["server"]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>tandem bench: "
             f"{e(server['model'])}</title><style>{_STYLE}</style></head><body>",
             f"<h1>tandem bench: {e(server['model'])} at {e(server['base_url'])}</h1>",
             f"<p>{e(report['created_utc'])}; tandem "
             f"{e(report['environment']['tandem_version'])}, python "
             f"{e(report['environment']['python_version'])}; server version "
             f"{e(str(server['version']))}</p>",
             f"<pre>{e(' '.join(report['command']))}</pre>"]
    if report["sweep"]:
        parts.append(f"<h2>sweep</h2><pre>{e(sweep_table(report))}</pre>")
    for run in report["runs"]:
        point = run["point"]
        title = ", ".join(f"{k}={v:g}" for k, v in point.items()) if point else "run"
        parts.append(f"<h2>{e(title)}</h2><table>")
        parts.extend(f"<tr><th>{e(label)}</th><td>{e(value)}</td></tr>"
                     for label, value in summary_rows(run["summary"]))
        parts.append("</table>")
        if run.get("by_model"):
            parts.append(f"<h3>per model (latencies in ms)</h3>"
                         f"<pre>{e(chr(10).join(model_table(run['by_model'])))}</pre>")
    for path in figures:
        data = base64.b64encode(Path(path).read_bytes()).decode()
        parts.append(f"<h3>{e(Path(path).stem)}</h3>"
                     f"<img alt='{e(Path(path).stem)}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(report: dict, path: Path, figures: list[Path] | None = None) -> None:
    """The page at `path`; draws the figures in a scratch folder unless given."""
    if figures is None:
        with tempfile.TemporaryDirectory() as scratch:
            Path(path).write_text(render(report, write_plots(report, Path(scratch))))
    else:
        Path(path).write_text(render(report, figures))
