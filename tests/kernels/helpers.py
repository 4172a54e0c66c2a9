"""What the kernel tests share: tolerances, random inputs, the paged-cache fixture and the two
attention case runners (each kernel's own test file runs them, and so does the compile-once test).

Paged-cache fixtures poison every slot that holds no live token with NaN (the reference gets a
zeroed copy, since it gathers whole blocks): a kernel that lets any stale slot into its math,
even with a zero softmax weight, fails with NaN.
"""

from __future__ import annotations

import math

import torch

from pdserve.kernels import decode_attention, prefill_attention

CPU = torch.device("cpu")
CPU_DTYPES = [torch.float32, torch.float16]  # never bf16 on CPU: the interpreter's bf16 arithmetic is wrong
GPU_DTYPES = [torch.bfloat16, torch.float16]
# The GPU tests' shapes: Qwen2.5-1.5B's heads, head_dim, hidden and intermediate sizes; its block size.
HQ, HKV, HEAD_DIM, HIDDEN, INTER, BLOCK = 12, 2, 128, 1536, 8960, 16


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
    assert not actual.isnan().any(), "kernel output has NaN"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# Tolerances. fp32 (interpreter only): summation order differs from torch's, nothing else.
# fp16 / bf16: both sides compute in fp32 and round once to the output dtype, so elementwise
# outputs may differ by an ulp or two after rounding (relative ulp: fp16 2^-10, bf16 2^-7).
# Attention kernels feed the stored 16-bit q/K/V straight to tl.dot (products exact in the fp32
# accumulator) but round the softmax weights to 16 bits before the P @ V dot: one relative ulp
# per weight, which averages out over the context; outputs (|o| <~ 3) stay within a few ulps.
ELEMENTWISE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
# Linear: fp32 sums of K products in another order (fp32), then one rounding to 16 bits.
LINEAR_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
ATTENTION_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def make_paged_cache(
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    spare_blocks: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V for ``context_lens`` tokens behind shuffled block tables.

    Returns (k_cache, v_cache, k_clean, v_clean, block_tables): the first pair has NaN in
    every slot no live token owns; the clean pair has zeros there (for the references). Block
    table entries past a sequence's blocks point at random (stale) blocks.
    """
    needed = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(needed) + spare_blocks
    max_blocks = max(needed) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen, dtype=torch.float32).to(device, dtype)
    v = torch.randn(shape, generator=gen, dtype=torch.float32).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=gen, dtype=torch.int32)
    live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for b, n in enumerate(context_lens):
        blocks = torch.tensor([perm.pop() for _ in range(needed[b])], dtype=torch.long)
        tables[b, : needed[b]] = blocks.int()
        pos = torch.arange(n)
        live[blocks[pos // block_size] * block_size + pos % block_size] = True
    dead = ~live.to(device).view(num_blocks, block_size, 1, 1)
    nan = float("nan")
    return (
        k.masked_fill(dead, nan),
        v.masked_fill(dead, nan),
        k.masked_fill(dead, 0),
        v.masked_fill(dead, 0),
        tables.to(device),
    )


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device, dtype)


def rope_table(max_pos: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """``[max_pos, head_dim]`` fp32: cos in the first half, sin in the second (base 10000)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


def last_slots(tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slot of each sequence's last token (where a decode step stores its new K/V)."""
    last = context_lens.long() - 1
    return tables.long().gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size


def new_decode_tokens(
    gen: torch.Generator,
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's q, k, v: strided views of one qkv row per sequence, as the engine passes them."""
    qkv = rand(gen, batch, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    return q, k, v


def check_decode(
    context_lens: list[int],
    max_context_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    gen = torch.Generator().manual_seed(4)
    batch = len(context_lens)
    k_cache, v_cache, k_clean, v_clean, tables = make_paged_cache(
        context_lens, block_size, num_kv_heads, head_dim, dtype, device, gen
    )
    q, k, v = new_decode_tokens(gen, batch, num_heads, num_kv_heads, head_dim, dtype, device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    positions = lens.long() - 1
    slots = last_slots(tables, lens, block_size)
    cos_sin = rope_table(max(context_lens), head_dim, device)
    # The new tokens' slots hold NaN: the kernel must store their K/V (from k and v) before it reads them.
    flat = (-1, num_kv_heads, head_dim)
    k_cache.view(flat)[slots] = float("nan")
    v_cache.view(flat)[slots] = float("nan")
    scale = head_dim**-0.5
    out = decode_attention.paged_decode_attention(
        q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens, scale, max_context_len
    )
    ref = decode_attention.paged_decode_attention_ref(
        q, k, v, positions, cos_sin, k_clean, v_clean, slots, tables, lens, scale, max_context_len
    )
    assert out.shape == (batch, num_heads, head_dim) and out.dtype == dtype
    assert_close(out, ref, *ATTENTION_TOL[dtype])
    # ... and store them as rope_and_store_kv_ref does (rotated k, plain v).
    assert_close(k_cache.view(flat)[slots], k_clean.view(flat)[slots], *ELEMENTWISE_TOL[dtype])
    assert torch.equal(v_cache.view(flat)[slots], v_clean.view(flat)[slots])


def check_prefill(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, k_clean, v_clean, tables = make_paged_cache(
        context_lens, block_size, num_kv_heads, head_dim, dtype, device, gen
    )
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = rand(gen, sum(query_lens), num_heads, head_dim, dtype=dtype, device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = prefill_attention.paged_prefill_attention(q, k_cache, v_cache, cu, tables, lens, scale)
    ref = prefill_attention.paged_prefill_attention_ref(q, k_clean, v_clean, cu, tables, lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, ref, *ATTENTION_TOL[dtype])
