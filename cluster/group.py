"""Worker-group processes: spawn, torch.distributed set-up, supervision.

One torch.distributed world holds every worker rank of a cluster. Each worker group is a TP
group of ``tp`` consecutive global ranks; its rank 0 is the leader that schedules, the others
are peers that run the leader's steps (``ModelRunner.run_peer``). Every rank creates every
subgroup in the same order, as torch.distributed requires.

Supervision: the parent watches every rank's process sentinel. A rank that exits with an
error (or dies) takes the whole set down with that rank named in the error, instead of
leaving its peers hanging in a collective.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from pdserve.engine.config import EngineConfig, ParallelConfig
from pdserve.engine.parallel import TensorParallel

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent (the launcher) dies, so that
    no rank or front end is orphaned."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to join the world and build its engine."""

    engine: EngineConfig  # this rank's copy: parallel.tp_rank and device already set
    global_rank: int
    world_size: int
    init_method: str  # tcp://127.0.0.1:PORT
    tp_groups: tuple[tuple[int, ...], ...]  # global ranks of every TP group, in one fixed order
    backend: str  # nccl on CUDA, gloo on CPU
    threads: int = 1  # torch CPU threads per process (oversubscribing 2 cores makes gloo crawl)

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        return next(g for g in self.tp_groups if self.global_rank in g)


def group_specs(
    engine: EngineConfig,
    tp_size: int,
    first_rank: int,
    world_size: int,
    init_method: str,
    tp_groups: tuple[tuple[int, ...], ...],
    devices: Sequence[int] | None,
    step_address: str,
) -> list[RankSpec]:
    """Per-rank specs of one TP group whose leader has global rank ``first_rank``.

    ``devices[i]`` is the CUDA device of TP rank ``i``; None runs the group on CPU.
    """
    backend = "nccl" if devices is not None else "gloo"
    specs = []
    for tp_rank in range(tp_size):
        parallel = ParallelConfig(tp_size=tp_size, tp_rank=tp_rank, step_address=step_address)
        device = f"cuda:{devices[tp_rank]}" if devices is not None else "cpu"
        rank_engine = dataclasses.replace(engine, parallel=parallel, device=device)
        specs.append(RankSpec(rank_engine, first_rank + tp_rank, world_size, init_method, tp_groups, backend))
    return specs


def init_distributed(spec: RankSpec) -> tuple[TensorParallel, dist.Store]:
    """Join the world, create every TP subgroup; this rank's TP state and the world's store
    (for handles that ranks exchange out of band)."""
    torch.set_num_threads(spec.threads)
    if spec.backend == "nccl":
        torch.cuda.set_device(torch.device(spec.engine.device))
    store = join_world(spec.backend, spec.init_method, spec.world_size, spec.global_rank)
    mine = None
    for ranks in spec.tp_groups:
        group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
        if spec.global_rank in ranks:
            mine = group
    tp = spec.engine.parallel
    return TensorParallel(rank=tp.tp_rank, size=tp.tp_size, group=mine), store


def join_world(backend: str, init_method: str, world_size: int, rank: int) -> dist.TCPStore:
    """``dist.init_process_group`` through a rendezvous store on the init address only (every
    process of one world, the cluster's ranks and the benchmarks' alike); the store, for handles
    the ranks exchange out of band."""
    store = _store(init_method, world_size, rank)
    dist.init_process_group(backend, store=store, world_size=world_size, rank=rank)
    return store


def _store(init_method: str, world_size: int, rank: int) -> dist.TCPStore:
    """The world's rendezvous store (``tcp://HOST:PORT``), served by rank 0 on that address only:
    a TCPStore that opens its own socket listens on every interface."""
    url = urlparse(init_method)
    host, port = url.hostname or "127.0.0.1", url.port or 0
    timeout = datetime.timedelta(minutes=30)  # torch.distributed's own default for gloo
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(world_size)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.detach())


class RankProcesses:
    """Spawned rank processes, watched together."""

    def __init__(self, target: Callable[..., None], args_per_rank: Sequence[tuple]) -> None:
        ctx = mp.get_context("spawn")
        # Children inherit the environment: keep per-process CPU threads low so that several
        # ranks on a small machine do not fight over cores.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.processes = [ctx.Process(target=target, args=args, daemon=False) for args in args_per_rank]
        for proc in self.processes:
            proc.start()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every process to exit 0; on the first failure stop the rest and raise."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = {proc.sentinel: (i, proc) for i, proc in enumerate(self.processes)}
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait(list(pending), timeout=left)
            if not ready:
                self.terminate()
                raise TimeoutError(f"ranks {sorted(i for i, _ in pending.values())} still running after {timeout} s")
            for sentinel in ready:
                _, proc = pending.pop(sentinel)
                proc.join()
                if proc.exitcode != 0:
                    failure = self.failure()  # every rank down so far: the first to die is among them
                    self.terminate()
                    raise RuntimeError(failure)

    def failure(self) -> str | None:
        """The ranks that exited non-zero so far, if any (non-blocking)."""
        failed = [
            f"rank {i} exited with code {p.exitcode}"
            for i, p in enumerate(self.processes)
            if p.exitcode not in (None, 0)
        ]
        return "; ".join(failed) + " (its traceback is in the cluster's log)" if failed else None

    def alive(self) -> bool:
        return any(proc.is_alive() for proc in self.processes)

    def terminate(self) -> None:
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
        for proc in self.processes:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
