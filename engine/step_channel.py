"""The channel from a TP leader to its peers, and the messages it carries.

Before every forward the leader sends the step's plan to every peer, so that all ranks run the
same forward in the same order; KV transfer commands travel on the same channel, so every rank
issues its part of each transfer in the same order relative to the steps. Messages are msgpack
over ZMQ PUSH/PULL (CPU only, no pickles, no GPU tensors); PUSH queues messages until a peer
connects, so no plan is lost to a slow start.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import msgpack
import numpy as np
import zmq

from pdserve.engine.step_plan import StepPlan


@dataclass
class KVCommand:
    """Send (prefill role) or receive (decode role) one request's KV, in this rank's part."""

    op: str  # "send" | "recv"; "drop" | "connect" a peer group; "discard" a transfer
    transfer_id: str
    block_ids: list[int]
    peer_group: int = 0  # the decode group sent to, or the prefill group received from
    generation: int = 0  # "connect": the peer group's generation (it counts its restarts)
    src_block_ids: list[int] = field(default_factory=list)  # recv from a pulling backend: the prefill blocks


PeerMessage = StepPlan | KVCommand


class PeerTransfers(Protocol):
    """What a peer's step loop needs of the KV transfers of its rank (``kvtransfer.agent``):
    issue a command from the leader, wait for a transfer whose KV a step reads, settle them all."""

    def execute(self, command: KVCommand) -> object: ...

    def wait(self, transfer_id: str) -> object: ...

    def close(self) -> None: ...


class LoopProgress(Protocol):
    """What a peer's step loop tells its rank's watchdog (``cluster.watchdog``): it made progress,
    or it waits for the leader's next message, which may legitimately take any time."""

    def tick(self) -> None: ...

    def idle(self) -> None: ...


_NDARRAY = 1  # msgpack extension code of an integer array: [dtype, shape, raw bytes]


def _pack_array(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "iu":
        return msgpack.ExtType(_NDARRAY, msgpack.packb([obj.dtype.str, list(obj.shape), obj.tobytes()]))
    raise TypeError(f"cannot encode {type(obj).__name__} in a peer message")


def _unpack_array(code: int, data: bytes) -> Any:
    if code != _NDARRAY:
        return msgpack.ExtType(code, data)
    dtype, shape, raw = msgpack.unpackb(data)
    if np.dtype(dtype).kind not in "iu":
        raise ValueError(f"peer message array of dtype {dtype}: only integer arrays are sent")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def encode_message(message: PeerMessage) -> bytes:
    kind = "step" if isinstance(message, StepPlan) else "kv"
    # The fields as they are (dataclasses.asdict would deep-copy every list), block tables as
    # raw bytes.
    fields_ = {f.name: getattr(message, f.name) for f in fields(message)}
    return msgpack.packb({"kind": kind, **fields_}, default=_pack_array)


def decode_message(data: bytes) -> PeerMessage:
    fields_ = msgpack.unpackb(data, ext_hook=_unpack_array)
    kind = fields_.pop("kind")
    return StepPlan(**fields_) if kind == "step" else KVCommand(**fields_)


_SHUTDOWN = b"shutdown"
_LINGER_MS = 5000  # how long a closing leader waits for a peer to take its last messages


def peer_address(base: str, rank: int) -> str:
    """The address TP peer ``rank`` listens on, e.g. ``ipc:///tmp/run/prefill0-tp`` + ``-1``."""
    return f"{base}-{rank}"


class StepSender:
    """Leader side: one PUSH socket per peer, on a ZMQ context of its own: ``shutdown`` ends
    that context, which waits until the peers have their shutdown message. A process that
    exits right after sending it would otherwise take the unsent message down with it, and a
    peer would wait for it forever."""

    def __init__(self, base_address: str, tp_size: int) -> None:
        self._ctx = zmq.Context()
        self._sockets = []
        for rank in range(1, tp_size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, _LINGER_MS)
            sock.connect(peer_address(base_address, rank))
            self._sockets.append(sock)

    def send(self, message: PeerMessage) -> None:
        data = encode_message(message)
        for sock in self._sockets:
            sock.send(data, copy=False)

    def shutdown(self) -> None:
        """Tell every peer to leave its loop; return once they have it (or ``_LINGER_MS`` passed)."""
        for sock in self._sockets:
            sock.send(_SHUTDOWN)
            sock.close()
        self._sockets = []
        self._ctx.term()


class StepReceiver:
    """Peer side: a PULL socket bound at this rank's address."""

    def __init__(self, base_address: str, rank: int) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(peer_address(base_address, rank))

    def receive(self) -> PeerMessage | None:
        """The next message, or None when the leader shuts the group down."""
        data = self._sock.recv()
        return None if data == _SHUTDOWN else decode_message(data)

    def close(self) -> None:
        self._sock.close()
