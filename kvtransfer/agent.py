"""One rank's transfers, by id: the same object on a group's leader and on its peers."""

from __future__ import annotations

from engine.step_plan import KVCommand
from kvtransfer.base import Transfer, TransferBackend, TransferStats


class KVTransferAgent:
    def __init__(self, backend: TransferBackend) -> None:
        self.backend = backend
        self._transfers: dict[str, Transfer] = {}

    def execute(self, command: KVCommand) -> Transfer:
        """Issue this rank's part of a transfer (commands arrive in the same order on every rank)."""
        if command.transfer_id in self._transfers:
            raise ValueError(f"transfer {command.transfer_id!r} is already in flight on this rank")
        self._prune()
        if command.op == "send":
            transfer = self.backend.send(command.block_ids)
        elif command.op == "recv":
            transfer = self.backend.recv(command.block_ids)
        else:
            raise ValueError(f"unknown KV command {command.op!r}")
        self._transfers[command.transfer_id] = transfer
        return transfer

    def done(self, transfer_id: str) -> bool:
        return self._transfers[transfer_id].done()

    def wait(self, transfer_id: str) -> TransferStats:
        """Block until this rank's part is complete (received KV in the cache); forget it."""
        return self._transfers.pop(transfer_id).wait()

    def _prune(self) -> None:
        """Drop completed sends nobody waits for (peers), releasing their staging buffers."""
        for transfer_id in [t for t, tr in self._transfers.items() if tr.done()]:
            if self.backend.topology.is_prefill:
                del self._transfers[transfer_id]

    def close(self) -> None:
        self.backend.close()
        self._transfers.clear()
