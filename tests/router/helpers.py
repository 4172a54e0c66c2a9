"""The router in one process between plain sockets: stand-in leaders and a client, so every
message it sends is checked."""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

from pdserve.cluster.protocol import Message, decode, encode
from pdserve.router.router import Router


@dataclass
class RouterRig:
    """A router, a client socket, a socket that speaks for the workers, and the leaders' inboxes."""

    router: Router
    client: zmq.Socket
    to_router: zmq.Socket
    inboxes: dict[tuple[str, int], zmq.Socket]

    def pump(self, seconds: float = 0.05) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.router.poll(5)

    def received(self, role: str, group: int) -> list[Message]:
        """What the router sent this leader since the last call."""
        self.pump()
        inbox, out = self.inboxes[(role, group)], []
        while inbox.poll(50):
            out.append(decode(inbox.recv()))
        return out

    def worker(self, message: Message) -> None:
        self.to_router.send(encode(message))
        self.pump()

    def replies(self) -> list[Message]:
        """What the router sent the client since the last call."""
        self.pump()
        out = []
        while self.client.poll(50):
            out.append(decode(self.client.recv()))
        return out

    def close(self) -> None:
        for sock in (self.client, self.to_router, *self.inboxes.values()):
            sock.close(linger=0)
        self.router.close()
