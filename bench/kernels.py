"""Kernel micro-benchmarks on one GPU: each Triton kernel against its torch reference.

    python -m pdserve.bench.kernels --out out/kernels.json [--dtype bfloat16] [--sweep prefill|split|decode|linear ...]

Shapes are Qwen2.5-1.5B's (12 query heads, 2 KV heads, head_dim 128, hidden 1536,
intermediate 8960, block_size 16). Every Triton kernel is timed as CUDA-graph replays
(``triton.testing.do_bench_cudagraph``: GPU time without launch gaps, as the decode graph runs
them). Prefill attention, which runs eagerly, is also timed eagerly (``do_bench``, L2 flushed;
this includes the host's launch cost whenever that exceeds the GPU time); its reference syncs
with the host, so it is timed eagerly only. For one prompt without prefix, prefill is compared
with ``torch.nn.functional.scaled_dot_product_attention`` on contiguous, head-expanded K/V
(SDPA's best case: no paging, no GQA), timed as graph replays too. The KV copy of the cuda-ipc
backend is compared with ``Tensor.copy_`` of the same bytes. ``--sweep prefill|decode``
also times alternative tile and partition settings; ``--sweep split`` prefill attention's
split-KV settings (programs an SM, key tiles a partition); ``--sweep linear`` the tensor-core
linear's. Prints a table and writes every row as JSON to ``--out``.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

from pdserve.bench.common import bench_parser
from pdserve.kernels import (
    activation,
    attention_common,
    decode_attention,
    embedding,
    kv_copy,
    linear,
    prefill_attention,
    rmsnorm,
    rope,
)

HQ, HKV, HEAD_DIM, HIDDEN, INTER, BLOCK, VOCAB = 12, 2, 128, 1536, 8960, 16, 151936
Row = dict[str, Any]


def graph_us(fn: Callable[[], Any]) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def eager_us(fn: Callable[[], Any]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def max_err(a: Any, b: Any) -> float:
    if isinstance(a, tuple):
        return max(max_err(x, y) for x, y in zip(a, b))
    return (a.float() - b.float()).abs().max().item()


Timer = Callable[[Callable[[], Any]], float]


def row(
    op: str,
    shape: str,
    kernel: Callable[[], Any],
    ref: Callable[[], Any],
    kernel_timer: Timer,
    ref_timer: Timer | None,
    work: tuple[str, float] | None = None,
    extra: dict[str, Any] | None = None,
) -> Row:
    """Time the kernel (and the reference unless ref_timer is None); check it against the
    reference; ``work`` = (unit, amount per call) gives a throughput in tera-units per second."""
    result: Row = {
        "op": op,
        "shape": shape,
        "triton_us": kernel_timer(kernel),
        "max_abs_err": max_err(kernel(), ref()),
        "timing": f"triton {kernel_timer.__name__}",
    }
    if ref_timer is not None:
        result["ref_us"] = ref_timer(ref)
        result["speedup"] = result["ref_us"] / result["triton_us"]
        result["timing"] += f", ref {ref_timer.__name__}"
    if work is not None:
        unit, amount = work
        result["throughput"] = f"{amount / (result['triton_us'] * 1e-6) / 1e12:.2f} {unit}"
    result.update(extra or {})
    return result


def paged_cache(
    context_lens: list[int], dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V behind shuffled block tables: (k_cache, v_cache, block_tables, context_lens)."""
    needed = [math.ceil(n / BLOCK) for n in context_lens]
    num_blocks = sum(needed)
    shape = (num_blocks, BLOCK, HKV, HEAD_DIM)
    k = torch.randn(shape, device="cuda", dtype=dtype)
    v = torch.randn(shape, device="cuda", dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(context_lens), max(needed), dtype=torch.int32)
    start = 0
    for b, n in enumerate(needed):
        tables[b, :n] = perm[start : start + n]
        start += n
    lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
    return k, v, tables.cuda(), lens


def bench_elementwise(dtype: torch.dtype) -> Iterator[Row]:
    table = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=dtype)
    for rows in (1, 128, 2048):
        ids = torch.randint(0, VOCAB, (rows,), device="cuda")
        yield row(
            "embedding",
            f"{rows} of {VOCAB}x{HIDDEN}",
            lambda: embedding.embedding(ids, table),
            lambda: embedding.embedding_ref(ids, table),
            graph_us,
            graph_us,
            ("TB/s", 2 * rows * HIDDEN * table.element_size()),
        )
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=dtype)
        res = torch.randn_like(x)
        w = torch.randn(HIDDEN, device="cuda", dtype=dtype)
        moved = 2 * x.numel() * x.element_size()
        yield row(
            "rms_norm",
            f"{rows}x{HIDDEN}",
            lambda: rmsnorm.rms_norm(x, w, 1e-6),
            lambda: rmsnorm.rms_norm_ref(x, w, 1e-6),
            graph_us,
            graph_us,
            ("TB/s", moved),
        )
        yield row(
            "fused_add_rms_norm",
            f"{rows}x{HIDDEN}",
            lambda: rmsnorm.fused_add_rms_norm(x, res, w, 1e-6),
            lambda: rmsnorm.fused_add_rms_norm_ref(x, res, w, 1e-6),
            graph_us,
            graph_us,
            ("TB/s", 2 * moved),
        )
        gate_up = torch.randn(rows, 2 * INTER, device="cuda", dtype=dtype)
        yield row(
            "silu_and_mul",
            f"{rows}x{2 * INTER}",
            lambda: activation.silu_and_mul(gate_up),
            lambda: activation.silu_and_mul_ref(gate_up),
            graph_us,
            graph_us,
            ("TB/s", 1.5 * gate_up.numel() * gate_up.element_size()),
        )


def bench_rope(dtype: torch.dtype) -> Iterator[Row]:
    max_pos = 4096
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).cuda()
    for tokens in (1, 128, 2048):
        qkv = torch.randn(tokens, (HQ + 2 * HKV) * HEAD_DIM, device="cuda", dtype=dtype)
        q, k, v = qkv.split([HQ * HEAD_DIM, HKV * HEAD_DIM, HKV * HEAD_DIM], dim=-1)
        q, k, v = q.view(tokens, HQ, HEAD_DIM), k.view(tokens, HKV, HEAD_DIM), v.view(tokens, HKV, HEAD_DIM)
        positions = torch.randint(0, max_pos, (tokens,), device="cuda")
        num_blocks = math.ceil(tokens / BLOCK) + 1
        k_cache = torch.zeros(num_blocks, BLOCK, HKV, HEAD_DIM, device="cuda", dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:tokens]
        args = (q, k, v, positions, cos_sin, k_cache, v_cache, slots)
        yield row(
            "rope_and_store_kv",
            f"T={tokens}",
            lambda: rope.rope_and_store_kv(*args),
            lambda: rope.rope_and_store_kv_ref(*args),
            graph_us,
            graph_us,
            ("TB/s", 2 * qkv.numel() * qkv.element_size()),
        )


LINEAR_SHAPES = {
    "qkv_proj": (HQ * HEAD_DIM + 2 * HKV * HEAD_DIM, HIDDEN),
    "o_proj": (HIDDEN, HQ * HEAD_DIM),
    "gate_up_proj": (2 * INTER, HIDDEN),
    "down_proj": (HIDDEN, INTER),
    "lm_head": (151936, HIDDEN),
}


def bench_linear(dtype: torch.dtype, rows_list: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> Iterator[Row]:
    """What the decode linear layer runs (linear.linear: the one-row kernel, the tensor-core
    kernel or cuBLAS, by row count; the op names it) against cuBLAS (F.linear, its reference),
    graph replays both. Past MAX_DOT_ROWS both sides are cuBLAS."""
    for name, (n, k) in LINEAR_SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=dtype) / math.sqrt(k)
        bias = torch.randn(n, device="cuda", dtype=dtype) if name == "qkv_proj" else None
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=dtype)
            path = linear.linear_path(x, weight)
            yield row(
                f"linear {name} ({path})",
                f"{rows}x{k} @ {n}x{k}",
                lambda: linear.linear(x, weight, bias),
                lambda: linear.linear_ref(x, weight, bias),
                graph_us,
                graph_us,
                ("TB/s", weight.numel() * weight.element_size()),
                {"path": path},
            )
    # gate/up with the SwiGLU gate: against the two kernels it replaces at one row (the same bits)
    n, k = LINEAR_SHAPES["gate_up_proj"]
    weight = torch.randn(n, k, device="cuda", dtype=dtype) / math.sqrt(k)
    for rows in (1, 8):
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        yield row(
            "linear_silu_and_mul gate_up_proj (ref: linear, then silu_and_mul)",
            f"{rows}x{k} @ {n}x{k}",
            lambda: linear.linear_silu_and_mul(x, weight),
            lambda: activation.silu_and_mul(linear.linear(x, weight)),
            graph_us,
            graph_us,
            ("TB/s", weight.numel() * weight.element_size()),
        )


DECODE_SHAPES = [(1, 1024), (1, 4096), (8, 4096), (32, 2048), (128, 1024), (128, 4096)]


def bench_kv_copy(dtype: torch.dtype, gen: torch.Generator) -> Iterator[Row]:
    """The pool-to-pool KV copy of the cuda-ipc backend (28 layers, K and V, both KV heads),
    beside ``Tensor.copy_`` of the same bytes, its yardstick (it has no faster torch twin)."""
    for blocks in (64, 1024):
        src = torch.randn(28, 2, 2 * blocks + 1, BLOCK, HKV, HEAD_DIM, device="cuda", dtype=dtype)
        dst = torch.zeros_like(src)
        src_ids = torch.randperm(2 * blocks, generator=gen)[:blocks].cuda()
        dst_ids = torch.randperm(2 * blocks, generator=gen)[:blocks].cuda()
        copy = kv_copy.PagedKVCopy(src, dst, slice(0, HKV), slice(0, HKV))
        nbytes = blocks * 28 * 2 * BLOCK * HKV * HEAD_DIM * src.element_size()
        flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        flat_dst = torch.empty_like(flat_src)
        us = graph_us(lambda copy=copy, s=src_ids, d=dst_ids: copy(s, d))
        copy_us = graph_us(lambda a=flat_src, b=flat_dst: b.copy_(a))
        yield {
            "op": "paged_kv_copy",
            "shape": f"{blocks} blocks ({nbytes / 1e6:.0f} MB)",
            "triton_us": us,
            "max_abs_err": max_err(dst[:, :, dst_ids], src[:, :, src_ids]),
            "timing": "triton graph_us, copy_ graph_us",
            "copy_us": copy_us,
            "pct_of_copy": 100 * copy_us / us,
            "throughput": f"{nbytes / (us * 1e-6) / 1e12:.2f} TB/s copied",
        }


def bench_decode(
    dtype: torch.dtype, gen: torch.Generator, shapes: list[tuple[int, int]] = DECODE_SHAPES, label: str = ""
) -> Iterator[Row]:
    for batch, ctx in shapes:
        k_cache, v_cache, tables, lens = paged_cache([ctx] * batch, dtype, gen)
        # the step's new tokens (the last of each context): RoPE and their K/V store included
        q, k, v = torch.randn(batch, HQ + 2 * HKV, HEAD_DIM, device="cuda", dtype=dtype).split([HQ, HKV, HKV], dim=1)
        last = lens.long() - 1
        slots = tables.long().gather(1, (last // BLOCK)[:, None])[:, 0] * BLOCK + last % BLOCK
        cos_sin = torch.randn(ctx, HEAD_DIM, device="cuda")
        args = (q, k, v, last, cos_sin, k_cache, v_cache, slots, tables, lens, HEAD_DIM**-0.5, ctx)
        parts = decode_attention._num_partitions(ctx, batch, HKV, q.device)
        kv_bytes = 2 * batch * ctx * HKV * HEAD_DIM * k_cache.element_size()
        yield row(
            "paged_decode_attention" + label,
            f"B={batch} ctx={ctx}",
            lambda: decode_attention.paged_decode_attention(*args),
            lambda: decode_attention.paged_decode_attention_ref(*args),
            graph_us,
            graph_us,
            ("TB/s", kv_bytes),
            {"partitions": parts},
        )


# A mixed step last: 255 running decodes at 512 tokens beside a 256-token prompt.
MIXED_STEP = ([1] * 255 + [256], [512] * 255 + [256])
PREFILL_SHAPES = [
    ([2048], [2048]),
    ([512], [2048]),
    ([128], [2048]),  # a short chunk over a long cached prefix: the split-KV path
    ([512] * 4, [512] * 4),
    ([1, 300, 1000, 17], [1, 800, 3000, 529]),
    MIXED_STEP,
]


def bench_prefill(
    dtype: torch.dtype,
    gen: torch.Generator,
    shapes: list[tuple[list[int], list[int]]] = PREFILL_SHAPES,
    label: str = "",
) -> Iterator[Row]:
    """Triton timed as graph replays (GPU time) and eagerly (with the host's launch cost);
    the reference eagerly; SDPA, for a single prompt without prefix, as graph replays; where the
    kernel splits the keys, the unsplit kernel too (graph replays), its baseline."""
    for query_lens, context_lens in shapes:
        k_cache, v_cache, tables, lens = paged_cache(context_lens, dtype, gen)
        q = torch.randn(sum(query_lens), HQ, HEAD_DIM, device="cuda", dtype=dtype)
        cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        args = (q, k_cache, v_cache, cu, tables, lens, HEAD_DIM**-0.5)
        pairs = sum(ql * (cl - ql) + ql * (ql + 1) // 2 for ql, cl in zip(query_lens, context_lens))
        flops = 4 * pairs * HQ * HEAD_DIM

        def kernel() -> torch.Tensor:
            return prefill_attention.paged_prefill_attention(*args)

        extra: dict[str, Any] = {"triton_eager_us": eager_us(kernel)}
        extra["splits"] = prefill_attention.num_splits(q.shape[0], HQ // HKV, HKV, HEAD_DIM, q.device)
        if not label and extra["splits"] > 1:
            with patched(prefill_attention, "_MAX_SPLITS", 1):
                extra["unsplit_us"] = graph_us(kernel)
        if not label and len(query_lens) == 1 and query_lens == context_lens:
            # SDPA on contiguous K/V with the KV heads expanded outside the timing: its best case
            group = HQ // HKV
            qs = q.transpose(0, 1)[None]
            ks, vs = (
                attention_common.gather_kv(c, tables, context_lens[0])[0]
                .transpose(0, 1)
                .repeat_interleave(group, 0)[None]
                .contiguous()
                for c in (k_cache, v_cache)
            )

            def sdpa() -> torch.Tensor:
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=HEAD_DIM**-0.5)

            extra["sdpa_us"] = graph_us(sdpa)
            extra["sdpa_max_abs_err"] = max_err(kernel(), sdpa()[0].transpose(0, 1))
        shape = f"q={'+'.join(map(str, query_lens))} ctx={'+'.join(map(str, context_lens))}"
        yield row(
            "paged_prefill_attention" + label,
            shape,
            kernel,
            lambda: prefill_attention.paged_prefill_attention_ref(*args),
            graph_us,
            None if label else eager_us,
            ("TFLOP/s", flops),
            extra,
        )


@contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def sweep_prefill(dtype: torch.dtype, gen: torch.Generator) -> Iterator[Row]:
    """Alternative (BLOCK_M, BLOCK_N, num_warps, num_stages), each checked against the reference."""
    for tiles in [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2)]:
        with patched(prefill_attention, "_tile_config", lambda head_dim, tiles=tiles: tiles):
            shapes = [([2048], [2048]), ([1, 300, 1000, 17], [1, 800, 3000, 529]), MIXED_STEP]
            yield from bench_prefill(dtype, gen, shapes, label=f" tiles={tiles}")


def sweep_split(dtype: torch.dtype, gen: torch.Generator) -> Iterator[Row]:
    """Prefill attention's split-KV path: how full a wave it aims at, how short a partition may be."""
    shapes = [([128], [2048]), ([128], [8192]), ([512], [4096]), ([16, 100, 3], [16, 3000, 40])]
    for per_sm in (1, 2, 4):
        for min_tiles in (1, 2, 4):
            with (
                patched(prefill_attention, "_SPLIT_PROGRAMS_PER_SM", per_sm),
                patched(prefill_attention, "_MIN_SPLIT_TILES", min_tiles),
            ):
                yield from bench_prefill(dtype, gen, shapes, label=f" split {per_sm}/SM min_tiles={min_tiles}")


def sweep_decode(dtype: torch.dtype, gen: torch.Generator) -> Iterator[Row]:
    """Alternative partition targets, key-tile sizes, warps and pipeline stages."""
    shapes = [(1, 4096), (8, 4096), (32, 2048), (128, 4096)]
    for target in (1, 2, 8, 16):
        with patched(decode_attention, "_TARGET_PROGRAMS_PER_SM", target):
            yield from bench_decode(dtype, gen, shapes, label=f" target={target}/SM")
    for block_n in (32, 128):
        with patched(decode_attention, "_BLOCK_N", block_n):
            yield from bench_decode(dtype, gen, shapes, label=f" BLOCK_N={block_n}")
    for warps, stages in ((4, 3), (4, 4), (8, 2), (8, 3), (2, 3)):
        with patched(decode_attention, "_WARPS_STAGES", (warps, stages)):
            yield from bench_decode(dtype, gen, shapes, label=f" warps={warps} stages={stages}")


def sweep_linear(dtype: torch.dtype, gen: torch.Generator) -> Iterator[Row]:
    """Alternative linear._dot_config launches for the tensor-core linear at 2, 8, 16 and 32 rows,
    both products (``x W^T`` and the transposed ``W x^T``), each shape class's chosen one among
    them. Isolated replays of one weight: a weight under the 50 MB L2 reads partly from it."""
    tiles = [
        (block_n, 128, split_k, 4, stages)
        for block_n, split_k in [(32, 1), (32, 4), (64, 1), (64, 4), (64, 7), (128, 1), (128, 2)]
        for stages in (3, 4)
    ]
    configs = [linear.DotConfig(*tile, swap_ab=swap_ab) for tile in tiles for swap_ab in (False, True)]
    # the narrow layers' whole-slice tiles
    for config in [*configs, linear.DotConfig(64, 512, 3, 8, 1, swap_ab=False)]:
        with patched(linear, "_dot_config", lambda n, k, config=config: config):
            for r in bench_linear(dtype, (2, 8, 16, 32)):
                if r["path"] == "linear_dot":
                    yield {**r, "op": f"{r['op']} config={tuple(config)}"}


SWEEPS = {"prefill": sweep_prefill, "split": sweep_split, "decode": sweep_decode, "linear": sweep_linear}


def print_table(rows: list[Row]) -> None:
    def num(r: Row, key: str, fmt: str, width: int) -> str:
        return format(r[key], fmt) if key in r else " " * width

    header = (
        f"{'op':48s} {'shape':34s} {'triton us':>9s} {'eager us':>8s} {'ref us':>8s} {'x ref':>6s} "
        f"{'sdpa us':>7s} {'max err':>8s}  throughput"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['op']:48s} {r['shape']:34s} {r['triton_us']:9.1f} {num(r, 'triton_eager_us', '8.1f', 8)} "
            f"{num(r, 'ref_us', '8.1f', 8)} {num(r, 'speedup', '6.1f', 6)} {num(r, 'sdpa_us', '7.1f', 7)} "
            f"{r['max_abs_err']:8.1e}  {r.get('throughput', '')}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("kernels", __doc__)
    parser.add_argument("--out", type=Path, default=Path("out/kernels.json"), help="JSON results path")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument(
        "--sweep",
        action="append",
        choices=sorted(SWEEPS),
        default=[],
        help="also time alternative prefill tiles / prefill splits / decode partitions / linear tiles (repeatable)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA device", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    parts = [
        bench_linear(dtype),
        bench_elementwise(dtype),
        bench_rope(dtype),
        bench_decode(dtype, gen),
        bench_prefill(dtype, gen),
        bench_kv_copy(dtype, gen),
    ]
    for part in (*parts, *(SWEEPS[name](dtype, gen) for name in args.sweep)):
        for r in part:
            rows.append(r)
            print(f"  {r['op']} {r['shape']}: {r['triton_us']:.1f} us", file=sys.stderr, flush=True)
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
    }
    args.out.write_text(json.dumps({**meta, "results": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
