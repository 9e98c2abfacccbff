"""Which weights an engine serves: the reference (uri, version), its `file://` parsing,
and what a checkpoint path is (a HuggingFace folder or a .gguf file).

One owner for the concept, imported by the engine, its admin API, the fleet's refit
orchestration, `tandem refit` and the operator's spec parser. Torch-free. Each caller
names its input (a flag, a spec field, a request body field) so errors point at what
the user typed; the rule itself lives here once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlparse

from tandem_engine.errors import path_problem

GGUF_SUFFIX = ".gguf"
CHECKPOINT_FORMS = ("a HuggingFace-format folder (config.json, *.safetensors, tokenizer.json) "
                    "or a .gguf file")


def is_gguf_path(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix) rather than a checkpoint folder."""
    return Path(path).suffix.lower() == GGUF_SUFFIX


def nul_problem(path: str | Path) -> str | None:
    """Why `path` can name no file at all: it holds a NUL byte (a URI's `%00`), which no
    filesystem allows and which makes `os.stat` raise ValueError instead of saying the
    path does not exist. None for any other path."""
    if "\x00" in str(path):
        return f"{str(path)!r} holds a NUL byte, which no file name can hold"
    return None


def checkpoint_problem(path: str | Path) -> str | None:
    """Why `path` is not a checkpoint on this filesystem (a folder with config.json, or a
    .gguf file), or None when it looks like one. Only the layout is checked; the engine's
    loader validates the contents."""
    if (problem := nul_problem(path)) is not None:
        return problem
    path = Path(path)
    if is_gguf_path(path):
        problem = path_problem(path, "file")
        return None if problem is None else f"{path} {problem}"
    if (problem := path_problem(path, "folder")) is not None:
        return f"{path} {problem}"
    if not (path / "config.json").is_file():
        return f"{path} has no config.json"
    return None


def weights_root_problem(path: str | Path, roots: Sequence[str | Path]) -> str | None:
    """Why a refit may not load `path` from the weights roots `roots` (`--weights-root`
    folders), or None when it may: the path, resolved (symlinks and `..` followed), must
    lie inside one of them and be a checkpoint there."""
    if (problem := nul_problem(path)) is not None:  # before resolve(), which would raise
        return problem
    resolved = Path(path).resolve()
    if not any(resolved.is_relative_to(Path(root).resolve()) for root in roots):
        return f"{resolved} is outside the weights roots {', '.join(map(str, roots))}"
    return checkpoint_problem(resolved)


class WeightsURIError(ValueError):
    """A weights URI that cannot name a checkpoint; the message names the input and the fix."""


def checkpoint_path(uri: str, what: str = "weights uri") -> str:
    """`file:///abs/path` (or `file://localhost/abs/path`) -> `/abs/path`.

    `what` names the input in the error (`--uri`, `spec.model.weights.uri`, ...).
    Only local files are supported: other schemes, a host, or a relative path raise
    WeightsURIError."""
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        got = (f"scheme {parsed.scheme!r} is not supported" if parsed.scheme
               else "a bare path is not a URI")
        raise WeightsURIError(f"{what} {uri!r}: must be a file:// URI naming a checkpoint "
                              f"folder or .gguf file ({got}), e.g. file:///models/my-model-v2")
    if parsed.netloc not in ("", "localhost"):
        raise WeightsURIError(f"{what} {uri!r}: a file:// URI must not name a host "
                              "(write file:///absolute/path)")
    path = unquote(parsed.path)
    if not path.startswith("/") or PurePosixPath(path) == PurePosixPath("/"):
        raise WeightsURIError(f"{what} {uri!r}: needs an absolute checkpoint folder "
                              "or .gguf file, e.g. file:///models/demo")
    return path


@dataclass(frozen=True)
class WeightsRef:
    """A checkpoint and the version name the fleet knows it by."""

    uri: str
    version: str

    @property
    def path(self) -> str:
        """The checkpoint path the URI names (as the engine sees its filesystem)."""
        return checkpoint_path(self.uri)

    def to_dict(self) -> dict[str, str]:
        return {"uri": self.uri, "version": self.version}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WeightsRef:
        return cls(str(data["uri"]), str(data["version"]))


@dataclass(frozen=True)
class WeightIdentity:
    """What an engine serves now: the reference plus the pool-wide weight epoch that
    salts its prefix cache (bumped by every refit)."""

    uri: str
    version: str
    epoch: int


def format_bytes(n: int) -> str:
    """A checkpoint's (or any) byte count as people read it: "97.9 MB", "1.24 GB"."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
