"""How much of a decode step the engine's host side costs: ``LLMEngine.step`` against its forward,
with overlapped steps and without.

    python -m pdserve.bench.engine_step --preset qwen2.5-1.5b --batch-sizes 1,64,128 --out engine_step.json

For each batch size, B greedy requests of ``--context`` random prompt tokens are prefilled, then
``--iters`` decode steps of ``LLMEngine.step`` are timed on the wall clock: scheduling, the step
plan, the input copies, the forward (a graph replay on a GPU), the wait for the sampled tokens,
stop checks and outputs, everything a serving loop pays per token except its messaging. The
forward alone is timed as ``bench.decode`` times it, on a decode step of the same batch at the
contexts the timed steps reached (CUDA events around back-to-back calls, so the host's launch work
overlaps the GPU's). ``host`` is the difference: what the host adds to every step. Without
overlap (``--overlap off``) the inter-token latency pays the host's work in full, because the
engine reads each step's tokens back before it plans the next; with overlap (``on``) the host
plans and launches a step while the GPU runs the one before, and only what does not fit under
the GPU's time shows. ``both`` (the default) runs each batch size both ways, one engine each, in
the same run. On a CPU the forward runs eagerly and the same split holds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from pdserve.bench.common import (
    ON_OFF_BOTH,
    add_step_timing_args,
    bench_parser,
    blocks_for,
    command_line,
    fmt,
    format_table,
    metadata,
    model_dir,
    parse_ints,
    parse_step_timing_args,
    resolve_device,
    summary,
    time_steps,
    uniform_decode_plan,
    write_json,
)
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams


def measure(engine: LLMEngine, batch: int, context: int, warmup: int, iters: int, seed: int) -> dict[str, Any]:
    """Step wall times and forward times (ms) of ``batch`` sequences decoding from ``context``."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    # Long enough that no request ends before the timed steps do: the sequences prefilled first
    # decode while the others prefill.
    params = SamplingParams(max_tokens=engine.max_model_len - context, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, torch.randint(0, vocab, (context,), generator=gen).tolist(), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.requests.values()):
        engine.step()
    for _ in range(warmup):
        engine.step()
    wall = []
    for _ in range(iters):
        start = time.perf_counter()
        engine.step()
        wall.append((time.perf_counter() - start) * 1e3)
    # The forward of the same batch at the contexts the timed steps reached (their mean), in
    # fresh blocks of the pool (the requests still hold theirs).
    assert engine.stats().running == batch, "a request ended before the timed steps did"
    reached = round(statistics.mean(seq.num_tokens for seq in engine.requests.values()))
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():  # an overlapped engine still holds the last step launched
        engine.step()
    runner = engine.runner
    plan = uniform_decode_plan(runner, torch.randint(0, vocab, (batch,), generator=gen).tolist(), reached, gen)
    forward = time_steps(partial(runner.run, plan), runner.device, warmup, iters)
    step_ms, forward_ms = statistics.median(wall), statistics.median(forward)
    return {
        "batch": batch,
        "context": context,
        "overlap": engine.overlap,
        "step": summary(wall),
        "forward": summary(forward),
        "host_ms": step_ms - forward_ms,
        "forward_share": forward_ms / step_ms,
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    return format_table(
        ["batch", "context", "overlap", "step ms", "forward ms", "host ms", "forward share"],
        [
            [
                str(r["batch"]),
                str(r["context"]),
                "on" if r["overlap"] else "off",
                fmt(r["step"]["median_ms"]),
                fmt(r["forward"]["median_ms"]),
                fmt(r["host_ms"]),
                f"{100 * r['forward_share']:.0f}%",
            ]
            for r in rows
        ],
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("engine_step", __doc__)
    parser.add_argument("--preset", default="qwen2.5-1.5b", help="model-shape preset with random weights")
    parser.add_argument("--model", help="a Hugging Face model directory (instead of --preset)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--batch-sizes", default="1,8,32,64,128", type=parse_ints)
    parser.add_argument("--context", default=128, type=int, help="prompt tokens of every request")
    parser.add_argument(
        "--overlap",
        default="both",
        choices=sorted(ON_OFF_BOTH),
        help="overlapped steps (EngineConfig.overlap_scheduling), or both in turn",
    )
    add_step_timing_args(parser)
    args = parse_step_timing_args(parser, argv)
    device = resolve_device(args.device)
    path = model_dir(args.preset, args.model, "bfloat16", device)
    max_batch = max(args.batch_sizes)
    step_tokens = max(max_batch, 2048)
    # The largest batch's prompts take this many steps, the first ones decoding meanwhile.
    prefill_steps = -(-max_batch * args.context // step_tokens)
    max_model_len = args.context + prefill_steps + args.warmup + args.iters + 2 * args.block_size
    # Room for the requests and, beside them, the forward's copy of the batch.
    num_blocks = 2 * max_batch * blocks_for(max_model_len, args.block_size)
    rows = []
    for overlap in ON_OFF_BOTH[args.overlap]:
        engine = LLMEngine(
            EngineConfig(
                model=str(path),
                device=str(device),
                max_model_len=max_model_len,
                cuda_graph_max_batch=max_batch,
                overlap_scheduling=overlap,
                cache=CacheConfig(block_size=args.block_size, num_blocks=num_blocks),
                scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=step_tokens),
            )
        )
        try:
            rows += [measure(engine, b, args.context, args.warmup, args.iters, args.seed) for b in args.batch_sizes]
        finally:
            engine.close()
        del engine  # its weights and KV pool go before the next engine sizes itself
    rows.sort(key=lambda r: (r["batch"], r["overlap"]))
    print(table(rows))
    result = {
        "metadata": metadata(
            device,
            command_line("pdserve.bench.engine_step", argv),
            model_dir=str(path),
            iters=args.iters,
            warmup=args.warmup,
            block_size=args.block_size,
        ),
        "rows": rows,
    }
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
