"""`tandem refit --adapter NAME[@VERSION]=URI` / `--remove-adapter NAME`.

In-process: the input's checks, the plan (what a rollback restores, refusals before
anything is touched) and the one-engine-at-a-time change against fake engines and a fake
router (a refusal, a silent engine and a failed verification each put the changed engines
back). Then against a real `tandem serve --engines 2 --enable-lora` of the tiny model: an
adapter added and used through the router, re-versioned under streaming load with no
failed request, a refused version (bad shapes, a missing file) and one that loads but
cannot generate (rolled back from both engines) leaving the old version serving, and a
removal after which the name is a 404.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from msgspec import UNSET
from tandem_engine.admin_wire import EngineStatus
from tandem_engine.cli import main as cli
from tandem_engine.cli.adapter_refit import (
    AdapterChangeFailed,
    AdapterLedger,
    EngineAdapterState,
    apply_change,
    check_inside_roots,
    engine_adapter_state,
    parse_adapter,
    plan_change,
)
from tandem_engine.cli.serve import free_port
from tandem_engine.fleet import AdminError
from tandem_engine.lifecycle import EngineState
from tandem_engine.lora_request import LoRARequest
from test_serve import start_serve, stop_serve

# ---- the input --------------------------------------------------------------------------------


def test_parse_adapter(tmp_path: Path, monkeypatch) -> None:
    assert parse_adapter("sql@2=file:///adapters/sql-v2") == LoRARequest(
        "sql", "/adapters/sql-v2", "2")
    monkeypatch.chdir(tmp_path)
    assert parse_adapter("sql=rel/sql") == LoRARequest("sql", str(tmp_path / "rel/sql"), "1")
    for spec, words in (("sql", "write NAME=URI or NAME@VERSION=URI"),
                        ("=/x", "write NAME=URI"),
                        ("s q l=/x", "name 's q l' is invalid"),
                        ("sql@=/x", None),
                        ("sql=s3://bucket/sql", "must be a file:// URI"),
                        ("sql=pvc://claim/sql", "a local stack reads file:// only")):
        if words is None:  # an empty version is the default one
            assert parse_adapter(spec).lora_version == "1"
            continue
        with pytest.raises(ValueError, match=words):
            parse_adapter(spec)


def test_an_adapter_outside_the_weights_roots_is_refused_naming_the_fix(tmp_path: Path) -> None:
    inside = LoRARequest("a", str(tmp_path / "roots" / "a"))
    check_inside_roots(inside, [str(tmp_path / "roots")], 8000)
    check_inside_roots(inside, None, 8000)  # a stack that records none: the engines check
    with pytest.raises(ValueError, match=r"outside the weights roots of the stack on port "
                                         r"8000 .*tandem serve --weights-root DIR"):
        check_inside_roots(LoRARequest("a", "/elsewhere/a"), [str(tmp_path / "roots")], 8000)


def _status(state: EngineState = EngineState.RUNNING, loras=UNSET) -> EngineStatus:
    return EngineStatus(state=state, weight_version="v1", weight_epoch=0, num_running=0,
                        num_waiting=0, loras=loras)


def test_an_engine_that_cannot_take_part_is_refused_before_any_is_touched() -> None:
    assert engine_adapter_state("e0", "u", _status(loras=["b@1", "sql@3"]), "sql") == \
        EngineAdapterState("e0", "u", "sql@3")
    assert engine_adapter_state("e0", "u", _status(loras=[]), "sql").serves is None
    for status, words in ((None, "engine e0 does not answer its admin API at u"),
                          (_status(EngineState.PAUSED, []), "engine e0 is PAUSED"),
                          (_status(), "tandem serve --enable-lora")):
        with pytest.raises(ValueError, match=words):
            engine_adapter_state("e0", "u", status, "sql")


# ---- the plan -----------------------------------------------------------------------------------


def _ledger(tmp_path: Path, startup: list[str] = ()) -> AdapterLedger:
    return AdapterLedger(tmp_path, {"lora_modules": list(startup)})


def _engines(*serves: str | None) -> list[EngineAdapterState]:
    return [EngineAdapterState(f"engine-{i}", f"http://e{i}", s) for i, s in enumerate(serves)]


def test_a_rollback_restores_what_each_engine_served(tmp_path: Path) -> None:
    v2 = LoRARequest("sql", "/a/sql-v2", "2")
    # new: a rollback unloads it
    plan = plan_change("sql", v2, _engines(None, None), _ledger(tmp_path))
    assert plan.restore == {"engine-0": None, "engine-1": None}
    # a start-up adapter (tandem serve --lora-modules, recorded in stack.json)
    ledger = _ledger(tmp_path, ["sql@1=/a/sql-v1"])
    plan = plan_change("sql", v2, _engines("sql@1", "sql@1"), ledger)
    assert set(plan.restore.values()) == {LoRARequest("sql", "/a/sql-v1", "1")}
    assert "sql@1 → sql@2 (/a/sql-v2), on 2 engine(s) one at a time" in plan.describe()
    # an interrupted change run again: the engine already on the target goes back to the
    # version the stack last set
    plan = plan_change("sql", v2, _engines("sql@2", "sql@1"), ledger)
    assert set(plan.restore.values()) == {LoRARequest("sql", "/a/sql-v1", "1")}
    # what this command set last wins over the start-up version
    ledger.record("sql", LoRARequest("sql", "/a/sql-v3", "3"))
    plan = plan_change("sql", v2, _engines("sql@3", "sql@3"), _ledger(tmp_path))
    assert set(plan.restore.values()) == {LoRARequest("sql", "/a/sql-v3", "3")}


def test_a_version_of_unknown_folder_or_a_name_nobody_serves_is_refused(tmp_path: Path) -> None:
    v2 = LoRARequest("sql", "/a/sql-v2", "2")
    with pytest.raises(ValueError, match=r"engine engine-1 serves sql@7, and this stack has "
                                         r"no record of the folder .*--remove-adapter sql"):
        plan_change("sql", v2, _engines(None, "sql@7"), _ledger(tmp_path))
    with pytest.raises(ValueError, match="--remove-adapter sql: no engine of the stack "
                                         "serves it"):
        plan_change("sql", None, _engines(None, None), _ledger(tmp_path))
    # loading the version an engine serves again needs no record of it
    plan_change("sql", LoRARequest("sql", "/a/x", "7"), _engines("sql@7"), _ledger(tmp_path))


def test_the_ledger_keeps_each_names_last_version_and_removals(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path, ["a=/start/a", "b@4=/start/b"])
    ledger.record("a", LoRARequest("a", "/new/a", "2"))
    ledger.record("b", None)
    again = _ledger(tmp_path, ["a=/start/a", "b@4=/start/b"])
    assert again.current("a") == LoRARequest("a", "/new/a", "2")
    assert again.current("b") is None and again.current("c") is None
    assert again.folders() == {"a@1": "/start/a", "b@4": "/start/b", "a@2": "/new/a"}
    again.record("c", LoRARequest("c", "/new/c", "1"))
    # What a restarted engine is given: the start-up list with the changes over it.
    assert again.modules() == ["a@2=/new/a", "c@1=/new/c"]
    (tmp_path / "adapters.json").write_text('{"adapters": {"a": {"path": 3}}}')
    with pytest.raises(ValueError, match="cannot read the stack's adapter record"):
        _ledger(tmp_path)


# ---- carrying it out, against fakes -------------------------------------------------------------


@dataclass
class FakeEngines:
    """Engines' admin APIs: each serves {name: identity}; `refuse`/`silent` name engines
    whose next load is refused (400) or never answered."""

    serves: dict[str, dict[str, str]]
    refuse: set[str] = field(default_factory=set)
    silent: set[str] = field(default_factory=set)
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # engine, call, what

    async def call(self, engine: str, url: str, path: str, body: dict | None = None,
                   timeout: float | None = None) -> dict:
        name = body["lora_name"]
        load = path == "/v1/load_lora_adapter"
        what = f"{name}@{body['lora_version']}" if load else name
        self.calls.append((engine, path.removeprefix("/v1/"), what))
        if load:
            if engine in self.silent:
                self.silent.discard(engine)
                raise AdminError(engine, "POST " + path, "ReadTimeout", no_answer=True)
            if engine in self.refuse:
                self.refuse.discard(engine)
                raise AdminError(engine, "POST " + path, f"HTTP 400: LoRA adapter {name!r} "
                                 "not loaded: bad shapes", 400)
            self.serves[engine][name] = what
        elif self.serves[engine].pop(name, None) is None:
            raise AdminError(engine, "POST " + path, "HTTP 404: not served", 404)
        return {"loras": sorted(self.serves[engine].values())}


@dataclass
class FakeRouter:
    engines: FakeEngines
    verifies: bool = True
    completions: list[str] = field(default_factory=list)

    async def wait_serving(self, engine: str, name: str, identity: str | None,
                           timeout: float) -> None:
        assert self.engines.serves[engine].get(name) == identity

    async def complete_one(self, name: str) -> None:
        self.completions.append(name)
        if not self.verifies:
            raise AdapterChangeFailed(f"a one-token completion under {name} through the "
                                      "router answered HTTP 500: boom")


def _run(plan, engines: FakeEngines, router: FakeRouter) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = asyncio.run(apply_change(plan, engines, router, out, err))
    return code, out.getvalue(), err.getvalue()


def _three(serves: str | None) -> tuple[FakeEngines, list[EngineAdapterState]]:
    names = [f"engine-{i}" for i in range(3)]
    engines = FakeEngines({n: {"sql": serves} if serves else {} for n in names})
    return engines, _engines(serves, serves, serves)


V1 = LoRARequest("sql", "/a/sql-v1", "1")
V2 = LoRARequest("sql", "/a/sql-v2", "2")


def test_a_change_goes_one_engine_at_a_time_then_verifies(tmp_path: Path) -> None:
    engines, states = _three("sql@1")
    router = FakeRouter(engines)
    plan = plan_change("sql", V2, states, _ledger(tmp_path, ["sql@1=/a/sql-v1"]))
    code, out, err = _run(plan, engines, router)
    assert (code, err) == (0, "")
    assert engines.calls == [(f"engine-{i}", "load_lora_adapter", "sql@2") for i in range(3)]
    assert router.completions == ["sql"]
    assert "engine-2: serves sql@2" in out and "every engine serves sql@2, verified" in out


@pytest.mark.parametrize(("fault", "undone"), [
    ("refuse", ["engine-0"]),  # engine-1 refused: it serves what it did
    ("silent", ["engine-1", "engine-0"]),  # engine-1 never answered: it may have loaded
])
def test_a_failed_engine_puts_the_changed_ones_back(tmp_path: Path, fault: str,
                                                    undone: list[str]) -> None:
    engines, states = _three("sql@1")
    getattr(engines, fault).add("engine-1")
    plan = plan_change("sql", V2, states, _ledger(tmp_path, ["sql@1=/a/sql-v1"]))
    code, _, err = _run(plan, engines, FakeRouter(engines))
    assert code == 1
    assert engines.calls[2:] == [(e, "load_lora_adapter", "sql@1") for e in undone]
    assert all(s == {"sql": "sql@1"} for s in engines.serves.values())
    assert err.startswith("tandem refit: adapter sql@2 failed: engine engine-1: POST "
                          "/v1/load_lora_adapter: ")
    assert "Rolled back: " + "; ".join(f"{e} serves sql@1" for e in undone) + " again." in err


def test_a_new_adapter_that_fails_verification_is_unloaded_everywhere(tmp_path: Path) -> None:
    engines, states = _three(None)
    router = FakeRouter(engines, verifies=False)
    code, _, err = _run(plan_change("sql", V1, states, _ledger(tmp_path)), engines, router)
    assert code == 1
    assert [c[1] for c in engines.calls] == ["load_lora_adapter"] * 3 + [
        "unload_lora_adapter"] * 3
    assert all(s == {} for s in engines.serves.values())
    assert "answered HTTP 500: boom. Rolled back: engine-2 serves no sql; engine-1" in err


def test_a_refusal_at_the_first_engine_changes_nothing(tmp_path: Path) -> None:
    engines, states = _three("sql@1")
    engines.refuse.add("engine-0")
    plan = plan_change("sql", V2, states, _ledger(tmp_path, ["sql@1=/a/sql-v1"]))
    code, _, err = _run(plan, engines, FakeRouter(engines))
    assert code == 1 and len(engines.calls) == 1
    assert err.endswith("bad shapes. No engine had changed: every engine serves what it did.\n")


def test_a_removal_unloads_engine_by_engine(tmp_path: Path) -> None:
    engines, states = _three("sql@1")
    del engines.serves["engine-1"]["sql"]  # it never had it: its 404 counts as done
    states[1] = EngineAdapterState("engine-1", "http://e1", None)
    code, out, err = _run(plan_change("sql", None, states, _ledger(tmp_path)), engines,
                          FakeRouter(engines))
    assert (code, err) == (0, "")
    assert [c[:2] for c in engines.calls] == [(f"engine-{i}", "unload_lora_adapter")
                                              for i in range(3)]
    assert "engine-1: no longer serves sql" in out and "removed from every engine" in out


# ---- the command's input (no stack) -------------------------------------------------------------


@pytest.mark.parametrize(("argv", "words"), [
    (["--adapter", "sql"], "--adapter 'sql': write NAME=URI"),
    (["--adapter", "sql=/x", "--uri", "file:///y"], "one change at a time"),
    (["--remove-adapter", "s q l"], "name 's q l' is invalid"),
    ([], "give the new weights, --uri file:///dir and --weights-version NAME (or a LoRA "
         "adapter: --adapter NAME=URI"),
    (["--adapter", "sql=/x"], "stack.json does not exist; is `tandem serve --port"),
])
def test_bad_input_is_refused_by_name(argv: list[str], words: str, tmp_path: Path,
                                      monkeypatch, capsys) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert cli.main(["refit", "--port", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem refit: error: ") and words in err, err


def test_adapter_and_remove_adapter_exclude_each_other(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["refit", "--adapter", "a=/x", "--remove-adapter", "a"])
    assert "not allowed with argument --adapter" in capsys.readouterr().err


# ---- against a real `tandem serve --engines 2 --enable-lora` ------------------------------------

slow = pytest.mark.slow
TARGETS = ["q_proj", "v_proj", "down_proj"]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT folders of the tiny model: two versions of `sql`, one of `s`, and broken ones:
    a tensor of the wrong shape, no weights file, and weights so large that every token
    under them is non-finite (the folder loads; generating fails)."""
    from safetensors.torch import load_file, save_file
    from test_lora import make_adapter

    root = tmp_path_factory.mktemp("refit-adapters")
    out = {name: make_adapter(tiny_llama, root / name, rank, TARGETS, seed)
           for name, rank, seed in (("sql-v1", 4, 11), ("sql-v2", 8, 12), ("s-v1", 4, 13))}
    weights = "adapter_model.safetensors"
    tensors = load_file(str(out["sql-v2"] / weights))
    shapes = out["shapes"] = Path(shutil.copytree(out["sql-v2"], root / "shapes"))
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    save_file({**tensors, key: tensors[key][:-1].contiguous()}, str(shapes / weights))
    missing = out["missing"] = Path(shutil.copytree(out["sql-v2"], root / "missing"))
    (missing / weights).unlink()
    huge = out["huge"] = Path(shutil.copytree(out["sql-v2"], root / "huge"))
    save_file({k: v * 1e20 for k, v in tensors.items()}, str(huge / weights))
    return out


@dataclass
class Stack:
    tmp: Path
    port: int

    @property
    def router(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def description(self) -> dict:
        return json.loads((self.tmp / f"tandem-{self.port}" / "stack.json").read_text())

    def refit(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tandem_engine.cli.main", "refit", "--port",
             str(self.port), *args], capture_output=True, text=True, timeout=300,
            env={**os.environ, "TMPDIR": str(self.tmp)})

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.router}/v1", api_key="x", max_retries=0,
                             timeout=60)

    def text(self, model: str) -> str:
        r = self.client().completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                             temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].text

    def engine_loras(self) -> list[list[str]]:
        stack = self.description
        return [httpx.get(f"{e['admin_url']}/v1/state", timeout=10, headers={
            "Authorization": f"Bearer {stack['admin_token']}"}).json()["loras"]
            for e in stack["engines"]]

    def ledger(self) -> dict:
        return json.loads((self.tmp / f"tandem-{self.port}" / "adapters.json").read_text())


@pytest.fixture(scope="module")
def stack(tiny_llama: Path, adapters: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two engines of the tiny model (`tiny`), adapters enabled, `s` served from the
    start; run-time adapters load from the adapters' folder."""
    tmp, port = tmp_path_factory.mktemp("refit-adapter-stack"), free_port()
    proc, _ = start_serve(tmp, "--model", str(tiny_llama), "--served-model-name", "tiny",
                          "--port", str(port), "--engines", "2", "--threads", "1",
                          "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                          "--weights-root", str(adapters["sql-v1"].parent),
                          "--lora-modules", f"s={adapters['s-v1']}")
    try:
        yield Stack(tmp, port)
    finally:
        stop_serve(proc)


class Streams:
    """Streamed completions under each of `models`, `threads` at a time, until the block
    ends; each must end with all its tokens."""

    def __init__(self, stack: Stack, models: list[str], threads: int = 3) -> None:
        self.stack, self.models = stack, models
        self.stop = threading.Event()
        self.done: list[str] = []
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(threads)]

    def _loop(self, i: int) -> None:
        client = self.stack.client()
        k = i
        while not self.stop.is_set():
            model = self.models[k % len(self.models)]
            k += 1
            try:
                chunks = list(client.completions.create(
                    model=model, prompt=f"{PROMPT} {k}", max_tokens=16, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}))
                finish = [c.choices[0].finish_reason for c in chunks
                          if c.choices and c.choices[0].finish_reason]
                if finish != ["length"]:
                    self.failed.append(f"{model}: finish {finish}")
                else:
                    self.done.append(model)
            except openai.OpenAIError as exc:
                self.failed.append(f"{model}: {type(exc).__name__}: {exc}")

    def __enter__(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


@slow
def test_the_stack_records_its_start_up_adapters(stack: Stack, adapters: dict[str, Path]
                                                 ) -> None:
    assert stack.description["lora_modules"] == [f"s@1={adapters['s-v1'].resolve()}"]
    assert stack.engine_loras() == [["s@1"], ["s@1"]]


@slow
def test_an_adapter_added_reversioned_under_load_refused_and_removed(
        stack: Stack, adapters: dict[str, Path]) -> None:
    base = stack.text("tiny")
    done = stack.refit("--adapter", f"sql={adapters['sql-v1'].as_uri()}")
    assert done.returncode == 0, done.stderr
    assert "adapter sql: (none) → sql@1" in done.stdout
    assert "every engine serves sql@1, verified" in done.stdout
    assert stack.engine_loras() == [["s@1", "sql@1"], ["s@1", "sql@1"]]
    models = {m.id: m.model_extra for m in stack.client().models.list().data}
    assert models["sql"]["parent"] == "tiny" and models["sql"]["root"] == "sql@1"
    v1 = stack.text("sql")
    assert v1 != base

    # a new version, one engine at a time, under streams of the adapter and the base
    with Streams(stack, ["sql", "tiny"]) as load:
        while len(load.done) < 3 and not load.failed:  # streams running before it starts
            threading.Event().wait(0.05)
        started = len(load.done)
        done = stack.refit("--adapter", f"sql@2={adapters['sql-v2']}")
        ended = len(load.done)
        while len(load.done) < ended + 3 and not load.failed:  # and after it ended
            threading.Event().wait(0.05)
    assert done.returncode == 0, done.stderr
    assert load.failed == [] and ended > started
    assert {"sql", "tiny"} <= set(load.done)
    assert "sql@1 → sql@2" in done.stdout and "engine-1: serves sql@2" in done.stdout
    assert stack.engine_loras() == [["s@1", "sql@2"], ["s@1", "sql@2"]]
    v2 = {stack.text("sql") for _ in range(4)}  # whichever engine the router picks
    assert len(v2) == 1 and v2 != {v1}
    assert stack.ledger()["adapters"]["sql"] == {"version": "2",
                                                 "path": str(adapters["sql-v2"])}
    # An engine that `tandem serve` restarts comes back with what the stack serves now.
    child = stack.description["children"]["engine-1"]
    os.kill(child["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        restarted = stack.description["children"]["engine-1"]
        if restarted["pid"] != child["pid"]:
            try:
                if stack.engine_loras()[1] == ["s@1", "sql@2"]:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
        time.sleep(0.2)
    assert stack.engine_loras() == [["s@1", "sql@2"], ["s@1", "sql@2"]]

    # versions an engine refuses: the first engine refuses, none changes, v2 serves on
    for folder, words in (("shapes", "lora_B"), ("missing", "adapter_model.safetensors")):
        done = stack.refit("--adapter", f"sql@3={adapters[folder]}")
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith("tandem refit: adapter sql@3 failed: engine engine-0: "
                                      "POST /v1/load_lora_adapter: HTTP 400: "), done.stderr
        assert words in done.stderr and "No engine had changed" in done.stderr
        assert stack.text("sql") in v2
    assert stack.engine_loras() == [["s@1", "sql@2"], ["s@1", "sql@2"]]

    done = stack.refit("--remove-adapter", "sql")
    assert done.returncode == 0, done.stderr
    assert "adapter sql removed from every engine" in done.stdout
    with pytest.raises(openai.NotFoundError):
        stack.text("sql")
    assert stack.engine_loras() == [["s@1"], ["s@1"]]
    assert stack.ledger()["adapters"]["sql"] is None
    again = stack.refit("--remove-adapter", "sql")
    assert again.returncode == 2
    assert "--remove-adapter sql: no engine of the stack serves it" in again.stderr


@slow
def test_a_version_that_cannot_generate_is_rolled_back_from_every_engine(
        stack: Stack, adapters: dict[str, Path]) -> None:
    """Its folder loads on both engines (every shape is right), the verifying completion
    fails, and both engines go back to the start-up version (its folder from stack.json),
    which serves as before."""
    before = stack.text("s")
    done = stack.refit("--adapter", f"s@2={adapters['huge']}")
    assert done.returncode == 1, done.stderr
    assert "engine-0: serves s@2" in done.stdout and "engine-1: serves s@2" in done.stdout
    assert "failed: a one-token completion under s through the router" in done.stderr
    assert "Rolled back: engine-1 serves s@1; engine-0 serves s@1 again." in done.stderr
    assert stack.engine_loras() == [["s@1"], ["s@1"]]
    assert stack.text("s") == before
    if (stack.tmp / f"tandem-{stack.port}" / "adapters.json").exists():  # nothing recorded
        assert "s" not in stack.ledger()["adapters"]
