"""Host time of a decode step's inputs, block tables as int32 arrays against lists of Python ints.

    python -m pdserve.bench.step_inputs --out step_inputs.json

Rows per batch size (contexts of ``--context`` tokens, 16-token blocks, so batch x blocks
block-table entries), each as arrays against lists, for a real decode batch (sequences and their
block tables): what a leader pays every step (``build_plan``, then its block tables
to a tensor), ``build_plan`` alone, padding the sequences' tables into the plan's, ``host_tensor``
of the tables, and encoding and decoding the plan for TP peers. CPU only; microseconds, median of
``--iters``.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from pdserve.bench.common import bench_parser, format_table, write_json
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence as Request
from pdserve.engine.step_channel import decode_message, encode_message
from pdserve.engine.step_plan import StepPlan, build_plan, host_tensor, padded_block_tables

BLOCK_SIZE = 16


def paired_us(new: Callable[[], Any], old: Callable[[], Any], iters: int) -> tuple[float, float]:
    """Median wall times of ``new`` and ``old``, timed alternately (so that drift in the
    machine's speed hits both alike) with the garbage collector off (as ``timeit`` does: a
    collection landing in one loop would be charged to it alone)."""
    new(), old()
    times: tuple[list[float], list[float]] = ([], [])
    gc.disable()
    try:
        for _ in range(iters):
            for fn, out in ((new, times[0]), (old, times[1])):
                start = time.perf_counter()
                fn()
                out.append((time.perf_counter() - start) * 1e6)
    finally:
        gc.enable()
    return statistics.median(times[0]), statistics.median(times[1])


def decode_batch(batch: int, context: int, rng: random.Random) -> ScheduledBatch:
    """``batch`` running sequences of ``context`` tokens, each with its last token to compute."""
    blocks = -(-context // BLOCK_SIZE)
    seqs = []
    for i in range(batch):
        seq = Request(str(i), [rng.randrange(150000) for _ in range(context)], SamplingParams())
        seq.num_computed_tokens = context - 1
        seq.block_table = np.array([rng.randrange(1 << 20) for _ in range(blocks)], dtype=np.int32)
        seqs.append(seq)
    return ScheduledBatch(seqs, [1] * batch)


def build_plan_lists(batch: ScheduledBatch, tables: list[list[int]]) -> StepPlan:
    """The plan built from block tables as lists of Python ints (the baseline)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_seqlens = [0]
    context_lens: list[int] = []
    sample_rows: list[int] = []
    for seq, n, table in zip(batch.seqs, batch.num_new_tokens, tables):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end))
        cu_seqlens.append(cu_seqlens[-1] + n)
        context_lens.append(end)
        if end == seq.num_tokens:
            sample_rows.append(cu_seqlens[-1] - 1)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return StepPlan(
        input_ids,
        positions,
        slots,
        padded,
        context_lens,
        cu_seqlens,
        sample_rows,  # type: ignore[arg-type]
        batch.is_decode,
    )


def encode_lists(plan: StepPlan, tables: list[list[int]]) -> bytes:
    """The baseline encoding: every field as msgpack, block tables as nested lists."""
    values = {f.name: getattr(plan, f.name) for f in fields(plan)}
    return msgpack.packb({"kind": "step", **values, "block_tables": tables})


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("step_inputs", __doc__)
    parser.add_argument("--batch-sizes", default="8,32,128", type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--context", default=2048, type=int)
    parser.add_argument("--iters", default=50, type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    rows = []
    for batch_size in args.batch_sizes:
        batch = decode_batch(batch_size, args.context, rng)
        plan = build_plan(batch, BLOCK_SIZE)
        table_lists = [seq.block_table.tolist() for seq in batch.seqs]
        padded_lists = plan.block_tables.tolist()
        data, data_lists = encode_message(plan), encode_lists(plan, padded_lists)
        pieces: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
            "step": (
                lambda: host_tensor(build_plan(batch, BLOCK_SIZE).block_tables, torch.int32, pin=False),
                lambda: host_tensor(build_plan_lists(batch, table_lists).block_tables, torch.int32, pin=False),
            ),
            "build_plan": (lambda: build_plan(batch, BLOCK_SIZE), lambda: build_plan_lists(batch, table_lists)),
            "pad_tables": (
                lambda: padded_block_tables([s.block_table for s in batch.seqs]),
                lambda: [t + [0] * (len(padded_lists[0]) - len(t)) for t in table_lists],
            ),
            "host_tensor": (
                lambda: host_tensor(plan.block_tables, torch.int32, pin=False),
                lambda: host_tensor(padded_lists, torch.int32, pin=False),
            ),
            "encode": (lambda: encode_message(plan), lambda: encode_lists(plan, padded_lists)),
            "decode": (lambda: decode_message(data), lambda: msgpack.unpackb(data_lists)),
        }
        row: dict[str, Any] = {"batch": batch_size, "table_entries": plan.block_tables.size}
        for key, (new, old) in pieces.items():
            row[f"{key}_us"], row[f"{key}_lists_us"] = paired_us(new, old, args.iters)
        rows.append(row)
    print(
        f"decode step inputs, contexts of {args.context} tokens (us, median of {args.iters}; "
        "block tables as arrays / as lists)"
    )
    print(
        format_table(
            [
                "batch",
                "table entries",
                "plan + tables tensor",
                "build_plan",
                "pad tables",
                "host_tensor",
                "encode",
                "decode",
            ],
            [
                [str(r["batch"]), str(r["table_entries"])]
                + [
                    f"{r[key + '_us']:.0f} / {r[key + '_lists_us']:.0f}"
                    for key in ("step", "build_plan", "pad_tables", "host_tensor", "encode", "decode")
                ]
                for r in rows
            ],
        )
    )
    result = {"context": args.context, "rows": rows}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
