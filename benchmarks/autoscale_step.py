"""The autoscaling planner under a load step: engines per role and p90 TTFT/ITL over time.

Run alone (2 cores: the operator, the engines, the router and the load share them):

    .venv/bin/python benchmarks/autoscale_step.py [--low 1] [--high 8] [--output-len 256] \
        [--out docs/img/autoscale_step.png]

A fresh test API server (tests/kcluster, test-only code imported from the tests folder) and
its test kubelet run a pool of real engines on the tiny demo model: 1 prefill, 1 decode, 1
router, `maxNumSeqs: 2` so that one decode engine's capacity is small, and
`spec.autoscaling` (decode 1..3, prefill 1..2, SLO p90 TTFT 1 s, p90 ITL 0.2 s, at most 1
waiting request per engine, a 10 s window). `tandem bench --workload trace` replays a trace
written here: `--low` requests/s for 20 s, `--high` for 60 s (the step), `--low` / 2 for 40 s,
`--output-len` tokens each. The operator's status is sampled every 0.5 s meanwhile.

Prints the CPU model, a markdown table of the reaction (load step → the planner's decision →
the new engine ready → the violated SLO met again → scaled back down) and the bench's
totals; writes the figure (engines per role; p90 TTFT and ITL per 5 s; the queue depth the
planner saw) and the raw trace next to it as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "operator_tests")]  # kcluster, helpers

from kcluster.cluster import TestCluster  # noqa: E402
from kcluster.podrunner import PodRunner  # noqa: E402
from pool_ready import cpu_model  # noqa: E402
from tandem_engine.cli.demo_model import write_demo_model  # noqa: E402
from test_operator_cluster import Operator, wait_for  # noqa: E402

WINDOW = 10
SLO = {"ttftSeconds": "1", "itlSeconds": "0.2", "queueDepth": 1}
AUTOSCALING = {"prefill": {"minReplicas": 1, "maxReplicas": 2},
               "decode": {"minReplicas": 1, "maxReplicas": 3},
               "slo": SLO, "windowSeconds": WINDOW, "scaleUpStabilizationSeconds": 0,
               "scaleDownStabilizationSeconds": 15}
PHASES = (("low", 20.0, 1.0), ("step", 60.0, None), ("after", 40.0, 0.5))  # None: --high
BIN_S = 5.0


def pool_manifest(model: Path) -> str:
    return yaml.safe_dump({
        "apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool",
        "metadata": {"name": "demo"},
        "spec": {"model": {"name": "tiny", "weights": {"uri": model.as_uri(),
                                                        "version": "v1"}},
                 "engine": {"kvCache": {"numBlocks": 256}, "maxNumSeqs": 2},
                 "prefill": {"replicas": 1}, "decode": {"replicas": 1},
                 "router": {"replicas": 1}, "refit": {"drainTimeoutSeconds": 60},
                 "autoscaling": AUTOSCALING}})


def write_trace(path: Path, low: float, high: float, output_len: int
                ) -> tuple[list[tuple[float, str]], int]:
    """Evenly spaced arrivals per phase; returns (start, name) of each phase and the
    number of requests."""
    lines = [json.dumps({"tandem_bench_trace": 1})]
    marks, t, n = [], 0.0, 0
    for name, seconds, rate in PHASES:
        rate = high if rate is None else (low if name == "low" else low * rate)
        marks.append((t, name))
        count = round(seconds * rate)
        for i in range(count):
            n += 1
            lines.append(json.dumps({"arrival_s": round(t + i / rate, 3),
                                     "prompt": f"Request {n}: the river ran past the mill",
                                     "output_len": output_len}))
        t += seconds
    path.write_text("\n".join(lines) + "\n")
    return marks, n


class Sampler:
    """The pool's spec and status every half second."""

    def __init__(self, cluster: TestCluster) -> None:
        self.cluster, self.rows = cluster, []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                body = json.loads(self.cluster.kubectl("get", "inferencepool", "demo",
                                                       "-o", "json").stdout)
            except Exception:  # a missed sample is a gap in the figure
                continue
            st, spec = body.get("status") or {}, body["spec"]
            seen = (st.get("autoscaling") or {}).get("observed") or {}
            self.rows.append({
                "t": time.monotonic() - self.t0,
                **{f"{r}_desired": spec[r]["replicas"] for r in ("prefill", "decode")},
                **{f"{r}_ready": (st.get(r) or {}).get("ready", 0)
                   for r in ("prefill", "decode")},
                **{f"{r}_queue": float((seen.get(r) or {}).get("queueDepth") or 0)
                   for r in ("prefill", "decode")}})

    def start(self) -> Sampler:
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def p90(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * 0.9
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def latency_bins(requests: list[dict[str, Any]], offset: float, end: float
                 ) -> list[tuple[float, float | None, float | None]]:
    """(bin start, p90 TTFT s, p90 ITL s) per BIN_S, by when the first token / each gap
    happened (on the sampler's clock: the bench started `offset` s after it)."""
    ttft: dict[int, list[float]] = {}
    itl: dict[int, list[float]] = {}
    for r in requests:
        if not r.get("ok") or r.get("ttft_ms") is None:
            continue
        at = offset + r["sent_s"] + r["ttft_ms"] / 1000
        ttft.setdefault(int(at // BIN_S), []).append(r["ttft_ms"] / 1000)
        for gap in r.get("itl_ms") or ():
            at += gap / 1000
            itl.setdefault(int(at // BIN_S), []).append(gap / 1000)
    return [(b * BIN_S, p90(ttft.get(b, [])), p90(itl.get(b, [])))
            for b in range(int(end // BIN_S) + 1)]


def reaction(rows: list[dict[str, Any]], step: float) -> dict[str, float | None]:
    """Seconds from the load step to the first violation of the SLO (waiting requests per
    engine over the bound, as the planner saw it), and from that violation to: the
    planner's scale-up, the new engine ready, the SLO met again; then from the step down to
    the pool back at one engine per role."""
    after = [r for r in rows if r["t"] >= step]
    bound = float(SLO["queueDepth"])
    violated = next((r["t"] for r in after if max(r["decode_queue"], r["prefill_queue"])
                     > bound), None)
    decided = ready = met = None
    if violated is not None:
        later = [r for r in after if r["t"] >= violated - 1.0]
        decided = next((r["t"] for r in later if r["decode_desired"] > 1
                        or r["prefill_desired"] > 1), None)
        ready = next((r["t"] for r in later if r["decode_ready"] > 1
                      or r["prefill_ready"] > 1), None)
        if ready is not None:
            met = next((r["t"] for r in later if r["t"] >= ready
                        and max(r["decode_queue"], r["prefill_queue"]) <= bound), None)
    end_of_step = step + PHASES[1][1]
    down = next((r["t"] for r in rows if r["t"] >= end_of_step
                 and r["decode_desired"] == 1 and r["prefill_desired"] == 1), None)

    def since(t: float | None, origin: float | None) -> float | None:
        return None if t is None or origin is None else t - origin

    return {"load step -> SLO violated": since(violated, step),
            "violated -> scale-up decided": since(decided, violated),
            "violated -> new engine ready": since(ready, violated),
            "violated -> SLO met again": since(met, violated),
            "step down -> back to 1 + 1 engines": since(down, end_of_step)}


def plot(rows: list[dict[str, Any]], bins: list[tuple[float, float | None, float | None]],
         marks: list[tuple[float, str]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (eng, lat, queue) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    t = [r["t"] for r in rows]
    for role, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        eng.step(t, [r[f"{role}_desired"] for r in rows], where="post", color=color,
                 label=f"{role} desired")
        eng.step(t, [r[f"{role}_ready"] for r in rows], where="post", color=color,
                 linestyle="--", label=f"{role} ready")
    eng.set_ylabel("engines")
    eng.set_ylim(0, 4)
    eng.legend(loc="upper right", fontsize=8)
    bt = [b[0] + BIN_S / 2 for b in bins]
    lat.plot(bt, [b[1] for b in bins], marker="o", color="tab:blue", label="p90 TTFT")
    lat.plot(bt, [b[2] for b in bins], marker="s", color="tab:orange", label="p90 ITL")
    lat.axhline(float(SLO["ttftSeconds"]), color="tab:blue", linestyle=":",
                label="TTFT SLO")
    lat.axhline(float(SLO["itlSeconds"]), color="tab:orange", linestyle=":", label="ITL SLO")
    lat.set_yscale("log")
    lat.set_ylabel(f"seconds (client, per {BIN_S:g} s)")
    lat.legend(loc="upper right", fontsize=8)
    for role, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        queue.plot(t, [r[f"{role}_queue"] for r in rows], color=color,
                   label=f"{role} waiting / engine (planner's view)")
    queue.axhline(float(SLO["queueDepth"]), color="black", linestyle=":", label="queueDepth SLO")
    queue.set_ylabel("requests")
    queue.set_xlabel("seconds")
    queue.legend(loc="upper right", fontsize=8)
    for ax in (eng, lat, queue):
        for at, _ in marks:
            ax.axvline(at, color="grey", linewidth=0.8)
    eng.set_title(title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--low", type=float, default=1.0, help="requests/s before the step")
    p.add_argument("--high", type=float, default=8.0, help="requests/s during the step")
    p.add_argument("--output-len", type=int, default=256, help="tokens per request")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "autoscale_step.png")
    args = p.parse_args()
    print(f"CPU: {cpu_model()}")
    with tempfile.TemporaryDirectory() as tmp, TestCluster() as cluster:
        folder = Path(tmp)
        model = write_demo_model(folder / "demo")
        cluster.install_crds(ROOT / "crds")
        runner = PodRunner(cluster).start()
        operator = Operator(cluster, folder / "operator.log", "--standalone",
                            "--metrics-port", "0", "--liveness-port", "0")
        try:
            cluster.kubectl("apply", "-f", "-", input=pool_manifest(model))

            def ready() -> bool:
                st = json.loads(cluster.kubectl("get", "inferencepool", "demo", "-o",
                                                "json").stdout).get("status") or {}
                return any(c["type"] == "Ready" and c["status"] == "True"
                           for c in st.get("conditions") or ())

            wait_for("the pool to be Ready", ready, timeout=180, every=0.5)
            pods = json.loads(cluster.kubectl("get", "pods", "-l", "tandem.dev/role=router",
                                              "-o", "json").stdout)["items"]
            url = f"http://{pods[0]['status']['podIP']}:8000"
            trace = folder / "step.jsonl"
            marks, count = write_trace(trace, args.low, args.high, args.output_len)
            sampler = Sampler(cluster).start()
            started = time.monotonic() - sampler.t0
            marks = [(started + t, name) for t, name in marks]
            report = folder / "bench.json"
            bench = subprocess.run(
                [str(ROOT / ".venv" / "bin" / "tandem"), "bench", "--base-url", url,
                 "--model", "tiny", "--workload", "trace", "--trace", str(trace),
                 "--num-requests", str(count),
                 "--ignore-eos", "--request-timeout", "300", "--json", str(report),
                 "--quiet"], capture_output=True, text=True, timeout=900)
            if bench.returncode != 0:
                print(bench.stdout[-3000:], bench.stderr[-3000:])
                return 1
            time.sleep(AUTOSCALING["scaleDownStabilizationSeconds"] + 2 * WINDOW + 15)
            sampler.stop()
        finally:
            operator.stop()
            runner.stop()
        run = json.loads(report.read_text())["runs"][0]
        end = sampler.rows[-1]["t"]
        bins = latency_bins(run["requests"], started, end)
        step = marks[1][0]
        times = reaction(sampler.rows, step)
        s = run["summary"]
        print("\n| from -> to | seconds |\n|---|---|")
        for what, seconds in times.items():
            print(f"| {what} | {'-' if seconds is None else f'{seconds:.1f}'} |")
        print(f"\nbench: {s['requests']['sent']} sent, {s['requests']['completed']} completed, "
              f"{s['requests']['failed']} failed; low {args.low:g} req/s, step "
              f"{args.high:g} req/s, {args.output_len} tokens each")
        title = (f"load step {args.low:g} -> {args.high:g} req/s -> {args.low / 2:g} req/s "
                 f"({args.output_len} tokens each), tiny model, {cpu_model()}")
        plot(sampler.rows, bins, marks, args.out, title)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"rows": sampler.rows, "bins": bins, "marks": marks, "reaction_s": times,
             "autoscaling": AUTOSCALING, "summary": s}, indent=1))
        print(f"figure: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
