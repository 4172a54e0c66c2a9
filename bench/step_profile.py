"""Where one decode step's time goes, kernel by kernel.

    python -m bench.step_profile --preset qwen2.5-1.5b --batch 1 --context 128 --out profile.json

Runs decode steps of one (batch, context) case through ``ModelRunner.run`` (the CUDA graph on a
GPU) under ``torch.profiler`` and prints, per kernel name, the calls and the device time per
step, with its share of the step; the JSON holds every row. On a CPU it profiles the CPU ops.

With programmatic dependent launch (``kernels/pdl.py``, on by default on Hopper) a kernel's span
starts before its predecessor ends and includes its wait, so the rows overlap and their sum
exceeds the step: profile with ``PDSERVE_PDL=0`` for per-kernel times.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import fill_kv_random, format_table, model_dir, resolve_device, uniform_decode_plan, write_json
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.model_runner import ModelRunner
from kernels import pdl


def profile_rows(runner: ModelRunner, batch: int, context: int, steps: int, seed: int) -> tuple[list[dict], float]:
    """Per-kernel rows (name, calls and µs per step, share) and the profiled step time in µs."""
    gen = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, runner.model_config.vocab_size, (batch,), generator=gen).tolist()
    plan = uniform_decode_plan(runner, token_ids, context, gen)
    fill_kv_random(runner, seed)
    on_gpu = runner.device.type == "cuda"
    for _ in range(5):  # warm-up: Triton compiles, caches settle
        runner.run(plan)
    if on_gpu:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            runner.run(plan)
        if on_gpu:
            torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if on_gpu:  # kernels, those inside a graph replay included (CUPTI traces them)
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            micros = event.time_range.elapsed_us()
        else:  # top-level CPU ops
            if event.cpu_parent is not None:
                continue
            micros = event.cpu_time_total  # inclusive: a linear counts its matmul
        if micros > 0:
            totals[event.name] += micros
            calls[event.name] += 1
    step_us = sum(totals.values()) / steps
    rows = [
        {"name": name, "calls_per_step": calls[name] / steps, "us_per_step": total / steps,
         "share": total / steps / step_us if step_us else 0.0}
        for name, total in sorted(totals.items(), key=lambda kv: -kv[1])
    ]
    return rows, step_us


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen2.5-1.5b")
    parser.add_argument("--model", help="a Hugging Face model directory (instead of --preset)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", default=1, type=int)
    parser.add_argument("--context", default=128, type=int)
    parser.add_argument("--steps", default=20, type=int)
    parser.add_argument("--enforce-eager", action="store_true", help="profile the eager step, not the graph")
    parser.add_argument("--top", default=25, type=int, help="rows to print")
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    path = model_dir(args.preset, args.model, "bfloat16", device)
    model_config = ModelConfig.from_pretrained(path)
    block_size = 16
    blocks = args.batch * -(-args.context // block_size)
    runner = ModelRunner(EngineConfig(
        model=str(path), device=str(device), max_model_len=args.context + block_size, enforce_eager=args.enforce_eager,
        cuda_graph_max_batch=args.batch, cache=CacheConfig(block_size=block_size, num_blocks=blocks + 1),
        scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=max(args.batch, args.context)),
    ), model_config)
    rows, step_us = profile_rows(runner, args.batch, args.context, args.steps, args.seed)
    runner.close()
    if pdl.enabled(device):
        print("note: kernels launch with PDL, so their spans overlap; PDSERVE_PDL=0 gives per-kernel times")
    print(f"decode B={args.batch} C={args.context} on {device}: {step_us:.1f} us of "
          f"{'kernels' if device.type == 'cuda' else 'CPU ops'} per step")
    print(format_table(["name", "calls/step", "us/step", "share"],
                       [[r["name"][:70], f"{r['calls_per_step']:.0f}", f"{r['us_per_step']:.1f}",
                         f"{100 * r['share']:.1f}%"] for r in rows[: args.top]]))
    result = {"batch": args.batch, "context": args.context, "device": str(device), "graph": not args.enforce_eager,
              "step_us": step_us, "rows": rows}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
