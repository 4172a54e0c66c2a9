"""A group leader's inbox: its ZMQ PULL socket, the datagram socket beside it, and the wait on both.

Other leaders of its node send it datagrams where they can (``cluster.datagrams``); the router,
and leaders on other nodes, use ZMQ. ``receive`` returns whatever waits on either.

Waking a process that sleeps in ``poll()`` costs a KV hand-off as much as the rest of it
together, so a leader that worked a moment ago busy-polls for a while before it sleeps
(``spin_until``): under a steady load it stays awake between requests, as SGLang's scheduler
loop always does; a leader idle for longer sleeps and leaves its core to others.
"""

from __future__ import annotations

import math
import time

import zmq

from pdserve.cluster.datagrams import DatagramInbox


class LeaderInbox:
    """The PULL socket bound at a leader's address and, for an ``ipc://`` address, a datagram
    socket beside it."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.zmq = ctx.socket(zmq.PULL)
        self.zmq.bind(address)
        self.datagrams = DatagramInbox.beside(address)
        self._poller = zmq.Poller()
        self._poller.register(self.zmq, zmq.POLLIN)
        if self.datagrams is not None:
            self._poller.register(self.datagrams.fileno(), zmq.POLLIN)

    def receive(self, timeout_ms: int, spin_until: float = 0.0) -> list[bytes]:
        """Every message waiting. With none, wait up to ``timeout_ms`` for some: busy-polling
        until ``spin_until`` (``time.monotonic()``), then asleep in ``poll()``."""
        deadline = time.monotonic() + timeout_ms / 1e3
        spin_end = min(spin_until, deadline)
        while not (events := self._poller.poll(0)):
            now = time.monotonic()
            if now >= spin_end:
                left_ms = (deadline - now) * 1e3
                if left_ms <= 0 or not (events := self._poller.poll(math.ceil(left_ms))):
                    return []
                break
        return self._read(dict(events))

    def _read(self, events: dict[object, int]) -> list[bytes]:
        messages = []
        if self.zmq in events:
            while True:
                try:
                    messages.append(self.zmq.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
        if self.datagrams is not None and self.datagrams.fileno() in events:
            messages.extend(self.datagrams.drain())
        return messages

    def close(self) -> None:
        self.zmq.close()
        if self.datagrams is not None:
            self.datagrams.close()
