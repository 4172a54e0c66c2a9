"""The rank watchdog (``cluster.watchdog``): when it fires and when it must not, and that a real
process it ends leaves its stacks and the exit code the launcher reports in words
(``tests/cluster/test_group.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pdserve.cluster.watchdog import WATCHDOG_EXIT_CODE, Watchdog


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watched(timeout: float) -> tuple[Watchdog, FakeClock, list[float]]:
    clock, fired = FakeClock(), []
    return Watchdog(timeout, on_stuck=fired.append, clock=clock), clock, fired


def test_fires_once_when_the_loop_has_not_ticked_for_the_timeout() -> None:
    watchdog, clock, fired = watched(5.0)
    watchdog.tick()
    clock.now += 5.0
    assert not watchdog.check() and fired == []  # at the timeout, not past it
    clock.now += 0.5
    assert watchdog.check() and fired == [5.5]
    clock.now += 60.0
    assert watchdog.check() and fired == [5.5]  # once


def test_each_tick_starts_the_clock_again() -> None:
    watchdog, clock, fired = watched(5.0)
    for _ in range(20):
        watchdog.tick()
        clock.now += 4.0
        assert not watchdog.check()
    assert fired == []


def test_an_idle_loop_is_never_stuck_and_is_watched_again_from_its_next_tick() -> None:
    watchdog, clock, fired = watched(5.0)
    assert not watchdog.check()  # not armed before the first tick (the engine still loading)
    watchdog.tick()
    watchdog.idle()  # a peer waiting for its leader's next step
    clock.now += 3600.0
    assert not watchdog.check() and fired == []
    watchdog.tick()
    clock.now += 6.0
    assert watchdog.check() and fired == [6.0]


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan")])
def test_the_timeout_must_be_positive(timeout: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        Watchdog(timeout)


def test_an_infinite_timeout_watches_nothing() -> None:
    before = {t.name for t in threading.enumerate()}
    Watchdog(float("inf")).start().tick()
    assert "watchdog" not in {t.name for t in threading.enumerate()} - before


LOOP = """
import threading, time
from pdserve.cluster.watchdog import Watchdog

def serve_loop_stuck_here(watchdog):
    threading.Event().wait()  # a collective whose peer never comes

watchdog = Watchdog({timeout}).start()
for _ in range(5):  # working: ticks well inside the timeout
    watchdog.tick()
    time.sleep({timeout} / 5)
{then}
"""


def run_loop(timeout: float, then: str, wait: float) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(LOOP.format(timeout=timeout, then=then))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=wait)


@pytest.mark.slow
def test_a_process_whose_loop_hangs_writes_every_stack_and_exits_with_the_watchdog_code() -> None:
    started = time.monotonic()
    proc = run_loop(1.0, "watchdog.tick()\nserve_loop_stuck_here(watchdog)", wait=60)
    took = time.monotonic() - started
    assert proc.returncode == WATCHDOG_EXIT_CODE, proc.stderr
    assert "made no progress" in proc.stderr
    assert "serve_loop_stuck_here" in proc.stderr  # the main thread's stack: where it hung
    assert 'File "<string>"' in proc.stderr
    assert took < 30, took


@pytest.mark.slow
def test_a_process_whose_loop_waits_idle_is_left_alone() -> None:
    # Idle for four timeouts, then a clean exit: the watchdog must not end it.
    proc = run_loop(0.5, "watchdog.idle()\ntime.sleep(2.0)\nprint('done')", wait=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"
