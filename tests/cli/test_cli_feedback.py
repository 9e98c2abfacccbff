"""What a user sees: `--help` that documents every flag and its default, `--version`, and
progress of long operations (redrawn in place on a terminal, a line per phase otherwise)."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import os
import pty
from pathlib import Path
from types import SimpleNamespace

import pytest
from tandem_engine.cli import main as cli
from tandem_engine.cli.progress import Status, StatusBlock, render
from tandem_engine.cli.serve import phase_block
from tandem_engine.cli_help import DefaultsHelpFormatter
from tandem_engine.router.main import build_parser as router_parser
from tandem_engine.server.loading import (
    BUILDING_PHASE,
    KERNEL_BUILD_PHASE,
    PREPARING_PHASE,
    READING_PHASE,
    ModelLoad,
)
from tandem_engine.server.main import build_parser as engine_parser
from tandem_operator.main import build_parser as operator_parser

ENTRY_POINTS = {"tandem": cli.build_parser, "tandem-engine": engine_parser,
                "tandem-router": router_parser, "tandem-operator": operator_parser}


def _walk(parser: argparse.ArgumentParser):
    """`parser` and the parser of every subcommand under it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _walk(sub)


@pytest.mark.parametrize("command", ENTRY_POINTS)
def test_every_flag_of_every_command_has_help_and_shows_its_default(command: str) -> None:
    missing = []
    for parser in _walk(ENTRY_POINTS[command]()):
        assert parser.formatter_class is DefaultsHelpFormatter, parser.prog
        for action in parser._actions:
            if not (action.help or "").strip():
                missing.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
        parser.format_help()  # every %(default)s and %(prog)s expands
    assert not missing, f"flags without help: {missing}"


def test_help_shows_defaults_and_only_where_they_say_something() -> None:
    serve = next(p for p in _walk(cli.build_parser()) if p.prog.endswith(" serve"))
    text = " ".join(serve.format_help().split())
    assert "router (OpenAI API) port (default: 8000)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: [])" not in text
    engine = " ".join(engine_parser().format_help().split())
    assert "tokens per KV block (default: 16)" in engine


def test_tandem_version_prints_the_package_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"tandem {importlib.metadata.version('tandem')}"


@pytest.mark.parametrize("flag", ["--weights-version", "--version"])
def test_refit_takes_the_weights_version_under_both_spellings(flag: str) -> None:
    args = cli.build_parser().parse_args(["refit", "--uri", "file:///w", flag, "v2"])
    assert args.version == "v2"


def test_refit_help_documents_the_old_spelling() -> None:
    refit = next(p for p in _walk(cli.build_parser()) if p.prog.endswith(" refit"))
    text = " ".join(refit.format_help().split())
    assert "--weights-version NAME, --version NAME" in text
    assert "--version is an older spelling of the same flag" in text


@pytest.mark.parametrize(("argv", "usage", "error"), [
    (["serve", "--prot", "9000"], "usage: tandem serve [-h]",
     "tandem serve: error: unrecognized arguments: --prot 9000 (did you mean --port?)"),
    (["chat", "m", "--temprature", "0"], "usage: tandem chat [-h]",
     "unrecognized arguments: --temprature 0 (did you mean --temperature?)"),
    (["generate", "--model", "m", "--max-tokns=3", "hi"], "usage: tandem generate [-h]",
     "unrecognized arguments: --max-tokns=3 (did you mean --max-tokens?)"),
    (["bench", "--base-url", "u", "--model", "m", "--num-promts", "3"],
     "usage: tandem bench [-h]",
     "unrecognized arguments: --num-promts 3 (did you mean --num-prompts?)"),
    (["models", "pull", "x", "--formt", "hf"], "usage: tandem models pull [-h]",
     "tandem models pull: error: unrecognized arguments: --formt hf (did you mean "
     "--format?)"),
    (["mtp-heads", "fit", "a", "b", "--heads", "1", "--tokns", "3"],
     "usage: tandem mtp-heads fit [-h]",
     "unrecognized arguments: --tokns 3 (did you mean --tokens?)"),
    (["serve", "--prot", "1", "--hots", "h"], "usage: tandem serve [-h]",
     "--prot 1 --hots h (--prot: did you mean --port?; --hots: did you mean --host?)"),
    (["serv", "--demo"], "usage: tandem [-h]",
     "argument COMMAND: invalid choice: 'serv' (did you mean 'serve'? choose from serve, "
     "chat, generate,"),
    (["refit", "--uri", "u", "--version", "v", "--strategy", "rolling"],
     "usage: tandem refit [-h]", "invalid choice: 'rolling' (did you mean 'Rolling'?"),
])
def test_a_mistyped_flag_gets_its_commands_usage_and_a_suggestion(
        argv: list[str], usage: str, error: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert error in err.strip().splitlines()[-1]


def test_an_unknown_argument_without_a_close_flag_gets_no_guess(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["models", "list", "--zzzzzz", "extra"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "tandem models list: error: unrecognized arguments: --zzzzzz extra"


def test_demo_model_prints_a_line_per_phase_when_stdout_is_not_a_terminal(
        tmp_path: Path, capsys) -> None:
    assert cli.main(["demo-model", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out
    lines = out.splitlines()
    phases = [line.split(": ", 1)[1].split(" (")[0] for line in lines[:-1]]
    assert phases == ["training the tokenizer", "drawing the random weights",
                      "writing model.safetensors", "writing the tokenizer and configs", "done"]
    assert lines[-1] == f"wrote tiny llama demo model (seed 0) to {tmp_path / 'm'}"
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_demo_model_takes_its_folder_as_an_argument_or_as_dir(tmp_path: Path, capsys) -> None:
    assert cli.main(["demo-model", "--dir", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "config.json").is_file()
    assert cli.main(["demo-model"]) == 2
    assert "tandem demo-model DIR" in capsys.readouterr().err


class _FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_block_prints_a_line_per_phase_change_when_not_a_terminal() -> None:
    out = io.StringIO()
    block = StatusBlock(out)
    assert not block.tty
    block.show({"e0": Status("loading", "1 MB"), "e1": Status("starting")})
    block.show({"e0": Status("loading", "2 MB"), "e1": Status("starting")})  # detail only
    block.show({"e0": Status("ready", "3.0 s"), "e1": Status("starting")})
    assert out.getvalue().splitlines() == ["  e0: loading (1 MB)", "  e1: starting",
                                           "  e0: ready (3.0 s)"]


def test_status_block_redraws_in_place_on_a_terminal() -> None:
    out = _FakeTerminal()
    block = StatusBlock(out)
    assert block.tty
    block.show({"e0": Status("loading", "1 MB"), "e1": Status("starting")})
    first = out.getvalue()
    assert "\x1b[" not in first.split("\x1b[2K", 1)[0]  # the first draw moves up nothing
    block.show({"e0": Status("loading", "1 MB"), "e1": Status("starting")})
    assert out.getvalue() == first  # nothing changed: nothing drawn
    block.show({"e0": Status("loading", "2 MB"), "e1": Status("starting")})
    redraw = out.getvalue()[len(first):]
    assert redraw.startswith("\x1b[2F")  # back up over the block's two lines
    assert "  e0: loading (2 MB)\n" in redraw and "  e1: starting\n" in redraw
    block.release()
    block.show({"router": Status("connecting")})
    assert not out.getvalue()[len(first) + len(redraw):].startswith("\x1b[2F")


def test_status_block_sees_a_pty_as_a_terminal() -> None:
    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as stream:
            assert StatusBlock(stream).tty
    finally:
        os.close(leader)
        os.close(follower)


def test_serve_phase_block_from_each_engines_state() -> None:
    def loading(phase: str, **progress) -> dict:
        return {"state": "LOADING", "loading": {
            "phase": phase, "bytes_done": 0, "bytes_total": 0, "files_done": 0,
            "files_total": 0, "seconds": 12.4, **progress}}

    lines = phase_block({
        "prefill-0": None,
        "prefill-1": loading(KERNEL_BUILD_PHASE),
        "decode-2": loading(READING_PHASE, bytes_done=250_000_000, bytes_total=1_000_000_000,
                            files_done=1, files_total=4),
        "decode-3": loading(BUILDING_PHASE, bytes_done=5, bytes_total=5),
        "decode-4": {"state": "RUNNING"},
    })
    assert lines == [
        "  prefill-0: starting",
        f"  prefill-1: {KERNEL_BUILD_PHASE} (12 s)",
        "  decode-2:  loading the model (250.0 MB of 1.00 GB, 25%, 1 of 4 files, 12 s)",
        "  decode-3:  building the engine (12 s)",
        "  decode-4:  running, not ready yet",
    ]
    assert render({}) == []


def test_model_load_names_its_phase() -> None:
    load = ModelLoad("/m")
    assert load.as_dict()["phase"] == PREPARING_PHASE
    load.set_step(KERNEL_BUILD_PHASE)
    assert load.as_dict()["phase"] == KERNEL_BUILD_PHASE
    load.set_step(None)
    assert load.phase == READING_PHASE  # not "preparing" again
    progress = SimpleNamespace(bytes_done=0, bytes_total=10, files_done=0, files_total=1)
    load.report(progress)
    assert load.phase == READING_PHASE
    load.report(SimpleNamespace(bytes_done=10, bytes_total=10, files_done=1, files_total=1))
    assert load.phase == BUILDING_PHASE


def test_a_first_start_knows_it_must_compile_the_native_kernel(tmp_path: Path,
                                                               monkeypatch) -> None:
    from tandem_engine.model import native

    monkeypatch.delenv(native.PREBUILT_ENV, raising=False)
    monkeypatch.delenv(native.JIT_ENV, raising=False)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty build cache
    assert native.build_pending()
    name = native.kernel_name(native._source_text())
    (tmp_path / name).mkdir(exist_ok=True)
    (tmp_path / name / f"{name}.so").write_bytes(b"")  # a build from an earlier start...
    assert native.build_pending()  # ... for which torch? Unknown: it is built again
    stamp = native._built_with(tmp_path / name, ["-march=native"])
    stamp.write_text("0.0-other")
    assert native.build_pending()  # another torch's build is not loaded
    import torch

    stamp.write_text(torch.__version__)
    assert not native.build_pending()  # this torch's: loaded as it is
