"""A leader's inbox: what ``receive`` reads from its two sockets, how long it waits, and that it
busy-polls only until ``spin_until``. No engine, no processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.datagrams import DatagramOutbox
from pdserve.cluster.inbox import LeaderInbox


@pytest.fixture
def inbox(tmp_path: Path) -> Iterator[LeaderInbox]:
    box = LeaderInbox(zmq.Context.instance(), f"ipc://{tmp_path}/decode0")
    yield box
    box.close()


def _receive_all(inbox: LeaderInbox, count: int) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + 10
    while len(got) < count and time.monotonic() < deadline:
        got += inbox.receive(100)
    return got


def test_receive_reads_the_zmq_socket_and_the_datagrams_beside_it(inbox: LeaderInbox, tmp_path: Path) -> None:
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"ipc://{tmp_path}/decode0")
    outbox = DatagramOutbox()
    try:
        for i in range(3):
            push.send(b"zmq %d" % i)
        for i in range(3):
            assert outbox.send(f"ipc://{tmp_path}/decode0", b"datagram %d" % i)
        got = _receive_all(inbox, 6)
    finally:
        push.close()
        outbox.close()
    assert sorted(got) == sorted([b"zmq 0", b"zmq 1", b"zmq 2", b"datagram 0", b"datagram 1", b"datagram 2"])
    # Each channel keeps its own order.
    assert [m for m in got if m.startswith(b"zmq")] == [b"zmq 0", b"zmq 1", b"zmq 2"]
    assert [m for m in got if m.startswith(b"datagram")] == [b"datagram 0", b"datagram 1", b"datagram 2"]
    assert inbox.receive(0) == []


def test_a_tcp_inbox_has_no_datagrams_and_still_receives() -> None:
    ctx = zmq.Context.instance()
    box = LeaderInbox(ctx, "tcp://127.0.0.1:*")
    assert box.datagrams is None
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(box.zmq.getsockopt(zmq.LAST_ENDPOINT).decode())
    try:
        push.send(b"over tcp")
        assert _receive_all(box, 1) == [b"over tcp"]
    finally:
        push.close()
        box.close()


@pytest.mark.parametrize("spin_s", [0.0, 0.2])
def test_with_nothing_waiting_receive_returns_empty_after_its_timeout(inbox: LeaderInbox, spin_s: float) -> None:
    started = time.monotonic()
    assert inbox.receive(50, spin_until=started + spin_s) == []
    assert time.monotonic() - started >= 0.05


def test_it_busy_polls_until_spin_until_and_sleeps_after(inbox: LeaderInbox) -> None:
    """Spinning costs CPU time for the whole wait; sleeping in poll() next to none. Counted for
    this thread alone: the process's other threads may run meanwhile."""
    cpu = time.thread_time()
    inbox.receive(100, spin_until=time.monotonic() + 1.0)  # the timeout ends the spin too
    spun = time.thread_time() - cpu
    cpu = time.thread_time()
    inbox.receive(100, spin_until=0.0)
    slept = time.thread_time() - cpu
    assert spun > 0.02, spun  # a loaded machine may run the spin part of the time
    assert slept < 0.01, slept


def test_a_datagram_ends_a_spin_at_once(inbox: LeaderInbox, tmp_path: Path) -> None:
    outbox = DatagramOutbox()
    assert outbox.send(f"ipc://{tmp_path}/decode0", b"announce")
    started = time.monotonic()
    assert inbox.receive(5000, spin_until=started + 5.0) == [b"announce"]
    assert time.monotonic() - started < 2.5
    outbox.close()


def test_the_spin_defaults_on_for_gpus_and_off_for_cpus() -> None:
    default = ClusterConfig()
    assert default.leader_spin_s(on_gpu=False) == 0.0  # a CPU's cores are the ranks' to compute with
    assert default.leader_spin_s(on_gpu=True) > 0.0
    assert ClusterConfig(leader_spin_ms=0.0).leader_spin_s(on_gpu=True) == 0.0
    assert ClusterConfig(leader_spin_ms=20.0).leader_spin_s(on_gpu=False) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="leader_spin_ms must be >= 0"):
        ClusterConfig(leader_spin_ms=-1.0)
    with pytest.raises(ValueError, match="leader_spin_ms must be a finite number"):
        ClusterConfig(leader_spin_ms=float("inf"))
