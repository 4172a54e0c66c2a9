"""Fixtures of the cluster tests: real ``launch.py`` clusters on the CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from pdserve.bench.compare import LaunchedCluster
from pdserve.tests.cluster.helpers import MAX_MODEL_LEN


@pytest.fixture(scope="module")
def cluster_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LaunchedCluster]]:
    """Start ``launch.py --max-model-len MAX_MODEL_LEN ARGS``; every cluster a module started is
    killed when the module ends."""
    started: list[LaunchedCluster] = []

    def start(*args: str) -> LaunchedCluster:
        log = tmp_path_factory.mktemp("cluster") / "launch.log"
        cluster = LaunchedCluster(["--max-model-len", str(MAX_MODEL_LEN), *args], log, start_timeout=300)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.kill()
