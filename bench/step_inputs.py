"""Host time of a decode step's inputs: encoding the step plan for TP peers and turning its lists
into tensors, against the plain ways of doing both (measured in the same run).

    python -m bench.step_inputs --out step_inputs.json

Rows per batch size (contexts of ``--context`` tokens, 16-token blocks, so batch x blocks
block-table entries): ``encode_message`` against msgpack over ``dataclasses.asdict`` (which
deep-copies every list), ``decode_message``, and ``host_tensor`` against ``torch.tensor`` for the
block tables. CPU only; microseconds, median of ``--iters``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import torch

from bench.common import format_table, write_json
from engine.step_plan import StepPlan, decode_message, encode_message, host_tensor


def median_us(fn: Callable[[], Any], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def decode_step_plan(batch: int, context: int, block_size: int, rng: random.Random) -> StepPlan:
    blocks = -(-context // block_size)
    tables = [[rng.randrange(1 << 20) for _ in range(blocks)] for _ in range(batch)]
    return StepPlan(input_ids=[rng.randrange(150000) for _ in range(batch)], positions=[context - 1] * batch,
                    slot_mapping=[row[-1] * block_size for row in tables], block_tables=tables,
                    context_lens=[context] * batch, cu_seqlens_q=list(range(batch + 1)),
                    sample_rows=list(range(batch)), is_decode=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.step_inputs", description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="8,32,128", type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--context", default=2048, type=int)
    parser.add_argument("--iters", default=50, type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    rows = []
    for batch in args.batch_sizes:
        plan = decode_step_plan(batch, args.context, 16, rng)
        data = encode_message(plan)
        rows.append({
            "batch": batch, "table_entries": batch * len(plan.block_tables[0]),
            "encode_us": median_us(lambda: encode_message(plan), args.iters),
            "encode_asdict_us": median_us(
                lambda: msgpack.packb({"kind": "step", **dataclasses.asdict(plan)}), args.iters),
            "decode_us": median_us(lambda: decode_message(data), args.iters),
            "tables_host_tensor_us": median_us(
                lambda: host_tensor(plan.block_tables, torch.int32, pin=False), args.iters),
            "tables_torch_tensor_us": median_us(
                lambda: torch.tensor(plan.block_tables, dtype=torch.int32), args.iters),
        })
    print(f"decode step inputs, contexts of {args.context} tokens (us, median of {args.iters})")
    print(format_table(
        ["batch", "table entries", "encode", "asdict+msgpack", "decode", "host_tensor", "torch.tensor"],
        [[str(r["batch"]), str(r["table_entries"]), f"{r['encode_us']:.0f}", f"{r['encode_asdict_us']:.0f}",
          f"{r['decode_us']:.0f}", f"{r['tables_host_tensor_us']:.0f}", f"{r['tables_torch_tensor_us']:.0f}"]
         for r in rows]))
    result = {"context": args.context, "rows": rows}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
