"""The launcher's supervision and stop paths, without a cluster: stand-in ranks and router."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from pdserve.cluster import launcher
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.group import RankProcesses, free_port, group_state_key
from pdserve.cluster.launcher import Cluster, ClusterError, RestartBudget, _Group


def _exit_with(code: int, after: float) -> None:
    time.sleep(after)
    sys.exit(code)


class _Router:
    """What ``Cluster.serve`` and ``shutdown`` ask of the router: no request in flight, nothing
    for the stats line."""

    requests: dict[str, object] = {}
    token_counts = {"prompt": 0, "generated": 0}
    worker_stats: dict[str, dict[str, int]] = {}
    entry_role = "prefill"

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


class _BusyRouter(_Router):
    """A request that never ends; the drain's first poll sends this process a stop signal."""

    def __init__(self) -> None:
        self.requests = {"r": object()}
        self.failed: list[tuple[str, str]] = []
        self.signalled = False

    def poll(self, timeout_ms: int) -> None:
        if not self.signalled:
            self.signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(timeout_ms / 1000)

    def check_heartbeats(self, timeout: float) -> list[tuple[str, int, str]]:
        return []

    def reported_failures(self) -> list[tuple[str, int, str]]:
        return []

    def fail_all(self, code: str, message: str) -> None:
        self.failed.append((code, message))
        self.requests = {}


class _FailingRouter(_Router):
    """A joined group whose node reports its failure in the pass in which its heartbeats are
    overdue too; ``state``: what the router knows of it."""

    def __init__(self, state: str) -> None:
        self.state = state
        self.failed: list[tuple[str, int, str]] = []

    def reported_failures(self) -> list[tuple[str, int, str]]:
        return [("decode", 5, "its node reports: rank 0 was killed by SIGKILL")]

    def check_heartbeats(self, timeout: float) -> list[tuple[str, int, str]]:
        return [("decode", 5, "rank 0 sent no heartbeat for 10.2 s")]

    def group_state(self, key: tuple[str, int]) -> str:
        return self.state

    def group_failed(self, role: str, group: int, cause: str) -> None:
        self.failed.append((role, group, cause))
        self.state = "down"


class _Store:
    def __init__(self) -> None:
        self.keys: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value


@pytest.mark.parametrize("state", ["ready", "down"])
def test_a_joined_groups_failure_is_handled_once(state: str) -> None:
    """Reported by its node and overdue in the same pass, a joined group failed twice: its
    requests' failures and the other role's ``peer_failed`` counted twice, and the store's
    ``left`` of a group that had drained overwritten with ``removed``. Now once, and not at all
    for a group the router has forgotten (drained and left)."""
    cluster = Cluster(ClusterConfig.from_settings({}))
    router = _FailingRouter(state)
    cluster.router = router  # type: ignore[assignment]
    cluster._store = _Store()  # type: ignore[assignment]
    cluster._check_workers()
    assert [cause for *_, cause in router.failed] == (
        ["its node reports: rank 0 was killed by SIGKILL"] if state == "ready" else []
    )
    assert cluster._store.keys == ({group_state_key("decode", 5): "removed"} if state == "ready" else {})  # type: ignore[attr-defined]


def test_a_stop_signal_during_a_drain_that_until_began_ends_it() -> None:
    """``until()`` (the demo's end) began the drain, which logs "stop again to end them now": the
    user's stop signal then ends it at once (it was swallowed, and the drain ran its full time)."""
    cluster = Cluster(ClusterConfig.from_settings({"drain_timeout": 20.0}))
    router = _BusyRouter()
    cluster.router = router  # type: ignore[assignment]
    started = time.monotonic()
    cluster.serve(until=lambda: True)
    assert router.signalled and time.monotonic() - started < 10
    assert [code for code, _ in router.failed] == ["shutdown"] and "stopped again" in router.failed[0][1]


class _CallingRouter(_BusyRouter):
    """A request that never ends; the drain's first poll asks the launcher to stop twice,
    ``gap_s`` apart (as two signals would)."""

    def __init__(self, cluster: Cluster, gap_s: float) -> None:
        super().__init__()
        self.cluster, self.gap_s = cluster, gap_s

    def poll(self, timeout_ms: int) -> None:
        if not self.signalled:
            self.signalled = True
            self.cluster.request_stop()
            time.sleep(self.gap_s)
            self.cluster.request_stop()
        time.sleep(timeout_ms / 1000)


@pytest.mark.parametrize(("gap_s", "cut"), [(0.0, False), (0.7, True)])
def test_a_stop_signal_repeated_at_once_is_the_same_stop(gap_s: float, cut: bool) -> None:
    """timeout(1) sends SIGTERM to the launcher and then to its process group: two signals, one
    stop, which must drain. A second signal a moment later is the user's, and cuts the drain."""
    cluster = Cluster(ClusterConfig.from_settings({"drain_timeout": 3.0}))
    router = _CallingRouter(cluster, gap_s)
    cluster.router = router  # type: ignore[assignment]
    started = time.monotonic()
    cluster.serve()
    took = time.monotonic() - started
    (failed,) = router.failed
    assert ("stopped again" in failed[1]) is cut, failed
    assert (took < 2.5) is cut, took


def test_a_stop_signal_that_a_library_turns_into_its_own_error_still_stops_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C while transformers imports lazily (loading the tokenizer) came out as its
    ModuleNotFoundError and a traceback, not the one-line "stopped before the cluster was ready"."""

    def start_interrupted() -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs before this ends
        except KeyboardInterrupt as e:
            raise ModuleNotFoundError("Could not import module 'LlamaConfig'") from e

    def start_failing() -> None:
        raise ModuleNotFoundError("no module named 'x'")

    cluster = Cluster(ClusterConfig.from_settings({}))
    monkeypatch.setattr(cluster, "_start", start_interrupted)
    with pytest.raises(ClusterError, match="stopped before the cluster was ready"):
        cluster.start()
    monkeypatch.setattr(cluster, "_start", start_failing)
    with pytest.raises(ModuleNotFoundError):  # with no signal, the error is the error
        cluster.start()


class _FormingRouter(_Router):
    """Every group ready, and one KV pair that never connects."""

    def __init__(self, *args: object, **kwargs: object) -> None: ...
    def is_ready(self, key: tuple[str, int]) -> bool:
        return True

    def pairs_forming(self) -> list[str]:
        return ["decode0"]


def test_a_pair_that_never_connects_is_named_when_the_start_times_out(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dirs: dict[str, Path]
) -> None:
    """The endpoint waits for every KV pair to form; one that never does fails the start with
    the groups it holds up, not the "workers not ready" of groups that are."""
    monkeypatch.setattr(launcher, "Router", _FormingRouter)
    monkeypatch.setattr(Cluster, "_spawn", lambda self, group: None)
    settings = {"model": str(tiny_model_dirs["tiny-llama"]), "start_timeout": 1.0, "port": free_port()}
    cluster = Cluster(ClusterConfig.from_settings(settings))
    with pytest.raises(ClusterError, match=r"^the KV transfer pairs of decode0 did not connect in 1 s$"):
        cluster.start()


class _NeverReadyRouter(_Router):
    def __init__(self, *args: object, **kwargs: object) -> None: ...
    def is_ready(self, key: tuple[str, int]) -> bool:
        return False


def test_a_rank_that_dies_while_the_cluster_starts_fails_the_start_and_takes_the_others_down(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dirs: dict[str, Path]
) -> None:
    """A rank that exits during the start ends it at once, naming its group and exit, and no
    other group's rank outlives the launcher's error."""
    monkeypatch.setattr(launcher, "Router", _NeverReadyRouter)
    spawned: list[_Group] = []

    def spawn(self: Cluster, group: _Group) -> None:
        code, after = (3, 0.0) if group.key == ("decode", 0) else (0, 60.0)
        group.processes = RankProcesses(_exit_with, [(code, after)])
        spawned.append(group)

    monkeypatch.setattr(Cluster, "_spawn", spawn)
    settings = {"model": str(tiny_model_dirs["tiny-llama"]), "start_timeout": 30.0, "port": free_port()}
    cluster = Cluster(ClusterConfig.from_settings(settings))
    began = time.monotonic()
    with pytest.raises(ClusterError, match=r"^a worker failed to start: decode group 0: rank 0 exited with code 3"):
        cluster.start()
    assert time.monotonic() - began < 20  # not the start timeout
    assert {g.key for g in spawned} == {("prefill", 0), ("decode", 0)}
    assert all(g.processes is None for g in spawned)  # killed and reaped


def test_an_unexpected_fault_while_serving_ends_every_process_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher bug while serving (an OSError starting a restarted group's ranks, say) raises,
    but first ends the ranks: left running with no router, they would hold their GPUs, and the
    interpreter would wait for them at exit, for ever."""
    cluster = Cluster(ClusterConfig.from_settings({}))
    cluster.router = _Router()  # type: ignore[assignment]
    group = _Group("prefill", 0, 1, None, RestartBudget(1, 1.0))
    group.processes = RankProcesses(_exit_with, [(0, 60.0)])
    (rank,) = group.processes.processes
    cluster.groups = {group.key: group}

    def fault() -> None:
        raise OSError("cannot start a process")

    monkeypatch.setattr(cluster, "_check_workers", fault)
    try:
        with pytest.raises(OSError, match="cannot start"):
            cluster.serve()
        assert not rank.is_alive() and group.processes is None
    finally:
        rank.kill()


def test_a_second_stop_signal_while_the_start_is_undone_is_the_same_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """timeout(1) signals the launcher and then its process group: the second signal, while the
    first one's clean-up runs, came out as KeyboardInterrupt ("Aborted!", exit 1) instead of the
    one-line "stopped before the cluster was ready"."""

    def start_interrupted() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs before this ends

    cluster = Cluster(ClusterConfig.from_settings({}))
    abandon = cluster._abandon

    def abandon_signalled_again() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        abandon()

    monkeypatch.setattr(cluster, "_start", start_interrupted)
    monkeypatch.setattr(cluster, "_abandon", abandon_signalled_again)
    with pytest.raises(ClusterError, match="stopped before the cluster was ready"):
        cluster.start()
