"""kernels.decode_attention against its torch reference: the split-KV partition policy, the
reduce, CUDA-graph-sized grids and a captured graph replayed with new lengths; and the two
attention kernels' compiled variants across step shapes (tests/kernels/conftest.py says how the
CPU and GPU cases run)."""

from __future__ import annotations

import functools

import pytest
import torch
import triton

from pdserve.kernels import decode_attention
from pdserve.tests.kernels.helpers import (
    ATTENTION_TOL,
    BLOCK,
    CPU,
    CPU_DTYPES,
    GPU_DTYPES,
    HEAD_DIM,
    HKV,
    HQ,
    assert_close,
    check_decode,
    check_prefill,
    last_slots,
    make_paged_cache,
    new_decode_tokens,
    rand,
    rope_table,
)

# Decode partitions: the policy sees 4 "SMs" on CPU, 16 program slots, and fills one wave, with
# no more partitions than a max_context_len sequence has 64-token tiles; a sequence's partitions
# hold one tile while the batch's one-tile programs stay within 4 (one an "SM") or the context
# within two tiles, else two tiles at least. Ids say which path each case takes.
DECODE_CPU_CASES = {
    # one partition (direct output); lengths 1, non-multiples of block_size; G = 2
    "single": dict(context_lens=[1, 7, 30], max_context_len=30, num_heads=4, num_kv_heads=2, block_size=4),
    # 4 partitions, sized per sequence: seq 0 fills one of 64 (three empty), seq 1 two of 64 (two
    # tiles: within the one-tile limit of two), seq 2 two of 128 (past it; ends mid-partition),
    # seq 3 three of 128; G = 4
    "split-empty": dict(
        context_lens=[1, 70, 250, 380], max_context_len=384, num_heads=4, num_kv_heads=1, block_size=16
    ),
    # batch 1, long context: 8 partitions of 128 (fills the "GPU"); GQA group of 4
    "split-long": dict(context_lens=[1000], max_context_len=1000, num_heads=8, num_kv_heads=2, block_size=16),
    # MHA (group 1), max_context_len far above every length (a CUDA-graph-sized grid)
    "mha-graph-grid": dict(context_lens=[5, 33], max_context_len=512, num_heads=2, num_kv_heads=2, block_size=16),
}


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("case", list(DECODE_CPU_CASES))
def test_paged_decode_attention_interpreted(interpreter: None, case: str, dtype: torch.dtype) -> None:
    check_decode(**DECODE_CPU_CASES[case], head_dim=16, dtype=dtype, device=CPU)


def test_decode_partition_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an H200 (132 SMs, 528 program slots) the split fills one wave and no more, has no more
    partitions than a max_context_len sequence has tiles, and stops growing with max_context_len
    once the wave is full; one-tile partitions stop where the batch's would take more than 132
    programs, but never below two tiles of context."""
    monkeypatch.setattr(decode_attention, "num_sms", lambda device: 132)
    parts = decode_attention._num_partitions
    gpu = torch.device("cuda", 0)
    assert parts(4096, 1, 2, gpu) == 64  # a 64-token tile a partition: 128 programs
    assert parts(65536, 1, 2, gpu) == parts(1 << 20, 1, 2, gpu) == 264  # 528 programs, whatever the length
    assert parts(2064, 32, 2, gpu) == parts(32768, 32, 2, gpu) == 8  # 512 programs
    assert parts(4096, 128, 2, gpu) == 2  # 512 programs, not 768 (a second wave a third full)
    assert parts(4096, 512, 2, gpu) == 1  # 1024 (b, kv head) programs already
    assert parts(10, 1, 2, gpu) == 1
    one_tile_limit = decode_attention._one_tile_limit
    assert one_tile_limit(1, 2, gpu) == 66  # batch 1: one-tile partitions up to 4224 tokens
    assert one_tile_limit(8, 2, gpu) == 8  # batch 8: up to 512 tokens
    assert one_tile_limit(32, 2, gpu) == 2  # batch 32 at 128 tokens: two one-tile partitions
    assert one_tile_limit(128, 2, gpu) == 2  # the same at batch 128, where one program an SM allows none


def test_decode_reduce_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an H200 the reduce splits a head's columns while the batch's programs stay within 396
    (3 an SM), never below 16 columns: Qwen2.5-1.5B's 12 heads of 128 take 16 columns at batch
    1-4, 32 at 8, 64 at 16 and whole heads from 32."""
    monkeypatch.setattr(decode_attention, "num_sms", lambda device: 132)
    columns = functools.partial(decode_attention._reduce_columns, device=torch.device("cuda", 0))
    assert [columns(b, 12, 128) for b in (1, 2, 4, 8, 16, 32, 128)] == [16, 16, 16, 32, 64, 128, 128]
    assert columns(1, 6, 128) == 16 and columns(16, 6, 128) == 32  # a rank's heads under TP 2
    assert columns(1, 12, 80) == 16  # 80 wide: as a 128-wide head, in 5 programs
    assert columns(1, 2, 8) == 8  # a head narrower than the minimum stays whole


@pytest.mark.parametrize("head_dim", [64, 40])
def test_decode_reduce_splits_columns_interpreted(
    interpreter: None, monkeypatch: pytest.MonkeyPatch, head_dim: int
) -> None:
    """With an H200's 132 SMs the split kernel's reduce merges each head in 16-column programs
    (4 of them for 64-wide heads; 3 for 40-wide ones, the last masked): the same output."""
    monkeypatch.setattr(decode_attention, "num_sms", lambda device: 132)
    assert decode_attention._reduce_columns(2, 4, head_dim, CPU) == 16
    check_decode(
        [300, 70], 384, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=torch.float32, device=CPU
    )


def test_decode_reduce_merges_in_chunks_interpreted(interpreter: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With an H200's 132 SMs a 2100-token sequence beside a 100-token one splits into 33
    one-tile partitions, which the reduce merges in chunks of 32 (two: 32, then 1), while the
    short one's two partitions take the two-row tile: the reference's output either way."""
    monkeypatch.setattr(decode_attention, "num_sms", lambda device: 132)
    assert decode_attention._num_partitions(2100, 2, 2, CPU) == 33
    assert decode_attention._one_tile_limit(2, 2, CPU) == 33
    check_decode(
        [2100, 100], 2100, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32, device=CPU
    )


@pytest.mark.parametrize(("context_lens", "partitions"), [([70, 500], (4, 4)), ([300], (5, 8)), ([100], (2, 8))])
def test_decode_split_ignores_max_context_len(
    interpreter: None, context_lens: list[int], partitions: tuple[int, int]
) -> None:
    """Each sequence splits its own context: a grid sized for a long max_context_len (a CUDA
    graph captured for max_model_len) gives the bits of one sized for the live lengths, also
    where it has more partitions (4 "SMs", 16 program slots: one sequence gets 8 partitions at
    4096 tokens, and splits 300 tokens into 3 of two tiles, 100 into 2 of one, in either grid)."""
    gen = torch.Generator().manual_seed(7)
    batch, longest = len(context_lens), max(context_lens)
    k_cache, v_cache, _, _, tables = make_paged_cache(context_lens, 16, 2, 16, torch.float32, CPU, gen)
    q, k, v = new_decode_tokens(gen, batch, 4, 2, 16, torch.float32, CPU)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    new = (q, k, v, lens.long() - 1, rope_table(longest, 16, CPU), k_cache, v_cache, last_slots(tables, lens, 16))
    padded = torch.cat([tables, tables[:, :1].expand(-1, 256 - tables.shape[1])], dim=1)  # room for 4096 tokens
    parts = decode_attention._num_partitions
    assert (parts(longest, batch, 2, CPU), parts(4096, batch, 2, CPU)) == partitions
    exact = decode_attention.paged_decode_attention(*new, tables, lens, 0.25, longest)
    graph_sized = decode_attention.paged_decode_attention(*new, padded, lens, 0.25, 4096)
    assert torch.equal(exact, graph_sized)


DECODE_GPU_CASES = {
    "b1-4096": ([4096], 4096),
    "b1-777-graph-grid": ([777], 4096),
    "b8-mixed": ([1, 15, 16, 17, 1000, 2049, 4000, 4096], 4096),
    "b32": ([(i * 131) % 2048 + 1 for i in range(32)], 2048),
    "b128": ([(i * 997) % 4096 + 1 for i in range(128)], 4096),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", list(DECODE_GPU_CASES))
def test_paged_decode_attention_gpu(cuda: torch.device, case: str, dtype: torch.dtype) -> None:
    context_lens, max_context_len = DECODE_GPU_CASES[case]
    check_decode(context_lens, max_context_len, HQ, HKV, HEAD_DIM, BLOCK, dtype, cuda)


@pytest.mark.gpu
def test_paged_decode_attention_cuda_graph(cuda: torch.device) -> None:
    """Captured once for (batch, max_context_len), replayed after the lengths, tables, new
    tokens and their slots change."""
    gen = torch.Generator().manual_seed(6)
    batch, max_len, dtype = 4, 2048, torch.bfloat16
    k_cache, v_cache, _, _, tables = make_paged_cache([max_len] * batch, BLOCK, HKV, HEAD_DIM, dtype, cuda, gen)
    q, k, v = new_decode_tokens(gen, batch, HQ, HKV, HEAD_DIM, dtype, cuda)
    lens = torch.full((batch,), 10, dtype=torch.int32, device=cuda)
    positions, slots = lens.long() - 1, last_slots(tables, lens, BLOCK)
    args = (
        q,
        k,
        v,
        positions,
        rope_table(max_len, HEAD_DIM, cuda),
        k_cache,
        v_cache,
        slots,
        tables,
        lens,
        HEAD_DIM**-0.5,
        max_len,
    )
    decode_attention.paged_decode_attention(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention.paged_decode_attention(*args)
    for new_lens in ([1, 2048, 300, 17], [2048, 5, 1024, 1025]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        tables.copy_(tables[torch.randperm(batch, generator=gen)])
        positions.copy_(lens.long() - 1)
        slots.copy_(last_slots(tables, lens, BLOCK))
        for t in (q, k, v):
            t.copy_(rand(gen, *t.shape, dtype=dtype, device=cuda))
        graph.replay()
        ref = decode_attention.paged_decode_attention_ref(*args)  # rewrites the new tokens' slots
        assert_close(out, ref, *ATTENTION_TOL[dtype])


@pytest.mark.gpu
def test_attention_compiles_once_across_step_shapes(cuda: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequence counts, block-table widths, max context lengths and partition counts of 1, of
    multiples of 16 and of neither run one compiled variant of each attention kernel for each
    number of warps its wrapper launches: Triton would otherwise compile a variant per class on
    first sight, a second's stall mid-serving (docs/benchmarks.md). Every case keeps several
    partitions (one is a constexpr branch), and every case's split-KV reduce merges 16-column
    slices of the heads and prefetches its first K/V tiles (the columns and the prefetch are
    constexprs the wrapper picks from the batch size)."""
    compiled: list[tuple[str, int]] = []
    monkeypatch.setattr(
        triton.knobs.runtime,
        "jit_post_compile_hook",
        lambda *, fn, compile, **_: compiled.append((fn.name, compile["num_warps"])),
    )
    dtype = torch.bfloat16
    # (query lens, context lens): 1, 16 and 17 sequences; tables 2, 16 and 17 blocks wide.
    for query_lens, context_lens in (([1], [16]), ([8] * 16, [240] * 16), ([5] * 17, [256] * 17)):
        check_prefill(query_lens, context_lens, HQ, HKV, HEAD_DIM, BLOCK, dtype, cuda)
    # (context lens, max context len): 32, 20 and 64 partitions; tables 129, 80 and 257 blocks
    # wide. Each case has more than 16 partitions, so the reduce kernel's merge chunk (BLOCK_P, a
    # constexpr: the partition count's next power of two, at most 32) is 32 in all three.
    for context_lens, max_len in (([2048], 2048), ([1260, 7, 300], 1260), ([4095] * 4, 4095)):
        assert decode_attention._num_partitions(max_len, len(context_lens), HKV, cuda) > 1
        assert decode_attention._reduce_columns(len(context_lens), HQ, HEAD_DIM, cuda) == 16
        assert len(context_lens) <= decode_attention._PREFETCH_MAX_BATCH
        check_decode(context_lens, max_len, HQ, HKV, HEAD_DIM, BLOCK, dtype, cuda)
    for name in ("_prefill_kernel", "_decode_partition_kernel", "_decode_reduce_kernel"):
        warps = [w for n, w in compiled if n == name]
        assert len(warps) == len(set(warps)), (name, compiled)
