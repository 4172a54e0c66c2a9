"""The per-step plan a TP leader sends to its peers, and the channel that carries it.

Only the leader (TP rank 0) schedules. Before every forward it sends the step's host-side
inputs (token ids, positions, slots, block tables, ...) to every peer, so that all ranks run
the same forward in the same order. The plan is msgpack over ZMQ PUSH/PULL (CPU only, no
pickles, no GPU tensors); PUSH queues messages until a peer connects, so no plan is lost to a
slow start.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import msgpack
import zmq


@dataclass
class StepPlan:
    """Host-side description of one forward; every rank turns it into the same tensors."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    context_lens: list[int]
    cu_seqlens_q: list[int]
    sample_rows: list[int]
    is_decode: bool

    def encode(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> StepPlan:
        return cls(**msgpack.unpackb(data))


_SHUTDOWN = b"shutdown"


def peer_address(base: str, rank: int) -> str:
    """The address TP peer ``rank`` listens on, e.g. ``ipc:///tmp/run/prefill0-tp`` + ``-1``."""
    return f"{base}-{rank}"


class StepSender:
    """Leader side: one PUSH socket per peer."""

    def __init__(self, base_address: str, tp_size: int) -> None:
        self._ctx = zmq.Context.instance()
        self._sockets = []
        for rank in range(1, tp_size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(peer_address(base_address, rank))
            self._sockets.append(sock)

    def send(self, plan: StepPlan) -> None:
        data = plan.encode()
        for sock in self._sockets:
            sock.send(data, copy=False)

    def shutdown(self) -> None:
        """Tell every peer to leave its loop, then close."""
        for sock in self._sockets:
            sock.send(_SHUTDOWN)
            sock.close()
        self._sockets = []


class StepReceiver:
    """Peer side: a PULL socket bound at this rank's address."""

    def __init__(self, base_address: str, rank: int) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(peer_address(base_address, rank))

    def receive(self) -> StepPlan | None:
        """The next plan, or None when the leader shuts the group down."""
        data = self._sock.recv()
        return None if data == _SHUTDOWN else StepPlan.decode(data)

    def close(self) -> None:
        self._sock.close()
