"""The model's sampling defaults (vLLM's `--generation-config auto`): read from a folder's
generation_config.json, or for a GGUF from the `tandem models` registry; checked at
start with the file, the key and the limit; overridden by vLLM's flags; written into the
generation_config.json of `tandem models pull --format hf`; and announced by a router
that refuses to start on a bad file."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tandem_engine.errors import CheckpointError
from tandem_engine.generation_config import (
    GenerationDefaults,
    generation_defaults,
    serving_defaults,
)
from tandem_engine.known_models import KNOWN_MODELS, SMOLLM2_135M_INSTRUCT
from tandem_engine.sampling_params import SamplingParams


def _folder(tmp_path: Path, config: dict | str | None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (folder / "generation_config.json").write_text(text)
    return folder


def test_a_folder_s_generation_config_sets_only_the_sampling_keys(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True,
                                "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0,
                                "repetition_penalty": 1.05, "max_new_tokens": 99,
                                "transformers_version": "4.51.0"})
    defaults = generation_defaults(folder)
    assert defaults.sampling_kwargs() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                          "min_p": 0.0, "repetition_penalty": 1.05}
    assert defaults.source == str(folder / "generation_config.json")
    SamplingParams(**defaults.sampling_kwargs())  # the keyword names are SamplingParams'


def test_no_file_or_no_sampling_keys_means_neutral_defaults(tmp_path: Path) -> None:
    assert generation_defaults(_folder(tmp_path, None)).sampling_kwargs() == {}
    assert "has no generation_config.json" in generation_defaults(tmp_path / "model").source
    (tmp_path / "model" / "generation_config.json").write_text(
        '{"eos_token_id": 2, "temperature": null}')
    assert generation_defaults(tmp_path / "model") == GenerationDefaults(
        source=str(tmp_path / "model" / "generation_config.json"))


@pytest.mark.parametrize(("key", "value", "limit"), [
    ("temperature", "hot", "must be a finite number"),
    ("temperature", -1, "must be between 0 and 100"),
    ("top_p", 0, "must be in [1e-08, 1]"),
    ("top_k", 1.5, "must be an integer"),
    ("top_k", -2, "must be -1 or 0 (off) or a positive integer"),
    ("min_p", 2, "must be a number in [0, 1]"),
    ("repetition_penalty", True, "must be a finite number"),
])
def test_a_bad_value_names_the_file_the_key_and_the_limit(tmp_path: Path, key: str,
                                                          value: object, limit: str) -> None:
    folder = _folder(tmp_path, {key: value})
    with pytest.raises(CheckpointError) as err:
        generation_defaults(folder)
    message = str(err.value)
    assert str(folder / "generation_config.json") in message
    assert f"{key}={value!r}" in message and limit in message
    assert "--generation-config vllm" in message  # the way out


def test_a_file_that_is_not_a_json_object_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot be read as JSON"):
        generation_defaults(_folder(tmp_path, "{temperature: 0.2"))
    (tmp_path / "model" / "generation_config.json").write_text("[0.2]")
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        generation_defaults(tmp_path / "model")


def test_a_known_gguf_takes_the_registry_s_recommendation(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    by_name = tmp_path / SMOLLM2_135M_INSTRUCT.filename
    by_name.write_bytes(b"GGUF")  # matched by its file name alone
    defaults = generation_defaults(by_name)
    assert defaults.sampling_kwargs() == {"temperature": 0.2, "top_p": 0.9}
    assert "smollm2-135m-instruct" in defaults.source
    # A renamed copy is matched by its pinned sha256.
    data = b"GGUF" + bytes(range(256)) * 40
    renamed = tmp_path / "renamed.gguf"
    renamed.write_bytes(data)
    monkeypatch.setitem(KNOWN_MODELS, "fake", dataclasses.replace(
        SMOLLM2_135M_INSTRUCT, name="fake", member="x/Fake.gguf", size=len(data),
        sha256=hashlib.sha256(data).hexdigest(), sampling={"temperature": 0.3, "top_k": 40}))
    assert generation_defaults(renamed).sampling_kwargs() == {"temperature": 0.3, "top_k": 40}
    renamed.write_bytes(data[:-1] + b"x")  # same size, another file
    assert generation_defaults(renamed).sampling_kwargs() == {}
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        generation_defaults(tmp_path / "missing.gguf")


def test_vllm_s_flags_choose_and_override(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"temperature": 0.6, "top_p": 0.9})
    assert serving_defaults(folder).sampling_kwargs() == {"temperature": 0.6, "top_p": 0.9}
    assert serving_defaults(folder, "vllm").sampling_kwargs() == {}
    over = serving_defaults(folder, "auto", '{"temperature": 0.1, "top_k": 5}')
    assert over.sampling_kwargs() == {"temperature": 0.1, "top_p": 0.9, "top_k": 5}
    assert "--override-generation-config" in over.source
    assert serving_defaults(folder, "vllm", '{"min_p": 0.1}').sampling_kwargs() == {
        "min_p": 0.1}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"repetition_penalty": 1.2}')
    assert serving_defaults(folder, str(other)).sampling_kwargs() == {
        "repetition_penalty": 1.2}
    for mode, override, words in [
            ("nope", None, "not 'auto' or 'vllm'"),
            ("auto", "{temperature", "is not JSON"),
            ("auto", "[1]", "must be a JSON object"),
            ("auto", '{"max_tokens": 5}', "'max_tokens' is not a sampling default"),
            ("auto", '{"temperature": 200}', "temperature=200 is invalid")]:
        with pytest.raises(CheckpointError, match="generation-config") as err:
            serving_defaults(folder, mode, override)
        assert words in str(err.value)


def test_the_hf_export_of_a_known_gguf_carries_its_defaults(
        tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem_engine.model.gguf import export_hf_folder
    from test_gguf import gguf_of

    gguf = gguf_of(tiny_llama, tmp_path / "tiny.gguf")
    data = gguf.read_bytes()
    monkeypatch.setitem(KNOWN_MODELS, "tiny", dataclasses.replace(
        SMOLLM2_135M_INSTRUCT, name="tiny", member="x/Tiny.gguf", size=len(data),
        sha256=hashlib.sha256(data).hexdigest()))
    folder = export_hf_folder(gguf, tmp_path / "hf")
    written = json.loads((folder / "generation_config.json").read_text())
    assert written["do_sample"] is True  # transformers samples with them only then
    assert (written["temperature"], written["top_p"]) == (0.2, 0.9)
    assert generation_defaults(folder).sampling_kwargs() == generation_defaults(
        gguf).sampling_kwargs()
    monkeypatch.delitem(KNOWN_MODELS, "tiny")  # an unknown GGUF: ids only, as before
    shutil.rmtree(folder)
    written = json.loads((export_hf_folder(gguf, folder) / "generation_config.json")
                         .read_text())
    assert "temperature" not in written and "do_sample" not in written


def test_the_router_refuses_a_bad_generation_config_at_start(tiny_llama: Path,
                                                             tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (model / "generation_config.json").write_text('{"eos_token_id": 2, "temperature": -1}')
    run = subprocess.run([sys.executable, "-m", "tandem_engine.router.main", "--model",
                          str(model), "--engine", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert str(model / "generation_config.json") in run.stderr
    assert "temperature=-1 is invalid" in run.stderr and "between 0 and 100" in run.stderr
