"""Offline generation with one tensor-parallel group: the TP oracle for tests and benchmarks.

``generate_tp`` spawns ``tp`` rank processes; the leader runs the engine over the prompts and
writes the output token ids as JSON, the peers follow its steps.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from pdserve.cluster.group import RankProcesses, RankSpec, free_port, group_specs, init_distributed
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling import SamplingParams


def _rank_main(spec: RankSpec, prompts: list[list[int]], params: list[dict], result_path: str) -> None:
    tp = init_distributed(spec)
    try:
        if spec.engine.parallel.is_leader:
            engine = LLMEngine(spec.engine, tp)
            try:
                outputs = engine.generate(prompts, [SamplingParams(**p) for p in params])
            finally:
                engine.close()
            Path(result_path).write_text(json.dumps(outputs))
        else:
            ModelRunner(spec.engine, ModelConfig.from_pretrained(spec.engine.model), tp).run_peer()
    finally:
        dist.destroy_process_group()


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
    with tempfile.TemporaryDirectory(prefix="pdserve-tp-") as run_dir:
        specs = group_specs(
            engine, tp_size, first_rank=0, world_size=tp_size, init_method=f"tcp://127.0.0.1:{free_port()}",
            tp_groups=(tuple(range(tp_size)),), devices=devices, step_address=f"ipc://{run_dir}/steps",
        )
        result = Path(run_dir) / "outputs.json"
        payload = ([list(p) for p in prompts], [_params_dict(p) for p in per_prompt], str(result))
        RankProcesses(_rank_main, [(spec, *payload) for spec in specs]).wait(timeout)
        return json.loads(result.read_text())


def _params_dict(params: SamplingParams) -> dict:
    out = asdict(params)
    out["stop_token_ids"] = list(params.stop_token_ids)
    return out
