"""CUDA MPS for SM shares: find a running control daemon, or start one of our own and stop it.

Under MPS, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` caps the SMs a client process's kernels may
occupy, which lets a prefill and a decode rank share a GPU without either starving the other.
The variable is read when a process creates its CUDA context, so a rank sets it first thing
(``rank_env``). A daemon that already runs (at ``CUDA_MPS_PIPE_DIRECTORY``, or the default
directory) is used and left running; otherwise the launcher starts one whose pipe and log
directories live in the cluster's run directory, and quits it when the cluster stops.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_CONTROL = "nvidia-cuda-mps-control"
_DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
_QUIT_TIMEOUT_S = 10.0


class MpsError(RuntimeError):
    pass


class MpsDaemon:
    """The MPS control daemon the cluster's ranks connect to."""

    def __init__(self, pipe_dir: str, owned: bool, env: dict[str, str]) -> None:
        self.pipe_dir = pipe_dir
        self.owned = owned  # started by us: ours to quit
        self._env = env

    @classmethod
    def ensure(cls, run_dir: str) -> MpsDaemon:
        """The daemon that runs, or a new one of ours; MpsError when MPS is not available."""
        if shutil.which(_CONTROL) is None:
            raise MpsError(f"SM shares need CUDA MPS, and {_CONTROL} is not on PATH")
        pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", _DEFAULT_PIPE_DIR)
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe_dir}
        if _answers(env):
            logger.info("CUDA MPS: using the control daemon at %s", pipe_dir)
            return cls(pipe_dir, owned=False, env=env)
        pipe_dir, log_dir = str(Path(run_dir) / "mps-pipe"), str(Path(run_dir) / "mps-log")
        os.makedirs(pipe_dir, exist_ok=True)
        os.makedirs(log_dir, exist_ok=True)
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe_dir, "CUDA_MPS_LOG_DIRECTORY": log_dir}
        result = subprocess.run([_CONTROL, "-d"], env=env, capture_output=True, text=True, timeout=30)
        if result.returncode != 0 or not _answers(env):
            why = result.stderr.strip() or f"exit {result.returncode}"
            raise MpsError(
                f"could not start the CUDA MPS control daemon ({_CONTROL} -d: {why}); "
                f"start one yourself (`{_CONTROL} -d`, as a user allowed to) or leave out the SM percentages"
            )
        logger.info("CUDA MPS: started a control daemon at %s (stopped with the cluster)", pipe_dir)
        return cls(pipe_dir, owned=True, env=env)

    def rank_env(self, sm_percent: int | None) -> dict[str, str]:
        """What a rank sets in its environment before CUDA starts: this daemon, and its SM cap."""
        env = {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir}
        if sm_percent is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(sm_percent)
        return env

    def stop(self) -> None:
        """Quit the daemon if it is ours (after every rank has exited)."""
        if not self.owned:
            return
        self.owned = False
        try:
            subprocess.run([_CONTROL], input="quit\n", env=self._env, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            logger.warning("CUDA MPS: the control daemon did not quit: %s", e)
            return
        deadline = time.monotonic() + _QUIT_TIMEOUT_S  # quit returns before the daemon is gone
        while _answers(self._env):
            if time.monotonic() > deadline:
                logger.warning("CUDA MPS: the control daemon at %s still answers after quit", self.pipe_dir)
                return
            time.sleep(0.1)


def _answers(env: dict[str, str]) -> bool:
    """Whether a control daemon answers at ``env``'s pipe directory."""
    try:
        result = subprocess.run(
            [_CONTROL], input="get_server_list\n", env=env, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0
