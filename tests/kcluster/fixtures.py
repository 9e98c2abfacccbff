"""The `test_cluster` pytest fixture: a fresh API server per test (startup takes ~10 ms).

Import it into a test module with `from kcluster.fixtures import test_cluster  # noqa: F401`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .cluster import TestCluster


@pytest.fixture
def test_cluster() -> Iterator[TestCluster]:
    with TestCluster() as cluster:
        yield cluster
