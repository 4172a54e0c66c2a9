"""Causal attention for a variable-length batch of query chunks over the paged cache."""

from __future__ import annotations

import torch

from kernels.decode_attention import gather_kv


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """Queries of sequence ``b`` are the *last* ``q_len_b`` tokens of its ``context_lens[b]``.

    The K/V of all ``context_lens[b]`` tokens, a prefix already cached included, are read from
    the paged cache (the new tokens' K/V are stored before this call). Query ``i`` of ``b`` sits
    at position ``context_lens[b] - q_len_b + i`` and attends to every position ``<=`` it.

    Shapes: q ``[T, Hq, D]`` with ``T = cu_seqlens_q[-1]``, cu_seqlens_q ``[B + 1]`` int32,
    block_tables ``[B, max_blocks]`` int32, context_lens ``[B]`` int32, every ``q_len_b <=
    max_query_len``. Returns ``[T, Hq, D]`` in q's dtype; computed in fp32.
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
        qf = q[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qkgd,lkd->kgql", qf, keys) * scale
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        k_pos = torch.arange(context_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        o = torch.einsum("kgql,lkd->qkgd", scores.softmax(dim=-1), values)
        out[q_start:q_end] = o.reshape(q_len, num_heads, head_dim).to(q.dtype)
    return out
