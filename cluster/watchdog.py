"""A rank's watchdog: end the process when its serve loop stops making progress.

Heartbeats come from a thread of their own (``cluster.rank``), so a rank whose loop hangs with
its process running (a collective waiting on a peer that hangs, a kernel that never completes, a
deadlock) still looks alive to the router, and its requests would wait forever. As SGLang's
``--watchdog-timeout``: the loop ticks as it goes round, and says when it waits for work that
may legitimately never come (a TP peer waiting for its leader's next step); a tick older than
the timeout while not waiting means the loop is stuck. The watchdog then writes every thread's
stack to the log, which shows where it hung, and ends the process with ``WATCHDOG_EXIT_CODE``:
the launcher restarts the group and the router moves its requests, as for a rank that dies.

A long step is not told apart from a hung one: the timeout must exceed the longest step (a long
prompt's prefill on a CPU takes tens of seconds).
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# The exit code of a rank its watchdog ended, which the launcher reports in words
# (``cluster.group.exit_words``); 75 is otherwise unused here (sysexits' EX_TEMPFAIL).
WATCHDOG_EXIT_CODE = 75


class Watchdog:
    """Calls ``on_stuck(seconds)`` from a thread of its own once the loop has neither ticked
    nor gone idle for ``timeout`` seconds (by default: log the stacks and end the process).
    An infinite timeout watches nothing."""

    def __init__(
        self,
        timeout: float,
        on_stuck: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"the watchdog timeout must be positive, got {timeout}")
        self.timeout = timeout
        self._on_stuck = on_stuck or _end_process
        self._clock = clock
        self._since: float | None = None  # when the loop last ticked; None while it waits for work
        self._fired = False

    def tick(self) -> None:
        """The loop made progress: its clock starts again."""
        self._since = self._clock()

    def idle(self) -> None:
        """The loop waits for work, which may take any time: nothing is watched until its next tick."""
        self._since = None

    def check(self) -> bool:
        """One look (the thread's, every second or so): whether the loop is stuck, which fires
        ``on_stuck`` once."""
        since = self._since
        if self._fired or since is None:
            return self._fired
        stuck = self._clock() - since
        if stuck <= self.timeout:
            return False
        self._fired = True
        self._on_stuck(stuck)
        return True

    def start(self) -> Watchdog:
        """Watch from a daemon thread; the loop's first tick arms it."""
        if math.isfinite(self.timeout):
            threading.Thread(target=self._watch, name="watchdog", daemon=True).start()
        return self

    def _watch(self) -> None:
        period = min(1.0, self.timeout / 4)
        while not self.check():
            time.sleep(period)


def _end_process(stuck: float) -> None:
    logger.error(
        "watchdog: the serve loop made no progress for %.1f s (--watchdog-timeout); ending this rank. "
        "Every thread's stack follows: the main thread's shows where it hung.",
        stuck,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    # Not sys.exit: the main thread is the one that hangs, and it would never run a cleanup.
    os._exit(WATCHDOG_EXIT_CODE)
