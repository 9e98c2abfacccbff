"""Native CPU kernels, compiled on first use with torch's C++ extension tooling.

Decode attention on CPU is bound by reading the KV cache. The pure-torch path reads
it twice (a gather into a padded batch, then attention over the copy) and pays a
fixed cost per tiny matmul; `csrc/paged_decode_attention.cpp` reads each key and
value once, in place. The build (about half a minute, once per machine: torch caches
it under ~/.cache/torch_extensions) needs a C++ compiler and ninja.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


class NativeKernelUnavailable(RuntimeError):
    """The native kernel could not be built or loaded on this machine."""


def paged_decode_kernel() -> ModuleType:
    """The compiled module (built once per process, cached on disk across processes)."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise NativeKernelUnavailable(_error)
        try:
            from torch.utils.cpp_extension import _get_build_directory, load_inline

            # ninja comes from the `engine` extra, into this interpreter's bin folder,
            # which need not be on PATH (a venv that was never activated).
            bin_dir = os.path.dirname(sys.executable)
            if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
            source = _SOURCE.read_text()
            # Named by content: every checkout of the same source shares one build.
            name = "tandem_paged_decode_" + hashlib.sha256(source.encode()).hexdigest()[:12]
            log.info("loading the native decode-attention kernel (the first build on a "
                     "machine takes about 30 s)")
            with _builder_lock(Path(_get_build_directory(name, verbose=False))):
                _module = load_inline(name=name, cpp_sources=[source],
                                      extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                      extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # a compiler or ninja problem: report it, keep the cause
            _error = (f"building the native decode-attention kernel from {_SOURCE} failed "
                      f"({type(exc).__name__}: {exc}); install a C++ compiler and ninja, or "
                      "run with kernels='torch'")
            raise NativeKernelUnavailable(_error) from exc
        return _module


@contextlib.contextmanager
def _builder_lock(build_dir: Path) -> Iterator[None]:
    """One process at a time builds or loads the kernel of a build folder, under an
    `flock` that the kernel releases when its holder dies. torch's own lock file
    (`build_dir/lock`) is not released by a build killed midway, and every later load
    would wait on it forever; under our lock no live builder can hold it, so one found
    there is stale and is removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "tandem-build.flock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # a live builder: wait for its build
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing a kernel build lock left by a build that died: %s",
                            stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
