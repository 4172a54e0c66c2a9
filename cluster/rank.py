"""The entry point of a worker rank process: join the world, build the engine, serve.

A group's leader (TP rank 0) runs its role's ``GroupLeader`` over an ``LLMEngine``; the other
ranks follow its steps and KV commands (``ModelRunner.run_peer``). Ranks of the prefill and
decode roles also connect their KV transfers to every group of the other role.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pdserve.cluster.colocated import ColocatedLeader
from pdserve.cluster.config import Addresses, GroupLayout
from pdserve.cluster.group import RankSpec, die_with_parent, init_distributed
from pdserve.decode_worker.leader import DecodeLeader
from pdserve.engine.config import ModelConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.kvtransfer.agent import CommandChannel, KVTransferAgent, connect_groups
from pdserve.kvtransfer.base import TransferConfig
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
    env: dict[str, str] = field(default_factory=dict)  # set before CUDA starts (MPS: its daemon, the SM cap)


def _transfers(
    spec: WorkerSpec,
    kv_cache: torch.Tensor,
    model: ModelConfig,
    store: dist.Store,
    channel: CommandChannel | None = None,
) -> KVTransferAgent:
    """This rank's backends to every group of the other role (prefill -> each decode group, and back)."""
    other = "decode" if spec.role == "prefill" else "prefill"
    return connect_groups(
        spec.transfer,
        kv_cache,
        model.num_heads,
        model.num_kv_heads,
        spec.layout.ranks[spec.role][spec.group],
        spec.layout.ranks[other],
        spec.role == "prefill",
        spec.rank.global_rank,
        channel,
        store,
    )


def _lead(spec: WorkerSpec, engine: LLMEngine, store: dist.Store) -> None:
    """Serve as the group's leader until the router shuts the cluster down."""
    if spec.role == "colocated":
        ColocatedLeader(spec.group, spec.addresses, engine).run()
        return
    transfers = _transfers(spec, engine.kv_cache, engine.model_config, store, engine.step_channel)
    role = PrefillLeader if spec.role == "prefill" else DecodeLeader
    role(spec.group, spec.addresses, engine, transfers).run()


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a rank process: join the world, build the engine, serve until shutdown."""
    os.environ.update(spec.env)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher drives shutdown, not Ctrl-C
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {spec.role}{spec.group}.{spec.rank.engine.parallel.tp_rank} %(levelname)s %(message)s",
    )
    tp, store = init_distributed(spec.rank)
    try:
        config = spec.rank.engine
        if config.parallel.is_leader:
            _lead(spec, LLMEngine(config, tp), store)
        else:
            model = ModelConfig.from_pretrained(config.model)
            runner = ModelRunner(config, model, tp)
            runner.run_peer(None if spec.role == "colocated" else _transfers(spec, runner.kv_cache, model, store))
    finally:
        dist.destroy_process_group()
