"""kernels.prefill_attention against its torch reference: ragged batches, cached prefixes,
grouped-query rows and grid padding (tests/kernels/conftest.py says how the CPU and GPU cases
run)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import prefill_attention
from pdserve.tests.kernels.helpers import (
    BLOCK,
    CPU,
    CPU_DTYPES,
    GPU_DTYPES,
    HEAD_DIM,
    HKV,
    HQ,
    check_prefill,
    make_paged_cache,
    rand,
)

# Prefill cases (query_lens, context_lens); context_len > q_len means a cached prefix.
PREFILL_CPU_CASES = {
    # small tiles (16 x 16): several query tiles, full and diagonal key tiles, a prefix
    "small-tiles": dict(query_lens=[5, 1, 37], context_lens=[5, 9, 61], tiles=(16, 16, 4, 1)),
    # an empty sequence in the batch (q_len 0), one exactly a tile long, and query tiles whose
    # first position sits just before a key-tile boundary (prefix 14: positions 14 and 30)
    "empty-seq": dict(query_lens=[16, 0, 7, 20], context_lens=[16, 3, 30, 34], tiles=(16, 16, 4, 1)),
    # sequences starting mid-tile (query offsets 3, 19, 35): each owns the tile slots of the
    # flat grid its start gives it, one more than it needs; an empty one between two others
    "misaligned": dict(query_lens=[3, 16, 16, 0, 1], context_lens=[3, 20, 16, 2, 9], tiles=(16, 16, 4, 1)),
    # the GPU tile config (64 x 64): three query tiles over a 40-token prefix
    "gpu-tiles": dict(query_lens=[150], context_lens=[190], tiles=None),
    # three query heads a KV head, packed into the rows of a tile: 16-row tiles end mid-query
    # (5 1/3 queries a tile), so one tile's rows hold queries of different positions
    "gqa-3": dict(query_lens=[7, 1, 12], context_lens=[20, 9, 12], tiles=(16, 16, 4, 1), heads=(6, 2)),
    # a mixed step: one-query rows (running decodes, cached contexts) beside a prompt chunk
    "decode-rows": dict(
        query_lens=[1, 1, 1, 1, 1, 1, 9], context_lens=[5, 17, 1, 30, 8, 64, 9], tiles=(16, 16, 4, 1), heads=(6, 2)
    ),
}


def force_splits(monkeypatch: pytest.MonkeyPatch, splits: int) -> None:
    """Split every row tile's keys into ``splits`` partitions of one key tile or more, whatever
    the grid's size."""
    monkeypatch.setattr(prefill_attention, "num_splits", lambda *shape_and_device: splits)
    monkeypatch.setattr(prefill_attention, "_MIN_SPLIT_TILES", 1)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", list(PREFILL_CPU_CASES))
def test_paged_prefill_attention_interpreted(
    interpreter: None, monkeypatch: pytest.MonkeyPatch, case: str, splits: int, dtype: torch.dtype
) -> None:
    """Unsplit, and with each tile's keys in three partitions: partitions past some rows'
    positions (every key masked for them), empty partitions of short contexts, and the reduce."""
    spec = dict(PREFILL_CPU_CASES[case])
    tiles = spec.pop("tiles")
    num_heads, num_kv_heads = spec.pop("heads", (4, 2))
    if tiles is not None:
        monkeypatch.setattr(prefill_attention, "_tile_config", lambda head_dim: tiles)
    force_splits(monkeypatch, splits)
    check_prefill(
        **spec, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, block_size=4, dtype=dtype, device=CPU
    )


@pytest.mark.parametrize("splits", [1, 3])
def test_prefill_grid_padding_changes_no_bits(interpreter: None, monkeypatch: pytest.MonkeyPatch, splits: int) -> None:
    """The grid depends on T and B alone: the batch inside a larger one (padding token rows
    past cu_seqlens_q[-1], empty padding sequences, as a CUDA graph captured for more tokens and
    sequences runs it) gives the same bits on its own rows, split as often."""
    monkeypatch.setattr(prefill_attention, "_tile_config", lambda head_dim: (16, 16, 4, 1))
    force_splits(monkeypatch, splits)
    gen = torch.Generator().manual_seed(6)
    context_lens = [5, 29]  # query lens 5 and 20: cu below
    k_cache, v_cache, _, _, tables = make_paged_cache(context_lens, 4, 2, 16, torch.float32, CPU, gen)
    q = rand(gen, 25, 4, 16, dtype=torch.float32, device=CPU)
    cu = torch.tensor([0, 5, 25], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    exact = prefill_attention.paged_prefill_attention(q, k_cache, v_cache, cu, tables, lens, 0.25)
    padded_q = torch.cat([q, rand(gen, 39, 4, 16, dtype=torch.float32, device=CPU)])  # 64 token rows
    padded_cu = torch.tensor([0, 5, 25, 25, 25, 25], dtype=torch.int32)  # 5 sequences, 3 empty
    padded_tables = torch.cat([tables, torch.zeros(3, tables.shape[1], dtype=torch.int32)])
    padded_lens = torch.tensor([*context_lens, 1, 1, 1], dtype=torch.int32)
    padded = prefill_attention.paged_prefill_attention(
        padded_q, k_cache, v_cache, padded_cu, padded_tables, padded_lens, 0.25
    )
    assert torch.equal(padded[:25], exact)


def test_the_reference_in_query_chunks_gives_the_same_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt's scores do not fit at once, so the reference (the CPU engine's attention)
    takes its queries in chunks, each over the keys up to its last position: the same result as
    all at once, within fp32 rounding."""
    gen = torch.Generator().manual_seed(7)
    query_lens, context_lens = [37, 1, 20], [61, 9, 20]
    k_cache, v_cache, _, _, tables = make_paged_cache(context_lens, 4, 2, 16, torch.float32, CPU, gen)
    q = rand(gen, sum(query_lens), 4, 16, dtype=torch.float32, device=CPU)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, k_cache, v_cache, cu, tables, torch.tensor(context_lens, dtype=torch.int32), 0.25)
    whole = prefill_attention.paged_prefill_attention_ref(*args)
    monkeypatch.setattr(prefill_attention, "_REF_SCORES", 61 * 4 * 5)  # 5 queries a chunk of the first
    chunked = prefill_attention.paged_prefill_attention_ref(*args)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


PREFILL_GPU_CASES = {
    "one-2048": ([2048], [2048]),
    "mixed-prefix": ([1, 300, 1000, 17], [1, 800, 3000, 529]),
    "chunk-of-long": ([512], [4096]),
    "short-chunk-of-long": ([128], [2048]),  # few row tiles: the split-KV path
    "short-chunks": ([16, 100, 3], [16, 3000, 40]),  # split, with partitions only some rows fill
    "mixed-step": ([1] * 200 + [256], [512] * 200 + [256]),  # 200 decodes beside a prompt
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", list(PREFILL_GPU_CASES))
def test_paged_prefill_attention_gpu(cuda: torch.device, case: str, dtype: torch.dtype) -> None:
    query_lens, context_lens = PREFILL_GPU_CASES[case]
    check_prefill(query_lens, context_lens, HQ, HKV, HEAD_DIM, BLOCK, dtype, cuda)
