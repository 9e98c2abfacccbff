"""Figures of a report (`--plot DIR`): PNGs drawn with matplotlib's Agg backend.

Per run: `latency_cdf.png` (TTFT, ITL and E2E CDFs; a multi-adapter run adds each
model's TTFT CDF) and `timeline.png` (output tokens/s and requests in flight over time,
with the serving weights' version changes marked when the server is Tandem's router). A
sweep adds `sweep.png` (throughput against latency) and suffixes the per-run files with
the point (`latency_cdf_rate-4.png`).
"""

from __future__ import annotations

from pathlib import Path

EXTRA_HINT = "pip install 'tandem[bench]'"


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError(f"--plot and --html need matplotlib: {EXTRA_HINT}") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _suffix(point: dict | None) -> str:
    return "" if not point else "_" + "_".join(f"{k}-{v:g}" for k, v in point.items())


def latency_cdf(run: dict, path: Path) -> Path:
    plt = _pyplot()
    rows = [r for r in run["requests"] if r["ok"]]
    series = {"TTFT": [r["ttft_ms"] for r in rows],
              "ITL": [g for r in rows for g in r["itl_ms"]],
              "E2E": [r["e2e_ms"] for r in rows]}
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        _cdf(ax, values, "all" if run.get("by_model") else None)
        if values:
            for q in (0.5, 0.99):
                ax.axhline(q, color="grey", lw=0.5, ls=":")
        if name == "TTFT" and run.get("by_model"):  # each model's TTFT too
            for model in run["by_model"]:
                _cdf(ax, [r["ttft_ms"] for r in rows if r.get("model") == model], model,
                     lw=0.8)
            ax.legend(fontsize=7)
        ax.set_title(f"{name} ({len(values)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction ≤ x")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _cdf(ax, values: list[float], label: str | None, **style) -> None:
    values = sorted(values)
    if values:
        n = len(values)
        ax.step(values, [(i + 1) / n for i in range(n)], where="post", label=label, **style)


def timeline(run: dict, path: Path) -> Path:
    plt = _pyplot()
    tl = run["timeline"]
    fig, ax = plt.subplots(figsize=(10, 3.4))
    ax.plot(tl["t_s"], tl["output_tokens_per_s"], color="tab:blue", lw=1.2,
            drawstyle="steps-post")
    ax.set_xlabel("seconds since the run's start")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(tl["t_s"], tl["running_requests"], color="tab:orange", lw=1.0,
             drawstyle="steps-post")
    ax2.set_ylabel("requests in flight", color="tab:orange")
    changes = run["weight_versions"]
    for i, change in enumerate(changes):
        ax.axvline(change["t_s"], color="tab:red", ls="--", lw=0.8)
        ax.annotate(("" if i else "weights: ") + "+".join(change["versions"]),
                    (change["t_s"], 1.0), xycoords=("data", "axes fraction"),
                    textcoords="offset points", xytext=(2, -2 - 9 * (i % 4)), fontsize=7,
                    color="tab:red", va="top", ha="left")
    ax.set_title("throughput and load over time"
                 + (" (dashed: serving weights version)" if changes else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def sweep_curve(report: dict, path: Path) -> Path:
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator

    param = report["sweep"]["parameter"]
    runs = report["runs"]
    thr = [r["summary"]["throughput"]["output_tokens_per_s"] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, metric in zip(axes, ("ttft", "itl"), strict=True):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            values = [(r["summary"]["latency_ms"][metric] or {}).get(q) for r in runs]
            ax.plot(thr, values, style, label=q)
            if q == "p99":
                for x, y, r in zip(thr, values, runs, strict=True):
                    if y is not None:
                        ax.annotate(f"{param}={r['point'][param]:g}", (x, y), fontsize=7,
                                    textcoords="offset points", xytext=(3, 4))
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{metric.upper()} ms")
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(plain)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(f"throughput vs latency, sweeping {param}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_plots(report: dict, folder: Path) -> list[Path]:
    """Every figure of `report` into `folder` (created); returns their paths."""
    _pyplot()  # fail before creating anything when matplotlib is missing
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for run in report["runs"]:
        suffix = _suffix(run["point"])
        paths.append(latency_cdf(run, folder / f"latency_cdf{suffix}.png"))
        paths.append(timeline(run, folder / f"timeline{suffix}.png"))
    if report["sweep"]:
        paths.append(sweep_curve(report, folder / "sweep.png"))
    return paths
