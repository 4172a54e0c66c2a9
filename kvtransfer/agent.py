"""One rank's KV transfers, by id: the owner of the KV hand-off on every rank of a group.

A group's leader calls ``send`` (prefill) or ``recv`` (decode): the command goes to its TP peers
on the step channel, so that each issues its part in the same order relative to the steps, and
the leader issues its own part. A peer's step loop (``ModelRunner.run_peer``) hands each command
it receives to ``execute``.

When a peer group dies the leader ``drop``s it (its transfers fail, its backend is abandoned, on
every rank) and, once the group is restarted, ``reconnect``s to its new generation: a new
backend from the agent's ``connect`` factory, whose pair group forms in the background.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from pdserve.engine.step_channel import KVCommand
from pdserve.kvtransfer.base import (
    PairRendezvous,
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
        connect: Callable[[int, int], TransferBackend] | None = None,
    ) -> None:
        self.backends = dict(backends)
        self.max_staging_bytes = max_staging_bytes
        self._channel = channel  # the leader's, when its group has peers
        self._connect = connect  # (peer group, its generation) -> a backend to it
        self._transfers: dict[str, tuple[str, Transfer, int]] = {}

    def send(self, transfer_id: str, block_ids: list[int], peer_group: int) -> Transfer:
        """Prefill leader: every rank of the group sends its part of the KV in ``block_ids`` to
        decode group ``peer_group``; the handle is this rank's part."""
        transfer = self._issue(KVCommand("send", transfer_id, block_ids, peer_group))
        assert transfer is not None
        return transfer

    def recv(
        self, transfer_id: str, block_ids: list[int], peer_group: int, src_block_ids: list[int] | None = None
    ) -> Transfer:
        """Decode leader: every rank of the group receives its part of the KV from prefill group
        ``peer_group`` into ``block_ids`` (``src_block_ids``: where it lies in the prefill pool,
        which a pulling backend needs); ``done``/``wait`` by id settle this rank's part."""
        command = KVCommand("recv", transfer_id, block_ids, peer_group, src_block_ids=list(src_block_ids or []))
        transfer = self._issue(command)
        assert transfer is not None
        return transfer

    def pulls(self, peer_group: int) -> bool:
        """Whether the transfers with ``peer_group`` are pulled by the decode side: its receive
        completes the transfer, and the prefill side keeps its blocks until told so."""
        backend = self.backends.get(peer_group)
        return backend is not None and backend.pulls

    def drop(self, peer_group: int) -> None:
        """Leader: ``peer_group`` died; on every rank its transfers fail and its backend goes."""
        self._issue(KVCommand("drop", "", [], peer_group))

    def reconnect(self, peer_group: int, generation: int) -> None:
        """Leader: ``peer_group`` restarted as ``generation``; every rank forms a new pair group
        with it (in the background: ``connected`` says when it is up)."""
        self._issue(KVCommand("connect", "", [], peer_group, generation=generation))

    def discard(self, transfer_id: str) -> None:
        """Leader: give a transfer up on every rank (its lease expired, it failed, or its request
        was aborted): a receive never writes into the cache, so its blocks may be reused at once."""
        self._issue(KVCommand("discard", transfer_id, []))

    def connected(self, peer_group: int) -> bool:
        backend = self.backends.get(peer_group)
        return backend is not None and backend.connected()

    def forming(self) -> list[int]:
        """The peer groups whose pair cannot move KV yet (it forms in the background)."""
        return [group for group, backend in sorted(self.backends.items()) if not backend.connected()]

    def _issue(self, command: KVCommand) -> Transfer | None:
        if self._channel is not None:
            self._channel.send(command)
        return self.execute(command)

    def execute(self, command: KVCommand) -> Transfer | None:
        """Issue this rank's part of a command (commands arrive in the same order on every rank)."""
        if command.op in ("drop", "connect", "discard"):
            self._manage(command)
            return None
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
        self._transfers[command.transfer_id] = (command.op, transfer, command.peer_group)
        return transfer

    def _manage(self, command: KVCommand) -> None:
        if command.op == "discard":
            entry = self._transfers.pop(command.transfer_id, None)
            if entry is not None:
                entry[1].discard()
            return
        backend = self.backends.pop(command.peer_group, None)
        if backend is not None:
            backend.abandon()
        for transfer_id in [t for t, (_, _, group) in self._transfers.items() if group == command.peer_group]:
            del self._transfers[transfer_id]
        if command.op == "connect":
            if self._connect is None:
                raise ValueError("this agent cannot reconnect: it has no connect factory")
            self.backends[command.peer_group] = self._connect(command.peer_group, command.generation)

    def done(self, transfer_id: str) -> bool:
        """Whether this rank's part has completed or failed (``wait`` then raises)."""
        return self._transfers[transfer_id][1].done()

    def wait(self, transfer_id: str) -> TransferStats:
        """Block until this rank's part is complete (received KV in the cache); forget it.
        Raises ``TransferFailed`` for a transfer cut off by its peer's death."""
        return self._transfers.pop(transfer_id)[1].wait()

    def staging_bytes(self) -> int:
        """Bytes of KV buffers held for this rank's transfers in flight, sends and receives."""
        return sum(b.staging_bytes for b in self.backends.values())

    def has_staging_room(
        self, peer_group: int, num_blocks: int, keep: tuple[int, int] | None = None, promised: int = 0
    ) -> bool:
        """Whether a transfer of ``num_blocks`` blocks with ``peer_group`` fits under
        ``max_staging_bytes`` of buffers in flight. With nothing in flight it always fits, so a
        request larger than the bound still moves (alone). ``keep``: the (peer group, blocks) of
        a transfer waiting ahead of this one, whose room it must leave. ``promised``: bytes of
        transfers agreed on but not yet issued (announces awaiting their reply), in flight
        already. False while the pair is not connected."""
        if not self.connected(peer_group):
            return False
        needed = self.staging_need(peer_group, num_blocks)
        kept = 0 if keep is None else self.staging_need(*keep)
        in_flight = self.staging_bytes() + promised
        return needed == 0 or (in_flight == 0 and kept == 0) or in_flight + needed + kept <= self.max_staging_bytes

    def staging_need(self, peer_group: int, num_blocks: int) -> int:
        """Bytes of buffers a transfer of ``num_blocks`` blocks with ``peer_group`` holds on this
        rank while in flight."""
        backend = self.backends.get(peer_group)
        if backend is None or backend.pulls:  # pool to pool: nothing is staged
            return 0
        return num_blocks * backend.staged_block_bytes()

    def _prune(self) -> None:
        """Forget completed sends nobody waits for (peers), releasing their staging buffers."""
        for transfer_id, (op, transfer, _) in list(self._transfers.items()):
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
    own_size: int,
    peer_size: Callable[[int], int],
    is_prefill: bool,
    tp_rank: int,
    rendezvous: Callable[[int, int], PairRendezvous],
    generations: Sequence[int],
    channel: CommandChannel | None = None,
) -> KVTransferAgent:
    """This rank's agent for a group of one role (``own_size`` ranks, this one ``tp_rank``): a
    backend to each group of the other role (``peer_size(group)`` ranks each, keyed by index), over a
    process group of that pair alone, met at ``rendezvous(peer group, its generation)``.
    Each pair forms in the background; every rank of both groups takes part. ``channel``: the
    leader's step channel to its peers."""

    def backend(peer_group: int, generation: int) -> TransferBackend:
        peer = peer_size(peer_group)
        prefill, decode = (own_size, peer) if is_prefill else (peer, own_size)
        me = tp_rank if is_prefill else prefill + tp_rank
        topology = TransferTopology(
            num_heads,
            num_kv_heads,
            tuple(range(prefill)),
            tuple(range(prefill, prefill + decode)),
            me,
            rendezvous(peer_group, generation),
        )
        return create_backend(config, topology, kv_cache)

    backends = {group: backend(group, generation) for group, generation in enumerate(generations)}
    return KVTransferAgent(backends, config.max_staging_bytes, channel, backend)
