"""cluster.mps against a stand-in ``nvidia-cuda-mps-control`` on PATH (a script that keeps its
daemon's state as a file in the pipe directory): a running daemon is used and left alone, a
missing one is started in the run directory and quit, and no control program is a clear error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.cluster.mps import MpsDaemon, MpsError

FAKE_CONTROL = """#!/bin/sh
dir="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}"
if [ "$1" = "-d" ]; then mkdir -p "$dir" && touch "$dir/running" && exit 0; fi
read -r command
[ -e "$dir/running" ] || { echo "Cannot find MPS control daemon process"; exit 1; }
[ "$command" = "quit" ] && rm -f "$dir/running"
exit 0
"""


@pytest.fixture
def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text(FAKE_CONTROL)
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "system-mps"))
    return tmp_path


def test_a_missing_daemon_is_started_in_the_run_directory_and_quit(fake_control: Path) -> None:
    run_dir = fake_control / "run"
    daemon = MpsDaemon.ensure(str(run_dir))
    assert daemon.owned and daemon.pipe_dir == str(run_dir / "mps-pipe")
    assert (run_dir / "mps-pipe" / "running").exists()
    assert daemon.rank_env(40) == {
        "CUDA_MPS_PIPE_DIRECTORY": str(run_dir / "mps-pipe"),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
    }
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in daemon.rank_env(None)
    daemon.stop()
    assert not (run_dir / "mps-pipe" / "running").exists()


def test_a_running_daemon_is_used_and_left_running(fake_control: Path) -> None:
    system = fake_control / "system-mps"
    system.mkdir()
    (system / "running").touch()
    daemon = MpsDaemon.ensure(str(fake_control / "run"))
    assert not daemon.owned and daemon.pipe_dir == str(system)
    daemon.stop()
    assert (system / "running").exists()


def test_no_control_program_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control is not on PATH"):
        MpsDaemon.ensure(str(tmp_path))
