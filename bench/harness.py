"""One tensor-parallel group in spawned processes, for the tests and the benchmarks.

The group's leader runs a task and its peers follow its steps (``ModelRunner.run_peer``);
the task's result comes back to the caller. ``run_tp_group`` hands the task the leader's
``ModelRunner``; ``generate_tp`` runs ``LLMEngine.generate`` on the leader: the TP oracle.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdserve.bench.common import fill_kv_random
from pdserve.cluster.group import (
    RankProcesses,
    RankSpec,
    connect_store,
    free_port,
    group_specs,
    init_distributed,
    leave_process,
)
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.sampling import SamplingParams

RunnerTask = Callable[[ModelRunner, Any], Any]
_LeaderTask = Callable[[EngineConfig, TensorParallel, Any], Any]


def _runner(config: EngineConfig, tp: TensorParallel, random_kv: bool) -> ModelRunner:
    runner = ModelRunner(config, ModelConfig.from_pretrained(config.model), tp)
    if random_kv:
        fill_kv_random(runner, seed=config.parallel.tp_rank)
    return runner


def _rank_main(spec: RankSpec, lead: _LeaderTask, payload: Any, random_kv: bool, result_path: str) -> None:
    tp = init_distributed(spec)
    try:
        if spec.engine.parallel.is_leader:
            torch.save(lead(spec.engine, tp, payload), result_path)
        else:
            _runner(spec.engine, tp, random_kv).run_peer()
    finally:
        dist.destroy_process_group()
    leave_process()


def _spawn_group(
    engine: EngineConfig,
    tp_size: int,
    devices: Sequence[int] | None,
    lead: _LeaderTask,
    payload: Any,
    random_kv: bool,
    timeout: float,
) -> Any:
    """Run ``lead(leader's config, tp, payload)`` on the leader of a new group; its result."""
    with tempfile.TemporaryDirectory(prefix="pdserve-tp-") as run_dir:
        # The rendezvous store lives here, as the launcher's does: a rank that served it would
        # take it down with the first rank to exit (an abort in a peer still connected).
        address = f"tcp://127.0.0.1:{free_port()}"
        _store = connect_store(address, serve=True)  # served while the ranks run
        specs = group_specs(engine, tp_size, address, devices, f"ipc://{run_dir}/steps")
        result = Path(run_dir) / "result.pt"
        RankProcesses(_rank_main, [(spec, lead, payload, random_kv, str(result)) for spec in specs]).wait(timeout)
        return torch.load(result, weights_only=True)


def _run_task(config: EngineConfig, tp: TensorParallel, payload: tuple[RunnerTask, Any, bool]) -> Any:
    task, task_payload, random_kv = payload
    runner = _runner(config, tp, random_kv)
    try:
        return task(runner, task_payload)
    finally:
        runner.close()  # releases the peers from their step loop, then the graphs


def run_tp_group(
    engine: EngineConfig,
    tp_size: int,
    devices: Sequence[int] | None,
    task: RunnerTask,
    payload: Any,
    random_kv: bool = False,
    timeout: float = 600.0,
) -> Any:
    """Spawn a TP group of ``tp_size`` ranks; return what ``task(leader_runner, payload)`` returned.

    ``task`` must be a module-level function (it is pickled by name into the spawned ranks) and
    must send every step to the peers, e.g. through ``ModelRunner.step``; its result travels
    back through ``torch.save`` (tensors, numbers, strings, lists and dicts of them).
    ``random_kv``: every rank's pool is filled first (``bench.common.fill_kv_random``).
    """
    return _spawn_group(engine, tp_size, devices, _run_task, (task, payload, random_kv), random_kv, timeout)


def _generate(
    config: EngineConfig, tp: TensorParallel, payload: tuple[list[list[int]], list[SamplingParams]]
) -> list[list[int]]:
    engine = LLMEngine(config, tp)
    try:
        return engine.generate(*payload)
    finally:
        engine.close()


def generate_tp(
    engine: EngineConfig,
    tp_size: int,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    devices: Sequence[int] | None = None,
    timeout: float = 600.0,
) -> list[list[int]]:
    """Output token ids per prompt, from a TP group of ``tp_size`` processes (CPU when no devices)."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    payload = ([list(p) for p in prompts], per_prompt)
    return _spawn_group(engine, tp_size, devices, _generate, payload, False, timeout)
