"""The README's quickstart examples, run as written against the real SmolLM2 served as
`tandem serve` serves it (an engine and a router given the GGUF): five runs of each must
answer the question. Neither example sets a temperature, so this is also the test that
the model's sampling defaults (`generation_config.py`) make a small chat model usable."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_router_e2e import _free_port, _spawn, _stop, _wait_ready

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
SERVED = "smollm2-135m-instruct"  # the name `tandem serve` gives it, as the examples use
README_URL = "http://127.0.0.1:8000/v1"
RUNS = 5


def _block(language: str, marker: str) -> str:
    """The README's fenced `language` block that contains `marker`."""
    blocks = re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.M | re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"README.md: {len(found)} ```{language} blocks with {marker!r}"
    return found[0]


@pytest.fixture(scope="module")
def served(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The router's /v1 URL, with one engine, both given the GGUF as `tandem serve` does."""
    logs = tmp_path_factory.mktemp("readme")
    port, admin, router_port = _free_port(), _free_port(), _free_port()
    engine_log, router_log = logs / "engine.log", logs / "router.log"
    model = ["--model", str(smollm2_gguf), "--served-model-name", SERVED]
    engine = _spawn([sys.executable, "-m", "tandem_engine.server.main", *model, "--port",
                     str(port), "--admin-port", str(admin), "--threads", "1",
                     "--shutdown-grace", "1"], engine_log)
    procs = [engine]
    try:
        _wait_ready(f"http://127.0.0.1:{admin}/readyz", engine, engine_log, timeout=120)
        router = _spawn([sys.executable, "-m", "tandem_engine.router.main", *model,
                         "--engine", f"127.0.0.1:{port}", "--port", str(router_port)],
                        router_log)
        procs.append(router)
        _wait_ready(f"http://127.0.0.1:{router_port}/readyz", router, router_log)
        yield f"http://127.0.0.1:{router_port}/v1"
    finally:
        _stop(procs)


def test_the_served_model_s_defaults_are_its_model_card_s(served: str) -> None:
    (entry,) = httpx.get(f"{served}/models", timeout=10).json()["data"]
    assert entry["default_sampling_params"] == {"temperature": 0.2, "top_p": 0.9}
    assert "smollm2-135m-instruct" in entry["generation_config"]


def test_the_python_example_answers_five_times_of_five(served: str) -> None:
    code = _block("python", "from openai import OpenAI")
    assert README_URL in code and "temperature" not in code  # the model's defaults apply
    code = code.replace(README_URL, served)
    answers = []
    for _ in range(RUNS):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr
        answers.append(run.stdout.strip())
    assert all("Paris" in a for a in answers), answers


def test_the_curl_example_answers_five_times_of_five(served: str) -> None:
    command = shlex.split(_block("sh", "curl ").replace("\\\n", " "))
    assert command[0] == "curl" and command[2] == "localhost:8000/v1/chat/completions"
    body = json.loads(command[command.index("-d") + 1])
    assert body["model"] == SERVED and "temperature" not in body
    answers = []
    for _ in range(RUNS):
        r = httpx.post(f"{served}/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["message"]["content"])
    assert all("Paris" in a for a in answers), answers
