"""What the cluster tests share beside their fixtures (tests/cluster/conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.cluster.client import Client

# Every test cluster's --max-model-len: short, so that the CPU's KV pools stay small.
MAX_MODEL_LEN = 512


def wait_until_idle(
    client: Client, timeout: float = 60.0, also: Callable[[dict[str, dict[str, int]]], bool] = lambda groups: True
) -> dict[str, dict[str, int]]:
    """Poll stats until nothing is in flight, every group's blocks are all free again and ``also``
    holds. Groups report their stats periodically, so a reply can predate the last request."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        groups = stats.groups
        if (
            stats.requests_in_flight == 0
            and groups
            and all(g["free_blocks"] == g["num_blocks"] and g["kv_held"] == 0 for g in groups.values())
            and also(groups)
        ):
            return groups
        assert time.monotonic() < deadline, f"cluster not idle: {stats}"
        time.sleep(0.3)
