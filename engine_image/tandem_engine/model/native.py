"""Native CPU kernels: prebuilt in the engine image, or compiled on first use with torch's
C++ extension tooling.

Decode attention on CPU is bound by reading the KV cache. The pure-torch path reads
it twice (a gather into a padded batch, then attention over the copy) and pays a
fixed cost per tiny matmul; `csrc/paged_decode_attention.cpp` reads each key and
value once, in place. `csrc/paged_prefill_attention.cpp` does a prefill chunk's causal
attention in place too, in tiles of 16 queries against transposed keys (torch's flash
attention spends its time in matrix products with an inner size of the head size).
A decode step's few rows times quantized weights are bound by
decoding the weights; `csrc/quant_matvec.cpp` multiplies int4/int8 weights by int8-rounded
activations with byte multiply-adds (model/quant.py).

Where the kernel comes from, first match wins:

* `TANDEM_NATIVE_JIT=1`: compiled here with `-march=native` (all of this CPU's
  instructions), as below.
* `$TANDEM_NATIVE_PREBUILT/<name>.<march>.so`: the libraries the engine image compiles at
  build time for portable instruction sets (`PREBUILT_MARCHES`), so pods start without a
  compiler and without the build; the best one this CPU runs is loaded. `<name>` carries a
  hash of the source: a library built from other source is never loaded.
* Otherwise (a dev checkout) compiled on first use with `-march=native`: about half a
  minute, once per machine (torch caches it under ~/.cache/torch_extensions); it needs
  a C++ compiler and ninja.

`python3 native.py prebuild DIR` writes the portable libraries into DIR, one build process
each (the image's build stage runs it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

log = logging.getLogger(__name__)

# Compiled as one translation unit, in this order (module.cpp binds them all).
_SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in (
    "quant_matvec.cpp", "vec_math.cpp", "attention_rows.cpp", "decode_stack.cpp",
    "paged_decode_attention.cpp", "paged_prefill_attention.cpp", "module.cpp"))
_SOURCE = _SOURCES[0].parent  # what messages name
PREBUILT_ENV = "TANDEM_NATIVE_PREBUILT"  # folder of prebuilt libraries (the image sets it)
JIT_ENV = "TANDEM_NATIVE_JIT"  # "1": compile for this CPU even when a prebuilt one exists
# The prebuilt libraries' instruction sets per architecture, best first, each with the CPU
# capabilities it needs as torch's own kernel dispatch reports them (None: any CPU of the
# architecture). x86-64-v3 (AVX2, FMA) runs on x86-64 servers since 2013-2015 and decodes
# at least as fast as -march=native on an AVX-512 EPYC (docs/benchmarks.md); x86-64-v2
# (SSE4.2), from as fast to 35 % slower there, is the fallback for older or AVX-masked
# virtual CPUs, which v3 would crash with SIGILL. armv8-a: every 64-bit Arm CPU (NEON).
PREBUILT_MARCHES: dict[str, tuple[tuple[str, frozenset[str] | None], ...]] = {
    "x86_64": (("x86-64-v3", frozenset({"AVX2", "AVX512"})), ("x86-64-v2", None)),
    "aarch64": (("armv8-a", None),),
}
_CFLAGS = ["-O3", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_module: ModuleType | None = None
_origin: KernelOrigin | None = None
_error: str | None = None


class NativeKernelUnavailable(RuntimeError):
    """The native kernel could not be built or loaded on this machine."""


@dataclass(frozen=True)
class KernelOrigin:
    """Where the loaded kernel came from: the image's prebuilt library or a build here."""

    kind: Literal["prebuilt", "jit"]
    path: Path  # the shared library that was loaded


def _source_text() -> str:
    """The one translation unit: every source file, in `_SOURCES` order."""
    return "\n".join(path.read_text() for path in _SOURCES)


def kernel_name(source: str) -> str:
    """Named by content: every checkout of the same source shares one build."""
    return "tandem_paged_decode_" + hashlib.sha256(source.encode()).hexdigest()[:12]


def portable_marches(machine: str | None = None) -> list[str]:
    """The instruction sets the image prebuilds for this architecture, best first."""
    machine = machine or platform.machine()
    if machine not in PREBUILT_MARCHES:
        raise NativeKernelUnavailable(
            f"no portable -march baseline for CPU architecture {machine!r} (known: "
            f"{', '.join(PREBUILT_MARCHES)}); set {JIT_ENV}=1 to build for this CPU instead")
    return [march for march, _ in PREBUILT_MARCHES[machine]]


def runnable_marches() -> list[str]:
    """This CPU's prebuilt instruction sets, best first (torch's dispatch capability, which
    honours ATEN_CPU_CAPABILITY)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return [march for march, needs in PREBUILT_MARCHES.get(platform.machine(), ())
            if needs is None or capability in needs]


def kernel_origin() -> KernelOrigin | None:
    """Where the loaded kernel came from; None before `paged_decode_kernel()` loaded it."""
    return _origin


def build_pending() -> bool:
    """Whether `paged_decode_kernel()` would compile the kernel now: not loaded yet, no
    prebuilt library for this CPU, and no earlier build in torch's cache (the half-minute
    first start on a machine, which callers announce)."""
    if _module is not None or _error is not None:
        return False
    name = kernel_name(_source_text())
    if _prebuilt_path(name) is not None:
        return False
    import torch
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, verbose=False))
    stamp = _built_with(folder, ["-march=native"])
    return not ((folder / f"{name}.so").is_file() and stamp.is_file()
                and stamp.read_text() == torch.__version__)


def paged_decode_kernel() -> ModuleType:
    """The compiled module (loaded once per process; a JIT build is cached on disk)."""
    global _module, _origin, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise NativeKernelUnavailable(_error)
        source = _source_text()
        name = kernel_name(source)
        prebuilt = _prebuilt_path(name)
        try:
            if prebuilt is not None:
                _module = _load_library(name, prebuilt)
                _origin = KernelOrigin("prebuilt", prebuilt)
            else:
                _module = _build(name, source, ["-march=native"], build_dir=None)
                _origin = KernelOrigin("jit", Path(_module.__file__))
        except Exception as exc:  # a compiler or ninja problem: report it, keep the cause
            what = (f"loading the prebuilt kernel {prebuilt}" if prebuilt is not None else
                    f"building the native decode-attention kernel from {_SOURCE}")
            _error = (f"{what} failed ({type(exc).__name__}: {exc}); install a C++ compiler "
                      f"and ninja (and unset {PREBUILT_ENV}), or run with kernels='torch'")
            raise NativeKernelUnavailable(_error) from exc
        return _module


def _prebuilt_path(name: str) -> Path | None:
    """The image's best library for this source and CPU, unless a JIT build is asked for."""
    if os.environ.get(JIT_ENV, "") == "1":
        return None
    folder = os.environ.get(PREBUILT_ENV, "")
    if not folder:
        return None
    for march in runnable_marches():
        path = Path(folder) / f"{name}.{march}.so"
        if path.is_file():
            return path
    log.warning("%s=%s holds no %s.*.so this CPU runs (built from other source?); "
                "compiling the kernel here", PREBUILT_ENV, folder, name)
    return None


def _load_library(name: str, path: Path, what: str = "prebuilt") -> ModuleType:
    import torch  # noqa: F401  the library links against libtorch: load it first

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    log.info("loaded the %s native decode-attention kernel %s", what, path)
    return module


def _build(name: str, source: str, arch_flags: list[str], build_dir: Path | None) -> ModuleType:
    """Compile and load; `build_dir` None is torch's per-user extension cache."""
    from torch.utils.cpp_extension import _get_build_directory, load_inline

    # ninja comes from the `engine` extra, into this interpreter's bin folder,
    # which need not be on PATH (a venv that was never activated).
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    import torch

    folder = build_dir or Path(_get_build_directory(name, verbose=False))
    # The build is the source's (the folder's name) for this torch. ninja would redo it
    # for every other virtual environment (its command line names that one's torch
    # headers): a build made for the same torch version is loaded as it is instead.
    stamp = _built_with(folder, arch_flags)
    with _builder_lock(folder):
        built = folder / f"{name}.so"
        if built.is_file() and stamp.is_file() and stamp.read_text() == torch.__version__:
            return _load_library(name, built, "cached")
        log.info("building the native decode-attention kernel (%s; about 30 s)",
                 " ".join(arch_flags))
        module = load_inline(name=name, cpp_sources=[source], build_directory=str(folder),
                             extra_cflags=[*_CFLAGS, *arch_flags], extra_ldflags=_LDFLAGS,
                             verbose=False)
        stamp.write_text(torch.__version__)
        return module


def _built_with(folder: Path, arch_flags: list[str]) -> Path:
    """The file naming the torch version a build in `folder` was made for."""
    return folder / f"torch-version{''.join(arch_flags)}"


def prebuild(out_dir: Path, march: str) -> Path:
    """Compile the library for one instruction set into `out_dir`. Once per process: torch
    renames a second build of the same name (`<name>_v1`), which would no longer load."""
    source = _source_text()
    name = kernel_name(source)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        module = _build(name, source, [f"-march={march}"], Path(tmp))
        target = out_dir / f"{name}.{march}.so"
        shutil.copyfile(module.__file__, target)
    return target


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


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="prebuild the native decode kernel")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("prebuild", help="compile the portable libraries into DIR")
    build.add_argument("dir", type=Path)
    build.add_argument("--march", action="append",
                       help="an instruction set, repeatable (default: this architecture's "
                            "in PREBUILT_MARCHES)")
    args = parser.parse_args(argv)
    marches = args.march or portable_marches()
    if len(marches) == 1:
        print(prebuild(args.dir, marches[0]))
        return 0
    for march in marches:  # a process each (see `prebuild`)
        subprocess.run([sys.executable, __file__, "prebuild", str(args.dir), "--march", march],
                       check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
