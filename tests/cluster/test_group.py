"""The world's rendezvous (what ``cluster.group.join_world`` leaves listening), and how a dead
rank is reported."""

from __future__ import annotations

import os
import signal
import subprocess

import torch.distributed as dist

from pdserve.cluster.group import (
    PEER_GONE_EXIT_CODE,
    RankProcesses,
    exit_words,
    free_port,
    join_world,
    peer_gone,
)
from pdserve.cluster.watchdog import WATCHDOG_EXIT_CODE


def test_join_world_listens_on_loopback_only() -> None:
    """The store (and gloo's own sockets) of a world joined through ``join_world`` (the cluster's
    ranks and the benchmarks') listen on 127.0.0.1, never on every interface."""
    port = free_port()
    join_world("gloo", f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
    try:
        listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    finally:
        dist.destroy_process_group()
    ours = [line.split()[3] for line in listening if f"pid={os.getpid()}," in line]
    assert f"127.0.0.1:{port}" in ours, listening
    assert all(address.startswith("127.0.0.1:") for address in ours), ours


def test_exit_words_name_the_signal_that_killed() -> None:
    """A rank killed by a signal (the OOM killer's SIGKILL) is reported by the signal's name, and
    only an exit with a code points at a traceback."""
    assert exit_words(3) == "exited with code 3"
    assert exit_words(-9) == "was killed by SIGKILL"
    assert exit_words(-15) == "was killed by SIGTERM"
    assert exit_words(-200) == "was killed by signal 200"


def _exit_with(code: int) -> None:
    if code < 0:
        os.kill(os.getpid(), -code)
    os._exit(code)


def test_failure_points_at_a_traceback_only_where_one_was_written() -> None:
    killed = RankProcesses(_exit_with, [(0,), (-signal.SIGKILL,)])
    for proc in killed.processes:
        proc.join(60)
    assert killed.failure() == "rank 1 was killed by SIGKILL"
    both = RankProcesses(_exit_with, [(3,), (-signal.SIGKILL,)])
    for proc in both.processes:
        proc.join(60)
    assert (
        both.failure()
        == "rank 0 exited with code 3; rank 1 was killed by SIGKILL (its traceback is in the cluster's log)"
    )
    stuck = RankProcesses(_exit_with, [(WATCHDOG_EXIT_CODE,), (0,)])
    for proc in stuck.processes:
        proc.join(60)
    assert stuck.failure() == (
        "rank 0 was ended by its watchdog: its serve loop made no progress for --watchdog-timeout "
        "(every thread's stack is in the cluster's log)"
    )


def _all_reduce_after_the_other_ends(rank: int, address: str) -> None:
    """Rank 1 ends once the group formed; rank 0's next all-reduce fails on its connection and
    exits with whether ``peer_gone`` takes that error for the other rank's end."""
    import torch

    join_world("gloo", address, world_size=2, rank=rank)
    if rank == 1:
        os._exit(0)
    try:
        for _ in range(100):  # until the closed connection shows
            dist.all_reduce(torch.ones(1))
    except RuntimeError as e:
        os._exit(PEER_GONE_EXIT_CODE if peer_gone(e) else 3)
    os._exit(4)


def test_a_collective_cut_by_another_ranks_end_is_told_from_a_fault() -> None:
    """Such a rank exits in one line (cluster.rank), and its failure points at no traceback."""
    address = f"tcp://127.0.0.1:{free_port()}"
    ranks = RankProcesses(_all_reduce_after_the_other_ends, [(0, address), (1, address)])
    for proc in ranks.processes:
        proc.join(120)
    assert ranks.failure() == "rank 0 ended as another rank of its group did (a collective failed)"
    assert not peer_gone(RuntimeError("CUDA error: an illegal memory access was encountered"))
