"""The `tandem` command as a user runs it: a real subprocess each time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem_engine.cli.main", *args],
                          capture_output=True, text=True, timeout=120)


def test_demo_model_then_generate(tmp_path: Path) -> None:
    model = tmp_path / "demo"
    made = _tandem("demo-model", str(model), "--arch", "qwen3", "--seed", "3")
    assert made.returncode == 0, made.stderr
    assert (model / "model.safetensors").is_file()
    run = _tandem("generate", "--model", str(model), "--max-tokens", "7", "--threads", "1",
                  "Hello there", "Second prompt")
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("[7 tokens, finish_reason=length]") == 2
    assert "--- prompt: 'Second prompt'" in run.stdout
    assert "generated 14 tokens" in run.stderr


def test_generate_reports_a_bad_checkpoint_clearly(tmp_path: Path) -> None:
    run = _tandem("generate", "--model", str(tmp_path), "hi")
    assert run.returncode == 2
    assert "config.json" in run.stderr and "missing" in run.stderr
    assert "Traceback" not in run.stderr


def test_the_tandem_command_line_does_not_import_torch() -> None:
    """Building the `tandem` parser (every subcommand's flags) stays torch-free, so
    `tandem refit`, `tandem serve` and `tandem bench` start in a fraction of a second;
    only the commands that run a model import it, when they run."""
    code = ("import sys\n"
            "from tandem_engine.cli.main import build_parser\n"
            "build_parser()\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'tandem' in m)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
