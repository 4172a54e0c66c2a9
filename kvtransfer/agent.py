"""One rank's KV transfers, by id: the owner of the KV hand-off on every rank of a group.

A group's leader calls ``send`` (prefill) or ``recv`` (decode): the command goes to its TP peers
on the step channel, so that each issues its part in the same order relative to the steps, and
the leader issues its own part. A peer's step loop (``ModelRunner.run_peer``) hands each command
it receives to ``execute``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from pdserve.engine.step_channel import KVCommand
from pdserve.kvtransfer.base import (
    Transfer,
    TransferBackend,
    TransferConfig,
    TransferStats,
    TransferTopology,
    create_backend,
)


class CommandChannel(Protocol):
    """The leader's step channel to its TP peers (``engine.step_channel.StepSender``)."""

    def send(self, message: KVCommand) -> None: ...


class KVTransferAgent:
    """Routes each command to the backend of its peer group and tracks transfers by id."""

    def __init__(
        self,
        backends: Mapping[int, TransferBackend],
        max_staging_bytes: int,
        channel: CommandChannel | None = None,
    ) -> None:
        self.backends = dict(backends)
        self.max_staging_bytes = max_staging_bytes
        self._channel = channel  # the leader's, when its group has peers
        self._transfers: dict[str, tuple[str, Transfer]] = {}

    def send(self, transfer_id: str, block_ids: list[int], peer_group: int) -> Transfer:
        """Prefill leader: every rank of the group sends its part of the KV in ``block_ids`` to
        decode group ``peer_group``; the handle is this rank's part."""
        return self._issue(KVCommand("send", transfer_id, block_ids, peer_group))

    def recv(self, transfer_id: str, block_ids: list[int], peer_group: int, src_block_ids: list[int]) -> Transfer:
        """Decode leader: every rank of the group receives its part of the KV from prefill group
        ``peer_group`` into ``block_ids`` (``src_block_ids``: where it lies in the prefill pool);
        ``done``/``wait`` by id settle this rank's part."""
        return self._issue(KVCommand("recv", transfer_id, block_ids, peer_group, src_block_ids))

    def pulls(self, peer_group: int) -> bool:
        """Whether the transfers with ``peer_group`` are pulled by the decode side: its receive
        completes the transfer, and the prefill side keeps its blocks until told so."""
        return self.backends[peer_group].pulls

    def _issue(self, command: KVCommand) -> Transfer:
        if self._channel is not None:
            self._channel.send(command)
        return self.execute(command)

    def execute(self, command: KVCommand) -> Transfer:
        """Issue this rank's part of a transfer (commands arrive in the same order on every rank)."""
        if command.transfer_id in self._transfers:
            raise ValueError(f"transfer {command.transfer_id!r} is already in flight on this rank")
        self._prune()
        backend = self.backends[command.peer_group]
        if command.op == "send":
            transfer = backend.send(command.block_ids)
        elif command.op == "recv":
            transfer = backend.recv(command.block_ids, command.src_block_ids)
        else:
            raise ValueError(f"unknown KV command {command.op!r}")
        self._transfers[command.transfer_id] = (command.op, transfer)
        return transfer

    def done(self, transfer_id: str) -> bool:
        return self._transfers[transfer_id][1].done()

    def wait(self, transfer_id: str) -> TransferStats:
        """Block until this rank's part is complete (received KV in the cache); forget it."""
        return self._transfers.pop(transfer_id)[1].wait()

    def staging_bytes(self) -> int:
        """Bytes of KV buffers held for this rank's transfers in flight, sends and receives."""
        return sum(b.staging_bytes for b in self.backends.values())

    def has_staging_room(self, peer_group: int, num_blocks: int) -> bool:
        """Whether a transfer of ``num_blocks`` blocks with ``peer_group`` fits under
        ``max_staging_bytes`` of buffers in flight. With nothing in flight it always fits, so a
        request larger than the bound still moves (alone)."""
        in_flight = self.staging_bytes()
        needed = num_blocks * self.backends[peer_group].block_bytes()
        return in_flight == 0 or in_flight + needed <= self.max_staging_bytes

    def _prune(self) -> None:
        """Forget completed sends nobody waits for (peers), releasing their staging buffers."""
        for transfer_id, (op, transfer) in list(self._transfers.items()):
            if op == "send" and transfer.done():
                del self._transfers[transfer_id]

    def warm_up(self) -> None:
        """Connect to every peer group, in group order (the same order on every rank)."""
        for group in sorted(self.backends):
            self.backends[group].warm_up()

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self._transfers.clear()


def connect_groups(
    config: TransferConfig,
    kv_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    own_ranks: tuple[int, ...],
    peer_groups: Sequence[tuple[int, ...]],
    is_prefill: bool,
    global_rank: int,
    channel: CommandChannel | None = None,
    store: dist.Store | None = None,
) -> KVTransferAgent:
    """This rank's agent for a group of one role (``own_ranks``, global ranks by TP rank): a
    backend to each group of the other role, keyed by its index in ``peer_groups``, connected now
    (every rank of both groups calls it). ``channel``: the leader's step channel to its peers;
    ``store``: the world's rendezvous store."""
    backends = {}
    for index, ranks in enumerate(peer_groups):
        prefill, decode = (own_ranks, ranks) if is_prefill else (ranks, own_ranks)
        topology = TransferTopology(num_heads, num_kv_heads, prefill, decode, global_rank, store)
        backends[index] = create_backend(config, topology, kv_cache)
    agent = KVTransferAgent(backends, config.max_staging_bytes, channel)
    agent.warm_up()
    return agent
