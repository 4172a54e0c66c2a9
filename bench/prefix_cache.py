"""Prefill time of a prompt whose leading tokens are in the prefix cache, against the same prompt
uncached, in one run.

    python -m pdserve.bench.prefix_cache --preset qwen2.5-1.5b --prompt-len 2048 --cached-len 1920 \\
        --out prefix_cache.json

Each repetition draws a fresh shared prefix of ``--cached-len`` random tokens and two suffixes.
The first request (prefix + suffix A) runs uncached and leaves its full blocks in the cache; the
second (prefix + suffix B) finds them there. Each request is timed on the wall clock from
``add_request`` to its first token (``max_tokens=1``): scheduling, the prefill forward and
sampling, everything a request's time to first token pays inside the engine. The cached
request's first token is checked against an engine with the cache off (same weights), so the
speed-up is of the same answer.

With ``--profile``, one more cached request runs under ``torch.profiler`` after the timed ones,
and the report says where its time went: on a GPU, the host's time before the first kernel, the
device's busy time (the union of its kernels), the gaps between kernels, and the host's time
after the last one (sync, read-back, output), with the top kernels; on any device, the top CPU
ops by their own time. Where a prefill graph ran the cached request, its graph is then replayed
alone, without the profiler (whose tracing widens the gaps between a graph's kernels): the
device time of one replay, and the host's time to launch it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pdserve.bench.common import (
    bench_parser,
    command_line,
    fmt,
    format_table,
    metadata,
    model_dir,
    resolve_device,
    write_json,
)
from pdserve.bench.step_profile import KernelSpan, critical_path_rows, kernel_spans, trace_events
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.step_plan import StepPlan

_PROFILED = "cached request"  # the profiler annotation around the profiled request
_TOP = 12  # rows of each top list
_REPLAYS = 50  # replays of the cached request's graph, timed without the profiler

_FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def time_to_first_token(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Milliseconds from submission to the first token, and that token."""
    device = engine.runner.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, _FIRST_TOKEN)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3, tokens[0]


def time_breakdown(request: tuple[float, float], kernels: Sequence[KernelSpan]) -> dict[str, Any]:
    """Where a request's span ``(start, end)`` went, given the device kernels that ran in it (one
    clock, µs): host time before the first kernel, the union of the kernels (device busy), the
    gaps between them (device idle), host time after the last one; the four add up to the span.
    Without kernels (a CPU run) only the wall time is known."""
    start, end = request
    inside = [k for k in kernels if start <= k.start and k.end <= end]
    result: dict[str, Any] = {"wall_ms": (end - start) / 1e3, "kernels": []}
    if not inside:
        return {**result, "host_before_ms": None, "device_busy_ms": None, "device_gaps_ms": None, "host_after_ms": None}
    _, busy, gaps = critical_path_rows(inside, steps=1)
    per_kernel: dict[str, list[float]] = {}
    for k in inside:
        per_kernel.setdefault(k.name, []).append(k.end - k.start)
    top = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:_TOP]
    return {
        **result,
        "host_before_ms": (min(k.start for k in inside) - start) / 1e3,
        "device_busy_ms": busy / 1e3,
        "device_gaps_ms": gaps / 1e3,
        "host_after_ms": (end - max(k.end for k in inside)) / 1e3,
        "kernels": [{"name": name, "calls": len(d), "ms": sum(d) / 1e3} for name, d in top],
    }


def profile_cached_request(
    engine: LLMEngine, prefix: list[int], suffixes: tuple[list[int], list[int]]
) -> dict[str, Any]:
    """One more pair: the first request untimed, the second, cached, under the profiler."""
    time_to_first_token(engine, "profile-cold", prefix + suffixes[0])
    on_gpu = engine.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof, record_function(_PROFILED):
        time_to_first_token(engine, "profile-warm", prefix + suffixes[1])
    events = trace_events(prof)
    span = next(e for e in events if e.get("name") == _PROFILED and e.get("cat") == "user_annotation")
    result = time_breakdown((span["ts"], span["ts"] + span["dur"]), kernel_spans(events))
    ops = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:_TOP]
    result["cpu_ops"] = [{"name": a.key, "calls": a.count, "self_ms": a.self_cpu_time_total / 1e3} for a in ops]
    result["graph_replay"] = graph_replay(engine, len(suffixes[1])) if on_gpu else None
    return result


def graph_replay(engine: LLMEngine, num_tokens: int) -> dict[str, Any] | None:
    """The prefill graph that runs a step of ``num_tokens`` tokens of one prompt, replayed
    ``_REPLAYS`` times back to back on its static inputs as the last such step left them (the
    same work again, the same values into the same KV slots): the device's ms a replay (CUDA
    events) and the host's ms to launch one. None where no prefill graph holds that step."""
    graphs = engine.runner.prefill_graph_runner
    step = StepPlan(
        [0] * num_tokens, [], [], np.zeros((1, 1), dtype=np.int32), [num_tokens], [0, num_tokens], [0], False
    )
    if graphs is None or not graphs.can_run(step):
        return None
    bucket = graphs.bucket_for(step)
    graph = graphs.graphs[bucket]
    graph.replay()  # warm
    torch.cuda.synchronize(engine.runner.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    launches = []
    start.record()
    for _ in range(_REPLAYS):
        began = time.perf_counter()
        graph.replay()
        launches.append((time.perf_counter() - began) * 1e3)
    end.record()
    end.synchronize()
    return {
        "bucket": list(bucket),
        "device_ms": start.elapsed_time(end) / _REPLAYS,
        "launch_ms": statistics.median(launches),
    }


def print_profile(result: dict[str, Any]) -> None:
    phases = ["host_before_ms", "device_busy_ms", "device_gaps_ms", "host_after_ms", "wall_ms"]
    print(format_table(["phase", "ms"], [[p.removesuffix("_ms"), fmt(result[p])] for p in phases]))
    replay = result.get("graph_replay")
    if replay is not None:
        print(
            f"its graph {tuple(replay['bucket'])} replayed alone, unprofiled: "
            f"{fmt(replay['device_ms'])} ms on the device, {fmt(replay['launch_ms'])} ms to launch"
        )
    if result["kernels"]:
        print(
            format_table(
                ["kernel", "calls", "ms"], [[k["name"][:60], str(k["calls"]), fmt(k["ms"])] for k in result["kernels"]]
            )
        )
    print(
        format_table(
            ["CPU op", "calls", "self ms"],
            [[o["name"][:60], str(o["calls"]), fmt(o["self_ms"])] for o in result["cpu_ops"]],
        )
    )


def run(
    config: EngineConfig, prompt_len: int, cached_len: int, reps: int, warmup: int, seed: int, profiled: bool = False
) -> dict[str, Any]:
    cached = LLMEngine(config)
    uncached = LLMEngine(replace(config, cache=replace(config.cache, enable_prefix_caching=False)))
    gen = torch.Generator().manual_seed(seed)
    vocab = cached.model_config.vocab_size

    def draw(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    rows = []
    for rep in range(warmup + reps):
        prefix = draw(cached_len)
        first, second = prefix + draw(prompt_len - cached_len), prefix + draw(prompt_len - cached_len)
        cold_ms, _ = time_to_first_token(cached, f"cold-{rep}", first)
        hits_before = cached.stats().prefix_cache.hit_tokens
        warm_ms, warm_token = time_to_first_token(cached, f"warm-{rep}", second)
        hit = cached.stats().prefix_cache.hit_tokens - hits_before
        _, reference_token = time_to_first_token(uncached, f"ref-{rep}", second)
        if rep >= warmup:
            rows.append(
                {
                    "uncached_ms": cold_ms,
                    "cached_ms": warm_ms,
                    "cached_tokens": hit,
                    "same_first_token": warm_token == reference_token,
                }
            )
    uncached_ms = statistics.median(r["uncached_ms"] for r in rows)
    cached_ms = statistics.median(r["cached_ms"] for r in rows)
    extra = {}
    if profiled:
        suffixes = (draw(prompt_len - cached_len), draw(prompt_len - cached_len))
        extra["profile"] = profile_cached_request(cached, draw(cached_len), suffixes)
    for engine in (cached, uncached):
        engine.close()
    return {
        **extra,
        "prompt_len": prompt_len,
        "cached_len": cached_len,
        "uncached_ms": uncached_ms,
        "cached_ms": cached_ms,
        "speedup": uncached_ms / cached_ms,
        "cached_tokens": statistics.median(r["cached_tokens"] for r in rows),
        "same_first_token": sum(r["same_first_token"] for r in rows),
        "reps": rows,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("prefix_cache", __doc__)
    parser.add_argument("--preset", default="qwen2.5-1.5b", help="model-shape preset with random weights")
    parser.add_argument("--model", help="a Hugging Face model directory (instead of --preset)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--cached-len", type=int, default=1920, help="leading tokens shared with the first request")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overlap", choices=("on", "off"), default="on", help="overlapped engine steps")
    parser.add_argument("--profile", action="store_true", help="also say where one cached request's time goes")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not 0 < args.cached_len < args.prompt_len:
        parser.error("--cached-len must be between 0 and --prompt-len")
    device = resolve_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    path = model_dir(args.preset, args.model, dtype, device)
    config = EngineConfig(
        model=str(path),
        dtype=dtype,
        device=str(device),
        max_model_len=args.prompt_len + 16,
        overlap_scheduling=args.overlap == "on",
        cache=CacheConfig(num_blocks=4 * (args.prompt_len // 16 + 2) * (args.reps + args.warmup)),
    )
    result = run(config, args.prompt_len, args.cached_len, args.reps, args.warmup, args.seed, args.profile)
    print(
        format_table(
            ["prompt", "cached", "uncached ms", "cached ms", "speed-up", "hit tokens", "same first token"],
            [
                [
                    str(result["prompt_len"]),
                    str(result["cached_len"]),
                    fmt(result["uncached_ms"]),
                    fmt(result["cached_ms"]),
                    f"{result['speedup']:.2f}x",
                    f"{result['cached_tokens']:.0f}",
                    f"{result['same_first_token']}/{len(result['reps'])}",
                ]
            ],
        )
    )
    if "profile" in result:
        print_profile(result["profile"])
    document = {"metadata": metadata(device, command_line("pdserve.bench.prefix_cache", argv)), "result": result}
    write_json(document, args.out)
    return document


if __name__ == "__main__":
    main()
