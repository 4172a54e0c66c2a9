"""A side channel for the messages between two group leaders of one node: Unix datagrams.

A ZMQ message over ``ipc://`` passes through an I/O thread on each side, and after an idle pause
each of those threads, then the receiver, must wake up in turn; a KV announce's hand-off waits
for all three. A Unix datagram socket wakes the receiver alone. So a leader also binds one
beside its ZMQ inbox, and another leader of its node sends its messages there, falling back to
ZMQ (which queues until the peer is up) whenever a datagram cannot go: no such socket yet (TCP
peers, a peer not started or gone), its queue full, or a message over ``MAX_DATAGRAM_BYTES``.

Messages to one peer may then arrive out of order across the two channels, so only the KV
announces go this way: the decode leader takes them in whatever order they come, and its replies
go over ZMQ, in order. That order matters: a push backend's receives are posted in the order the
replies were sent, and the prefill side issues the matching sends in the order it reads them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# Well under a Unix datagram socket's default limit (net.core.wmem_default, 208 KiB), and room
# for the announce of a 16k-token prompt.
MAX_DATAGRAM_BYTES = 64 * 1024


def datagram_path(endpoint: str) -> str | None:
    """Where the leader whose ZMQ inbox is ``endpoint`` takes datagrams: beside its ``ipc://``
    socket; None for a TCP endpoint (another node)."""
    return endpoint.removeprefix("ipc://") + ".dgram" if endpoint.startswith("ipc://") else None


class DatagramInbox:
    """A non-blocking datagram socket bound beside a ZMQ ``ipc://`` inbox."""

    def __init__(self, path: str) -> None:
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a dead predecessor's (a restarted group binds the same path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(path)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)

    @classmethod
    def beside(cls, endpoint: str) -> DatagramInbox | None:
        """The inbox beside ``endpoint``'s; None where there is none (TCP, or a path too long
        for a Unix socket): the peers then find no socket and use ZMQ."""
        path = datagram_path(endpoint)
        if path is None:
            return None
        try:
            return cls(path)
        except OSError as e:
            logger.warning("no datagram inbox at %s (%s): peers will use ZMQ alone", path, e)
            return None

    def fileno(self) -> int:
        return self._sock.fileno()

    def drain(self) -> Iterator[bytes]:
        """Every datagram waiting, in order of arrival."""
        while True:
            try:
                yield self._sock.recv(MAX_DATAGRAM_BYTES)
            except BlockingIOError:
                return

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class DatagramOutbox:
    """Sends datagrams to the inboxes of a node's leaders; one socket for every peer."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def send(self, endpoint: str, data: bytes) -> bool:
        """Send ``data`` to the datagram inbox beside ``endpoint``'s; False where it could not
        go (the caller sends it over ZMQ instead)."""
        path = datagram_path(endpoint)
        if path is None or len(data) > MAX_DATAGRAM_BYTES:
            return False
        try:
            self._sock.sendto(data, path)
        except OSError:  # no such socket, nobody reading it, its queue full
            return False
        return True

    def close(self) -> None:
        self._sock.close()
