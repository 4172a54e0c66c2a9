"""Removes a cluster's run directory once its launcher is gone, however it ended (kill -9 too).

    python -m pdserve.cluster.reaper RUN_DIR    (stdin: a pipe whose other end the launcher holds)

The launcher's end of the pipe closes when it exits or dies, so the read below returns then.
Its own session, and it ignores the stop signals: a Ctrl-C meant for the launcher, or a stop sent
to every process of the service (systemd's), does not end it first.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys


def spawn(run_dir: str) -> subprocess.Popen[bytes]:
    """Start the reaper of ``run_dir``; keep the returned process's stdin open while the run lasts."""
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.cluster.reaper", run_dir], stdin=subprocess.PIPE, start_new_session=True
    )


def stop(reaper: subprocess.Popen[bytes]) -> None:
    """End the run: the reaper reads the end of its stdin, finds the directory gone (or removes
    it), and exits."""
    if reaper.stdin is not None:
        reaper.stdin.close()
    reaper.wait()


def main() -> None:
    # cluster.group's STOP_SIGNALS, spelled out: importing that module would import torch here.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sys.stdin.buffer.read()
    shutil.rmtree(sys.argv[1], ignore_errors=True)


if __name__ == "__main__":
    main()
