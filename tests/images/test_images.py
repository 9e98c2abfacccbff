"""The container images, built by `make images` and checked from the inside.

A session fixture runs `make -s images` (cached: seconds), so this file alone builds what it
tests. No container can be started on the test machines (the runtime cannot set rlimits or
use cgroups), so a command runs in an image the way the test kubelet runs pods: the image's
root filesystem from `podman image mount`, bound read-only in a private mount namespace with a
fresh /tmp (a pod's emptyDir) and /proc, then `chroot` as the image's user with the image's
environment. Both images must work as the chart runs them: uid 65532, read-only root.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import platform
import shlex
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

# The built images are mounted once per worker: their tests share one (make test: -n 2).

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_DOCKERFILE = ROOT / "operator" / "Dockerfile"
ENGINE_DOCKERFILE = ROOT / "engine_image" / "Dockerfile"
CHART = ROOT / "charts" / "tandem"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
UID = "65532"
APP_VERSION = str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])
TORCH_PIN = next(line.split("=", 1)[1] for line in ENGINE_DOCKERFILE.read_text().splitlines()
                 if line.startswith("ARG TORCH_VERSION="))
COMPILERS = ("gcc", "g++", "cc", "c++", "cpp", "clang", "*-gcc", "*-gcc-*", "*-g++", "*-g++-*")


@dataclass(frozen=True)
class Image:
    name: str
    config: dict[str, Any]  # podman image inspect: Config (User, Env, Labels, ...)
    size: int
    rootfs: Path  # the mounted root filesystem; read it, never write it

    def run(self, *argv: str, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """`argv` in the image as its user, root filesystem read-only, /tmp a fresh tmpfs."""
        environment = dict(e.split("=", 1) for e in self.config.get("Env") or [])
        environment.update(env or {})
        workdir = self.config.get("WorkingDir") or "/"
        script = ('set -e; r="$1"; shift; mount --bind "$r" "$r"; '
                  'mount -o remount,bind,ro "$r"; '
                  'mount -t tmpfs -o mode=1777 tmpfs "$r/tmp"; mount -t proc proc "$r/proc"; '
                  'exec chroot --userspec="$USERSPEC" "$r" "$@"')
        command = ["unshare", "--mount", "--pid", "--fork", "sh", "-c", script, "sh",
                   str(self.rootfs), "/usr/bin/env", "-i", "-C", workdir,
                   *(f"{k}={v}" for k, v in environment.items()), *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                                   "USERSPEC": self.config["User"]}, check=False)

    def python(self, code: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run("python3", "-c", textwrap.dedent(code), **kwargs)


def image_name(component: str) -> str:
    """What `make images` builds with the default REGISTRY (localhost)."""
    return f"localhost/tandem/{component}:{APP_VERSION}"


@dataclass(frozen=True)
class BuiltImages:
    engine: str
    operator: str


@functools.cache
def built_images() -> BuiltImages:
    """`make -s images` once per test session (cached builds take seconds); their names.
    Skips where podman is missing (`make test` installs it through `make image-tools`)."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (`make image-tools` installs it; `make test` does)")
    done = subprocess.run(["make", "-s", "images"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1200, check=False)
    assert done.returncode == 0, f"make images failed:\n{done.stdout}\n{done.stderr}"
    return BuiltImages(engine=image_name("engine"), operator=image_name("operator"))


@pytest.fixture(scope="session")
def built() -> Iterator[dict[str, Image]]:
    names = built_images()
    images = {}
    for component in ("engine", "operator"):
        name = getattr(names, component)
        [inspect] = json.loads(subprocess.run(
            ["podman", "image", "inspect", name], capture_output=True, text=True, check=True,
            timeout=60).stdout)
        rootfs = subprocess.run(["podman", "image", "mount", name], capture_output=True,
                                text=True, check=True, timeout=60).stdout.strip()
        images[component] = Image(name, inspect["Config"], inspect["Size"], Path(rootfs))
    yield images
    for image in images.values():
        subprocess.run(["podman", "image", "unmount", image.name], capture_output=True,
                       timeout=60, check=False)


@pytest.fixture(scope="session")
def engine(built: dict[str, Image]) -> Image:
    return built["engine"]


@pytest.fixture(scope="session")
def operator(built: dict[str, Image]) -> Image:
    return built["operator"]


def site_packages(image: Image) -> Path:
    [path] = image.rootfs.glob("opt/tandem/lib/python3*/site-packages")
    return path


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


# --- both images ---------------------------------------------------------------------------------


@pytest.mark.parametrize("component", ["engine", "operator"])
def test_image_runs_as_the_charts_non_root_uid(built: dict[str, Image], component: str):
    image = built[component]
    assert image.config["User"] == f"{UID}:{UID}"
    assert ok(image.run("id", "-u")).strip() == UID
    security = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]
    assert (str(security["runAsUser"]), str(security["runAsGroup"])) == (UID, UID)


@pytest.mark.parametrize("component", ["engine", "operator"])
def test_image_version_is_the_charts_app_version(built: dict[str, Image], component: str):
    labels = built[component].config["Labels"]
    assert labels["org.opencontainers.image.version"] == APP_VERSION
    assert PYPROJECT["project"]["version"] == APP_VERSION  # one version for all three
    assert labels["org.opencontainers.image.title"] == f"tandem-{component}"


@pytest.mark.parametrize("component", ["engine", "operator"])
def test_root_filesystem_is_really_read_only_in_the_check(built: dict[str, Image],
                                                         component: str):
    """The helper's read-only root is what makes the other checks mean a pod's conditions."""
    done = built[component].run("sh", "-c", "touch /opt/x; echo $?; touch /tmp/x && echo tmp")
    assert ok(done).split() == ["1", "tmp"], done.stderr


# --- the operator image --------------------------------------------------------------------------


def test_operator_runs_its_command(operator: Image):
    assert operator.config["Entrypoint"] == ["tandem-operator"]
    assert "--all-namespaces" in ok(operator.run("tandem-operator", "--help"))


def test_operator_image_has_no_torch(operator: Image):
    done = operator.python("import torch")
    assert done.returncode != 0 and "No module named 'torch'" in done.stderr, done.stderr
    packages = {p.name.lower() for p in site_packages(operator).iterdir()}
    assert not {name for name in packages if fnmatch.fnmatch(name, "torch*")
                or fnmatch.fnmatch(name, "nixl*") or fnmatch.fnmatch(name, "numpy*")}
    assert "kopf" in packages


# --- the engine image ----------------------------------------------------------------------------


def test_engine_runs_engine_and_router(engine: Image):
    assert not engine.config.get("Entrypoint")  # the operator sets each pod's command
    assert "--model" in ok(engine.run("tandem-engine", "--help"))
    assert "--discover-pool" in ok(engine.run("tandem-router", "--help"))
    assert "models" in ok(engine.run("tandem", "--help"))


def test_engine_image_has_no_compiler(engine: Image):
    for folder in ("usr/bin", "usr/local/bin", "bin", "opt/tandem/bin"):
        found = [p.name for pattern in COMPILERS for p in (engine.rootfs / folder).glob(pattern)]
        assert not found, f"/{folder}: {found}"
    assert not list(engine.rootfs.glob("usr/lib/gcc/*/*/cc1*"))
    done = engine.run("sh", "-c", "for c in gcc g++ cc c++; do command -v $c; done; true")
    assert ok(done).strip() == ""


def test_engine_image_has_the_pinned_cpu_torch(engine: Image):
    pin = f"torch=={TORCH_PIN}"
    assert pin in (ROOT / "Makefile").read_text()  # the same pin as `make venv`
    packages = {p.name.lower() for p in site_packages(engine).iterdir()}
    assert f"torch-{TORCH_PIN}+cpu.dist-info" in packages, sorted(packages)
    assert not [name for name in packages if name.startswith("nvidia")]  # no CUDA libraries


# Decode attention over a paged cache, the prebuilt kernel against plain torch; prints where
# the kernel came from and whether anything was compiled under TMPDIR/HOME (/tmp).
KERNEL_CHECK = """
    import json, math, os
    import torch
    from tandem_engine.model import native

    torch.manual_seed(0)
    heads, kv_heads, dim, block, blocks = 4, 2, 16, 4, 8
    q = torch.randn(2, heads, dim)
    k_cache = torch.randn(blocks, block, kv_heads, dim)
    v_cache = torch.randn(blocks, block, kv_heads, dim)
    tables = torch.tensor([[3, 1, 6], [0, 5, 2]], dtype=torch.long)
    lens = torch.tensor([9, 5], dtype=torch.long)
    scale = 1 / math.sqrt(dim)
    out = native.paged_decode_kernel().paged_decode_attention(
        q, k_cache, v_cache, tables, lens, scale)
    error = 0.0
    for b in range(2):
        n = int(lens[b])
        k = k_cache[tables[b]].reshape(-1, kv_heads, dim)[:n]
        v = v_cache[tables[b]].reshape(-1, kv_heads, dim)[:n]
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) * scale, dim=-1)
        ref = torch.einsum("hn,nhd->hd", weights, v)
        error = max(error, float((out[b] - ref).abs().max()))
    origin = native.kernel_origin()
    print(json.dumps({"kind": origin.kind, "path": str(origin.path), "error": error,
                      "capability": torch.backends.cpu.get_cpu_capability(),
                      "tmp": sorted(os.listdir("/tmp"))}))
"""
# The prebuilt library a CPU must get, by torch's dispatch capability: AVX2 code only where
# the CPU has it (else SIGILL), the SSE4.2 baseline elsewhere.
X86_MARCH = {"AVX512": "x86-64-v3", "AVX2": "x86-64-v3", "DEFAULT": "x86-64-v2"}


def test_engine_image_prebuilds_every_portable_march(engine: Image):
    env = dict(e.split("=", 1) for e in engine.config["Env"])
    libraries = sorted(p.name for p in (engine.rootfs / env["TANDEM_NATIVE_PREBUILT"].lstrip("/"))
                       .iterdir())
    marches = [name.split(".", 1)[1].removesuffix(".so") for name in libraries]
    expected = {"x86_64": ["x86-64-v2", "x86-64-v3"], "aarch64": ["armv8-a"]}
    assert marches == expected[platform.machine()], libraries


@pytest.mark.parametrize("capability", [None, "default"], ids=["this-cpu", "no-avx"])
def test_engine_loads_the_prebuilt_kernel(engine: Image, capability: str | None):
    env = dict(e.split("=", 1) for e in engine.config["Env"])
    result = json.loads(ok(engine.python(
        KERNEL_CHECK, env={"ATEN_CPU_CAPABILITY": capability} if capability else None,
    )).splitlines()[-1])
    assert result["kind"] == "prebuilt"
    path = Path(result["path"])
    assert path.parent == Path(env["TANDEM_NATIVE_PREBUILT"])
    if platform.machine() == "x86_64":
        assert path.name.endswith(f".{X86_MARCH[result['capability']]}.so"), result
    if capability == "default":
        assert result["capability"] == "DEFAULT"
    assert result["error"] < 1e-4
    assert result["tmp"] == []  # nothing built, nothing cached: no torch_extensions


def test_engine_jit_is_opt_in_and_needs_a_compiler(engine: Image):
    """TANDEM_NATIVE_JIT=1 skips the prebuilt library; this image has no compiler, so the
    JIT build fails with the error that says what to do, as the engine reports it."""
    done = engine.python("""
        from tandem_engine.model import native
        try:
            native.paged_decode_kernel()
        except native.NativeKernelUnavailable as exc:
            print("unavailable:", exc)
        """, env={"TANDEM_NATIVE_JIT": "1"})
    out = ok(done)
    assert "unavailable: building the native decode-attention kernel" in out
    assert "kernels='torch'" in out


# --- the Dockerfiles' build context --------------------------------------------------------------


def copied_sources(dockerfile: Path) -> list[str]:
    """Sources of the COPY lines that read the build context (not --from a stage)."""
    sources = []
    for line in dockerfile.read_text().splitlines():
        words = shlex.split(line) if line.startswith("COPY ") else []
        if words and not words[1].startswith("--from"):
            sources += words[1:-1]
    return sources


def dockerignore() -> list[str]:
    rows = (ROOT / ".dockerignore").read_text().splitlines()
    return [r.strip() for r in rows if r.strip() and not r.lstrip().startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatch(prefix, pattern.removeprefix("**/"))
               or fnmatch.fnmatch(Path(prefix).name, pattern.removeprefix("**/"))
               for prefix in prefixes for pattern in patterns if not pattern.startswith("!"))


@pytest.mark.parametrize("dockerfile", [OPERATOR_DOCKERFILE, ENGINE_DOCKERFILE],
                         ids=["operator", "engine"])
def test_copied_paths_reach_the_build_context(dockerfile: Path):
    patterns = dockerignore()
    sources = copied_sources(dockerfile)
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not ignored(source.rstrip("/"), patterns), f"COPY {source}: .dockerignore'd"
    # Every package root pyproject.toml names is copied (setuptools looks in each).
    copied = {s.rstrip("/") for s in sources}
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]) <= copied
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied


def test_dockerignore_keeps_local_folders_out():
    patterns = dockerignore()
    for path in (".git", ".venv", "bench-models", ".demo-model", ".pytest_cache", ".hypothesis",
                 "engine_image/tandem_engine/__pycache__"):
        assert ignored(path, patterns), path
