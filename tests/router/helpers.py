"""The router in one process between plain sockets: stand-in leaders and a client, so every
message it sends is checked."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import zmq

from pdserve.cluster.config import Addresses, ClusterConfig
from pdserve.cluster.protocol import Message, Ping, Ready, decode, encode
from pdserve.router.router import Router

R = TypeVar("R", bound="RouterRig")


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

    def replies(self, pings: bool = False) -> list[Message]:
        """What the router sent the client since the last call; its pings only if asked for
        (a client drops them)."""
        self.pump()
        out = []
        while self.client.poll(50):
            message = decode(self.client.recv())
            if pings or not isinstance(message, Ping):
                out.append(message)
        return out

    def close(self) -> None:
        for sock in (self.client, self.to_router, *self.inboxes.values()):
            sock.close(linger=0)
        self.router.close()


@contextlib.contextmanager
def router_rig(run_dir: Path, settings: dict[str, object], rig_type: type[R]) -> Iterator[R]:
    """A router over ``settings`` (vocabulary 1000, 256 tokens a request) with an inbox for each
    group of the config, every group ready; its clients connect to ``router.addresses.client``."""
    config = ClusterConfig.from_settings(settings)
    addresses = Addresses(str(run_dir), f"ipc://{run_dir}/client")
    ctx = zmq.Context.instance()
    inboxes = {}
    for role, group, _ in config.groups():
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(addresses.leader(role, group))
        inboxes[(role, group)] = inbox
    router = Router(config, addresses, None, vocab_size=1000, max_model_len=256)
    client = ctx.socket(zmq.DEALER)
    client.connect(addresses.client)
    to_router = ctx.socket(zmq.PUSH)
    to_router.connect(addresses.router)
    rig = rig_type(router, client, to_router, inboxes)
    for role, group, _ in config.groups():
        rig.worker(Ready(role, group, 100))
    try:
        yield rig
    finally:
        rig.close()
