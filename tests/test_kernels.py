"""Each Triton kernel against its torch reference.

CPU (CI): every kernel runs under Triton's interpreter at tiny shapes, in fp32 and fp16 (never
bf16: the interpreter's bf16 arithmetic is wrong). ``triton.jit`` picks interpreter or compiler
when a kernel module is imported, and ``triton.language``'s own jitted helpers (``tl.sum``,
``tl.max``...) are fixed when triton is imported, so TRITON_INTERPRET=1 must be in the
environment before the first ``import triton`` of the process: tests/conftest.py sets it at its
top on machines without CUDA, and pytest loads it before any test module (the engine's modules,
which import ``kernels.*`` for the references, come later). The ``interpreter`` fixture
(conftest) checks that this held instead of trusting it. The interpreter costs about 18 ms per
program instance: each case keeps to a few dozen programs.

GPU (``-m gpu``; conftest skips them without CUDA): real Qwen2.5-1.5B shapes (12 query heads,
2 KV heads, head_dim 128, hidden 1536, intermediate 8960, block_size 16), bf16 and fp16, random
inputs, and a CUDA-graph capture of decode attention replayed with new lengths and tables.

Paged-cache fixtures poison every slot that holds no live token with NaN (the reference gets a
zeroed copy, since it gathers whole blocks): a kernel that lets any stale slot into its math,
even with a zero softmax weight, fails with NaN.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pytest
import torch
import triton

from pdserve.kernels import activation, decode_attention, embedding, linear, pdl, prefill_attention, rmsnorm, rope

CPU = torch.device("cpu")


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


# --------------------------------------------------------------------------------------------
# Paged-cache fixture shared by the attention tests
# --------------------------------------------------------------------------------------------


def make_paged_cache(
    context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device, gen: torch.Generator, spare_blocks: int = 3,
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
    return (k.masked_fill(dead, nan), v.masked_fill(dead, nan), k.masked_fill(dead, 0), v.masked_fill(dead, 0),
            tables.to(device))


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


def new_decode_tokens(gen: torch.Generator, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's q, k, v: strided views of one qkv row per sequence, as the engine passes them."""
    qkv = rand(gen, batch, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    return q, k, v


# --------------------------------------------------------------------------------------------
# Case runners: one body per kernel, used by the CPU (interpreter) and the GPU tests
# --------------------------------------------------------------------------------------------


def check_rms_norm(rows: tuple[int, ...], hidden: int, dtype: torch.dtype, device: torch.device,
                   strided: bool = False) -> None:
    gen = torch.Generator().manual_seed(1)
    wide = rand(gen, *rows, hidden + (16 if strided else 0), dtype=dtype, device=device)
    x = wide[..., :hidden]  # a row stride larger than hidden when strided
    residual = rand(gen, *rows, hidden, dtype=dtype, device=device)
    weight = rand(gen, hidden, dtype=dtype, device=device)
    x_before, r_before = x.clone(), residual.clone()
    atol, rtol = ELEMENTWISE_TOL[dtype]
    assert_close(rmsnorm.rms_norm(x, weight, 1e-6), rmsnorm.rms_norm_ref(x, weight, 1e-6), atol, rtol)
    out, summed = rmsnorm.fused_add_rms_norm(x, residual, weight, 1e-6)
    out_ref, summed_ref = rmsnorm.fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(summed, summed_ref)  # one fp32 add, one rounding: bit-exact
    assert_close(out, out_ref, atol, rtol)
    assert torch.equal(x, x_before) and torch.equal(residual, r_before)
    # Split-K partial sums in place of x: three fp32 splits, added in order and rounded first.
    partials = rand(gen, 3, *rows, hidden, dtype=torch.float32, device=device) * 4
    partials_before = partials.clone()
    out, summed = rmsnorm.fused_add_rms_norm(partials, residual, weight, 1e-6)
    out_ref, summed_ref = rmsnorm.fused_add_rms_norm_ref(partials, residual, weight, 1e-6)
    assert summed.dtype == dtype and torch.equal(summed, summed_ref)
    assert torch.equal(summed, ((partials[0] + partials[1] + partials[2]).to(dtype).float() + residual.float()).to(dtype))
    assert_close(out, out_ref, atol, rtol)
    assert torch.equal(partials, partials_before)


def check_embedding(num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device,
                    strided_ids: bool = False) -> None:
    """A gather: bitwise the reference, for ids that repeat and that hit both ends of the table."""
    gen = torch.Generator().manual_seed(11)
    weight = rand(gen, vocab, hidden, dtype=dtype, device=device)
    ids = torch.randint(0, vocab, (num_tokens * (2 if strided_ids else 1),), generator=gen)
    ids[:3] = torch.tensor([0, vocab - 1, 0])[: len(ids)]
    ids = ids.to(device)[:: 2 if strided_ids else 1]  # every other id: a stride-2 view when strided
    out = embedding.embedding(ids, weight)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    assert torch.equal(out, embedding.embedding_ref(ids, weight))


def check_silu_and_mul(rows: tuple[int, ...], inter: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(2)
    x = rand(gen, *rows, 2 * inter, dtype=dtype, device=device) * 3
    out = activation.silu_and_mul(x)
    assert out.shape == (*rows, inter)
    assert_close(out, activation.silu_and_mul_ref(x), *ELEMENTWISE_TOL[dtype])


def check_linear(rows: tuple[int, ...], n: int, k: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, strided: bool = False,
                 kernel: Callable[..., torch.Tensor] = linear.linear_kernel) -> None:
    """``kernel`` (linear_kernel or linear_dot) against the fp32 reference, and bitwise equal to
    itself on a second call (linear_dot's split-K partial sums are added in a fixed order). Into
    an fp32 ``out`` it stores the unrounded sum: fp32-close to the reference, and rounded to the
    inputs' dtype the bits of its own output."""
    gen = torch.Generator().manual_seed(3)
    wide = rand(gen, *rows, k + (8 if strided else 0), dtype=dtype, device=device)
    x = wide[..., :k]  # a row stride larger than K when strided
    weight = rand(gen, n, k, dtype=dtype, device=device) / math.sqrt(k)  # outputs of order 1
    b = rand(gen, n, dtype=dtype, device=device) if bias else None
    out = kernel(x, weight, b)
    assert out.shape == (*rows, n) and out.dtype == dtype
    # The reference in fp32 on the same (rounded) inputs: both accumulate in fp32, the kernel
    # then rounds once to the output dtype.
    expected = linear.linear_ref(x.float(), weight.float(), None if b is None else b.float())
    atol, rtol = LINEAR_TOL[dtype]
    assert_close(out, expected, atol, rtol)
    assert torch.equal(out, kernel(x, weight, b))
    out32 = torch.full((*rows, n), float("nan"), dtype=torch.float32, device=device)
    assert kernel(x, weight, b, out=out32) is out32
    assert torch.equal(out32.to(dtype), out)
    assert_close(out32, expected, *LINEAR_TOL[torch.float32])


def check_linear_silu_and_mul(rows: tuple[int, ...], inter: int, k: int, bias: bool, dtype: torch.dtype,
                              device: torch.device) -> None:
    """The one-row kernel with the gate in its epilogue against the fp32 reference, and bitwise
    equal to the two kernels it replaces (the linear kernel, then SiLU-mul)."""
    gen = torch.Generator().manual_seed(5)
    x = rand(gen, *rows, k, dtype=dtype, device=device)
    weight = rand(gen, 2 * inter, k, dtype=dtype, device=device) * (3 / math.sqrt(k))  # gates of order 3
    b = rand(gen, 2 * inter, dtype=dtype, device=device) if bias else None
    out = linear.linear_silu_and_mul_kernel(x, weight, b)
    assert out.shape == (*rows, inter) and out.dtype == dtype
    assert torch.equal(out, activation.silu_and_mul(linear.linear_kernel(x, weight, b)))
    expected = linear.linear_silu_and_mul_ref(x.float(), weight.float(), None if b is None else b.float())
    assert_close(out, expected, *LINEAR_TOL[dtype])


def check_linear_partial_sums(rows: tuple[int, ...], n: int, k: int, splits: int, dtype: torch.dtype,
                              device: torch.device, partial_sums: Callable[..., torch.Tensor],
                              reduced: Callable[..., torch.Tensor]) -> None:
    """``partial_sums(x, weight)`` has ``splits`` splits, and the add + RMSNorm of them gives the
    bits of ``reduced(x, weight)`` (the same linear, reduced) added to the residual. The
    normalised rows agree to an ulp: with several splits the kernel runs 16 warps, whose sum of
    squares over the row associates differently from the 8 of a single split."""
    gen = torch.Generator().manual_seed(4)
    x = rand(gen, *rows, k, dtype=dtype, device=device)
    weight = rand(gen, n, k, dtype=dtype, device=device) / math.sqrt(k)
    residual = rand(gen, *rows, n, dtype=dtype, device=device)
    norm = rand(gen, n, dtype=dtype, device=device)
    partials = partial_sums(x, weight)
    assert partials.shape == (splits, *rows, n)
    assert partials.dtype == (torch.float32 if splits > 1 else dtype)
    out, summed = rmsnorm.fused_add_rms_norm(partials, residual, norm, 1e-6)
    out_want, summed_want = rmsnorm.fused_add_rms_norm(reduced(x, weight), residual, norm, 1e-6)
    assert torch.equal(summed, summed_want)
    assert_close(out, out_want, *ELEMENTWISE_TOL[dtype])


def check_rope(num_tokens: int, num_pad: int, num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device) -> None:
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
    q_ref, k_ref = rope.rope_and_store_kv_ref(q, k, v, positions, cos_sin_cache, k_cache_ref, v_cache_ref,
                                              slot_mapping)
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


def check_decode(context_lens: list[int], max_context_len: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(4)
    batch = len(context_lens)
    k_cache, v_cache, k_clean, v_clean, tables = make_paged_cache(
        context_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
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
    out = decode_attention.paged_decode_attention(q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens,
                                                  scale, max_context_len)
    ref = decode_attention.paged_decode_attention_ref(q, k, v, positions, cos_sin, k_clean, v_clean, slots, tables,
                                                      lens, scale, max_context_len)
    assert out.shape == (batch, num_heads, head_dim) and out.dtype == dtype
    assert_close(out, ref, *ATTENTION_TOL[dtype])
    # ... and store them as rope_and_store_kv_ref does (rotated k, plain v).
    assert_close(k_cache.view(flat)[slots], k_clean.view(flat)[slots], *ELEMENTWISE_TOL[dtype])
    assert torch.equal(v_cache.view(flat)[slots], v_clean.view(flat)[slots])


def check_prefill(query_lens: list[int], context_lens: list[int], num_heads: int, num_kv_heads: int,
                  head_dim: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, k_clean, v_clean, tables = make_paged_cache(
        context_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = rand(gen, sum(query_lens), num_heads, head_dim, dtype=dtype, device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = prefill_attention.paged_prefill_attention(q, k_cache, v_cache, cu, tables, lens, scale)
    ref = prefill_attention.paged_prefill_attention_ref(q, k_clean, v_clean, cu, tables, lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, ref, *ATTENTION_TOL[dtype])


# --------------------------------------------------------------------------------------------
# CPU: the interpreter at tiny shapes
# --------------------------------------------------------------------------------------------

CPU_DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("rows", "hidden", "strided"), [((3,), 40, False), ((2, 2), 64, True)])
def test_rms_norm_interpreted(interpreter: None, rows: tuple[int, ...], hidden: int, strided: bool,
                              dtype: torch.dtype) -> None:
    check_rms_norm(rows, hidden, dtype, CPU, strided)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("num_tokens", "vocab", "hidden", "strided_ids"), [(5, 50, 40, False), (4, 17, 96, True)])
def test_embedding_interpreted(interpreter: None, num_tokens: int, vocab: int, hidden: int, strided_ids: bool,
                               dtype: torch.dtype) -> None:
    check_embedding(num_tokens, vocab, hidden, dtype, CPU, strided_ids)


def test_embedding_of_no_tokens() -> None:
    out = embedding.embedding(torch.zeros(0, dtype=torch.int64), torch.randn(5, 8))
    assert out.shape == (0, 8)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [((3,), 50), ((1, 2), 1100)])  # 1100: two column blocks
def test_silu_and_mul_interpreted(interpreter: None, rows: tuple[int, ...], inter: int, dtype: torch.dtype) -> None:
    check_silu_and_mul(rows, inter, dtype, CPU)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("rows", "n", "k", "bias", "strided"),
                         [((1,), 10, 600, True, False), ((3,), 9, 40, False, True), ((2, 2), 6, 4100, True, False)])
def test_linear_interpreted(interpreter: None, rows: tuple[int, ...], n: int, k: int, bias: bool, strided: bool,
                            dtype: torch.dtype) -> None:
    """Ragged N and K tails; 4100 takes the long-row configuration (K tiles of 1024)."""
    check_linear(rows, n, k, bias, dtype, CPU, strided)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("rows", "inter", "k", "bias"),
                         [((1,), 5, 600, True), ((2, 2), 4100, 40, False), ((3,), 6, 4100, True)])
def test_linear_silu_and_mul_interpreted(interpreter: None, rows: tuple[int, ...], inter: int, k: int, bias: bool,
                                         dtype: torch.dtype) -> None:
    """Each launch configuration of the one-row kernel: narrow (5 features, the last program's
    second one masked), wide (2 * 4100 rows: 4 features a program, 1025 programs) and long K
    (DEPTH 2)."""
    check_linear_silu_and_mul(rows, inter, k, bias, dtype, CPU)


@pytest.mark.parametrize(("stages", "depth"), [(1, 1), (3, 1), (1, 2)])
@pytest.mark.parametrize("k", [16, 40, 80])  # one tile; three, the last ragged; five
def test_linear_kernel_loops_interpreted(interpreter: None, monkeypatch: pytest.MonkeyPatch, stages: int,
                                         depth: int, k: int) -> None:
    """Each loop of the one-row kernel over 16-wide K tiles: plain, pipelined through shared
    memory (3 stages; the interpreter runs it as the plain loop, the GPU tests compile it), and
    DEPTH 2 (a tile ahead in registers)."""
    monkeypatch.setattr(linear, "_launch_config", lambda n, k: (4, 16, 4, stages, depth))
    check_linear((2,), 6, k, True, torch.float32, CPU)


# linear_dot at its own launch configurations: ids name the shape class and the K split
# (plan_split's ranges) each case takes; every case is checked against the fp32 reference with
# and without bias, split and unsplit, masked and unmasked along K.
LINEAR_DOT_CPU_CASES = {
    # narrow (one 512-wide tile a range), K 600 in 2 ranges of 512 + 88 (the second a ragged
    # tile); N 40 in one ragged 64-feature tile
    "narrow-split2": dict(rows=(2,), n=40, k=600, bias=True, strided=False),
    # narrow, K under one tile and under 256 (no split); N under one tile; strided x
    "narrow-short-k": dict(rows=(3,), n=9, k=100, bias=False, strided=True),
    # 17 rows: one 32-row tile; K 1024 in 2 ranges of 512, unmasked along K (EVEN_K); strided x
    "17-rows-even-k-split2": dict(rows=(17,), n=40, k=1024, bias=True, strided=True),
    # 33 rows: a full 32-row tile and a 1-row one, each reading the weight
    "33-rows": dict(rows=(33,), n=70, k=600, bias=True, strided=False),
    # long rows (K 4100), the transposed product: 64-feature tiles (N 70: a full and a ragged
    # one), K in 5 ranges of 1024 (the last of 4, one masked 256-wide step); a 3-D x
    "long-split5": dict(rows=(2, 3), n=70, k=4100, bias=False, strided=False),
    # long rows, 17 rows (a 32-row tile), K 4096 in 4 ranges of 1024, unmasked along
    # K (EVEN_K); strided x
    "long-17-rows-even-k": dict(rows=(17,), n=64, k=4096, bias=False, strided=True),
    # wide outputs (N 8200), the transposed product: 64-feature tiles, 129 programs with a
    # ragged last one; no split, so the dot kernel adds the bias; K one full tile (EVEN_K)
    "wide-even-k": dict(rows=(16,), n=8200, k=128, bias=True, strided=False),
    # wide, 33 rows: two 32-row tiles (the second holds one row); K 200 in a full and a
    # masked step
    "wide-33-rows": dict(rows=(33,), n=8200, k=200, bias=True, strided=False),
}


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("case", list(LINEAR_DOT_CPU_CASES))
def test_linear_dot_interpreted(interpreter: None, case: str, dtype: torch.dtype) -> None:
    check_linear(**LINEAR_DOT_CPU_CASES[case], dtype=dtype, device=CPU, kernel=linear.linear_dot)


@pytest.mark.parametrize("case", ["narrow-split2", "long-split5", "narrow-short-k"])
def test_linear_partial_sums_interpreted(interpreter: None, case: str) -> None:
    """linear_dot's partials left unreduced (2 and 5 splits; one when K is not split) and added
    by the add + RMSNorm kernel: the bits of the reduce kernel's output added to the residual."""
    shape = LINEAR_DOT_CPU_CASES[case]
    splits = {"narrow-split2": 2, "long-split5": 5, "narrow-short-k": 1}[case]
    check_linear_partial_sums(shape["rows"], shape["n"], shape["k"], splits, torch.float16, CPU,
                              lambda x, w: linear._linear_dot(x, w, None, reduce=False), linear.linear_dot)


def test_linear_partial_sums_off_gpu_is_one_split() -> None:
    x, weight = torch.randn(5, 24), torch.randn(16, 24)
    partials = linear.linear_partial_sums(x, weight)
    assert partials.shape == (1, 5, 16) and torch.equal(partials[0], linear.linear_ref(x, weight))
    assert torch.equal(linear.linear_partial_sums_ref(x, weight), partials)


def test_fused_add_rms_norm_of_no_rows() -> None:
    """An empty batch, plain or as partial sums, gives empty outputs and launches nothing."""
    residual, weight = torch.randn(0, 8), torch.randn(8)
    for x in (torch.randn(0, 8), torch.randn(3, 0, 8)):
        out, summed = rmsnorm.fused_add_rms_norm(x, residual, weight, 1e-6)
        assert out.shape == summed.shape == (0, 8)


@pytest.mark.parametrize("splits", [2, 7])
def test_split_k_reduce_adds_splits_in_order_interpreted(interpreter: None, splits: int) -> None:
    """The split-K reduce kernel (its splits unrolled) against the splits added one after
    another in torch, then the bias: the same bits."""
    gen = torch.Generator().manual_seed(5)
    rows, n = 3, 1100  # two 1024-feature programs a row, the second ragged
    ws = rand(gen, splits, rows, n, dtype=torch.float32, device=CPU) * 100
    bias = rand(gen, n, dtype=torch.float16, device=CPU)
    y = torch.empty(rows, n, dtype=torch.float16)
    linear._split_k_reduce_kernel[(rows, 2)](ws, bias, y, n, rows * n, n, n, SPLITS=splits, HAS_BIAS=True,
                                             BLOCK_N=1024, USE_PDL=False)
    want = ws[0].clone()
    for s in range(1, splits):
        want += ws[s]
    assert torch.equal(y, (want + bias.float()).to(torch.float16))


def test_linear_dot_config() -> None:
    """The H200 sweep's configurations at the Qwen2.5-1.5B shapes, and K splits that never
    leave a range empty (the reduce kernel would add garbage) or shorter than 256."""
    narrow = linear.DotConfig(64, 512, 3, 8, 1, swap_ab=False)  # one tile a program
    assert linear._dot_config(2048, 1536) == narrow  # qkv
    assert linear._dot_config(1536, 1536) == narrow  # o_proj
    assert linear._dot_config(2 * 8960, 1536) == linear.DotConfig(64, 128, 1, 4, 3, swap_ab=True)  # gate/up
    assert linear._dot_config(1536, 8960) == linear.DotConfig(64, 256, 5, 4, 3, swap_ab=True)  # down
    assert linear._dot_config(151936, 1536) == linear.DotConfig(64, 128, 1, 4, 3, swap_ab=True)  # LM head
    for n, k in [(40, 600), (9, 100), (70, 4100), (1536, 1536), (1536, 8960), (896, 896), (64, 300), (64, 7)]:
        cfg = linear._dot_config(n, k)
        per, splits = linear.plan_split(k, cfg.block_k, cfg.split_k)
        assert per % cfg.block_k == 0 and 1 <= splits <= cfg.split_k and (splits - 1) * per < k <= splits * per
        assert splits == 1 or per >= 256


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                    (torch.float32, torch.float16)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (3, 1, 12)])
def test_rope_and_store_kv_interpreted(interpreter: None, num_heads: int, num_kv_heads: int, head_dim: int,
                                       dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    check_rope(5, 3, num_heads, num_kv_heads, head_dim, 4, dtype, cache_dtype, CPU)


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
    "split-empty": dict(context_lens=[1, 70, 250, 380], max_context_len=384, num_heads=4, num_kv_heads=1,
                        block_size=16),
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
    monkeypatch.setattr(decode_attention, "_num_sms", lambda device: 132)
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
    monkeypatch.setattr(decode_attention, "_num_sms", lambda device: 132)
    columns = functools.partial(decode_attention._reduce_columns, device=torch.device("cuda", 0))
    assert [columns(b, 12, 128) for b in (1, 2, 4, 8, 16, 32, 128)] == [16, 16, 16, 32, 64, 128, 128]
    assert columns(1, 6, 128) == 16 and columns(16, 6, 128) == 32  # a rank's heads under TP 2
    assert columns(1, 12, 80) == 16  # 80 wide: as a 128-wide head, in 5 programs
    assert columns(1, 2, 8) == 8  # a head narrower than the minimum stays whole


@pytest.mark.parametrize("head_dim", [64, 40])
def test_decode_reduce_splits_columns_interpreted(interpreter: None, monkeypatch: pytest.MonkeyPatch,
                                                   head_dim: int) -> None:
    """With an H200's 132 SMs the split kernel's reduce merges each head in 16-column programs
    (4 of them for 64-wide heads; 3 for 40-wide ones, the last masked): the same output."""
    monkeypatch.setattr(decode_attention, "_num_sms", lambda device: 132)
    assert decode_attention._reduce_columns(2, 4, head_dim, CPU) == 16
    check_decode([300, 70], 384, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16,
                 dtype=torch.float32, device=CPU)


def test_decode_reduce_merges_in_chunks_interpreted(interpreter: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With an H200's 132 SMs a 2100-token sequence beside a 100-token one splits into 33
    one-tile partitions, which the reduce merges in chunks of 32 (two: 32, then 1), while the
    short one's two partitions take the two-row tile: the reference's output either way."""
    monkeypatch.setattr(decode_attention, "_num_sms", lambda device: 132)
    assert decode_attention._num_partitions(2100, 2, 2, CPU) == 33
    assert decode_attention._one_tile_limit(2, 2, CPU) == 33
    check_decode([2100, 100], 2100, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                 dtype=torch.float32, device=CPU)


@pytest.mark.parametrize(("context_lens", "partitions"), [([70, 500], (4, 4)), ([300], (5, 8)), ([100], (2, 8))])
def test_decode_split_ignores_max_context_len(interpreter: None, context_lens: list[int],
                                              partitions: tuple[int, int]) -> None:
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
    "decode-rows": dict(query_lens=[1, 1, 1, 1, 1, 1, 9], context_lens=[5, 17, 1, 30, 8, 64, 9],
                        tiles=(16, 16, 4, 1), heads=(6, 2)),
}


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("case", list(PREFILL_CPU_CASES))
def test_paged_prefill_attention_interpreted(interpreter: None, monkeypatch: pytest.MonkeyPatch, case: str,
                                             dtype: torch.dtype) -> None:
    spec = dict(PREFILL_CPU_CASES[case])
    tiles = spec.pop("tiles")
    num_heads, num_kv_heads = spec.pop("heads", (4, 2))
    if tiles is not None:
        monkeypatch.setattr(prefill_attention, "_tile_config", lambda head_dim: tiles)
    check_prefill(**spec, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, block_size=4, dtype=dtype,
                  device=CPU)


def test_prefill_grid_padding_changes_no_bits(interpreter: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid depends on T and B alone: the batch inside a larger one (padding token rows
    past cu_seqlens_q[-1], empty padding sequences, as a CUDA graph captured for more tokens and
    sequences runs it) gives the same bits on its own rows."""
    monkeypatch.setattr(prefill_attention, "_tile_config", lambda head_dim: (16, 16, 4, 1))
    gen = torch.Generator().manual_seed(6)
    query_lens, context_lens = [5, 20], [5, 29]
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
        padded_q, k_cache, v_cache, padded_cu, padded_tables, padded_lens, 0.25)
    assert torch.equal(padded[:25], exact)


def test_wrappers_reject_bad_inputs() -> None:
    """Shape, dtype and stride errors are ValueErrors raised before any launch."""
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm.rms_norm(x, torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="unit stride"):
        rmsnorm.rms_norm(x.t(), torch.randn(4), 1e-6)
    with pytest.raises(ValueError, match="do not chain"):
        linear.linear_kernel(x, torch.randn(3, 7))
    with pytest.raises(ValueError, match="at most 16 rows"):
        linear.linear_kernel(torch.randn(17, 8), torch.randn(3, 8))
    with pytest.raises(ValueError, match="bias"):
        linear.linear_kernel(x, torch.randn(3, 8), torch.randn(4))
    with pytest.raises(ValueError, match="even number of rows"):
        linear.linear_silu_and_mul_kernel(x, torch.randn(3, 8))
    with pytest.raises(ValueError, match="at most 16 rows"):
        linear.linear_silu_and_mul_kernel(torch.randn(17, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="do not chain"):
        linear.linear_silu_and_mul_kernel(x, torch.randn(4, 7))
    with pytest.raises(ValueError, match="do not chain"):
        linear.linear_dot(x, torch.randn(3, 7))
    with pytest.raises(ValueError, match="bias"):
        linear.linear_dot(x, torch.randn(3, 8), torch.randn(4))
    with pytest.raises(ValueError, match="bias must have unit stride"):
        linear.linear_dot(x, torch.randn(3, 8), torch.randn(3, 2)[:, 0])
    with pytest.raises(ValueError, match="weight must have unit stride"):
        linear.linear_dot(x, torch.randn(8, 3).t())
    with pytest.raises(ValueError, match="weight is torch.float16"):
        linear.linear_dot(x, torch.randn(3, 8).half())
    with pytest.raises(ValueError, match="unit stride in its last dim"):
        linear.linear_dot(torch.randn(8, 4).t(), torch.randn(3, 8))
    for kernel in (linear.linear_kernel, linear.linear_dot, linear.linear_ref):
        with pytest.raises(ValueError, match=r"out must be \[4, 3\]"):
            kernel(x, torch.randn(3, 8), out=torch.empty(4, 4))
        with pytest.raises(ValueError, match="float32"):
            kernel(x, torch.randn(3, 8), out=torch.empty(4, 3, dtype=torch.float16))
        with pytest.raises(ValueError, match="out must be contiguous"):
            kernel(x, torch.randn(3, 8), out=torch.empty(3, 4).t())
    with pytest.raises(ValueError, match="partial sums"):
        rmsnorm.fused_add_rms_norm(torch.randn(2, 4, 7), x, torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="partial sums"):
        rmsnorm.fused_add_rms_norm_ref(torch.randn(4, 7), x, torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="even"):
        activation.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="1-D integer"):
        embedding.embedding(torch.zeros(2, 3, dtype=torch.int64), torch.randn(5, 8))
    with pytest.raises(ValueError, match="1-D integer"):
        embedding.embedding(torch.zeros(3), torch.randn(5, 8))
    with pytest.raises(ValueError, match="unit stride in hidden"):
        embedding.embedding(torch.zeros(3, dtype=torch.int64), torch.randn(8, 5).t())
    with pytest.raises(ValueError, match="weight must be float32, float16 or bfloat16"):
        embedding.embedding(torch.zeros(3, dtype=torch.int64), torch.randn(5, 8, dtype=torch.float64))
    new = (torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16), torch.zeros(2, dtype=torch.int64),
           torch.randn(8, 16), torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="int32"):
        decode_attention.paged_decode_attention(
            *new, torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, dtype=torch.int32), 0.25, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        decode_attention.paged_decode_attention(
            *new[:7], torch.zeros(3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32), 0.25, 8)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        prefill_attention.paged_prefill_attention(
            torch.randn(3, 3, 16), torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16),
            torch.tensor([0, 3], dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32),
            torch.full((1,), 3, dtype=torch.int32), 0.25)
    # every wrapper's float-dtype check (kernels.checks.check_float_dtype)
    with pytest.raises(ValueError, match="x must be float32, float16 or bfloat16, got torch.float64"):
        rmsnorm.rms_norm(x.double(), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="cos_sin_cache must be float32, float16 or bfloat16, got torch.float64"):
        decode_attention.paged_decode_attention(
            *new[:4], new[4].double(), *new[5:], torch.zeros(2, 3, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32), 0.25, 8)
    with pytest.raises(ValueError, match="q must be float32, float16 or bfloat16, got torch.float64"):
        prefill_attention.paged_prefill_attention(
            torch.randn(3, 4, 16, dtype=torch.float64), torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16),
            torch.tensor([0, 3], dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32),
            torch.full((1,), 3, dtype=torch.int32), 0.25)


# --------------------------------------------------------------------------------------------
# GPU: real shapes (Qwen2.5-1.5B)
# --------------------------------------------------------------------------------------------

HQ, HKV, HEAD_DIM, HIDDEN, INTER, BLOCK = 12, 2, 128, 1536, 8960, 16
GPU_DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("rows", [1, 8, 32, 128, 2048])
def test_rms_norm_gpu(cuda: torch.device, rows: int, dtype: torch.dtype) -> None:
    check_rms_norm((rows,), HIDDEN, dtype, cuda, strided=rows == 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 32, 2048])
def test_embedding_gpu(cuda: torch.device, num_tokens: int, dtype: torch.dtype) -> None:
    check_embedding(num_tokens, 151936, HIDDEN, dtype, cuda, strided_ids=num_tokens == 32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 16])
@pytest.mark.parametrize(("n", "k", "bias"), [(2048, HIDDEN, True), (HIDDEN, HIDDEN, False), (2 * INTER, HIDDEN, False),
                                              (HIDDEN, INTER, False), (151936, HIDDEN, False)])
def test_linear_gpu(cuda: torch.device, rows: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    """Every Qwen2.5-1.5B projection (qkv with its bias, o, gate/up, down, LM head)."""
    check_linear((rows,), n, k, bias, dtype, cuda, strided=rows == 3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("rows", [2, 8, 16, 24])
@pytest.mark.parametrize(("n", "k", "bias"), [(2048, HIDDEN, True), (HIDDEN, HIDDEN, False), (2 * INTER, HIDDEN, False),
                                              (HIDDEN, INTER, False), (151936, HIDDEN, False)])
def test_linear_dot_gpu(cuda: torch.device, rows: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    """Every Qwen2.5-1.5B projection at batch sizes linear() gives linear_dot (24 rows: the
    32-row tile), both products (``x W^T`` on qkv and o_proj, ``W x^T`` on the rest); qkv,
    o_proj and down split K, so the second call's bitwise equality checks the ordered reduction."""
    check_linear((rows,), n, k, bias, dtype, cuda, strided=rows == 8, kernel=linear.linear_dot)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(("rows", "n", "k", "splits"), [
    (1, HIDDEN, HIDDEN, 1), (2, HIDDEN, HIDDEN, 1), (8, HIDDEN, HIDDEN, 3), (24, HIDDEN, HIDDEN, 3),
    (2, HIDDEN, INTER, 5), (16, HIDDEN, INTER, 5), (32, HIDDEN, INTER, 5), (33, HIDDEN, INTER, 1)])
def test_linear_partial_sums_gpu(cuda: torch.device, rows: int, n: int, k: int, splits: int,
                                 dtype: torch.dtype) -> None:
    """o_proj and down through linear_partial_sums at the row counts of each linear() path (one
    row and two narrow ones: linear_kernel; 33: cuBLAS; both give one split), added by the
    add + RMSNorm kernel: the residual sum has the bits of linear()'s output added to the
    residual (the checker says why the normalised rows agree to an ulp, not bitwise)."""
    check_linear_partial_sums((rows,), n, k, splits, dtype, cuda, linear.linear_partial_sums, linear.linear)


@pytest.mark.gpu
def test_linear_dispatch(cuda: torch.device) -> None:
    """linear() on a GPU: linear_kernel at 1 row (and 2 on a narrow layer), linear_dot up to
    MAX_DOT_ROWS, cuBLAS above; same results. Every CPU tensor goes to F.linear."""
    narrow = torch.randn(256, 512, device=cuda, dtype=torch.bfloat16) / math.sqrt(512)
    wide = torch.randn(2 * INTER, 512, device=cuda, dtype=torch.bfloat16) / math.sqrt(512)
    long = torch.randn(256, INTER, device=cuda, dtype=torch.bfloat16) / math.sqrt(INTER)
    expected_paths = {  # (rows, weight): path
        (1, "narrow"): "linear_kernel", (1, "wide"): "linear_kernel", (1, "long"): "linear_kernel",
        (2, "narrow"): "linear_kernel", (2, "wide"): "linear_dot", (2, "long"): "linear_dot",
        (3, "narrow"): "linear_dot", (16, "narrow"): "linear_dot", (16, "wide"): "linear_dot",
        (16, "long"): "linear_dot", (17, "narrow"): "linear_dot", (17, "wide"): "linear_dot",
        (17, "long"): "linear_dot", (linear.MAX_DOT_ROWS, "narrow"): "linear_dot",
        (linear.MAX_DOT_ROWS, "wide"): "linear_dot", (linear.MAX_DOT_ROWS, "long"): "linear_dot",
        (linear.MAX_DOT_ROWS + 1, "narrow"): "F.linear", (linear.MAX_DOT_ROWS + 1, "wide"): "F.linear",
        (linear.MAX_DOT_ROWS + 1, "long"): "F.linear",
    }
    weights = {"narrow": narrow, "wide": wide, "long": long}
    for (rows, name), path in expected_paths.items():
        weight = weights[name]
        x = torch.randn(rows, weight.shape[1], device=cuda, dtype=torch.bfloat16)
        assert linear.linear_path(x, weight) == path, (rows, name)
        assert_close(linear.linear(x, weight), linear.linear_ref(x.float(), weight.float()), *LINEAR_TOL[x.dtype])
        out32 = linear.linear(x, weight, out=torch.empty(rows, weight.shape[0], device=cuda))
        if path == "F.linear":  # cuBLAS rounds to bf16, then the copy
            assert torch.equal(out32, linear.linear_ref(x, weight).float())
        else:  # the kernels store their fp32 sum
            assert torch.equal(out32.to(x.dtype), linear.linear(x, weight))
    assert linear.linear_path(torch.randn(1, 512), narrow.cpu()) == "F.linear"
    assert linear.linear_path(torch.randn(4, 512), narrow.cpu()) == "F.linear"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 16])
def test_linear_silu_and_mul_gpu(cuda: torch.device, rows: int, dtype: torch.dtype) -> None:
    """Qwen2.5-1.5B's gate/up projection."""
    check_linear_silu_and_mul((rows,), INTER, HIDDEN, False, dtype, cuda)


@pytest.mark.gpu
def test_linear_silu_and_mul_dispatch(cuda: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """linear_silu_and_mul() runs the fused kernel where linear() would run the one-row kernel,
    and the linear then SiLU-mul elsewhere, with the same bits either way."""
    fused_rows = []
    fused = linear.linear_silu_and_mul_kernel

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        fused_rows.append(x.shape[0])
        return fused(x, weight, bias)

    monkeypatch.setattr(linear, "linear_silu_and_mul_kernel", spy)
    weight = torch.randn(2 * INTER, HIDDEN, device=cuda, dtype=torch.bfloat16) / math.sqrt(HIDDEN)
    for rows in (1, 2, 8, linear.MAX_DOT_ROWS + 1):
        x = torch.randn(rows, HIDDEN, device=cuda, dtype=torch.bfloat16)
        out = linear.linear_silu_and_mul(x, weight)
        assert torch.equal(out, activation.silu_and_mul(linear.linear(x, weight)))
    assert fused_rows == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("rows", [1, 32, 2048])
def test_silu_and_mul_gpu(cuda: torch.device, rows: int, dtype: torch.dtype) -> None:
    check_silu_and_mul((rows,), INTER, dtype, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(("tokens", "pad"), [(1, 0), (8, 24), (128, 0), (2048, 0)])
def test_rope_and_store_kv_gpu(cuda: torch.device, tokens: int, pad: int, dtype: torch.dtype) -> None:
    check_rope(tokens, pad, HQ, HKV, HEAD_DIM, BLOCK, dtype, dtype, cuda)


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
    k_cache, v_cache, _, _, tables = make_paged_cache(
        [max_len] * batch, BLOCK, HKV, HEAD_DIM, dtype, cuda, gen)
    q, k, v = new_decode_tokens(gen, batch, HQ, HKV, HEAD_DIM, dtype, cuda)
    lens = torch.full((batch,), 10, dtype=torch.int32, device=cuda)
    positions, slots = lens.long() - 1, last_slots(tables, lens, BLOCK)
    args = (q, k, v, positions, rope_table(max_len, HEAD_DIM, cuda), k_cache, v_cache, slots, tables, lens,
            HEAD_DIM**-0.5, max_len)
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


PREFILL_GPU_CASES = {
    "one-2048": ([2048], [2048]),
    "mixed-prefix": ([1, 300, 1000, 17], [1, 800, 3000, 529]),
    "chunk-of-long": ([512], [4096]),
    "mixed-step": ([1] * 200 + [256], [512] * 200 + [256]),  # 200 decodes beside a prompt
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", list(PREFILL_GPU_CASES))
def test_paged_prefill_attention_gpu(cuda: torch.device, case: str, dtype: torch.dtype) -> None:
    query_lens, context_lens = PREFILL_GPU_CASES[case]
    check_prefill(query_lens, context_lens, HQ, HKV, HEAD_DIM, BLOCK, dtype, cuda)


# --------------------------------------------------------------------------------------------
# Programmatic dependent launch
# --------------------------------------------------------------------------------------------


def test_pdl_is_off_on_cpu_and_when_the_environment_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not pdl.enabled(CPU)
    assert pdl.launch_args(CPU) == {"USE_PDL": False, "launch_pdl": False}
    monkeypatch.setenv("PDSERVE_PDL", "0")
    pdl.enabled.cache_clear()
    try:
        assert not pdl.enabled(torch.device("cuda", 0))  # decided before any CUDA query
    finally:
        pdl.enabled.cache_clear()


def _decode_layer_chain(cuda: torch.device) -> list[torch.Tensor]:
    """One decode layer's kernels back to back, each reading the previous one's output."""
    gen = torch.Generator().manual_seed(9)
    dtype = torch.bfloat16
    _, _, k_cache, v_cache, tables = make_paged_cache([300], BLOCK, HKV, HEAD_DIM, dtype, cuda, gen)  # no NaN
    hidden = embedding.embedding(torch.tensor([7], device=cuda), rand(gen, 64, HIDDEN, dtype=dtype, device=cuda))
    residual = rand(gen, 1, HIDDEN, dtype=dtype, device=cuda)
    shapes = [((HQ + 2 * HKV) * HEAD_DIM, HIDDEN), (HIDDEN, HQ * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    weights = [rand(gen, *shape, dtype=dtype, device=cuda) / math.sqrt(shape[1]) for shape in shapes]
    norm = rand(gen, HIDDEN, dtype=dtype, device=cuda)
    freqs = torch.arange(512, dtype=torch.float32)[:, None] * torch.rand(HEAD_DIM // 2, generator=gen)[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(cuda)
    positions = torch.tensor([299], device=cuda)
    lens = torch.tensor([300], dtype=torch.int32, device=cuda)
    x, residual = rmsnorm.fused_add_rms_norm(hidden, residual, norm, 1e-6)
    q, k, v = linear.linear_kernel(x, weights[0]).split([HQ * HEAD_DIM, HKV * HEAD_DIM, HKV * HEAD_DIM], dim=-1)
    attn = decode_attention.paged_decode_attention(
        q.view(1, HQ, HEAD_DIM), k.view(1, HKV, HEAD_DIM), v.view(1, HKV, HEAD_DIM), positions, cos_sin,
        k_cache, v_cache, last_slots(tables, lens, BLOCK), tables, lens, HEAD_DIM**-0.5, 4096)
    o = linear.linear_kernel(attn.reshape(1, HQ * HEAD_DIM), weights[1])
    x, residual = rmsnorm.fused_add_rms_norm(o, residual, norm, 1e-6)
    down = linear.linear_kernel(linear.linear_silu_and_mul_kernel(x, weights[2]), weights[3])
    return [hidden, attn, o, down, residual, k_cache]


def _linear_dot_chain(cuda: torch.device) -> list[torch.Tensor]:
    """Batches of 4 and 24 rows (16- and 32-row tiles) through one layer's projections on
    linear_dot, each reading the previous kernel's output (qkv, o_proj and down split K: dot
    kernel, then reduce kernel)."""
    gen = torch.Generator().manual_seed(10)
    dtype = torch.bfloat16
    shapes = [((HQ + 2 * HKV) * HEAD_DIM, HIDDEN), (HIDDEN, HQ * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    weights = [rand(gen, *shape, dtype=dtype, device=cuda) / math.sqrt(shape[1]) for shape in shapes]
    qkv_bias = rand(gen, shapes[0][0], dtype=dtype, device=cuda)
    outputs = []
    for rows in (4, 24):
        x = rand(gen, rows, HIDDEN, dtype=dtype, device=cuda)
        qkv = linear.linear_dot(x, weights[0], qkv_bias)
        o = linear.linear_dot(qkv[:, : HQ * HEAD_DIM], weights[1])
        gate_up = linear.linear_dot(o, weights[2])
        down = linear.linear_dot(activation.silu_and_mul(gate_up), weights[3])
        outputs += [qkv, o, gate_up, down]
    return outputs


@pytest.mark.gpu
@pytest.mark.parametrize("chain", [_decode_layer_chain, _linear_dot_chain])
def test_pdl_changes_no_bits(cuda: torch.device, monkeypatch: pytest.MonkeyPatch,
                             chain: Callable[[torch.device], list[torch.Tensor]]) -> None:
    """With programmatic dependent launch every kernel still reads its predecessor's finished
    output: a decode layer's chain gives the same bits with PDL and without."""
    monkeypatch.setenv("PDSERVE_PDL", "1")  # whatever the caller's environment says
    pdl.enabled.cache_clear()
    try:
        if not pdl.enabled(cuda):
            pytest.skip("PDL needs compute capability 9.0+ (the H200 machines have it)")
        with_pdl = chain(cuda)
        monkeypatch.setenv("PDSERVE_PDL", "0")
        pdl.enabled.cache_clear()
        without = chain(cuda)
    finally:
        pdl.enabled.cache_clear()
    for a, b in zip(with_pdl, without):
        assert torch.equal(a, b)


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
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook",
                        lambda *, fn, compile, **_: compiled.append((fn.name, compile["num_warps"])))
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
