"""The soak benchmark's bookkeeping: which pid a rank has now, and a process tree's memory."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pdserve.bench.soak import rank_pids, rss_mib


def test_rank_pids_are_the_newest_generations() -> None:
    log = (
        "2026-12-04 16:38:00,001 decode0.0 INFO rank up: pid 100, generation 0\n"
        "2026-12-04 16:38:00,002 prefill0.1 INFO rank up: pid 101, generation 0\n"
        "decode group 0 (generation 0) failed: rank 0 exited with code -9\n"
        "2026-12-04 16:38:09,003 decode0.0 INFO rank up: pid 205, generation 1\n"
    )
    assert rank_pids(log) == {"decode0.0": 205, "prefill0.1": 101}


def test_rss_of_a_tree_counts_its_children() -> None:
    """A child holding 64 MiB: the tree's RSS exceeds this process's own by at least that."""
    child = subprocess.Popen([sys.executable, "-c", "import time; x = b'1' * (64 << 20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while (rss := rss_mib(os.getpid()))[1] - rss[0] < 60:
            assert time.monotonic() < deadline, rss
            time.sleep(0.05)
        assert rss[0] > 0
    finally:
        child.kill()
        child.wait()
