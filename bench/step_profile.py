"""Where one decode step's time goes, kernel by kernel.

    python -m pdserve.bench.step_profile --preset qwen2.5-1.5b --batch 1 --context 128 --out profile.json

Runs decode steps of one (batch, context) case through ``ModelRunner.run`` (the CUDA graph on a
GPU) under ``torch.profiler`` and prints, per kernel name, the calls and the device time per
step, with its share of the step; the JSON holds every row. On a CPU it profiles the CPU ops.

With programmatic dependent launch (``kernels/pdl.py``, on by default on Hopper) a kernel's span
starts before its predecessor ends and includes its wait, so the rows overlap and their sum
exceeds the step: profile with ``PDSERVE_PDL=0`` for per-kernel times, or add
``--critical-path`` for what each kernel adds to the step as it really runs. That charges each
kernel with its own end minus the latest end before it, in stream order (kernels sorted by
start: each launches after its predecessor started), so the charges add up to the step's busy
time. Rows are keyed by the kernel and the one before it, which tells apart the uses of one
kernel (a linear after the norm is qkv, after SiLU-mul it is down).
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve.bench.common import (
    bench_parser,
    fill_kv_random,
    format_table,
    model_dir,
    resolve_device,
    uniform_decode_plan,
    write_json,
)
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.kernels import pdl


def profiled_steps(runner: ModelRunner, batch: int, context: int, steps: int, seed: int) -> profile:
    """The profiler (CPU ops, and the kernels on a GPU) after ``steps`` decode steps of
    ``batch`` sequences of ``context`` tokens (random K/V), following 5 untimed ones."""
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
    return prof


def profile_rows(prof: profile, on_gpu: bool, steps: int) -> tuple[list[dict], float]:
    """Per-kernel rows (name, calls and µs per step, share) and the profiled step time in µs,
    of ``steps`` steps in ``prof`` (:func:`profiled_steps`)."""
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
        {
            "name": name,
            "calls_per_step": calls[name] / steps,
            "us_per_step": total / steps,
            "share": total / steps / step_us if step_us else 0.0,
        }
        for name, total in sorted(totals.items(), key=lambda kv: -kv[1])
    ]
    return rows, step_us


class KernelSpan(NamedTuple):
    """One kernel's run on the device, in µs."""

    name: str
    start: float
    end: float


def critical_path_rows(kernels: Sequence[KernelSpan], steps: int) -> tuple[list[dict], float, float]:
    """(rows, busy µs a step, idle µs a step) of ``steps`` steps' kernels on one stream.

    In start order, kernel i is charged ``max(0, end_i - latest end before it)``; when it starts
    after that end the device idled, and the gap goes to the idle time instead. Rows, by (name,
    the previous kernel's name), hold calls and µs a step, µs a call and the share of the busy
    time; the charges sum to the busy time."""
    charged: dict[tuple[str, str], float] = defaultdict(float)
    spans: dict[tuple[str, str], float] = defaultdict(float)
    calls: dict[tuple[str, str], int] = defaultdict(int)
    idle = 0.0
    latest_end: float | None = None
    previous = ""
    for kernel in sorted(kernels, key=lambda k: k.start):
        key = (kernel.name, previous)
        if latest_end is None or kernel.start >= latest_end:
            idle += 0.0 if latest_end is None else kernel.start - latest_end
            charged[key] += kernel.end - kernel.start
        else:
            charged[key] += max(0.0, kernel.end - latest_end)
        spans[key] += kernel.end - kernel.start
        calls[key] += 1
        latest_end = kernel.end if latest_end is None else max(latest_end, kernel.end)
        previous = kernel.name
    busy = sum(charged.values())
    rows = [
        {
            "name": name,
            "after": after,
            "calls_per_step": calls[name, after] / steps,
            "us_per_step": us / steps,
            "us_per_call": us / calls[name, after],
            "span_us_per_call": spans[name, after] / calls[name, after],
            "share": us / busy if busy else 0.0,
        }
        for (name, after), us in sorted(charged.items(), key=lambda kv: -kv[1])
    ]
    return rows, busy / steps, idle / steps


def trace_events(prof: profile) -> list[dict[str, Any]]:
    """The events of ``prof``'s Chrome trace: CPU ops, annotations and device kernels, in µs."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return json.loads(trace.read_text())["traceEvents"]


def kernel_spans(events: list[dict[str, Any]]) -> list[KernelSpan]:
    """The device kernels among a trace's events (CUPTI's spans, graph replays included)."""
    return [KernelSpan(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("step_profile", __doc__)
    parser.add_argument("--preset", default="qwen2.5-1.5b")
    parser.add_argument("--model", help="a Hugging Face model directory (instead of --preset)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", default=1, type=int)
    parser.add_argument("--context", default=128, type=int)
    parser.add_argument("--steps", default=20, type=int)
    parser.add_argument("--enforce-eager", action="store_true", help="profile the eager step, not the graph")
    parser.add_argument(
        "--critical-path",
        action="store_true",
        help="also charge each kernel with what it adds to the step as it runs (GPU)",
    )
    parser.add_argument("--top", default=25, type=int, help="rows to print")
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if args.critical_path and device.type != "cuda":
        parser.error("--critical-path needs a CUDA device")
    path = model_dir(args.preset, args.model, "bfloat16", device)
    model_config = ModelConfig.from_pretrained(path)
    block_size = 16
    blocks = args.batch * -(-args.context // block_size)
    runner = ModelRunner(
        EngineConfig(
            model=str(path),
            device=str(device),
            max_model_len=args.context + block_size,
            enforce_eager=args.enforce_eager,
            cuda_graph_max_batch=args.batch,
            cache=CacheConfig(block_size=block_size, num_blocks=blocks + 1),
            scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=max(args.batch, args.context)),
        ),
        model_config,
    )
    prof = profiled_steps(runner, args.batch, args.context, args.steps, args.seed)
    runner.close()
    rows, step_us = profile_rows(prof, device.type == "cuda", args.steps)
    path_rows = critical_path_rows(kernel_spans(trace_events(prof)), args.steps) if args.critical_path else None
    if pdl.enabled(device):
        print("note: kernels launch with PDL, so their spans overlap; PDSERVE_PDL=0 gives per-kernel times")
    print(
        f"decode B={args.batch} C={args.context} on {device}: {step_us:.1f} us of "
        f"{'kernels' if device.type == 'cuda' else 'CPU ops'} per step"
    )
    print(
        format_table(
            ["name", "calls/step", "us/step", "share"],
            [
                [r["name"][:70], f"{r['calls_per_step']:.0f}", f"{r['us_per_step']:.1f}", f"{100 * r['share']:.1f}%"]
                for r in rows[: args.top]
            ],
        )
    )
    result = {
        "batch": args.batch,
        "context": args.context,
        "device": str(device),
        "graph": not args.enforce_eager,
        "step_us": step_us,
        "rows": rows,
    }
    if path_rows is not None:
        critical, busy_us, idle_us = path_rows
        print(f"critical path: {busy_us:.1f} us busy per step ({idle_us:.1f} idle between kernels)")
        print(
            format_table(
                ["name", "after", "calls/step", "us/step", "us/call", "share"],
                [
                    [
                        r["name"][:50],
                        r["after"][:30],
                        f"{r['calls_per_step']:.0f}",
                        f"{r['us_per_step']:.1f}",
                        f"{r['us_per_call']:.2f}",
                        f"{100 * r['share']:.1f}%",
                    ]
                    for r in critical[: args.top]
                ],
            )
        )
        result["critical_path"] = {"busy_us": busy_us, "idle_us": idle_us, "rows": critical}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
