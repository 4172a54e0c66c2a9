"""bench.frontend: the router and the client library against its stand-in leader, every token
counted (tests/router/test_streaming.py uses the same stand-in to test the router itself)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.bench.frontend import main


def test_frontend_benchmark_counts_every_token() -> None:
    result = main(["--streams", "3", "--output-len", "20", "--step-ms", "0,1"])
    assert [(r["streams"], r["step_ms"], r["batch_chunks"]) for r in result["rows"]] == [
        (3, 0.0, False),
        (3, 0.0, True),
        (3, 1.0, False),
        (3, 1.0, True),
    ]
    for row in result["rows"]:
        assert row["delivered_tok_s"] == pytest.approx(3 * 20 / row["wall_s"])
        assert row["itl_p50_ms"] <= row["itl_p99_ms"]
    assert [r["emitted_tok_s"] for r in result["rows"]] == [None, None, pytest.approx(3000), pytest.approx(3000)]


_HOLD_A_STAND_IN = """
import multiprocessing
import time
from pdserve.bench.frontend import stand_in_cluster
with stand_in_cluster(output_len=2, step_ms=0.0) as setup:
    print(setup.run_dir, *(p.pid for p in multiprocessing.active_children()), flush=True)
    time.sleep(600)
"""


def test_a_killed_benchmark_leaves_no_run_directory() -> None:
    """kill -9 skips the benchmark's own clean-up: its processes die with it, and its reaper
    removes the run directory."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_A_STAND_IN], stdout=subprocess.PIPE, text=True)
    try:
        run_dir, *children = proc.stdout.readline().split()
        assert os.path.isdir(run_dir) and len(children) >= 2
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while os.path.exists(run_dir) or any(os.path.exists(f"/proc/{pid}") for pid in children):
        assert time.monotonic() < deadline, f"{run_dir} or one of {children} is still there"
        time.sleep(0.1)
