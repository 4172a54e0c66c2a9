"""Host time of a decode step's inputs, block tables as int32 arrays (now) against lists of
Python ints (before), measured in the same run.

    python -m bench.step_inputs --out step_inputs.json

Rows per batch size (contexts of ``--context`` tokens, 16-token blocks, so batch x blocks
block-table entries): ``build_plan`` for a real decode batch (sequences and their block tables),
then each piece with tables as arrays against tables as lists: padding the sequences' tables
into the plan's, turning them into a tensor (``host_tensor``), and encoding and decoding the plan
for TP peers. CPU only; microseconds, median of ``--iters``.
"""

from __future__ import annotations

import argparse
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

from bench.common import format_table, write_json
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence as Request
from engine.step_plan import StepPlan, build_plan, decode_message, encode_message, host_tensor, padded_block_tables

BLOCK_SIZE = 16


def median_us(fn: Callable[[], Any], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


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


def encode_lists(plan: StepPlan, tables: list[list[int]]) -> bytes:
    """The encoding before: every field as msgpack, block tables as nested lists."""
    values = {f.name: getattr(plan, f.name) for f in fields(plan)}
    return msgpack.packb({"kind": "step", **values, "block_tables": tables})


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.step_inputs", description=__doc__.split("\n")[0])
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
        rows.append({
            "batch": batch_size, "table_entries": plan.block_tables.size,
            "build_plan_us": median_us(lambda: build_plan(batch, BLOCK_SIZE), args.iters),
            "pad_tables_us": median_us(lambda: padded_block_tables([s.block_table for s in batch.seqs]), args.iters),
            "pad_tables_lists_us": median_us(lambda: [t + [0] * (len(padded_lists[0]) - len(t)) for t in table_lists],
                                             args.iters),
            "host_tensor_us": median_us(lambda: host_tensor(plan.block_tables, torch.int32, pin=False), args.iters),
            "host_tensor_lists_us": median_us(lambda: host_tensor(padded_lists, torch.int32, pin=False), args.iters),
            "encode_us": median_us(lambda: encode_message(plan), args.iters),
            "encode_lists_us": median_us(lambda: encode_lists(plan, padded_lists), args.iters),
            "decode_us": median_us(lambda: decode_message(data), args.iters),
            "decode_lists_us": median_us(lambda: msgpack.unpackb(data_lists), args.iters),
        })
    print(f"decode step inputs, contexts of {args.context} tokens (us, median of {args.iters}; "
          "block tables as arrays / as lists)")
    print(format_table(
        ["batch", "table entries", "build_plan", "pad tables", "host_tensor", "encode", "decode"],
        [[str(r["batch"]), str(r["table_entries"]), f"{r['build_plan_us']:.0f}"]
         + [f"{r[key + '_us']:.0f} / {r[key + '_lists_us']:.0f}" for key in ("pad_tables", "host_tensor", "encode",
                                                                                "decode")]
         for r in rows]))
    result = {"context": args.context, "rows": rows}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
