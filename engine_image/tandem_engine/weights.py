"""Which weights an engine serves: the reference (uri, version), its URI grammar (`file://`,
`pvc://`, `oci://`: `weights_source`) and what a checkpoint path is (a HuggingFace folder,
a .gguf file, or a folder holding exactly one .gguf file).

One owner for the concept, imported by the engine, its admin API, the fleet's refit
orchestration, `tandem refit` and the operator's spec parser. Torch-free. Each caller
names its input (a flag, a spec field, a request body field) so errors point at what
the user typed; the rule itself lives here once.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlparse

from tandem_engine.errors import path_problem

GGUF_SUFFIX = ".gguf"
CHECKPOINT_FORMS = ("a HuggingFace-format folder (config.json, *.safetensors, tokenizer.json), "
                    "a .gguf file, or a folder holding one .gguf file")


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
    path = resolve_checkpoint(path)
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


# Where a pod sees the checkpoints of `pvc://` and `oci://` URIs (the operator mounts them
# there; the engine maps a URI to the same path, so a refit names weights as the pool does).
WEIGHTS_MOUNT = "/weights"
URI_FORMS = ("file:///ABSOLUTE/PATH, pvc://CLAIM/PATH (a PersistentVolumeClaim, mounted "
             "read-only) or oci://REGISTRY/REPOSITORY:TAG (a model image holding its "
             "checkpoint at /model)")
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # a PVC name (DNS subdomain)
# An image reference: registry/repository[:tag][@digest], lower-case path components.
_IMAGE = re.compile(r"^[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)+"
                    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$")


@dataclass(frozen=True)
class WeightsSource:
    """Where a weights URI's checkpoint comes from and where a pod sees it.

    file://: a path the pod has already (a volume the pool mounts, or baked in);
    pvc://CLAIM/PATH: the claim, mounted read-only at /weights/pvc/CLAIM;
    oci://IMAGE: the image's /model, copied into the pod at /weights/oci/KEY (KEY: a hash of
    the reference) by an init container running the image."""

    scheme: str  # file | pvc | oci
    path: str  # the checkpoint as the pod sees it
    claim: str | None = None
    image: str | None = None

    @property
    def mount_path(self) -> str | None:
        """The folder the pod mounts for this source (None: file://, nothing to mount)."""
        if self.claim is not None:
            return f"{WEIGHTS_MOUNT}/pvc/{self.claim}"
        if self.image is not None:
            return f"{WEIGHTS_MOUNT}/oci/{image_key(self.image)}"
        return None

    @property
    def volume(self) -> str | None:
        """What a pod must mount to see it: 'pvc:CLAIM', 'oci:IMAGE'; None for file://.
        Weights on the same volume refit in place; others need new pods."""
        if self.claim is not None:
            return f"pvc:{self.claim}"
        if self.image is not None:
            return f"oci:{self.image}"
        return None


def image_key(image: str) -> str:
    return hashlib.sha256(image.encode()).hexdigest()[:16]


def weights_source(uri: str, what: str = "weights uri") -> WeightsSource:
    """Parse a weights URI (`what` names the input in the error: --uri,
    spec.model.weights.uri, ...). Raises WeightsURIError naming the input and the fix."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return WeightsSource("file", _file_path(uri, parsed, what))
    if parsed.scheme == "pvc":
        claim = parsed.netloc
        sub = unquote(parsed.path)
        if not _CLAIM.match(claim or ""):
            raise WeightsURIError(f"{what} {uri!r}: {claim!r} is not a PersistentVolumeClaim "
                                  "name (lower-case letters, digits, '-' and '.'): write "
                                  "pvc://CLAIM/PATH, e.g. pvc://models/llama-3-8b")
        parts = PurePosixPath(sub).parts[1:] if sub.startswith("/") else ()
        if not parts or any(p in ("..", ".") for p in parts):
            raise WeightsURIError(f"{what} {uri!r}: needs the checkpoint's path inside the "
                                  "claim, without '..', e.g. pvc://models/llama-3-8b")
        return WeightsSource("pvc", f"{WEIGHTS_MOUNT}/pvc/{claim}/{'/'.join(parts)}",
                             claim=claim)
    if parsed.scheme == "oci":
        image = uri[len("oci://"):]
        if not _IMAGE.match(image) or ("/" not in image):
            raise WeightsURIError(f"{what} {uri!r}: not an image reference: write "
                                  "oci://REGISTRY/REPOSITORY:TAG (or @sha256:DIGEST), e.g. "
                                  "oci://ghcr.io/me/llama-3-8b:v1")
        return WeightsSource("oci", f"{WEIGHTS_MOUNT}/oci/{image_key(image)}", image=image)
    got = (f"scheme {parsed.scheme!r} is not supported" if parsed.scheme
           else "a bare path is not a URI")
    hint = ("; s3:// and hf:// are not fetched by Tandem: copy the checkpoint into a volume "
            "with an init container (docs/weights.md)" if parsed.scheme in ("s3", "hf", "gs",
                                                                             "http", "https")
            else "")
    raise WeightsURIError(f"{what} {uri!r}: must be {URI_FORMS} ({got}){hint}")


def _file_path(uri: str, parsed: Any, what: str) -> str:
    if parsed.netloc not in ("", "localhost"):
        raise WeightsURIError(f"{what} {uri!r}: a file:// URI must not name a host "
                              "(write file:///absolute/path)")
    path = unquote(parsed.path)
    if not path.startswith("/") or PurePosixPath(path) == PurePosixPath("/"):
        raise WeightsURIError(f"{what} {uri!r}: needs an absolute checkpoint folder "
                              "or .gguf file, e.g. file:///models/demo")
    return path


def checkpoint_path(uri: str, what: str = "weights uri") -> str:
    """The checkpoint path a weights URI names, as a pod sees its filesystem:
    `file:///abs/path` (or `file://localhost/abs/path`) -> `/abs/path`; `pvc://` and
    `oci://` -> where the operator mounts them (`WeightsSource`). Raises WeightsURIError."""
    return weights_source(uri, what).path


def local_checkpoint_path(uri: str, what: str = "weights uri") -> str:
    """`checkpoint_path` for a process outside Kubernetes (`tandem serve`, `tandem refit`
    of a local stack): file:// only, as nothing mounts claims or images here."""
    scheme = urlparse(uri).scheme
    if scheme in ("pvc", "oci"):
        raise WeightsURIError(f"{what} {uri!r}: {scheme}:// weights are mounted by the "
                              "operator in a pool's pods; a local stack reads file:// only "
                              "(refit a pool with kubectl patch ipool NAME)")
    if scheme != "file":
        got = f"scheme {scheme!r} is not supported" if scheme else "a bare path is not a URI"
        raise WeightsURIError(f"{what} {uri!r}: must be a file:// URI naming a checkpoint "
                              f"folder or .gguf file ({got}), e.g. file:///models/my-model-v2")
    return weights_source(uri, what).path


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint path as loaders take it: a folder with no config.json holding exactly
    one .gguf file (a model image's /model) is that file; anything else is itself."""
    path = Path(path)
    try:
        if path.is_dir() and not (path / "config.json").exists():
            ggufs = [p for p in path.iterdir() if is_gguf_path(p) and p.is_file()]
            if len(ggufs) == 1:
                return ggufs[0]
    except OSError:  # unreadable: the caller's own check says so, naming the path
        pass
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

    @property
    def volume(self) -> str | None:
        """The volume the checkpoint comes from (`WeightsSource.volume`): weights on the
        same one refit in place."""
        return weights_source(self.uri).volume

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
