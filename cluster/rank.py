"""The entry point of a worker rank process: join the world, build the engine, serve.

A group's leader (TP rank 0) runs its role's ``GroupLeader`` over an ``LLMEngine``; the other
ranks follow its steps and KV commands (``ModelRunner.run_peer``). Every rank sends the router
a heartbeat from a thread of its own. Ranks of the prefill and decode roles also connect their
KV transfers to every group of the other role, one process group per pair of groups, named by
both groups' generations.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import zmq

from pdserve.cluster.colocated import ColocatedLeader
from pdserve.cluster.config import Addresses, GroupLayout, RankTiming
from pdserve.cluster.group import (
    PEER_GONE_EXIT_CODE,
    RankSpec,
    connect_store,
    die_with_parent,
    group_tp_key,
    ignore_stop_signals,
    init_distributed,
    leave_process,
    name_process,
    peer_gone,
)
from pdserve.cluster.leader import GroupLeader
from pdserve.cluster.protocol import Heartbeat, encode
from pdserve.cluster.watchdog import Watchdog
from pdserve.decode_worker.leader import DecodeLeader
from pdserve.engine.config import ModelConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.kvtransfer.agent import CommandChannel, KVTransferAgent, connect_groups
from pdserve.kvtransfer.base import PairRendezvous, TransferConfig
from pdserve.prefill_worker.leader import PrefillLeader


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker rank process needs: its rank, its group and role, where to talk."""

    rank: RankSpec
    role: str  # prefill | decode | colocated
    group: int
    addresses: Addresses
    layout: GroupLayout
    transfer: TransferConfig
    timing: RankTiming
    generation: int = 0  # this group's: how often it was restarted
    generations: dict[str, list[int]] = field(default_factory=dict)  # every group's, by role, at spawn
    env: dict[str, str] = field(default_factory=dict)  # set before CUDA starts (MPS: its daemon, the SM cap)


def _transfers(
    spec: WorkerSpec,
    kv_cache: torch.Tensor,
    model: ModelConfig,
    channel: CommandChannel | None = None,
) -> KVTransferAgent:
    """This rank's backends to every group of the other role (prefill -> each decode group, and back)."""
    other = "decode" if spec.role == "prefill" else "prefill"
    store = urlparse(spec.rank.init_method)
    mine = f"{spec.role}{spec.group}.g{spec.generation}"

    def rendezvous(peer_group: int, generation: int) -> PairRendezvous:
        peer = f"{other}{peer_group}.g{generation}"
        pair = f"{mine}-{peer}" if spec.role == "prefill" else f"{peer}-{mine}"
        # A transfer may wait on the wire as long as its KV may wait for its hand-off.
        return PairRendezvous(
            store.hostname or "127.0.0.1",
            store.port or 0,
            f"kv/{pair}/",
            spec.timing.rendezvous_timeout,
            spec.timing.kv_lease_timeout,
        )

    started = [len(ranks) for ranks in spec.layout.ranks[other]]

    def peer_size(peer_group: int) -> int:
        """The TP degree of a group of the other role: in the layout when the router's node
        started it, else (a group that joined at run time) in the store, written before it started."""
        if peer_group < len(started):
            return started[peer_group]
        return int(connect_store(spec.rank.init_method).get(group_tp_key(other, peer_group)))

    parallel = spec.rank.engine.parallel
    return connect_groups(
        spec.transfer,
        kv_cache,
        model.num_heads,
        model.num_kv_heads,
        parallel.tp_size,
        peer_size,
        spec.role == "prefill",
        parallel.tp_rank,
        rendezvous,
        spec.generations[other],
        channel,
    )


def _heartbeats(spec: WorkerSpec) -> None:
    """A rank's heartbeats to the router, until the process ends (a stopped or dead process
    sends none: that is what the router watches for). A thread, not the serve loop: one step
    may legitimately take longer than the timeout (a long prompt's prefill on a CPU)."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)  # a router that stopped reading gets no backlog of them
    sock.connect(spec.addresses.router)
    beat = encode(Heartbeat(spec.role, spec.group, spec.rank.engine.parallel.tp_rank, spec.rank.engine.device))
    while True:
        with contextlib.suppress(zmq.Again):
            sock.send(beat, zmq.NOBLOCK)
        time.sleep(spec.timing.heartbeat_interval)


def _lead(spec: WorkerSpec, engine: LLMEngine, watchdog: Watchdog) -> None:
    """Serve as the group's leader until the router shuts the cluster down."""
    leader: GroupLeader
    if spec.role == "colocated":
        leader = ColocatedLeader(spec.group, spec.addresses, engine)
    else:
        transfers = _transfers(spec, engine.kv_cache, engine.model_config, engine.step_channel)
        lease = spec.timing.kv_lease_timeout
        if spec.role == "prefill":
            leader = PrefillLeader(spec.group, spec.addresses, engine, transfers, lease, spec.generation)
        else:
            leader = DecodeLeader(spec.group, spec.addresses, engine, transfers, lease, spec.generations["prefill"])
    leader.run(watchdog, spec.timing.leader_spin_s)


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a rank process: join the world, build the engine, serve until shutdown."""
    os.environ.update(spec.env)
    die_with_parent()
    ignore_stop_signals()  # the launcher drives shutdown, not Ctrl-C, SIGTERM or a hangup
    name_process(f"pdserve-{spec.role[0]}{spec.group}.{spec.rank.engine.parallel.tp_rank}")  # pdserve-p0.1
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {spec.role}{spec.group}.{spec.rank.engine.parallel.tp_rank} %(levelname)s %(message)s",
    )
    logging.info("rank up: pid %d, generation %d", os.getpid(), spec.generation)  # tests and operators find it here
    threading.Thread(target=_heartbeats, args=(spec,), daemon=True).start()
    watchdog = Watchdog(spec.timing.watchdog_timeout).start()  # armed by the serve loop's first tick
    tp = init_distributed(spec.rank)
    try:
        config = spec.rank.engine
        if config.parallel.is_leader:
            _lead(spec, LLMEngine(config, tp), watchdog)
        else:
            model = ModelConfig.from_pretrained(config.model)
            runner = ModelRunner(config, model, tp)
            runner.run_peer(None if spec.role == "colocated" else _transfers(spec, runner.kv_cache, model), watchdog)
    except Exception as e:
        if not peer_gone(e):
            raise
        # The consequence of another rank's end, which the launcher reports: one line, no traceback.
        logging.error("a collective failed, a rank of the group is gone: %s", str(e).splitlines()[0][:200])
        raise SystemExit(PEER_GONE_EXIT_CODE) from None
    finally:
        dist.destroy_process_group()
    logging.info("rank down")
    leave_process()
