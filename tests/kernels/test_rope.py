"""kernels.rope (rotary embedding fused with the paged KV store) against its torch reference
(tests/kernels/conftest.py says how the CPU and GPU cases run)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels import rope
from pdserve.tests.kernels.helpers import (
    BLOCK,
    CPU,
    ELEMENTWISE_TOL,
    GPU_DTYPES,
    HEAD_DIM,
    HKV,
    HQ,
    assert_close,
    rand,
    rope_table,
)


def check_rope(
    num_tokens: int,
    num_pad: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    device: torch.device,
) -> None:
    """``num_pad`` trailing padding tokens all map to dummy slot 0, the others to shuffled slots."""
    gen = torch.Generator().manual_seed(3)
    total = num_tokens + num_pad
    max_pos = 4 * total + 8
    qkv = rand(gen, total, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(total, num_heads, head_dim)  # strided views, as the engine passes them
    k = k.view(total, num_kv_heads, head_dim)
    v = v.view(total, num_kv_heads, head_dim)
    positions = torch.randint(0, max_pos, (total,), generator=gen).to(device)
    cos_sin_cache = rope_table(max_pos, head_dim, device)
    num_blocks = math.ceil(total / block_size) + 2
    slots = 1 + torch.randperm(num_blocks * block_size - 1, generator=gen)[:num_tokens]
    slot_mapping = torch.cat((slots, torch.zeros(num_pad, dtype=torch.long))).to(device)
    k_cache = rand(gen, num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype, device=device)
    v_cache = rand(gen, num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype, device=device)
    k_cache_ref, v_cache_ref = k_cache.clone(), v_cache.clone()
    q_before, k_before = q.clone(), k.clone()

    q_rot, k_rot = rope.rope_and_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    q_ref, k_ref = rope.rope_and_store_kv_ref(q, k, v, positions, cos_sin_cache, k_cache_ref, v_cache_ref, slot_mapping)
    atol, rtol = ELEMENTWISE_TOL[dtype]
    assert_close(q_rot, q_ref, atol, rtol)
    assert_close(k_rot, k_ref, atol, rtol)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # out of place, as the reference
    # Padding tokens race on the dummy slot (each writes its heads and halves separately, so
    # the slot may end up a mix of several): its content is unspecified and skipped. Every
    # other slot must match, written ones and untouched ones alike.
    flat = (-1, num_kv_heads, head_dim)
    keep = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    keep[0] = num_pad == 0
    atol_c, rtol_c = ELEMENTWISE_TOL[cache_dtype if cache_dtype != torch.float32 else dtype]
    assert_close(k_cache.view(flat)[keep], k_cache_ref.view(flat)[keep], atol_c, rtol_c)
    assert torch.equal(v_cache.view(flat)[keep], v_cache_ref.view(flat)[keep])  # a plain copy


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float16)],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (3, 1, 12)])
def test_rope_and_store_kv_interpreted(
    interpreter: None, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    check_rope(5, 3, num_heads, num_kv_heads, head_dim, 4, dtype, cache_dtype, CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(("tokens", "pad"), [(1, 0), (8, 24), (128, 0), (2048, 0)])
def test_rope_and_store_kv_gpu(cuda: torch.device, tokens: int, pad: int, dtype: torch.dtype) -> None:
    check_rope(tokens, pad, HQ, HKV, HEAD_DIM, BLOCK, dtype, dtype, cuda)
