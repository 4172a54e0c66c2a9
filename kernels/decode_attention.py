"""Paged decode attention: each sequence's new token, rotated and stored into the paged cache,
attends to its whole cached context (the new token included). Tuning figures: docs/decisions.md."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import pdl
from pdserve.kernels.attention_common import LOG2E, check_paged_cache, gather_kv, num_sms, online_softmax_step
from pdserve.kernels.checks import dot_precision
from pdserve.kernels.pdl import prefetch_l2
from pdserve.kernels.rope import check_new_tokens, rope_and_store_kv_ref


def paged_decode_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
) -> torch.Tensor:
    """One decode step's attention: :func:`~kernels.rope.rope_and_store_kv_ref` on the new tokens,
    then :func:`cached_decode_attention_ref` of the rotated q. q ``[B, Hq, D]``, k and v
    ``[B, Hkv, D]``, positions and slot_mapping ``[B]``; returns ``[B, Hq, D]`` in q's dtype.
    Decode contract (the Triton kernel relies on it): ``slot_mapping[b]`` is the slot of token
    ``context_lens[b] - 1``, sequence b's new and last token, under ``block_tables[b]``.
    """
    q_rot, _ = rope_and_store_kv_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    return cached_decode_attention_ref(q_rot, k_cache, v_cache, block_tables, context_lens, scale, max_context_len)


def cached_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
) -> torch.Tensor:
    """Attention of one (already rotated) query per sequence over its ``context_lens[b]`` cached
    tokens, in fp32. q ``[B, Hq, D]``, caches ``[num_blocks, block_size, Hkv, D]``, block_tables
    ``[B, max_blocks]`` int32, context_lens ``[B]`` int32 in ``[1, max_context_len]``. Query head
    ``h`` reads KV head ``h // (Hq // Hkv)``. Returns ``[B, Hq, D]`` in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    length = min(max_context_len, block_tables.shape[1] * k_cache.shape[1])
    keys = gather_kv(k_cache, block_tables, length).float()  # [B, L, Hkv, D]
    values = gather_kv(v_cache, block_tables, length).float()
    qf = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,blkd->bkgl", qf, keys) * scale
    valid = torch.arange(length, device=q.device)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgl,blkd->bkgd", scores.softmax(dim=-1), values)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


# Triton: split-KV ("flash-decoding") paged attention. Grid (partition, KV head, sequence): a
# program takes one KV head with its G query heads, so each K/V row is loaded once for the group,
# and runs a base-2 online softmax over its partition. The partition count P depends on host
# shapes only (static under CUDA graphs); each sequence splits its live context into at most P
# partitions of whole tiles. With P > 1 the reduce kernel merges the partials (m, l, acc / l).


@triton.jit
def _partition_size(context_len, num_partitions, one_tile_limit, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """Tokens per partition of one sequence: its context over the partitions in whole tiles, at
    least one tile, at least MIN_TILES past one_tile_limit tiles."""
    min_tiles = tl.where(tl.cdiv(context_len, BLOCK_N) > one_tile_limit, MIN_TILES, 1)
    # Not the equal cdiv(tiles, P): that form compiled to a slower partition kernel.
    return tl.maximum(tl.cdiv(tl.cdiv(context_len, num_partitions), BLOCK_N), min_tiles) * BLOCK_N


@triton.jit
def _rotated(ptrs, d, pair, mask, cos, signed_sin):
    """RoPE of the rows at ``ptrs`` in fp32, rotate-half as one multiply-add per element:
    ``x[d] * cos + x[pair] * signed_sin`` (see the partition kernel for pair and signed_sin)."""
    return (
        tl.load(ptrs + d, mask=mask, other=0.0).to(tl.float32) * cos
        + tl.load(ptrs + pair, mask=mask, other=0.0).to(tl.float32) * signed_sin
    )


# Integers that change between steps are not specialized, so a new shape never triggers a compile.
@triton.jit(do_not_specialize=["max_len", "stride_bt", "num_partitions", "one_tile_limit"])
def _decode_partition_kernel(
    q_ptr,
    k_new_ptr,
    v_new_ptr,
    pos_ptr,
    cos_sin_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    part_ptr,
    qk_scale,
    max_len,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_cos,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    num_heads,
    group,
    head_dim,
    num_partitions,
    one_tile_limit,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MIN_TILES: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH_FIRST_TILE: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    part = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    # Rotate-half RoPE as one multiply-add per element: out[d] = x[d] * cos + x[pair] * signed_sin,
    # pair = d +- D/2, the sine negated on the first half (rope_and_store_kv_ref's formula).
    half = head_dim // 2
    first = d < half
    pair = tl.where(first, d + half, d - half)
    freq = tl.where(first, d, d - half)
    # Step inputs and the cos/sin table load before the PDL wait (kernels.pdl); in the loop,
    # block ids are loaded a tile ahead of the K/V gather they address.
    context_len = tl.minimum(tl.load(context_lens_ptr + seq), max_len)
    partition_size = _partition_size(context_len, num_partitions, one_tile_limit, BLOCK_N, MIN_TILES)
    start = part * partition_size
    end = tl.minimum(start + partition_size, context_len)
    n = start + tl.arange(0, BLOCK_N)
    block = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n < end, other=0)
    pos = tl.load(pos_ptr + seq).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cos + freq, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cos + half + freq, mask=d_mask, other=0.0).to(tl.float32)
    signed_sin = tl.where(first, -sin, sin)
    if USE_PDL:
        if PREFETCH_FIRST_TILE:
            # Prefetch the first tile's K/V rows into L2 while the kernel ahead finishes.
            row = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
            lines = row[:, None] + (tl.arange(0, BLOCK_D // LINE_ELEMS) * LINE_ELEMS)[None, :]
            line_mask = (n < end)[:, None] & (lines >= 0)  # broadcast to the lines' shape
            prefetch_l2(k_cache_ptr + lines, line_mask)
            prefetch_l2(v_cache_ptr + lines, line_mask)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # Empty partitions exit at once; the single partition always writes (zeros for an empty
    # context, e.g. a padding row of a CUDA-graph batch).
    if SINGLE_PARTITION or start < context_len:
        cache_ty = k_cache_ptr.dtype.element_ty
        # The partition holding the new token stores its rotated K and V before the loop; the
        # barrier makes them visible to the program's threads before the gather reads that slot.
        newest = context_len - 1
        k_rot = _rotated(k_new_ptr + seq * stride_kb + kv_head * stride_kh, d, pair, d_mask, cos, signed_sin)
        # Rounded to k's dtype first, as the reference returns and stores it.
        k_rot = k_rot.to(k_new_ptr.dtype.element_ty).to(cache_ty)
        v_new = tl.load(v_new_ptr + seq * stride_vb + kv_head * stride_vh + d, mask=d_mask, other=0.0).to(cache_ty)
        newest_d = newest + d * 0  # per element: the interpreter rejects a scalar bool in a mask
        store_mask = d_mask & (newest_d >= start) & (newest_d < end)
        slot_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_head * stride_ch + d
        tl.store(k_cache_ptr + slot_off, k_rot, mask=store_mask)
        tl.store(v_cache_ptr + slot_off, v_new, mask=store_mask)
        tl.debug_barrier()

        g = tl.arange(0, BLOCK_G)
        g_mask = g < group
        heads = kv_head * group + g
        q_mask = g_mask[:, None] & d_mask[None, :]
        q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh
        q = _rotated(q_ptrs, d[None, :], pair[None, :], q_mask, cos[None, :], signed_sin[None, :])
        # tl.dot takes one dtype, the cache's (16-bit products are exact in fp32); q is rounded
        # to its own dtype first, as the reference's rotated q is.
        q = q.to(q_ptr.dtype.element_ty).to(cache_ty)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        head_off = kv_head * stride_ch
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < end
            row = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_cs + head_off
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            n_next = n + BLOCK_N
            block = tl.load(block_tables_ptr + seq * stride_bt + n_next // BLOCK_SIZE, mask=n_next < end, other=0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, N], log2 units
            s = tl.where(n_mask[None, :], s, float("-inf"))
            # The first tile holds a valid token, so m_i stays finite and masked tokens weigh 0.
            m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_mask = g_mask[:, None] & d_mask[None, :]
        if SINGLE_PARTITION:
            tl.store(
                out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=out_mask,
            )
        else:
            # Partials are contiguous fp32: m, l [B, Hq, P]; part [B, Hq, P, D].
            idx = (seq * num_heads + heads) * num_partitions + part
            tl.store(m_ptr + idx, m_i, mask=g_mask)
            tl.store(l_ptr + idx, l_i, mask=g_mask)
            tl.store(part_ptr + idx[:, None] * head_dim + d[None, :], acc, mask=out_mask)


@triton.jit
def _merge_chunk(m_ptr, l_ptr, part_ptr, base, p0, used, d, d_mask, head_dim, m_run, l_run, acc, BLOCK_P: tl.constexpr):
    """The merge state (running max m_run, sum l_run, accumulator acc over columns d) after
    partitions p0 .. p0 + BLOCK_P - 1 of those below ``used`` (p0 < used)."""
    p = p0 + tl.arange(0, BLOCK_P)
    p_mask = p < used
    m = tl.load(m_ptr + base + p, mask=p_mask, other=float("-inf"))
    l = tl.load(l_ptr + base + p, mask=p_mask, other=0.0)
    o = tl.load(
        part_ptr + (base + p)[:, None] * head_dim + d[None, :], mask=p_mask[:, None] & d_mask[None, :], other=0.0
    )
    # The chunk holds partition p0 < used, so m_new is finite.
    m_new = tl.maximum(m_run, tl.max(m, axis=0))
    w = tl.where(p_mask, l * tl.exp2(m - m_new), 0.0)
    alpha = tl.exp2(m_run - m_new)
    return m_new, l_run * alpha + tl.sum(w, axis=0), acc * alpha + tl.sum(w[:, None] * o, axis=0)


@triton.jit(do_not_specialize=["max_len", "num_partitions", "one_tile_limit"])
def _decode_reduce_kernel(
    m_ptr,
    l_ptr,
    part_ptr,
    context_lens_ptr,
    out_ptr,
    max_len,
    stride_ob,
    stride_oh,
    num_heads,
    head_dim,
    num_partitions,
    one_tile_limit,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per (query head, sequence, BLOCK_D columns of the head): merges those
    columns of the head's partition partials."""
    head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    context_len = tl.minimum(tl.load(context_lens_ptr + seq), max_len)  # a step input: before the wait
    # partitions that hold at least one token, as the partition kernel split this sequence
    used = tl.cdiv(context_len, _partition_size(context_len, num_partitions, one_tile_limit, BLOCK_N, MIN_TILES))
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # the partials are the partition kernel's output
    base = (seq * num_heads + head) * num_partitions
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    # Masked rows cost time: a short merge gets a tile of its own height, longer ones BLOCK_P chunks.
    if used > _SHORT_MERGE:
        for p0 in range(0, used, BLOCK_P):
            m_run, l_run, acc = _merge_chunk(
                m_ptr, l_ptr, part_ptr, base, p0, used, d, d_mask, head_dim, m_run, l_run, acc, BLOCK_P
            )
    elif used > 0:
        m_run, l_run, acc = _merge_chunk(
            m_ptr, l_ptr, part_ptr, base, 0, used, d, d_mask, head_dim, m_run, l_run, acc, _SHORT_MERGE
        )
    # l_run is 0 only for an empty context (used == 0): write zeros rather than NaN.
    out = acc / tl.where(l_run > 0, l_run, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


_BLOCK_N = 64  # tokens per KV tile: 4 pages of 16; [64, 128] bf16 tiles for K and for V
_TARGET_PROGRAMS_PER_SM = 4  # resident 4-warp programs an SM: the grid fills one wave
_MIN_PARTITION_TILES = 2  # tiles a partition holds at least, past the one-tile limit
_ONE_TILE_PROGRAMS_PER_SM = 1  # one-tile partitions while the batch's take at most this many an SM
_WARPS_STAGES = (4, 2)  # num_warps, num_stages of the partition kernel
# The reduce runs one warp a program, so its merge over partitions stays in registers; small
# batches split each head's columns over several programs to spread over the SMs.
_REDUCE_PROGRAMS_PER_SM = 3
_MIN_REDUCE_COLUMNS = 16
_SHORT_MERGE = tl.constexpr(2)  # partitions merged in a tile of their own height
_MAX_MERGE_CHUNK = 32  # longer merges go in chunks of up to this many partitions
# Only small batches prefetch the first K/V tile into L2: larger ones gained nothing from it.
_PREFETCH_MAX_BATCH = 16


def _num_partitions(max_context_len: int, batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Partitions per (sequence, KV head): as many as fill one wave of programs (a partly filled
    second wave costs a full one), at least one, at most a max_context_len sequence's tiles.
    Host ints only, so a graph captured for (batch, max_context_len) serves every shorter context.
    """
    wave = _TARGET_PROGRAMS_PER_SM * num_sms(device) // (batch * num_kv_heads)
    return max(1, min(wave, triton.cdiv(max_context_len, _BLOCK_N)))


def _reduce_columns(batch: int, num_heads: int, head_dim: int, device: torch.device) -> int:
    """Columns of a head a reduce program merges: the head's width (a power of two), halved while
    the batch's programs stay within _REDUCE_PROGRAMS_PER_SM an SM, down to _MIN_REDUCE_COLUMNS."""
    columns = triton.next_power_of_2(head_dim)
    programs = batch * num_heads
    while columns > _MIN_REDUCE_COLUMNS and 2 * programs <= _REDUCE_PROGRAMS_PER_SM * num_sms(device):
        columns //= 2
        programs *= 2
    return columns


def _one_tile_limit(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Tiles of context up to which partitions hold one tile each (at least _MIN_PARTITION_TILES):
    while the batch's one-tile programs fit _ONE_TILE_PROGRAMS_PER_SM an SM. Past that, a one-tile
    partition spends as much on its partial and merge as on its keys."""
    return max(_MIN_PARTITION_TILES, _ONE_TILE_PROGRAMS_PER_SM * num_sms(device) // (batch * num_kv_heads))


def paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
) -> torch.Tensor:
    """Triton :func:`paged_decode_attention_ref`: RoPE, the K/V store and the attention in one
    kernel (plus the split-KV reduce). q, k, v may be strided views with unit stride in D. Returns
    a new contiguous ``[B, Hq, D]`` tensor. No host sync: capturable in a CUDA graph for a fixed
    (B, max_context_len), with inputs changing between replays. Padding rows (context length 1,
    a shared dummy slot) race only on that slot and get unspecified output; context_len 0 yields
    zeros (the reference: NaN).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    batch, num_heads, head_dim = q.shape
    check_new_tokens(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    check_paged_cache(q, k_cache, v_cache, block_tables, context_lens, batch)
    if max_context_len < 1:
        raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    # As in the reference, nothing past the block table's reach is read.
    max_len = min(max_context_len, block_tables.shape[1] * k_cache.shape[1])
    num_partitions = _num_partitions(max_len, batch, num_kv_heads, q.device)
    one_tile_limit = _one_tile_limit(batch, num_kv_heads, q.device)
    block_d = triton.next_power_of_2(head_dim)
    if num_partitions == 1:
        m = l = partials = out  # unused by the single-partition variant
    else:
        m = torch.empty((batch, num_heads, num_partitions), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        partials = torch.empty((batch, num_heads, num_partitions, head_dim), dtype=torch.float32, device=q.device)
    _decode_partition_kernel[(num_partitions, num_kv_heads, batch)](
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        slot_mapping,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        m,
        l,
        partials,
        scale * LOG2E,
        max_len,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads,
        group,
        head_dim,
        num_partitions,
        one_tile_limit,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=_BLOCK_N,
        BLOCK_D=block_d,
        MIN_TILES=_MIN_PARTITION_TILES,
        SINGLE_PARTITION=num_partitions == 1,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        PREFETCH_FIRST_TILE=batch <= _PREFETCH_MAX_BATCH,
        LINE_ELEMS=min(block_d, pdl.L2_LINE_BYTES // k_cache.element_size()),
        num_warps=_WARPS_STAGES[0],
        num_stages=_WARPS_STAGES[1],
        **pdl.launch_args(q.device),
    )
    if num_partitions > 1:
        columns = _reduce_columns(batch, num_heads, head_dim, q.device)
        _decode_reduce_kernel[(num_heads, batch, triton.cdiv(head_dim, columns))](
            m,
            l,
            partials,
            context_lens,
            out,
            max_len,
            out.stride(0),
            out.stride(1),
            num_heads,
            head_dim,
            num_partitions,
            one_tile_limit,
            BLOCK_P=min(_MAX_MERGE_CHUNK, triton.next_power_of_2(num_partitions)),
            BLOCK_D=columns,
            BLOCK_N=_BLOCK_N,
            MIN_TILES=_MIN_PARTITION_TILES,
            num_warps=1,
            **pdl.launch_args(q.device),
        )
    return out
