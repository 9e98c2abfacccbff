"""`tandem refit` against a real `tandem serve --prefill 2 --decode 2`, under load.

One stack serves every scenario (it is refitted back and forth): a corrupt target rolled
back, an incompatible one halted, a rolling refit under continuous streaming load whose
outputs are checked against fresh engines of each version, a refit killed mid-way and
run again, and an all-at-once refit with Recompute that keeps long generations in
flight. Load goes through the router with
the `openai` client from several threads, retries off, so any failed request shows.
"""

from __future__ import annotations

import json
import os
import re
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
from tandem_engine.cli import main as cli
from tandem_engine.cli.serve import free_port
from test_serve import spawn_serve, stop_serve, wait_for_url

MODEL = "t"
PROMPTS = ["Once upon a time", "The harbour at night", "Seven bridges cross",
           "A letter arrived", "In the old library", "She opened the door"]
SHORT = 8  # tokens of each load request


def name(version: str) -> str:
    """The stack starts on v1's weights under the engines' default version name."""
    return "v1" if version == "initial" else version


@dataclass
class Stack:
    proc: subprocess.Popen
    port: int
    tmp: Path

    @property
    def router(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def engines(self) -> list[dict]:
        return httpx.get(f"{self.router}/v1/engines", timeout=10).json()["engines"]

    def admin_states(self) -> list[dict]:
        """Each engine's /v1/state from its admin API (stack.json lists them)."""
        stack_json = self.tmp / f"tandem-{self.port}" / "stack.json"
        return [httpx.get(f"{e['admin_url']}/v1/state", timeout=10).json()
                for e in json.loads(stack_json.read_text())["engines"]]

    def versions(self) -> set[str]:
        return {name(e["weight_version"]) for e in self.engines()}

    def all_serving(self, version: str) -> bool:
        engines = self.engines()
        return len(engines) == 4 and all(
            e["alive"] and e["state"] == "RUNNING" and not e["draining"]
            and name(e["weight_version"]) == version for e in engines)

    def metric(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """Every sample of `name`, by its labels."""
        out = {}
        for line in httpx.get(f"{self.router}/metrics", timeout=10).text.splitlines():
            m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
            if m:
                labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")))
                out[labels] = float(m.group(2))
        return out

    def refit(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tandem_engine.cli.main", "refit", "--port", str(self.port),
             *args], capture_output=True, text=True, timeout=180,
            env={**os.environ, "TMPDIR": str(self.tmp)})

    def primed_refit(self, *args: str) -> PrimedRefit:
        return PrimedRefit(["refit", "--port", str(self.port), *args],
                           {**os.environ, "TMPDIR": str(self.tmp)})


class PrimedRefit:
    """`tandem refit` with Python started and its modules imported, waiting for `go()`:
    the transaction then begins within milliseconds, where a fresh `tandem refit` spends
    seconds starting Python on a busy 2-core machine (long enough for a test's in-flight
    requests to end before the refit reaches them)."""

    _PRIME = ("import sys; import tandem_engine.cli.main as m; import tandem_engine.cli.refit; "
              "print('primed', flush=True); sys.stdin.readline(); "
              "sys.exit(m.main(sys.argv[1:]))")

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", self._PRIME, *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if line.strip() != "primed":
            self.proc.kill()
            raise RuntimeError(f"tandem refit did not start: {line}{self.proc.stderr.read()}")

    def go(self, timeout: float = 180) -> subprocess.CompletedProcess:
        try:
            out, err = self.proc.communicate("\n", timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)


@dataclass
class Record:
    prompt: str
    sent: float
    done: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # when each chunk arrived
    finish: str | None = None
    error: str | None = None


def stream(client: openai.OpenAI, prompt: str, max_tokens: int, ignore_eos: bool = False,
           progress: list[int] | None = None) -> Record:
    record = Record(prompt, time.monotonic())
    try:
        chunks = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": ignore_eos})
        for chunk in chunks:
            choice = chunk.choices[0]
            record.token_ids += choice.model_extra.get("token_ids") or []
            record.stamps.append(time.monotonic())
            record.finish = choice.finish_reason or record.finish
            if progress is not None:
                progress.append(1)
    except openai.OpenAIError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.done = time.monotonic()
    return record


class Load:
    """Short greedy streams through the router from `threads` threads until stopped."""

    def __init__(self, stack: Stack, threads: int = 3) -> None:
        self.client = openai.OpenAI(base_url=f"{stack.router}/v1", api_key="x",
                                    max_retries=0, timeout=120)
        self.records: list[Record] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True)
                         for i in range(threads)]

    def _loop(self, i: int) -> None:
        n = i
        while not self._stop.is_set():
            self.records.append(stream(self.client, PROMPTS[n % len(PROMPTS)], SHORT))
            n += 1

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        time.sleep(0.5)  # requests before the refit starts
        return self

    def __exit__(self, *_exc) -> None:
        time.sleep(0.5)  # requests after it ended
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def failed(self) -> list[Record]:
        return [r for r in self.records if r.error or r.finish not in ("length", "stop")]


@pytest.fixture(scope="module")
def checkpoints(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tandem_engine.cli.demo_model import write_demo_model

    root = tmp_path_factory.mktemp("refit-checkpoints")
    v2 = write_demo_model(root / "v2", size="tiny", seed=1)
    v3 = write_demo_model(root / "v3", size="tiny", seed=2)  # the second edit's target
    # Corrupt: v1 with its weights file cut short (the header still reads).
    corrupt = root / "corrupt"
    shutil.copytree(tiny_llama, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    # Incompatible: a config for another hidden size than the running model's.
    wrong = root / "wrong-shape"
    shutil.copytree(tiny_llama, wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    return {"v1": tiny_llama, "v2": v2, "v3": v3, "corrupt": corrupt, "wrong": wrong,
            **bad_weights(tiny_llama, root)}


def bad_weights(good: Path, root: Path) -> dict[str, Path]:
    """v1 changed so that every shape still fits, but the weights must not go live."""
    import torch
    from safetensors.torch import load_file, save_file

    def variant(name: str, change) -> Path:
        folder = root / name
        shutil.copytree(good, folder)
        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors")
        return folder

    return {
        # A diverged training step: NaN in one norm (refused while loading).
        "nan": variant("nan", lambda t: t["model.norm.weight"].fill_(torch.nan)),
        # Finite weights whose logits overflow float32 (the canary sees Inf/NaN logits).
        "overflow": variant("overflow", lambda t: (t["model.norm.weight"].mul_(1e36),
                                                   t["lm_head.weight"].mul_(100))),
        # A zeroed final norm: every logit 0, so greedy repeats token 0 (degenerate).
        "degenerate": variant("degenerate", lambda t: t["model.norm.weight"].zero_()),
        # Over-confident: the same greedy tokens, a far worse perplexity on real text.
        "sharp": variant("sharp", lambda t: t["lm_head.weight"].mul_(20)),
    }


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
    """version -> prompt -> greedy token ids of a fresh engine on those weights."""
    from tandem_engine import LLM, SamplingParams

    out = {}
    for version in ("v1", "v2"):
        outputs = LLM(checkpoints[version]).generate(
            PROMPTS, SamplingParams(max_tokens=SHORT, temperature=0.0))
        out[version] = {p: list(o.outputs[0].token_ids)
                        for p, o in zip(PROMPTS, outputs, strict=True)}
    differ = sum(out["v1"][p] != out["v2"][p] for p in PROMPTS)
    assert differ >= len(PROMPTS) - 1, "v1 and v2 must answer differently to tell them apart"
    return out


@pytest.fixture(scope="module")
def stack(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    tmp, port = tmp_path_factory.mktemp("refit-stack"), free_port()
    proc = spawn_serve(tmp, "--model", str(checkpoints["v1"]), "--prefill", "2", "--decode",
                       "2", "--port", str(port), "--served-model-name", MODEL,
                       "--weights-root", str(checkpoints["v2"].parent))
    try:
        wait_for_url(proc, timeout=240)
        yield Stack(proc, port, tmp)
    finally:
        stop_serve(proc)


def uri(path: Path) -> str:
    return path.resolve().as_uri()


def other(version: str) -> str:
    return "v2" if version == "v1" else "v1"


def current(stack: Stack) -> str:
    """The version every engine serves, v1 or v2."""
    (version,) = stack.versions()
    assert stack.all_serving(version)
    return version


class AwayWatch:
    """Polls the router's view: when did it first see no engine serving?"""

    def __init__(self, stack: Stack) -> None:
        self.stack, self.first_away = stack, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set() and self.first_away is None:
            at = time.monotonic()
            if not any(e["state"] == "RUNNING" and not e["draining"]
                       for e in self.stack.engines()):
                self.first_away = at
            time.sleep(0.02)

    def __enter__(self) -> AwayWatch:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def assert_no_failure(stack: Stack, load: Load) -> None:
    """No request of `load` failed, on the client's side and in the router's counters
    (counted since the stack started: no earlier test may have failed one either)."""
    assert load.records, "the load sent nothing"
    assert load.failed() == [], load.failed()
    outcomes = stack.metric("tandem_router_requests_total")
    assert outcomes[(("outcome", "failed"),)] == 0
    assert outcomes[(("outcome", "unavailable"),)] == 0


def assert_pairs_never_mixed(stack: Stack) -> dict[tuple[str, str], float]:
    pairs: dict[tuple[str, str], float] = {}
    for labels, n in stack.metric("tandem_router_kv_handoff_versions_total").items():
        pair = (name(dict(labels)["prefill_version"]), name(dict(labels)["decode_version"]))
        pairs[pair] = pairs.get(pair, 0) + n
    assert pairs and all(p == d for p, d in pairs), pairs
    return pairs


# ---- input errors (no stack needed) -------------------------------------------------------------


def test_refit_refuses_bad_input_by_name(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    (tmp_path / "no-config").mkdir()
    cases = [
        (["--uri", "s3://bucket/model"], "--uri 's3://bucket/model': must be a file:// URI"),
        (["--uri", uri(tmp_path / "missing")], "missing does not exist"),
        (["--uri", uri(tmp_path / "no-config")], "no-config has no config.json"),
    ]
    for args, message in cases:
        assert cli.main(["refit", "--version", "v2", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tandem refit: error: --uri") and message in err, err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for args, message in ((["--max-unavailable", "0"], "--max-unavailable 0: must be >= 1"),
                          (["--drain-timeout", "0"], "--drain-timeout 0.0: must be > 0"),
                          (["--version", ""], "--weights-version '': give 1 to 253 characters")):
        assert cli.main(["refit", "--uri", uri(model), "--version", "v2", *args]) == 2
        assert message in capsys.readouterr().err
    port = free_port()
    assert cli.main(["refit", "--uri", uri(model), "--version", "v2", "--port",
                     str(port)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / f"tandem-{port}" / "stack.json") in err
    assert f"is `tandem serve --port {port}` running?" in err


def test_refit_lock_takes_over_a_stale_lock_and_supersedes_a_live_holder(
        tmp_path: Path, monkeypatch) -> None:
    import io

    from tandem_engine.cli.refit import RefitLock
    from tandem_engine.weights import WeightsRef

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    port = free_port()
    path = tmp_path / f"tandem-{port}" / "refit.pid"
    path.parent.mkdir()
    # A dead holder (a pid that exited): its lock is stale.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path.write_text(json.dumps({"pid": gone.pid, "version": "v2", "uri": "file:///v2"}))
    out = io.StringIO()
    lock = RefitLock(port, WeightsRef("file:///v3", "v3"), out)
    lock.acquire()
    assert f"taking over a stale lock {path} (refit to v2, pid {gone.pid}" in out.getvalue()
    assert json.loads(path.read_text()) == {"pid": os.getpid(), "version": "v3",
                                            "uri": "file:///v3"}
    lock.release()
    assert not path.exists()
    # A live holder (its command line names refit) gets SIGTERM and is waited for.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "refit"])
    try:
        # Until the child has exec'd, its /proc cmdline is still this process's (no "refit"),
        # and the lock would rightly call the holder stale; a loaded machine showed that.
        deadline = time.monotonic() + 10
        while b"refit" not in Path(f"/proc/{holder.pid}/cmdline").read_bytes().split(b"\0"):
            assert time.monotonic() < deadline, "the holder never started"
            time.sleep(0.01)
        path.write_text(json.dumps({"pid": holder.pid, "version": "v2", "uri": "file:///v2"}))
        out = io.StringIO()
        RefitLock(port, WeightsRef("file:///v3", "v3"), out, wait=5).acquire()
        assert out.getvalue() == f"superseding the refit to v2 (pid {holder.pid})\n"
        assert holder.wait(timeout=5) == -signal.SIGTERM
    finally:
        holder.kill()
        holder.wait()
    assert json.loads(path.read_text())["pid"] == os.getpid()


# ---- against a running stack --------------------------------------------------------------------

slow = pytest.mark.slow


@slow
def test_stack_describes_itself(stack: Stack) -> None:
    description = json.loads((stack.tmp / f"tandem-{stack.port}" / "stack.json").read_text())
    assert description["router"] == f"{stack.router}/v1" and description["port"] == stack.port
    stack_json = stack.tmp / f"tandem-{stack.port}" / "stack.json"
    assert description["admin_token"] and stack_json.stat().st_mode & 0o777 == 0o600
    assert [(e["name"], e["role"]) for e in description["engines"]] == [
        ("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-2", "decode"),
        ("decode-3", "decode")]
    for e in description["engines"]:
        state = httpx.get(f"{e['admin_url']}/v1/state", timeout=10).json()
        assert (state["engine_id"], state["role"]) == (e["name"], e["role"])


@slow
def test_corrupt_target_is_rolled_back_without_failing_a_request(
        stack: Stack, checkpoints: dict[str, Path], references) -> None:
    old = current(stack)
    with Load(stack) as load:
        done = stack.refit("--uri", uri(checkpoints["corrupt"]), "--version", "v9")
    assert done.returncode == 1, done.stdout + done.stderr
    # The reason names the engine, the step and the engine's own error.
    assert "failed and was rolled back" in done.stderr
    assert re.search(r"engine (prefill|decode)-\d failed at POST /v1/refit: HTTP 422: refit "
                     r"to file://\S+ refused, old weights still serving: .*model.safetensors",
                     done.stderr), done.stderr
    assert "RefitRolledBack" in done.stdout
    assert stack.all_serving(old)
    assert_no_failure(stack, load)
    # Every request ran on the old weights.
    assert all(r.token_ids == references[old][r.prompt] for r in load.records)
    assert_pairs_never_mixed(stack)


@slow
@pytest.mark.parametrize(("target", "options", "reason"), [
    ("nan", (), r"failed at POST /v1/refit: HTTP 422: .*weights that are not finite numbers"
                r".*model\.norm\.weight: 64 of 64 values are NaN or Inf"),
    ("overflow", (), r"failed at POST /v1/canary: HTTP 409: canary failed: the model "
                     r"produced non-finite logits"),
    ("degenerate", (), r"failed at verify: degenerate canary: 16 greedy tokens are all "
                       r"token 0, where the previous weights \(\S+\) gave \[\d+, \d+"),
    ("sharp", ("--max-perplexity-ratio", "1.5"),
     r"failed at verify: perplexity \S+ on the probe text is \S+x the previous weights' "
     r"\S+ \(\S+\), above refit.verify.maxPerplexityRatio 1.5"),
])
def test_weights_that_fail_verification_never_serve(
        stack: Stack, checkpoints: dict[str, Path], target: str, options: tuple[str, ...],
        reason: str) -> None:
    old = current(stack)
    with Load(stack) as load:
        done = stack.refit("--uri", uri(checkpoints[target]), "--version", "v9", *options)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "failed and was rolled back" in done.stderr
    assert re.search(reason, done.stderr, re.S), done.stderr
    assert "RefitBaseline" in done.stdout and "RefitRolledBack" in done.stdout
    assert stack.all_serving(old)
    assert_no_failure(stack, load)


@slow
def test_incompatible_target_with_halt_stops_and_keeps_serving(
        stack: Stack, checkpoints: dict[str, Path]) -> None:
    old = current(stack)
    with Load(stack) as load:
        done = stack.refit("--uri", uri(checkpoints["wrong"]), "--version", "v9",
                           "--on-failure", "Halt", "--max-unavailable", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "failed and was halted" in done.stderr
    assert "hidden_size" in done.stderr and "HTTP 422" in done.stderr
    assert "RefitHalted" in done.stdout and "RefitRolledBack" not in done.stdout
    assert stack.all_serving(old)  # the refit was refused: nothing left on another version
    assert_no_failure(stack, load)


@slow
def test_rolling_refit_under_load(stack: Stack, checkpoints: dict[str, Path],
                                  references) -> None:
    old = current(stack)
    new = other(old)
    before = assert_pairs_never_mixed(stack)
    with Load(stack, threads=4) as load:
        started = time.monotonic()
        done = stack.refit("--uri", uri(checkpoints[new]), "--version", new)
        ended = time.monotonic()
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"refit succeeded: every engine serves {new}" in done.stdout
    assert done.stdout.count("EngineRefitted") == 4 and "RefitWave: wave 2" in done.stdout
    assert "engines: prefill-0" in done.stdout  # the per-engine state line
    assert stack.all_serving(new)
    assert_no_failure(stack, load)
    finished_before = [r for r in load.records if r.done < started]
    admitted_after = [r for r in load.records if r.sent > ended]
    during = [r for r in load.records if r not in finished_before + admitted_after]
    assert finished_before and admitted_after and during
    for r in finished_before:
        assert r.token_ids == references[old][r.prompt], r
    for r in admitted_after:
        assert r.token_ids == references[new][r.prompt], r
    # In-flight requests drained on their engine: each is wholly one version's output.
    for r in during:
        assert r.token_ids in (references[old][r.prompt], references[new][r.prompt]), r
    # No request paired a prefill and a decode engine of different versions.
    pairs = assert_pairs_never_mixed(stack)
    assert pairs.get((old, old), 0) > before.get((old, old), 0)
    assert pairs.get((new, new), 0) > before.get((new, new), 0)


@slow
def test_an_interrupted_refit_is_finished_by_running_it_again(
        stack: Stack, checkpoints: dict[str, Path], references) -> None:
    """`tandem refit` killed (SIGKILL: no cleanup) while engines are paused, suspended or
    resumed; the same command again takes every engine to the target, and no request
    fails or mixes versions meanwhile."""
    old = current(stack)
    description = json.loads((stack.tmp / f"tandem-{stack.port}" / "stack.json").read_text())
    admins = [e["admin_url"] for e in description["engines"]]
    env = {**os.environ, "TMPDIR": str(stack.tmp)}

    def command(version: str) -> list[str]:
        return [sys.executable, "-m", "tandem_engine.cli.main", "refit", "--port",
                str(stack.port), "--uri", uri(checkpoints[version]), "--version", version]

    def kill_in(phase: str, version: str) -> list[dict] | None:
        """Run the refit to `version`, kill it once an engine is in `phase`: the engines'
        states then, or None when the refit finished before a poll saw the phase."""
        proc = subprocess.Popen(command(version), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if phase in [httpx.get(f"{a}/v1/state", timeout=10).json()["state"]
                         for a in admins]:
                proc.kill()
                proc.wait(timeout=60)
                return [httpx.get(f"{a}/v1/state", timeout=10).json() for a in admins]
        proc.wait(timeout=60)
        return None

    left = []
    target = other(old)
    with Load(stack) as load:
        for phase in ("PAUSED", "SUSPENDED", "RESUMED"):
            # A phase lasts milliseconds on the tiny model: on a busy machine a refit can
            # finish between two polls. Then the stack is on `target`: refit back, again.
            for _ in range(4):
                states = kill_in(phase, target)
                if states is not None:
                    left.append(states)
                    break
                target = other(target)
        done = stack.refit("--uri", uri(checkpoints[target]), "--version", target)
    assert done.returncode == 0, done.stdout + done.stderr
    # The kills did leave engines mid-refit.
    assert any(s["state"] != "RUNNING" or s["draining"] for states in left for s in states)
    assert stack.all_serving(target)
    assert_no_failure(stack, load)
    for r in load.records:
        assert r.token_ids in (references[old][r.prompt], references[other(old)][r.prompt]), r
    assert_pairs_never_mixed(stack)


def start_long_generations(stack: Stack, n: int, tokens: int
                           ) -> tuple[list[threading.Thread], list]:
    """`n` streamed generations of `tokens` tokens each, returned once every one is under
    way (two tokens streamed); their records land in the returned list when they end."""
    client = openai.OpenAI(base_url=f"{stack.router}/v1", api_key="x", max_retries=0,
                           timeout=120)
    results: list = []
    progress: list[list] = [[] for _ in range(n)]
    threads = [threading.Thread(target=lambda i=i: results.append(stream(
        client, f"Story number {i} begins", tokens, True, progress[i])))
        for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while min(len(p) for p in progress) < 2:
        assert time.monotonic() < deadline, [len(p) for p in progress]
        time.sleep(0.01)
    return threads, results


@slow
def test_all_at_once_with_recompute_keeps_every_inflight_request(
        stack: Stack, checkpoints: dict[str, Path]) -> None:
    old = current(stack)
    new = other(old)
    long_tokens = 1000
    refit = stack.primed_refit("--uri", uri(checkpoints[new]), "--version", new,
                               "--strategy", "AllAtOnce", "--inflight", "Recompute",
                               "--low-memory")
    threads, results = start_long_generations(stack, 6, long_tokens)
    with Load(stack, threads=2) as load, AwayWatch(stack) as watch:
        done = refit.go()
        for t in threads:
            t.join(timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    window = re.search(r"fleet unavailable window: ([\d.]+) s", done.stdout)
    assert window and 0 < float(window.group(1)) < 30, done.stdout
    assert "RefitWave: wave 1: decode-2, decode-3, prefill-0, prefill-1" in done.stdout
    assert stack.all_serving(new)
    # --low-memory streamed the new weights into the serving ones: one copy at the peak
    # (a refit built beside the old weights peaks at two).
    for state in stack.admin_states():
        assert state["last_refit_peak_bytes"] == state["weight_bytes"], state
    assert len(results) == 6
    for r in results:
        assert r.error is None and r.finish == "length", r.error
        assert len(r.token_ids) == long_tokens
        # It was in flight across the refit: tokens before and after the moment the
        # router saw every engine away.
        assert watch.first_away is not None
        assert r.stamps[0] < watch.first_away < r.stamps[-1]
    assert_no_failure(stack, load)
    assert_pairs_never_mixed(stack)


@slow
def test_a_second_refit_supersedes_the_first(stack: Stack, checkpoints: dict[str, Path]
                                              ) -> None:
    """A second edit during a refit: `tandem refit` to v3 started while one to v2 (or v1)
    drains its first wave stops that one between steps (exit 3) and takes every engine to
    v3, those the first left draining, paused or suspended included. Leaves the stack on
    v3 (run last). Long generations keep the first refit busy: each decode engine drains
    them before its refit (Drain), so it cannot finish before they do
    (seconds)."""
    first_to = other(current(stack))
    log_dir = stack.tmp / f"tandem-{stack.port}"
    admins = [e["admin_url"] for e in json.loads((log_dir / "stack.json").read_text())[
        "engines"]]
    env = {**os.environ, "TMPDIR": str(stack.tmp)}
    long_tokens = 1000
    threads, results = start_long_generations(stack, 4, long_tokens)
    with Load(stack) as load:
        first = subprocess.Popen(
            [sys.executable, "-m", "tandem_engine.cli.main", "refit", "--port", str(stack.port),
             "--uri", uri(checkpoints[first_to]), "--version", first_to],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            # The first refit's first wave is under way: an engine left service.
            deadline = time.monotonic() + 30
            while not any(s["state"] != "RUNNING" or s["draining"] for s in (
                    httpx.get(f"{a}/v1/state", timeout=10).json() for a in admins)):
                assert first.poll() is None and time.monotonic() < deadline, \
                    first.communicate()[0]
                time.sleep(0.02)
            lock = json.loads((log_dir / "refit.pid").read_text())
            assert (lock["pid"], lock["version"]) == (first.pid, first_to)
            second = stack.refit("--uri", uri(checkpoints["v3"]), "--version", "v3")
            first_out = first.communicate(timeout=60)[0]
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        for t in threads:
            t.join(timeout=120)
    assert first.returncode == 3, first_out
    assert "superseded by a newer `tandem refit`" in first_out, first_out
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"superseding the refit to {first_to} (pid {first.pid})" in second.stdout
    assert "refit succeeded: every engine serves v3" in second.stdout, second.stdout
    assert stack.all_serving("v3")
    for a in admins:
        state = httpx.get(f"{a}/v1/state", timeout=10).json()
        assert (state["state"], state["draining"], state["weight_version"]) == (
            "RUNNING", False, "v3"), state
    assert not (log_dir / "refit.pid").exists()
    assert len(results) == 4
    for r in results:
        assert r.error is None and r.finish == "length" and len(r.token_ids) == long_tokens, r
    # A request that began on an engine the first refit had just verified on `first_to`
    # continues on an engine of `first_to`: the second refit keeps one of each role serving
    # until v3 does (fleet/transaction.py `choose_wave`).
    assert_no_failure(stack, load)
    assert_pairs_never_mixed(stack)


@slow
def test_a_restarted_engine_comes_back_on_the_refitted_weights(stack: Stack) -> None:
    """After refits, an engine killed (-9) is restarted by `tandem serve` on the weights
    its peers serve now, under their epoch (not the stack's start-up --model), so the
    router takes it back into traffic. No request fails meanwhile."""
    log_dir = stack.tmp / f"tandem-{stack.port}"
    description = json.loads((log_dir / "stack.json").read_text())
    admin = {e["name"]: e["admin_url"] for e in description["engines"]}
    before = {n: httpx.get(f"{a}/v1/state", timeout=10).json() for n, a in admin.items()}
    (version,) = {s["weight_version"] for s in before.values()}
    (epoch,) = {s["weight_epoch"] for s in before.values()}
    assert version != "initial" and epoch > 0  # refitted since the start
    victim = "decode-3"
    with Load(stack) as load:  # the router fails over meanwhile
        os.kill(description["children"][victim]["pid"], signal.SIGKILL)
        time.sleep(2)
    deadline = time.monotonic() + 120
    while True:
        try:
            state = httpx.get(f"{admin[victim]}/v1/state", timeout=2).json()
        except httpx.HTTPError:
            state = {}
        if state.get("incarnation") not in (None, before[victim]["incarnation"]) \
                and state.get("state") == "RUNNING":
            break
        assert time.monotonic() < deadline, "the engine was not restarted"
        time.sleep(0.2)
    assert (state["weight_version"], state["weight_epoch"]) == (version, epoch), state
    assert state["weight_uri"] == before[victim]["weight_uri"]
    deadline = time.monotonic() + 30
    while not stack.all_serving(name(version)):
        assert time.monotonic() < deadline, stack.engines()
        time.sleep(0.2)
    assert_no_failure(stack, load)


@slow
def test_stopping_the_stack_removes_its_description(stack: Stack) -> None:
    path = stack.tmp / f"tandem-{stack.port}" / "stack.json"
    assert path.is_file()
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(timeout=60) == 0
    assert not path.exists()
