"""What the paged attention kernels (decode and prefill) share: the checks of the paged cache and
its tables, the online-softmax step over one key tile, the reference's gather of cached K/V and
the SM count their grids are sized by."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import check_float_dtype

LOG2E = 1.4426950408889634  # scores are scaled by it so that the softmax runs on exp2


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[B, num_tokens, Hkv, D]``: the first ``num_tokens`` cached tokens of each row."""
    block_size = cache.shape[1]
    positions = torch.arange(num_tokens, device=cache.device)
    blocks = block_tables.long()[:, positions // block_size]
    slots = blocks * block_size + positions % block_size
    return cache.view(-1, *cache.shape[2:])[slots]


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Online softmax state (running max m_i, sum l_i, accumulator acc) after one more key tile:
    scores s ``[M, N]`` in log2 units (-inf where masked; each row's m_i or s must hold a finite
    value) and values v ``[N, D]``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number keeps the partition count small
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_paged_cache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    batch: int,
) -> None:
    """Checks shared by the decode and prefill wrappers (q is [*, Hq, D])."""
    num_heads, head_dim = q.shape[1:]
    if k_cache.dim() != 4 or k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache must be [num_blocks, block_size, Hkv, {head_dim}], got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} {v_cache.stride()} {v_cache.dtype} must match "
            f"k_cache {tuple(k_cache.shape)} {k_cache.stride()} {k_cache.dtype}"
        )
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    for name, t in (("q", q), ("k_cache", k_cache)):
        check_float_dtype(name, t)
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be [{batch}, max_blocks] int32, got {tuple(block_tables.shape)} {block_tables.dtype}"
        )
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be contiguous in its last dim, got strides {block_tables.stride()}")
    if context_lens.shape != (batch,) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be [{batch}] int32, got {tuple(context_lens.shape)} {context_lens.dtype}")
    for name, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("context_lens", context_lens),
    ):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
