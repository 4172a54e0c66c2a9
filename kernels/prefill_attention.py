"""Causal attention for a variable-length batch of query chunks over the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention_common import LOG2E, check_paged_cache, gather_kv, num_sms, online_softmax_step
from pdserve.kernels.checks import dot_precision

_REF_SCORES = 1 << 24  # score elements the reference holds at once (64 MiB in fp32)


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention, in fp32, of the *last* ``q_len_b`` of sequence b's ``context_lens[b]``
    tokens over all of them, read from the paged cache (the new tokens' K/V stored beforehand).
    q ``[T, Hq, D]`` with ``T = cu_seqlens_q[-1]``, cu_seqlens_q ``[B + 1]`` int32, block_tables
    ``[B, max_blocks]`` int32, context_lens ``[B]`` int32. Returns ``[T, Hq, D]`` in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lengths = context_lens.tolist()
    for b, context_len in enumerate(lengths):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        keys = gather_kv(k_cache, block_tables[b : b + 1], context_len)[0].float()  # [L, Hkv, D]
        values = gather_kv(v_cache, block_tables[b : b + 1], context_len)[0].float()
        # Queries in chunks, each over the keys up to its last position: the scores of a long
        # prompt stay within _REF_SCORES (this reference is the CPU engine's attention).
        chunk = max(1, _REF_SCORES // (context_len * num_heads))
        for c0 in range(0, q_len, chunk):
            c1 = min(q_len, c0 + chunk)
            visible = context_len - q_len + c1  # keys the chunk's last query sees
            qf = q[q_start + c0 : q_start + c1].float().view(c1 - c0, num_kv_heads, group, head_dim)
            scores = torch.einsum("qkgd,lkd->kgql", qf, keys[:visible]) * scale
            q_pos = torch.arange(context_len - q_len + c0, visible, device=q.device)
            k_pos = torch.arange(visible, device=q.device)
            scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
            o = torch.einsum("kgql,lkd->qkgd", scores.softmax(dim=-1), values[:visible])
            out[q_start + c0 : q_start + c1] = o.reshape(c1 - c0, num_heads, head_dim).to(q.dtype)
    return out


# Triton flash-attention. A tile's rows pack the G query heads of one KV head (row r: query
# r // G, head kv_head * G + r % G), so each K/V tile is loaded once for the group. Grid (row tile,
# KV head): sequence b owns tiles [cu_seqlens_q[b] * G // BLOCK_M + b, cu_seqlens_q[b + 1] * G //
# BLOCK_M + b + 1), so the grid depends on T and B alone (CUDA-graph safe) and spare tiles exit.
# Tiles run from the end, heaviest first. Keys below full_end need no causal mask.
#
# Split-KV: when the row tiles fill few programs (a short chunk over a long cached context), a
# third grid axis splits each tile's keys into partitions of whole key tiles; every partition
# writes its unnormalized partial (m, l, acc) and the reduce kernel merges them. The split count
# depends on T alone, so the grid still depends on T and B alone.


@triton.jit
def _guarded_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """:func:`online_softmax_step` for rows that may have seen no key yet (m_i and s all -inf):
    a partition past a row's position masks every key of that row, which must then stay at
    m -inf, l 0, acc 0 instead of NaN."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    head_off,
    qk_scale,
    stride_cb,
    stride_cs,
    n0,
    q_pos,
    context_len,
    d,
    d_mask,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    GUARDED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile's update of the online softmax state (m_i, l_i, acc) of a row tile; GUARDED
    when a row may have seen no key yet (a split's partition past its position)."""
    n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = n < context_len
        block = tl.load(block_table_ptr + n // BLOCK_SIZE, mask=n_mask, other=0)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        block = tl.load(block_table_ptr + n // BLOCK_SIZE)
        kv_mask = d_mask[None, :]
    row = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_cs + head_off
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N], log2 units
    if MASKED:
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
    if GUARDED:
        return _guarded_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)
    # Unsplit, every row sees key 0 in the first tile it processes, so m_new is finite from then on.
    return online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)


@triton.jit
def _find_sequence(cu_seqlens_ptr, tile, num_seqs, group, BLOCK_M: tl.constexpr):
    """The sequence whose tile range (see above) holds flat tile ``tile``: the last b with
    cu_seqlens_q[b] * group // BLOCK_M + b <= tile, by binary search (those starts grow
    strictly)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_ptr + mid) * group // BLOCK_M + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Not specialized (they change between steps), so a new shape never triggers a compile.
@triton.jit(do_not_specialize=["stride_bt", "num_seqs", "num_rows", "num_splits"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cu_seqlens_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    part_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    num_heads,
    group,
    head_dim,
    num_seqs,
    num_rows,
    num_splits,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_idx = _find_sequence(cu_seqlens_ptr, tile, num_seqs, group, BLOCK_M)
    q_start = tl.load(cu_seqlens_ptr + seq_idx)
    m_tile = tile - (q_start * group // BLOCK_M + seq_idx)  # the tile's index within its sequence
    seq = seq_idx.to(tl.int64)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M < q_len * group:
        context_len = tl.load(context_lens_ptr + seq)
        r = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # the tile's rows within its sequence
        i = r // group  # query index within the sequence
        r_mask = r < q_len * group
        q_pos = context_len - q_len + i
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_dim
        q_rows = (q_start + i).to(tl.int64)
        heads = kv_head * group + r % group
        q_offsets = q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q_mask = r_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
        # tl.dot takes one dtype, the cache's. The scale goes on the fp32 scores: folding it into
        # q would round q a second time.
        q = q.to(k_cache_ptr.dtype.element_ty)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        block_table_ptr = block_tables_ptr + seq * stride_bt
        head_off = kv_head * stride_ch
        first_pos = context_len - q_len + m_tile * BLOCK_M // group  # the tile's first query
        last_pos = tl.minimum(context_len - q_len + (m_tile * BLOCK_M + BLOCK_M - 1) // group, context_len - 1)
        full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
        end = last_pos + 1
        lo = 0
        if SPLIT:
            # This split's keys: whole key tiles, at least MIN_SPLIT_TILES of them, so that a short
            # context uses fewer partitions instead of many near-empty ones.
            partition = tl.maximum(tl.cdiv(tl.cdiv(end, num_splits), BLOCK_N), MIN_SPLIT_TILES) * BLOCK_N
            lo = split * partition
            end = tl.minimum(lo + partition, end)
        for n0 in range(lo, tl.minimum(full_end, end), BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q,
                m_i,
                l_i,
                acc,
                k_cache_ptr,
                v_cache_ptr,
                block_table_ptr,
                head_off,
                qk_scale,
                stride_cb,
                stride_cs,
                n0,
                q_pos,
                context_len,
                d,
                d_mask,
                BLOCK_SIZE,
                BLOCK_N,
                False,
                False,  # every row sees these keys: m turns finite at the first
                DOT_PRECISION,
            )
        for n0 in range(tl.maximum(lo, full_end), end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q,
                m_i,
                l_i,
                acc,
                k_cache_ptr,
                v_cache_ptr,
                block_table_ptr,
                head_off,
                qk_scale,
                stride_cb,
                stride_cs,
                n0,
                q_pos,
                context_len,
                d,
                d_mask,
                BLOCK_SIZE,
                BLOCK_N,
                True,
                SPLIT,  # a partition's masked keys may be all a row sees in it
                DOT_PRECISION,
            )
        if SPLIT:
            # Partials are fp32, row = token * Hq + head: m, l [S, num_rows]; acc [S, num_rows, D],
            # unnormalized. Rows that saw no key here (m -inf) write no acc: the reduce skips them.
            idx = split * num_rows + q_rows * num_heads + heads
            tl.store(m_ptr + idx, m_i, mask=r_mask)
            tl.store(l_ptr + idx, l_i, mask=r_mask)
            seen = q_mask & (m_i > float("-inf"))[:, None]
            tl.store(part_ptr + idx[:, None] * head_dim + d[None, :], acc, mask=seen)
        else:
            out = acc / l_i[:, None]
            out_offsets = q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
            tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=["num_rows"])
def _prefill_reduce_kernel(
    m_ptr,
    l_ptr,
    part_ptr,
    cu_seqlens_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    head_dim,
    num_seqs,
    num_rows,
    NUM_SPLITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merges the split partials of BLOCK_R rows (token * Hq + head) into the output; rows of
    padding tokens (past cu_seqlens_q[-1]) are left alone. The split count is a constexpr so the
    loop unrolls and every partition's loads go out together."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < tl.load(cu_seqlens_ptr + num_seqs) * num_heads
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    m_run = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        idx = split * num_rows + r.to(tl.int64)
        m = tl.load(m_ptr + idx, mask=r_mask, other=float("-inf"))
        l = tl.load(l_ptr + idx, mask=r_mask, other=0.0)
        seen = r_mask & (m > float("-inf"))
        o = tl.load(part_ptr + idx[:, None] * head_dim + d[None, :], mask=seen[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m_run, m)
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # finite for padding rows too
        alpha = tl.exp2(m_run - m_use)
        w = tl.where(seen, tl.exp2(m - m_use), 0.0)
        l_run = l_run * alpha + l * w
        acc = acc * alpha[:, None] + o * w[:, None]
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    token = r // num_heads
    head = r % num_heads
    offsets = token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def _tile_config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the prefill kernel; BLOCK_M counts rows
    (query, head) of one KV head's group. Tuned for head_dim 128; wider heads halve the key tile
    so that the staged K/V tiles still fit in shared memory."""
    if head_dim <= 128:
        return 64, 64, 4, 2
    return 64, 32, 4, 2


_SPLIT_PROGRAMS_PER_SM = 2  # a split grid aims at this many programs an SM: one wave
_MAX_SPLITS = 16
_MIN_SPLIT_TILES = 2  # key tiles a partition holds at least
_REDUCE_ROWS = 16  # (token, head) rows a reduce program merges


def num_splits(num_tokens: int, group: int, num_kv_heads: int, head_dim: int, device: torch.device) -> int:
    """Key partitions per row tile of a step of T tokens: 1 while the row tiles fill the GPU,
    else as many as fill one wave, at most _MAX_SPLITS. Each sequence's spare tile is not
    counted: a graph's padding sequences own one each and exit at once. From host ints only, so a
    CUDA graph captured for T tokens splits every context its replays bring."""
    block_m = _tile_config(head_dim)[0]
    busy_programs = (num_tokens * group // block_m + 1) * num_kv_heads
    return max(1, min(_MAX_SPLITS, _SPLIT_PROGRAMS_PER_SM * num_sms(device) // busy_programs))


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton :func:`paged_prefill_attention_ref` (same shapes, invariants and result); q may be a
    strided view with unit stride in D. No host sync and a grid from T and B alone: capturable in
    a CUDA graph for a fixed (T, B), with the other inputs changing between replays. Token rows
    past ``cu_seqlens_q[-1]`` (a graph's padding) get unspecified output.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1 or cu_seqlens_q.dtype != torch.int32:
        raise ValueError(f"cu_seqlens_q must be [B + 1] int32, got {tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}")
    if cu_seqlens_q.device != q.device:
        raise ValueError(f"cu_seqlens_q is on {cu_seqlens_q.device}, q on {q.device}")
    batch = cu_seqlens_q.shape[0] - 1
    check_paged_cache(q, k_cache, v_cache, block_tables, context_lens, batch)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0 or num_tokens == 0:
        return out
    block_m, block_n, num_warps, num_stages = _tile_config(head_dim)
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    tiles = num_tokens * group // block_m + batch
    splits = num_splits(num_tokens, group, num_kv_heads, head_dim, q.device)
    num_rows = num_tokens * num_heads
    if splits == 1:
        m = l = partials = out  # unused by the unsplit variant
    else:
        m = torch.empty((splits, num_rows), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        partials = torch.empty((splits, num_rows, head_dim), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    _prefill_kernel[(tiles, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        block_tables,
        context_lens,
        out,
        m,
        l,
        partials,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads,
        group,
        head_dim,
        batch,
        num_rows,
        splits,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        MIN_SPLIT_TILES=_MIN_SPLIT_TILES,
        SPLIT=splits > 1,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        _prefill_reduce_kernel[(triton.cdiv(num_rows, _REDUCE_ROWS),)](
            m,
            l,
            partials,
            cu_seqlens_q,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            head_dim,
            batch,
            num_rows,
            NUM_SPLITS=splits,
            BLOCK_R=_REDUCE_ROWS,
            BLOCK_D=block_d,
        )
    return out
