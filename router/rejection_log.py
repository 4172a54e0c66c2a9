"""Warnings about rejected client input, rate-limited per class.

Every refused message is worth a line to an operator (who sends what, from where), but a client
that floods the server with bad input must not flood its log too: each class (an error code)
gets a token bucket of ``burst`` lines refilled over ``interval`` seconds. Lines past it are
counted, and the count comes out as "suppressed K similar messages" just before the next line of
that class that is let through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

LINES_PER_INTERVAL = 10
INTERVAL_S = 60.0
MAX_DETAIL_CHARS = 200  # an error message may quote the client's input: never log much of it


@dataclass
class _Bucket:
    tokens: float
    updated: float
    suppressed: int = 0


class RejectionLog:
    """``warning(kind, ...)`` logs at WARNING unless ``kind`` has used up its lines for now."""

    def __init__(
        self,
        logger: logging.Logger,
        burst: int = LINES_PER_INTERVAL,
        interval: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.burst = burst
        self.interval = interval
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}  # by kind: callers pass a fixed set of codes

    def warning(self, kind: str, message: str, *args: object) -> bool:
        """Log ``message % args`` (with the suppressed count first, if any); False if it was
        suppressed."""
        now = self.clock()
        bucket = self._buckets.get(kind)
        if bucket is None:
            bucket = self._buckets[kind] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.updated) * self.burst / self.interval)
        bucket.updated = now
        if bucket.tokens < 1.0:
            bucket.suppressed += 1
            return False
        bucket.tokens -= 1.0
        if bucket.suppressed:
            self.logger.warning("suppressed %d similar messages (%s)", bucket.suppressed, kind)
            bucket.suppressed = 0
        self.logger.warning(message, *args)
        return True


def shorten(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was, on one line: a client's
    newlines and control characters are escaped, or its text could forge log lines."""
    cut = text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
    return cut if cut.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
