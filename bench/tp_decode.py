"""Decode step time of one tensor-parallel group, for several TP degrees.

    python -m pdserve.bench.tp_decode --preset qwen2.5-1.5b --out tp.json
    python -m pdserve.bench.tp_decode --preset tiny-llama --device cpu --tp 1,2 --batch-sizes 1,2 \\
        --contexts 16 --iters 2            # CPU smoke run (gloo, no graphs)

For each degree ``t`` a group of ``t`` rank processes starts on GPUs ``0..t-1`` (NCCL, CUDA
graphs captured as in serving). Every rank fills its KV pool with random values. The leader
times ``send plan to the peers + ModelRunner.run(plan)`` for a decode step of B sequences of
context C (as ``bench.decode`` builds it) with CUDA events on its stream, median of
``--iters`` steps after ``--warmup``; the peers replay the same step from the step channel and
meet the leader in every all-reduce, so a step's time includes the slowest rank and the step
channel. The floor is the bandwidth floor of one rank: (its weight bytes + B * C * its KV bytes
per token) / ``H200_BANDWIDTH``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pdserve.bench.common import (
    H200_BANDWIDTH,
    add_step_timing_args,
    bench_parser,
    blocks_for,
    command_line,
    fmt,
    format_table,
    kv_bytes_per_token,
    metadata,
    model_dir,
    parse_ints,
    parse_step_timing_args,
    resolve_device,
    summary,
    time_steps,
    uniform_decode_plan,
    weight_bytes,
    write_json,
)
from pdserve.bench.harness import run_tp_group
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.model_runner import ModelRunner


def time_decode_task(runner: ModelRunner, payload: dict[str, Any]) -> dict[str, Any]:
    """Leader of a TP group: time every (batch, context) decode step; peers follow each step."""
    gen = torch.Generator().manual_seed(payload["seed"])
    w_bytes, kv_token = weight_bytes(runner), kv_bytes_per_token(runner)
    cases = []
    for batch, context in payload["cases"]:
        tokens = torch.randint(0, runner.model_config.vocab_size, (batch,), generator=gen).tolist()
        plan = uniform_decode_plan(runner, tokens, context, gen)
        times = time_steps(partial(runner.step, plan), runner.device, payload["warmup"], payload["iters"])
        stats = summary(times)
        floor_ms = (w_bytes + batch * context * kv_token) / H200_BANDWIDTH * 1e3
        cases.append(
            {
                "batch": batch,
                "context": context,
                **stats,
                "tokens_per_s": batch / stats["median_ms"] * 1e3,
                "floor_ms": floor_ms,
                "floor_fraction": floor_ms / stats["median_ms"],
            }
        )
    return {
        "graphs": runner.graph_runner is not None,
        "rank0_weight_bytes": w_bytes,
        "rank0_kv_bytes_per_token": kv_token,
        "cases": cases,
    }


def engine_config(
    path: Path, dtype: str, device: torch.device, batches: Sequence[int], contexts: Sequence[int], block_size: int
) -> EngineConfig:
    """Pool and graphs sized for the largest case (the device is set per rank by the group)."""
    model_config = ModelConfig.from_pretrained(path)
    max_batch, longest = max(batches), max(contexts)
    return EngineConfig(
        model=str(path),
        dtype=dtype,
        device=device.type,
        max_model_len=min(longest + block_size, model_config.max_position_embeddings),
        cuda_graph_max_batch=max_batch,
        cache=CacheConfig(block_size=block_size, num_blocks=max_batch * blocks_for(longest, block_size)),
        scheduler=SchedulerConfig(max_num_seqs=max_batch),
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = bench_parser("tp_decode", __doc__)
    parser.add_argument("--preset", default="qwen2.5-1.5b", help="model-shape preset with random weights")
    parser.add_argument("--model", help="a Hugging Face model directory (instead of --preset)")
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cuda", "cpu"],
        help="cuda: TP rank r on GPU r (NCCL); cpu: gloo, no graphs",
    )
    parser.add_argument("--dtype", help="compute dtype (default bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--tp", default="1,2", type=parse_ints, help="TP degrees to time")
    parser.add_argument("--batch-sizes", default="1,32", type=parse_ints)
    parser.add_argument("--contexts", default="128,2048", type=parse_ints)
    parser.add_argument("--timeout", default=600.0, type=float, help="seconds one TP group may take")
    add_step_timing_args(parser)
    return parse_step_timing_args(parser, argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cuda" and max(args.tp) > torch.cuda.device_count():
        raise SystemExit(f"--tp {max(args.tp)} needs as many GPUs; {torch.cuda.device_count()} visible")
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    path = model_dir(args.preset, args.model, "bfloat16", device)
    config = engine_config(path, dtype, device, args.batch_sizes, args.contexts, args.block_size)
    payload = {
        "cases": [(b, c) for c in args.contexts for b in args.batch_sizes],
        "seed": args.seed,
        "warmup": args.warmup,
        "iters": args.iters,
    }
    groups: dict[int, dict[str, Any]] = {}
    for tp in tqdm(args.tp, unit="group", desc="pdserve.bench.tp_decode"):
        devices = list(range(tp)) if device.type == "cuda" else None
        groups[tp] = run_tp_group(config, tp, devices, time_decode_task, payload, random_kv=True, timeout=args.timeout)

    headers = ["case"] + [f"tp{tp} {col}" for tp in args.tp for col in ("ms", "tok/s", "% floor")]
    headers += [f"tp{args.tp[0]}/tp{tp}" for tp in args.tp[1:]]
    rows = []
    for i, (batch, context) in enumerate(payload["cases"]):
        row = [f"decode B={batch} C={context}"]
        for tp in args.tp:
            case = groups[tp]["cases"][i]
            row += [fmt(case["median_ms"]), fmt(case["tokens_per_s"], 0), f"{100 * case['floor_fraction']:.0f}%"]
        base = groups[args.tp[0]]["cases"][i]["median_ms"]
        row += [fmt(base / groups[tp]["cases"][i]["median_ms"], 2) for tp in args.tp[1:]]
        rows.append(row)
    print(format_table(headers, rows))

    result = {
        "metadata": metadata(
            device,
            command_line("pdserve.bench.tp_decode", argv),
            preset=None if args.model else args.preset,
            model_dir=str(path),
            dtype=dtype,
            iters=args.iters,
            warmup=args.warmup,
            block_size=args.block_size,
            max_model_len=config.max_model_len,
            bandwidth_bytes_per_s=H200_BANDWIDTH,
        ),
        "groups": {str(tp): groups[tp] for tp in args.tp},
    }
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
