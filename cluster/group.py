"""Worker-group processes: spawn, torch.distributed set-up, supervision.

Each worker group is a torch.distributed world of its own: its ``tp`` ranks, met in a TCPStore
under a prefix that names the group and its generation, so a group restarted after a failure
forms a new world while the others keep theirs (KV moves over a process group per pair of
groups: ``kvtransfer.agent.connect_groups``). TP rank 0 is the leader that schedules, the
others are peers that run the leader's steps (``ModelRunner.run_peer``).

Supervision: the parent watches every rank's process sentinel (``RankProcesses``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from pdserve.cluster.watchdog import WATCHDOG_EXIT_CODE
from pdserve.engine.config import EngineConfig, ParallelConfig
from pdserve.engine.parallel import TensorParallel

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


# What asks a launcher or a group node to drain and stop: Ctrl-C, SIGTERM, and the hangup of the
# terminal it runs in. Ranks ignore all three: their launcher drives their shutdown, and a stop
# sent to the whole job (a terminal's, `timeout`'s, systemd's) reaches them too.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# A stop signal this soon after the first is the same stop: timeout(1) signals a process, then
# its whole process group. A later one is a second stop: end now, without waiting for a drain.
SAME_STOP_S = 0.5


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Hold the stop signals pending in this thread while it spawns ranks, which inherit the
    mask: a stop sent to the whole job cannot end one before it ignores them
    (``ignore_stop_signals``). This process handles what arrived meanwhile when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stop_signals() -> None:
    """In a rank: ignore the stop signals, then let go of those held since its spawn."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


# The exit code of a rank whose collective failed because another rank of its group ended
# (``peer_gone``): a consequence, reported in words, with no traceback.
PEER_GONE_EXIT_CODE = 76


def peer_gone(error: BaseException) -> bool:
    """Whether ``error`` is a collective's on a connection another rank of the group closed by
    ending (gloo's transport errors, NCCL's backend errors), not a fault of this rank's."""
    text = str(error)
    if isinstance(error, dist.DistBackendError):
        return any(sign in text for sign in ("remote process exited", "by peer", "was aborted"))
    return isinstance(error, RuntimeError) and "gloo/transport" in text and "by peer" in text


def exit_words(code: int) -> str:
    """A process's exit code in words: "exited with code 3", "was killed by SIGKILL"."""
    if code == WATCHDOG_EXIT_CODE:
        return (
            "was ended by its watchdog: its serve loop made no progress for --watchdog-timeout "
            "(every thread's stack is in the cluster's log)"
        )
    if code == PEER_GONE_EXIT_CODE:
        return "ended as another rank of its group did (a collective failed)"
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent (the launcher) dies, so that
    no rank or front end is orphaned."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def name_process(name: str) -> None:
    """Linux: the name ``top``, ``ps -o comm`` and ``pgrep pdserve`` show for this process
    (at most 15 bytes): spawned ranks otherwise all read "python"."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15])


def leave_process() -> typing.NoReturn:
    """End a rank process that finished cleanly, without interpreter finalization: a thread
    still inside a C++ call (a pair group still forming, gloo's workers) must not be torn down
    under it, which aborts the process or hangs it at exit. Everything that matters is done by
    then; the streams are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` that nothing listens on now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to join its group's world and build its engine."""

    engine: EngineConfig  # this rank's copy: parallel.tp_rank, tp_size and device already set
    init_method: str  # the store's address, tcp://127.0.0.1:PORT, served by the spawning process
    backend: str  # nccl on CUDA, gloo on CPU
    store_prefix: str = ""  # the group and its generation, e.g. "tp/decode1.g2/"
    threads: int = 1  # torch CPU threads per process (oversubscribing 2 cores makes gloo crawl)


def group_specs(
    engine: EngineConfig,
    tp_size: int,
    init_method: str,
    devices: Sequence[int] | None,
    step_address: str,
    store_prefix: str = "",
) -> list[RankSpec]:
    """Per-rank specs of one TP group.

    ``devices[i]`` is the CUDA device of TP rank ``i``; None runs the group on CPU.
    """
    backend = "nccl" if devices is not None else "gloo"
    specs = []
    for tp_rank in range(tp_size):
        parallel = ParallelConfig(tp_size=tp_size, tp_rank=tp_rank, step_address=step_address)
        device = f"cuda:{devices[tp_rank]}" if devices is not None else "cpu"
        rank_engine = dataclasses.replace(engine, parallel=parallel, device=device)
        specs.append(RankSpec(rank_engine, init_method, backend, store_prefix))
    return specs


def init_distributed(spec: RankSpec) -> TensorParallel:
    """Join the group's world (its TP ranks alone), return this rank's TP state."""
    torch.set_num_threads(spec.threads)
    if spec.backend == "nccl":
        torch.cuda.set_device(torch.device(spec.engine.device))
    tp = spec.engine.parallel
    store = connect_store(spec.init_method)
    if spec.store_prefix:
        store = dist.PrefixStore(spec.store_prefix, store)
    dist.init_process_group(spec.backend, store=store, world_size=tp.tp_size, rank=tp.tp_rank)
    return TensorParallel(rank=tp.tp_rank, size=tp.tp_size, group=dist.group.WORLD if tp.tp_size > 1 else None)


def connect_store(address: str, serve: bool = False, clients: int = 1, timeout_s: float = 1800.0) -> dist.TCPStore:
    """A TCPStore at ``tcp://HOST:PORT``: a client of it, or (``serve``) its server, listening on
    that address only (a TCPStore that opens its own socket listens on every interface).
    ``timeout_s`` bounds the connection and every wait on a key (default: torch.distributed's
    own for gloo)."""
    url = urlparse(address)
    host, port = url.hostname or "127.0.0.1", url.port or 0
    timeout = datetime.timedelta(seconds=timeout_s)
    if not serve:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(max(clients, 128))
    return dist.TCPStore(
        host, port, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=listener.detach()
    )


def group_tp_key(role: str, group: int) -> str:
    """The store key that holds a group's TP degree, for the ranks of groups that meet it at run time."""
    return f"group/{role}{group}/tp"


def group_state_key(role: str, group: int) -> str:
    """The store key of a joining group's state: starting, then joined (admitted by the router's
    node) or left (its node stopped first), whichever comes first; removed once the router's
    node gave up on its heartbeats."""
    return f"group/{role}{group}/state"


def join_world(backend: str, init_method: str, world_size: int, rank: int) -> dist.TCPStore:
    """``dist.init_process_group`` of a world whose rank 0 serves the rendezvous store on the init
    address only (the benchmarks' worlds); the store."""
    store = connect_store(init_method, serve=rank == 0, clients=world_size)
    dist.init_process_group(backend, store=store, world_size=world_size, rank=rank)
    return store


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
                self.kill()
                raise TimeoutError(f"ranks {sorted(i for i, _ in pending.values())} still running after {timeout} s")
            for sentinel in ready:
                _, proc = pending.pop(sentinel)
                proc.join()
                if proc.exitcode != 0:
                    failure = self.failure()  # every rank down so far: the first to die is among them
                    self.kill()
                    raise RuntimeError(failure)

    def failure(self) -> str | None:
        """The ranks that exited non-zero so far, if any (non-blocking)."""
        failed = [(i, p.exitcode) for i, p in enumerate(self.processes) if p.exitcode not in (None, 0)]
        if not failed:
            return None
        words = "; ".join(f"rank {i} {exit_words(code)}" for i, code in failed)
        # A rank killed by a signal wrote no traceback; one that exited with a code did (one its
        # watchdog ended wrote its stacks, which its words say).
        traceback = any(code > 0 and code not in (WATCHDOG_EXIT_CODE, PEER_GONE_EXIT_CODE) for _, code in failed)
        return words + " (its traceback is in the cluster's log)" if traceback else words

    def alive(self) -> bool:
        return any(proc.is_alive() for proc in self.processes)

    def kill(self) -> None:
        """SIGKILL every rank now (a stopped or hung one included) and reap them."""
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()
        for proc in self.processes:
            proc.join()
