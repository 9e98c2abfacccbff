"""The GPU check's CPU rehearsal: every step reports a result or a named skip, the table
and the JSON agree, and a step that fails, hangs or crashes is one row."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
STEPS = ["environment", "greedy-float32", "greedy-bfloat16", "throughput-small",
         "throughput-1b", "handoff", "lifecycle", "quantized-int8", "quantized-int4"]


def _gpu_check():
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

    return gpu_check


def test_the_dry_run_reports_every_step_with_a_result_or_a_named_skip(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "check.json"
    # In this process (torch is loaded already); each step still runs in a forked child.
    rc = _gpu_check().main(["--cpu-dry-run", "--quick", "--json", str(out),
                            "--workdir", str(tmp_path / "work")])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert rc == 0, printed
    steps = {s["step"]: s for s in report["steps"]}
    assert list(steps) == STEPS
    assert report["device"] == "cpu"
    for name, step in steps.items():
        assert step["status"] in ("ok", "skip"), (name, step)
        assert step["summary"], f"{name} says nothing"
        assert step["summary"] in printed  # the printed table carries the same rows
    assert steps["throughput-1b"]["status"] == "skip"
    assert "GPU only" in steps["throughput-1b"]["summary"]
    assert steps["handoff"]["status"] == "skip" and "--quick" in steps["handoff"]["summary"]
    greedy = steps["greedy-float32"]["detail"]
    assert greedy["compared"] > 0 and greedy["mismatched_prompts"] == []
    assert steps["throughput-small"]["detail"]["tandem_tok_s"] > 0
    modes = [row["mode"] for row in steps["lifecycle"]["detail"]["suspend"]]
    assert modes == ["persist", "offload", "recompute"]
    for kind in ("int8", "int4"):
        quantized = steps[f"quantized-{kind}"]["detail"]
        assert max(quantized["relative_rms_error"].values()) <= 0.05
        assert quantized["weight_bytes"] < quantized["dense_weight_bytes"]


def _raises(plan) -> None:
    raise RuntimeError("the device said no")


def _hangs(plan) -> None:
    time.sleep(60)


def _dies(plan) -> None:
    os._exit(3)


def test_a_failed_hung_or_crashed_step_is_a_row_of_its_own(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    plan = gpu_check.Plan("cpu", True, tmp_path)
    rows = [gpu_check.run_step("raises", _raises, plan, 20),
            gpu_check.run_step("hangs", _hangs, plan, 1.0),
            gpu_check.run_step("dies", _dies, plan, 20),
            gpu_check.run_step("skips", gpu_check.step_handoff, plan, 20)]
    assert [r.status for r in rows] == ["fail", "fail", "fail", "skip"]
    assert "RuntimeError: the device said no" in rows[0].summary
    assert rows[1].summary == "timed out after 1 s" and rows[1].seconds < 10
    assert rows[2].summary == "the step's process died (exit code 3)"
    table = gpu_check.format_table(rows)
    assert all(r.summary in table for r in rows)
