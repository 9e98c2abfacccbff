"""Native CPU kernels, compiled on first use with torch's C++ extension tooling.

Decode attention on CPU is bound by reading the KV cache. The pure-torch path reads
it twice (a gather into a padded batch, then attention over the copy) and pays a
fixed cost per tiny matmul; `csrc/paged_decode_attention.cpp` reads each key and
value once, in place. The build (about half a minute, once per machine: torch caches
it under ~/.cache/torch_extensions) needs a C++ compiler and ninja.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
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
            _clear_stale_lock(Path(_get_build_directory(name, verbose=False)))
            log.info("loading the native decode-attention kernel (the first build on a "
                     "machine takes about 30 s)")
            _module = load_inline(name=name, cpp_sources=[source],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                  extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # a compiler or ninja problem: report it, keep the cause
            _error = (f"building the native decode-attention kernel from {_SOURCE} failed "
                      f"({type(exc).__name__}: {exc}); install a C++ compiler and ninja, or "
                      "run with kernels='torch'")
            raise NativeKernelUnavailable(_error) from exc
        return _module


def _clear_stale_lock(build_dir: Path, max_age_s: float = 600.0) -> None:
    """A build killed midway leaves torch's lock file behind, and every later load would
    wait on it forever; a lock older than any real build is removed."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > max_age_s:
            log.warning("removing a stale kernel build lock %s", lock)
            os.unlink(lock)
    except FileNotFoundError:
        pass
