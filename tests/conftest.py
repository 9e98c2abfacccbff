"""Shared fixtures: freshly written tiny demo checkpoints, one per architecture.

Each is written once per test session (about 0.1 s each) under pytest's tmp
folder, so no test depends on a checkpoint lying around from an earlier run.
Tests may read these folders but must not modify them; copy one first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TINY_ARCHS = ("llama", "qwen2", "qwen3")


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
