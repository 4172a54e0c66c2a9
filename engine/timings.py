"""A request's clock in one engine, and the durations a request reports when it ends.

No torch: the durations travel between processes (``cluster.protocol``), as a msgspec Struct
that the wire codec checks and writes without Python code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec


class RequestTimings(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Seconds a request spent in each phase, the KV bytes it moved and the prompt tokens the
    prefix caches served; None where a value does not apply. An engine measures ``queue``,
    ``prefill``, ``decode`` and ``cached_tokens``; a decode group's leader adds ``transfer``,
    ``transfer_bytes`` and ``decode_cached_tokens`` (its own engine's ``cached_tokens``: the
    prompt tokens whose KV it held, which did not move); the router ``first_token`` and
    ``total``, and widens ``queue`` to the whole wait before prefill."""

    queue: float | None = None
    prefill: float | None = None
    transfer: float | None = None
    transfer_bytes: float | None = None  # a count, kept a float as the wire carries it
    decode: float | None = None
    first_token: float | None = None
    total: float | None = None
    cached_tokens: float | None = None  # a count, as transfer_bytes; None with prefix caching off
    decode_cached_tokens: float | None = None  # likewise, the decode group's cache

    def as_dict(self) -> dict[str, float]:
        """The values that apply, by name: the wire form (``timings`` in docs/protocol.md)."""
        return {name: value for name in self.__struct_fields__ if (value := getattr(self, name)) is not None}


@dataclass
class Milestones:
    """Monotonic timestamps (``time.monotonic``) of a request's milestones in this engine."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    def durations(self) -> RequestTimings:
        """Seconds spent queued, in prefill (to the first token) and decoding (after it)."""
        if self.first_scheduled is None:
            return RequestTimings()
        queue = self.first_scheduled - self.arrival
        if self.first_token is None:
            return RequestTimings(queue=queue)
        prefill = self.first_token - self.first_scheduled
        decode = None if self.finished is None else self.finished - self.first_token
        return RequestTimings(queue=queue, prefill=prefill, decode=decode)
