"""`tandem refit` checks its target before it touches any engine: a checkpoint outside the
stack's weights roots, one that does not exist, or a path no file can have (a NUL byte) is
refused at once with the allowed folders and the flag that adds one, and no engine ever
leaves RUNNING."""

from __future__ import annotations

import json
import os
import shutil
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
from prometheus_client.parser import text_string_to_metric_families
from tandem_engine.cli.serve import free_port
from test_serve import spawn_serve, stop_serve, wait_for_url

pytestmark = pytest.mark.slow


@dataclass
class Stack:
    proc: subprocess.Popen
    port: int
    tmp: Path
    model: Path  # alone in its folder: the stack's one weights root

    @property
    def description(self) -> dict:
        return json.loads((self.tmp / f"tandem-{self.port}" / "stack.json").read_text())

    def refit(self, uri: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tandem_engine.cli.main", "refit", "--port", str(self.port),
             "--uri", uri, "--version", "v2"], capture_output=True, text=True, timeout=120,
            env={**os.environ, "TMPDIR": str(self.tmp)})


@pytest.fixture(scope="module")
def stack(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp, port = tmp_path_factory.mktemp("preflight"), free_port()
    model = tmp_path_factory.mktemp("preflight-root") / "v1"
    shutil.copytree(tiny_llama, model)
    proc = spawn_serve(tmp, "--model", str(model), "--engines", "2", "--port", str(port),
                       "--served-model-name", "t")
    try:
        wait_for_url(proc)
        yield Stack(proc, port, tmp, model)
    finally:
        stop_serve(proc)


@dataclass
class Watch:
    """Every engine's /v1/state, polled, and requests sent through the router meanwhile."""

    stack: Stack
    states: set[tuple[str, str, bool]] = field(default_factory=set)  # engine, state, draining
    answers: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Watch:
        urls = [e["admin_url"] for e in self.stack.description["engines"]]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.stack.port}/v1",
                               api_key="x", max_retries=0, timeout=30)

        def poll() -> None:
            with httpx.Client(timeout=5) as http:
                while not self.stop.is_set():
                    for url in urls:
                        s = http.get(f"{url}/v1/state").json()
                        self.states.add((s["engine_id"], s["state"], s["draining"]))
                    time.sleep(0.01)

        def load() -> None:
            while not self.stop.is_set():
                try:
                    self.answers.append(client.completions.create(
                        model="t", prompt="In the old library", max_tokens=4,
                        temperature=0).choices[0].text)
                except openai.OpenAIError as exc:
                    self.errors.append(repr(exc))

        self.threads = [threading.Thread(target=poll), threading.Thread(target=load)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def refused_refits(stack: Stack) -> dict[str, float]:
    """Each engine's `tandem_refits_total{outcome="refused"}`: a refit that reached it."""
    out = {}
    for engine in stack.description["engines"]:
        text = httpx.get(engine["metrics_url"], timeout=10).text
        out[engine["name"]] = next(
            s.value for f in text_string_to_metric_families(text) if f.name == "tandem_refits"
            for s in f.samples if s.labels.get("outcome") == "refused")
    return out


def test_refit_to_a_path_outside_the_weights_roots_or_missing_touches_no_engine(
        stack: Stack, tmp_path: Path) -> None:
    outside = tmp_path / "outside" / "v2"  # a real checkpoint, in no weights root
    shutil.copytree(stack.model, outside)
    missing = stack.model.parent / "no-such-checkpoint"  # inside the root, but absent
    nul = Path(f"{stack.model}\x00")  # `%00` in the URI: a name no file can have
    root = str(stack.model.parent.resolve())
    assert stack.description["weights_roots"] == [root]
    with Watch(stack) as watch:
        for path, problem in ((outside, f"{outside.resolve()} is outside the weights roots"),
                              (missing, f"{missing} does not exist"),
                              (nul, f"{str(nul)!r} holds a NUL byte")):
            started = time.monotonic()
            refit = stack.refit(path.as_uri())
            took = time.monotonic() - started
            assert refit.returncode == 2, refit.stdout + refit.stderr
            assert took < 10, f"{took:.1f} s"
            err = refit.stderr
            assert err.startswith(f"tandem refit: error: --uri '{path.as_uri()}': {problem}")
            assert f"The stack on port {stack.port} loads checkpoints only from inside " \
                   f"{root}" in err
            assert "`tandem serve --weights-root DIR`" in err and "no engine was touched" in err
            assert refit.stdout == ""  # no refit began: no progress line at all
        time.sleep(0.3)  # a few more polls and answers after the last refusal
    assert watch.states == {("engine-0", "RUNNING", False), ("engine-1", "RUNNING", False)}
    assert watch.errors == [] and len(watch.answers) >= 2 and all(watch.answers)
    # No refit ever reached an engine (it would have counted it refused).
    assert refused_refits(stack) == {"engine-0": 0.0, "engine-1": 0.0}
