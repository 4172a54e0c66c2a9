"""Careless and hostile clients against a real cluster (``launch.py`` on CPU, gloo): aborts in
any order of messages, repeated signals, oversized input, exposure and wrong results."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.bench.compare import LaunchedCluster
from pdserve.cluster.client import Client

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def cluster_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    started: list[LaunchedCluster] = []

    def start(*args: str) -> LaunchedCluster:
        log = tmp_path_factory.mktemp("cluster") / "launch.log"
        cluster = LaunchedCluster(["--max-model-len", str(MAX_MODEL_LEN), *args], log, start_timeout=300)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.kill()


def idle(stats_groups: dict[str, dict[str, int]]) -> bool:
    return bool(stats_groups) and all(
        g["free_blocks"] == g["num_blocks"] and g["kv_held"] == 0 and g["running"] == 0 and g["waiting"] == 0
        for g in stats_groups.values()
    )


@pytest.mark.slow
def test_aborts_right_after_submit_free_every_block_and_decode_nothing(
    cluster_factory, tiny_model_dirs: dict[str, Path]
) -> None:
    """The decode group is kept busy, so the aborted requests' announcements reach it late (or
    are refused and retried): whatever the order of abort and announce, none of them is ever
    admitted to decode, and every block on both sides comes back."""
    cluster = cluster_factory(
        "--model",
        str(tiny_model_dirs["tiny-llama"]),
        "--prefill-tp",
        "1",
        "--decode-tp",
        "1",
        "--transfer",
        "gloo-async",
        "--num-blocks",
        "200",
    )
    with Client(cluster.endpoint, timeout=120) as client:
        busy = [client.submit(token_ids=[7] * 200, max_tokens=100, temperature=0.0, ignore_eos=True) for _ in range(6)]
        while client.stats().groups.get("decode0", {}).get("running", 0) < len(busy):
            time.sleep(0.05)
        # Half are aborted at once (before their prefill ends, mostly), half once their first token
        # is out (their KV is then announced to the decode group, or about to be).
        aborted = []
        for i in range(20):
            request_id = client.submit(
                token_ids=[3 + i] * 40, stream=True, max_tokens=400, temperature=0.0, ignore_eos=True
            )
            if i % 2:
                next(client.chunks(request_id))
            client.abort(request_id)
            aborted.append(request_id)
        for request_id in aborted:
            assert list(client.chunks(request_id))[-1].finish_reason == "abort"
        # Until every block is back, the decode group never runs more than the busy requests.
        most_running = 0
        deadline = time.monotonic() + 120
        while True:
            stats = client.stats()
            most_running = max(most_running, stats.groups["decode0"]["running"])
            if stats.requests_in_flight == 0 and idle(stats.groups):
                break
            assert time.monotonic() < deadline, f"blocks or requests still held: {stats}"
            time.sleep(0.1)
        assert most_running <= len(busy), f"aborted requests were decoded ({most_running} running at once)"
        assert [len(client.result(r).token_ids) for r in busy] == [100] * len(busy)
    assert cluster.stop() == 0
