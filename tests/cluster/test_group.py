"""The world's rendezvous: what ``cluster.group.join_world`` leaves listening."""

from __future__ import annotations

import os
import subprocess

import torch.distributed as dist

from pdserve.cluster.group import free_port, join_world


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
