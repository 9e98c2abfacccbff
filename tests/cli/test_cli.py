"""The `tandem` command as a user runs it: a real subprocess each time."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tandem_engine.cli.chat import ChatRenderer, sampling_params
from tandem_engine.cli.main import DEFAULT_GENERATE_MAX_TOKENS, build_parser
from tandem_engine.engine.llm import LLM
from tandem_engine.sampling_params import SamplingParams


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem_engine.cli.main", *args],
                          capture_output=True, text=True, timeout=120)


def test_demo_model_then_generate(tmp_path: Path) -> None:
    model = tmp_path / "demo"
    made = _tandem("demo-model", str(model), "--arch", "qwen3", "--seed", "3")
    assert made.returncode == 0, made.stderr
    assert (model / "model.safetensors").is_file()
    run = _tandem("generate", "--model", str(model), "--max-tokens", "7", "--threads", "1",
                  "--ignore-eos", "Hello there", "Second prompt")
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("[7 tokens, finish_reason=length]") == 2
    assert "--- prompt: 'Second prompt'" in run.stdout
    assert "generated 14 tokens" in run.stderr


def _completions(stdout: str) -> list[str]:
    """The completion printed under each `--- prompt:` line."""
    return [block.split("\n", 1)[1].rsplit("\n[", 1)[0]
            for block in stdout.split("--- prompt: ")[1:]]


def test_generate_answers_in_the_chat_template_unless_no_chat(tiny_qwen3: Path) -> None:
    """A chat model gets the prompt as a user's message (what /v1/chat/completions and
    `tandem chat` send), and prints only the answer; --no-chat continues the raw text.
    One token is counted in the singular."""
    flags = ("--temperature", "0", "--ignore-eos", "--threads", "1")
    chat = _tandem("generate", "--model", str(tiny_qwen3), "--max-tokens", "5", *flags,
                   "hello there")
    raw = _tandem("generate", "--model", str(tiny_qwen3), "--max-tokens", "1", *flags,
                  "--no-chat", "hello there")
    assert chat.returncode == 0 and raw.returncode == 0, chat.stderr + raw.stderr
    llm = LLM(model=str(tiny_qwen3), max_num_seqs=1)
    ids = ChatRenderer.of(llm.tokenizer).encode([{"role": "user", "content": "hello there"}])
    templated, plain = (out.outputs[0].text for out in llm.generate(
        [ids, "hello there"], [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                               for n in (5, 1)]))
    assert _completions(chat.stdout) == [templated]
    assert "[5 tokens, finish_reason=length]" in chat.stdout
    assert _completions(raw.stdout) == ["hello there" + plain]
    assert "[1 token, finish_reason=length]" in raw.stdout
    assert "generated 1 token in" in raw.stderr


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_sampling_flags_left_out_take_the_models_defaults(tiny_qwen3: Path, tmp_path: Path,
                                                         command: str) -> None:
    """As vLLM's --generation-config auto: the checkpoint's generation_config.json fills
    the sampling flags the user did not give; the ones given win."""
    model = tmp_path / "m"
    shutil.copytree(tiny_qwen3, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.3, top_p=0.9, top_k=20)
    (model / "generation_config.json").write_text(json.dumps(config))
    head = ["generate", "--model", str(model)] if command == "generate" else ["chat", str(model)]
    tail = ["hi"] if command == "generate" else []

    def params(*flags: str) -> SamplingParams:
        args = build_parser().parse_args([*head, *flags, *tail])
        return sampling_params(args, model, default_max_tokens=DEFAULT_GENERATE_MAX_TOKENS)

    got = params()
    assert (got.temperature, got.top_p, got.top_k) == (0.3, 0.9, 20)
    assert got.max_tokens == DEFAULT_GENERATE_MAX_TOKENS
    mine = params("--temperature", "0.7", "--top-k", "5", "--max-tokens", "3")
    assert (mine.temperature, mine.top_p, mine.top_k, mine.max_tokens) == (0.7, 0.9, 5, 3)
    plain = sampling_params(build_parser().parse_args([*head, *tail]), tiny_qwen3,
                            default_max_tokens=7)
    engine = SamplingParams()
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (
        engine.temperature, engine.top_p, engine.top_k, 7)


@pytest.mark.slow
def test_generate_answers_the_real_chat_model(smollm2_gguf: Path) -> None:
    """The README's first question to the default model gets its real answer. (Without
    "Answer in one sentence." the first token under the default system prompt is a near
    tie, 0.08 apart in the dense float32 model; with it, every token is 0.7 or more.)"""
    run = _tandem("generate", "--model", str(smollm2_gguf), "--max-tokens", "12",
                  "--temperature", "0", "What is the capital of France? Answer in one sentence.")
    assert run.returncode == 0, run.stderr
    (answer,) = _completions(run.stdout)
    assert "Paris" in answer, run.stdout


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
