"""An engine process while its checkpoint loads: probes and state from the start, progress
in /v1/state and the log, ready only once it serves, and a failed load ends the process.

The slow load is simulated with the test knob TANDEM_TEST_LOAD_DELAY_S (the load waits
that long once the checkpoint is validated, before reading tensor data)."""

from __future__ import annotations

import math
import socket
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tandem_engine.cli.serve import free_port
from tandem_engine.model.checkpoint import LoadProgress, load_checkpoint
from test_checkpoint import copy_with, write_sharded
from test_engine_process import EngineProcess
from test_gguf import gguf_of

DELAY_ENV = "TANDEM_TEST_LOAD_DELAY_S"


def stored_bytes(*files: Path) -> int:
    """Bytes of tensor data in safetensors `files`, from their headers."""
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                piece = f.get_slice(name)
                size = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}[piece.get_dtype()]
                total += math.prod(piece.get_shape()) * size
    return total


def until(condition, what: str, timeout: float = 20.0, proc: EngineProcess | None = None):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if proc is not None:
            assert proc.proc.poll() is None, proc.log.read_text()
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.1)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# ---- the loader's progress callback (in process) ------------------------------------------


def test_progress_reports_bytes_and_files_of_a_sharded_checkpoint(tiny_llama: Path,
                                                                   tmp_path: Path) -> None:
    folder = write_sharded(tiny_llama, tmp_path / "sharded", num_shards=3)
    reports: list[LoadProgress] = []
    load_checkpoint(folder, progress=reports.append)
    total = stored_bytes(*folder.glob("*.safetensors"))
    assert reports[0] == LoadProgress(0, total, 0, 3)  # totals known before any data
    assert reports[-1] == LoadProgress(total, total, 3, 3)
    assert [r.files_done for r in reports] == sorted(r.files_done for r in reports)
    assert [r.bytes_done for r in reports] == sorted(r.bytes_done for r in reports)
    # Loading without a callback is unchanged.
    assert load_checkpoint(folder)[0] == load_checkpoint(tiny_llama)[0]


def test_progress_of_a_gguf_file(tiny_llama: Path, tmp_path: Path) -> None:
    path = gguf_of(tiny_llama, tmp_path / "tiny.gguf")
    reports: list[LoadProgress] = []
    load_checkpoint(path, progress=reports.append)
    assert reports[0].bytes_done == 0 and reports[0].files_total == 1
    assert reports[-1].bytes_done == reports[-1].bytes_total > 0
    assert reports[-1].files_done == 1


# ---- a real engine process ----------------------------------------------------------------


@pytest.mark.slow
def test_probes_state_and_progress_while_loading_then_serves(tiny_llama: Path,
                                                            tmp_path: Path) -> None:
    metrics_port = free_port()
    started = time.monotonic()
    # Torch kernels: no native-kernel build (its first one on a machine) in the timing.
    engine = EngineProcess(tiny_llama, tmp_path, "--metrics-port", str(metrics_port),
                           "--kernels", "torch", env={DELAY_ENV: "5"}, wait_ready=False)
    try:
        until(lambda: engine.http("GET", "/healthz")[0] == 200, "/healthz", proc=engine)
        # The knob holds the load once the totals are known and before any data is read.
        state = until(lambda: (s := engine.http("GET", "/v1/state")[1]).get("loading", {})
                      .get("bytes_total") and s, "load progress in /v1/state", proc=engine)
        assert state["state"] == "LOADING" and state["engine_id"] == "e0"
        assert state["weight_version"] == "initial" and state["num_running"] == 0
        loading = state["loading"]
        assert loading["bytes_total"] == stored_bytes(tiny_llama / "model.safetensors")
        assert (loading["bytes_done"], loading["files_done"], loading["files_total"]) == (
            0, 0, 1)
        assert engine.http("GET", "/readyz") == (503, {"ready": False, "state": "LOADING"})
        status, body = engine.http("POST", "/v1/pause")
        assert status == 503 and "still loading" in body["error"]["message"]
        # The read-only metrics port: probes and the load's bytes.
        assert get(metrics_port, "/healthz")[0] == 200
        assert get(metrics_port, "/readyz")[0] == 503
        status, text = get(metrics_port, "/metrics")
        assert status == 200
        size = next(line for line in text.splitlines()
                    if line.startswith('tandem_model_load_size_bytes{engine_id="e0",'))
        assert float(size.split()[-1]) == loading["bytes_total"]
        assert get(metrics_port, "/v1/state")[0] == 404  # still read-only

        engine.wait_ready(60)
        assert time.monotonic() - started >= 5  # not ready before the delay ran out
        status, state = engine.http("GET", "/v1/state")
        assert status == 200 and state["state"] == "RUNNING" and "loading" not in state
        assert get(metrics_port, "/readyz")[0] == 200
        outs = engine.client().run("r0", [1, 2, 3, 4], max_tokens=4, temperature=0.0,
                                   ignore_eos=True)
        assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 4
        log = engine.log.read_text()
        assert "0.0 MB of 1.4 MB (0%), 0 of 1 files" in log
        assert "1.4 MB of 1.4 MB (100%), 1 of 1 files" in log
        assert "TANDEM_TEST_LOAD_DELAY_S" in log and "loaded " in log
    finally:
        engine.close()


@pytest.mark.slow
def test_a_failed_load_exits_non_zero_and_takes_the_probes_with_it(tiny_llama: Path,
                                                                  tmp_path: Path) -> None:
    """A NaN weight passes validation and fails only after the data is read: the engine
    said LOADING meanwhile, then exits 2 with the error and stops answering /healthz."""
    def poison(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.norm.weight"][0] = float("nan")

    bad = copy_with(tiny_llama, tmp_path / "bad", poison)
    engine = EngineProcess(bad, tmp_path, env={DELAY_ENV: "2"}, wait_ready=False)
    try:
        until(lambda: engine.http("GET", "/healthz")[0] == 200, "/healthz", proc=engine)
        assert engine.proc.wait(timeout=30) == 2
        log = engine.log.read_text()
        assert "tandem-engine: error:" in log and "not finite" in log, log
        assert engine.http("GET", "/healthz")[0] == 0  # nobody answers any more
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("value", ["soon", "-1"])
def test_a_malformed_delay_knob_is_refused(tiny_llama: Path, tmp_path: Path,
                                           value: str) -> None:
    engine = EngineProcess(tiny_llama, tmp_path, env={DELAY_ENV: value}, wait_ready=False)
    try:
        assert engine.proc.wait(timeout=30) == 2
        assert DELAY_ENV in engine.log.read_text()
    finally:
        engine.close()


def test_a_zmq_port_in_use_is_refused_before_the_load_and_after_it(tiny_llama: Path,
                                                                     tmp_path: Path) -> None:
    """`--port` held by another process: refused at start, in one line naming the port
    (the model is never read); and taken while the model loads (the port is bound once it
    has loaded): the same one line, exit 2, no traceback."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        engine = EngineProcess(tmp_path / "never-read", tmp_path, "--weights-root",
                               str(tmp_path), port=port, wait_ready=False)
        try:
            assert engine.proc.wait(timeout=30) == 2
            log = engine.log.read_text()
            assert (f"tandem-engine: error: --port {port}: cannot listen on 127.0.0.1:{port}"
                    in log and "give another port" in log), log
        finally:
            engine.close()
    engine = EngineProcess(tiny_llama, tmp_path, env={DELAY_ENV: "2"}, wait_ready=False)
    try:
        until(lambda: engine.http("GET", "/healthz")[0] == 200, "/healthz", proc=engine)
        with socket.socket() as taken:  # while it loads
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind(("127.0.0.1", engine.port))
            taken.listen()
            assert engine.proc.wait(timeout=30) == 2
        log = engine.log.read_text()
        assert (f"tandem-engine: error: [Errno 98] cannot listen on tcp://127.0.0.1:"
                f"{engine.port}: Address already in use" in log and "Traceback" not in log
                and "give another --port" in log), log
    finally:
        engine.close()
