"""`tandem chat MODEL`: a conversation in the terminal, fed through a pipe as a user's
script would, and its answers checked against the engine run directly on the same
rendered conversation."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tandem_engine.cli.chat import ChatRenderer, Conversation, stream_answer
from tandem_engine.engine.llm import LLM
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.tokenizer import Tokenizer

STATS = re.compile(r"\[(\d+) prompt tokens?, (\d+) tokens?, finish_reason=(\w+), ")


def _chat(model: Path, stdin: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem_engine.cli.main", "chat", str(model),
                           "--threads", "1", *flags], input=stdin, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path) -> LLM:
    return LLM(model=str(tiny_qwen3), max_num_seqs=1)


def _answer(llm: LLM, messages: list[dict[str, str]], max_tokens: int) -> str:
    """The greedy answer the engine gives the conversation, run directly."""
    ids = ChatRenderer.of(llm.tokenizer).encode(messages)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([ids], params)[0].outputs[0].text


def test_a_piped_conversation_keeps_its_history_until_clear(tiny_qwen3: Path, llm: LLM
                                                            ) -> None:
    got = _chat(tiny_qwen3, "hello there\nand then?\n/clear\nhello there\n/exit\nunread\n",
                "--temperature", "0", "--max-tokens", "6", "--ignore-eos", "--verbose")
    assert got.returncode == 0, got.stderr
    stats = [tuple(int(x) if x.isdigit() else x for x in m.groups())
             for m in STATS.finditer(got.stderr)]
    assert len(stats) == 3, got.stderr  # nothing after /exit is read
    assert all(n == 6 and reason == "length" for _, n, reason in stats)
    renderer = ChatRenderer.of(llm.tokenizer)
    first = [{"role": "user", "content": "hello there"}]
    one = _answer(llm, first, 6)
    second = [*first, {"role": "assistant", "content": one},
              {"role": "user", "content": "and then?"}]
    two = _answer(llm, second, 6)
    # Each answer streamed to stdout, then a blank line; the second turn saw the first.
    assert got.stdout == f"{one}\n\n{two}\n\n{one}\n\n"
    assert [s[0] for s in stats] == [len(renderer.encode(first)),
                                     len(renderer.encode(second)),
                                     len(renderer.encode(first))]
    assert "Cleared the conversation." in got.stderr


def test_system_prompt_commands_and_eof(tiny_qwen3: Path, llm: LLM) -> None:
    got = _chat(tiny_qwen3, '/?\n/nope\n"""two\nlines"""\n', "--system", "Be brief.",
                "--temperature", "0", "--max-tokens", "4", "--ignore-eos", "--verbose")
    assert got.returncode == 0, got.stderr  # EOF ends the chat like /exit
    assert "/exit or /bye" in got.stderr and "Unknown command '/nope'" in got.stderr
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "two\nlines"}]
    assert got.stdout == _answer(llm, messages, 4) + "\n\n"
    (match,) = STATS.finditer(got.stderr)
    assert int(match.group(1)) == len(ChatRenderer.of(llm.tokenizer).encode(messages))


def test_an_answer_streams_as_it_is_generated(llm: LLM) -> None:
    writes: list[str] = []
    messages = Conversation("Be brief.").with_user("hi")
    ids = ChatRenderer.of(llm.tokenizer).encode(messages)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    done = stream_answer(llm, ids, params, writes.append)
    assert len(writes) > 3  # piece by piece, not once at the end
    assert "".join(writes) == done.text == _answer(llm, messages, 12)
    assert len(done.token_ids) == 12 and done.finish_reason == "length"


def test_a_model_without_a_chat_template_is_refused_before_loading(tiny_qwen3: Path,
                                                                    tmp_path: Path) -> None:
    model = tmp_path / "no-template"
    shutil.copytree(tiny_qwen3, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(b"")  # never read: refused before the load
    assert Tokenizer.from_path(model).chat_template is None
    got = _chat(model, "hi\n")
    assert got.returncode == 2
    assert "no chat template" in got.stderr and "tandem generate --no-chat" in got.stderr
    assert "Traceback" not in got.stderr


def test_an_unknown_model_is_named(tmp_path: Path) -> None:
    got = _chat(tmp_path / "missing", "hi\n")
    assert got.returncode == 2
    assert "MODEL" in got.stderr and "missing" in got.stderr and "tandem models list" in \
        got.stderr
