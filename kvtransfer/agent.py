"""One rank's transfers, by id: the same object on a group's leader and on its peers."""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.engine.step_channel import KVCommand
from pdserve.kvtransfer.base import Transfer, TransferBackend, TransferStats


class KVTransferAgent:
    """Routes each command to the backend of its peer group and tracks transfers by id."""

    def __init__(self, backends: Mapping[int, TransferBackend]) -> None:
        self.backends = dict(backends)
        self._transfers: dict[str, tuple[str, Transfer]] = {}

    def execute(self, command: KVCommand) -> Transfer:
        """Issue this rank's part of a transfer (commands arrive in the same order on every rank)."""
        if command.transfer_id in self._transfers:
            raise ValueError(f"transfer {command.transfer_id!r} is already in flight on this rank")
        self._prune()
        backend = self.backends[command.peer_group]
        if command.op == "send":
            transfer = backend.send(command.block_ids)
        elif command.op == "recv":
            transfer = backend.recv(command.block_ids)
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

    def has_staging_room(self, peer_group: int, num_blocks: int, limit: int) -> bool:
        """Whether a transfer of ``num_blocks`` blocks with ``peer_group`` fits under ``limit``
        bytes of buffers in flight. With nothing in flight it always fits, so a request larger
        than the limit still moves (alone)."""
        in_flight = self.staging_bytes()
        needed = num_blocks * self.backends[peer_group].block_bytes()
        return in_flight == 0 or in_flight + needed <= limit

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
