"""The launcher's supervision and stop paths, without a cluster: stand-in ranks and router."""

from __future__ import annotations

import sys
import time

import pytest

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.group import RankProcesses
from pdserve.cluster.launcher import Cluster, ClusterError, RestartBudget, _Group


def _exit_with(code: int, after: float) -> None:
    time.sleep(after)
    sys.exit(code)


class _Router:
    """What ``Cluster.shutdown`` asks of the router: no request in flight."""

    requests: dict[str, object] = {}

    def stop_accepting(self) -> None: ...
    def poll(self, timeout_ms: int) -> None: ...
    def shutdown_workers(self) -> None: ...
    def close(self) -> None: ...
    def fail_all(self, code: str, message: str) -> None: ...


def test_one_group_failing_to_exit_cleanly_does_not_cut_short_the_others_shutdown() -> None:
    """Shutdown waits for every group (and front end) even when one group's rank exits non-zero
    on the way out: the others are still settling their transfers and must not be left running
    (in the real launcher: SIGKILLed by the launcher's exit mid-teardown)."""
    cluster = Cluster(ClusterConfig.from_settings({}))
    cluster.router = _Router()  # type: ignore[assignment]
    crashing = _Group("prefill", 0, 1, None, RestartBudget(1, 1.0))
    slow = _Group("decode", 0, 1, None, RestartBudget(1, 1.0))
    crashing.processes = RankProcesses(_exit_with, [(3, 0.0)])
    slow.processes = RankProcesses(_exit_with, [(0, 3.0)])  # a clean exit that takes a moment
    cluster.groups = {crashing.key: crashing, slow.key: slow}
    try:
        with pytest.raises(ClusterError, match="prefill group 0"):  # one line, once every group is down
            cluster.shutdown()
        (proc,) = slow.processes.processes
        assert not proc.is_alive() and proc.exitcode == 0
    finally:
        slow.processes.kill()
