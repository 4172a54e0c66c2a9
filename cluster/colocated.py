"""The colocated role: one group serves whole requests, prompt and decode, with no hand-off."""

from __future__ import annotations

from pdserve.cluster.leader import GroupLeader
from pdserve.cluster.protocol import Message, WorkRequest


class ColocatedLeader(GroupLeader):
    role = "colocated"

    def handle(self, message: Message) -> None:
        if isinstance(message, WorkRequest):
            self.add(message)
        else:
            super().handle(message)
