"""kernels.linear against its torch reference: the one-row kernel (plain and with the SiLU-mul
gate in its epilogue), linear_dot and its split-K partial sums, and linear()'s dispatch
(tests/kernels/conftest.py says how the CPU and GPU cases run)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from pdserve.kernels import activation, linear, rmsnorm
from pdserve.tests.kernels.helpers import (
    CPU,
    CPU_DTYPES,
    ELEMENTWISE_TOL,
    GPU_DTYPES,
    HIDDEN,
    INTER,
    LINEAR_TOL,
    assert_close,
    rand,
)


def check_linear(
    rows: tuple[int, ...],
    n: int,
    k: int,
    bias: bool,
    dtype: torch.dtype,
    device: torch.device,
    strided: bool = False,
    kernel: Callable[..., torch.Tensor] = linear.linear_kernel,
) -> None:
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


def check_linear_silu_and_mul(
    rows: tuple[int, ...], inter: int, k: int, bias: bool, dtype: torch.dtype, device: torch.device
) -> None:
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


def check_linear_partial_sums(
    rows: tuple[int, ...],
    n: int,
    k: int,
    splits: int,
    dtype: torch.dtype,
    device: torch.device,
    partial_sums: Callable[..., torch.Tensor],
    reduced: Callable[..., torch.Tensor],
) -> None:
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


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(
    ("rows", "n", "k", "bias", "strided"),
    [((1,), 10, 600, True, False), ((3,), 9, 40, False, True), ((2, 2), 6, 4100, True, False)],
)
def test_linear_interpreted(
    interpreter: None, rows: tuple[int, ...], n: int, k: int, bias: bool, strided: bool, dtype: torch.dtype
) -> None:
    """Ragged N and K tails; 4100 takes the long-row configuration (K tiles of 1024)."""
    check_linear(rows, n, k, bias, dtype, CPU, strided)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(
    ("rows", "inter", "k", "bias"), [((1,), 5, 600, True), ((2, 2), 4100, 40, False), ((3,), 6, 4100, True)]
)
def test_linear_silu_and_mul_interpreted(
    interpreter: None, rows: tuple[int, ...], inter: int, k: int, bias: bool, dtype: torch.dtype
) -> None:
    """Each launch configuration of the one-row kernel: narrow (5 features, the last program's
    second one masked), wide (2 * 4100 rows: 4 features a program, 1025 programs) and long K
    (DEPTH 2)."""
    check_linear_silu_and_mul(rows, inter, k, bias, dtype, CPU)


@pytest.mark.parametrize(("stages", "depth"), [(1, 1), (3, 1), (1, 2)])
@pytest.mark.parametrize("k", [16, 40, 80])  # one tile; three, the last ragged; five
def test_linear_kernel_loops_interpreted(
    interpreter: None, monkeypatch: pytest.MonkeyPatch, stages: int, depth: int, k: int
) -> None:
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
    check_linear_partial_sums(
        shape["rows"],
        shape["n"],
        shape["k"],
        splits,
        torch.float16,
        CPU,
        lambda x, w: linear._linear_dot(x, w, None, reduce=False),
        linear.linear_dot,
    )


def test_linear_partial_sums_off_gpu_is_one_split() -> None:
    x, weight = torch.randn(5, 24), torch.randn(16, 24)
    partials = linear.linear_partial_sums(x, weight)
    assert partials.shape == (1, 5, 16) and torch.equal(partials[0], linear.linear_ref(x, weight))
    assert torch.equal(linear.linear_partial_sums_ref(x, weight), partials)


@pytest.mark.parametrize("splits", [2, 7])
def test_split_k_reduce_adds_splits_in_order_interpreted(interpreter: None, splits: int) -> None:
    """The split-K reduce kernel (its splits unrolled) against the splits added one after
    another in torch, then the bias: the same bits."""
    gen = torch.Generator().manual_seed(5)
    rows, n = 3, 1100  # two 1024-feature programs a row, the second ragged
    ws = rand(gen, splits, rows, n, dtype=torch.float32, device=CPU) * 100
    bias = rand(gen, n, dtype=torch.float16, device=CPU)
    y = torch.empty(rows, n, dtype=torch.float16)
    linear._split_k_reduce_kernel[(rows, 2)](
        ws, bias, y, n, rows * n, n, n, SPLITS=splits, HAS_BIAS=True, BLOCK_N=1024, USE_PDL=False
    )
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 16])
@pytest.mark.parametrize(
    ("n", "k", "bias"),
    [
        (2048, HIDDEN, True),
        (HIDDEN, HIDDEN, False),
        (2 * INTER, HIDDEN, False),
        (HIDDEN, INTER, False),
        (151936, HIDDEN, False),
    ],
)
def test_linear_gpu(cuda: torch.device, rows: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    """Every Qwen2.5-1.5B projection (qkv with its bias, o, gate/up, down, LM head)."""
    check_linear((rows,), n, k, bias, dtype, cuda, strided=rows == 3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("rows", [2, 8, 16, 24])
@pytest.mark.parametrize(
    ("n", "k", "bias"),
    [
        (2048, HIDDEN, True),
        (HIDDEN, HIDDEN, False),
        (2 * INTER, HIDDEN, False),
        (HIDDEN, INTER, False),
        (151936, HIDDEN, False),
    ],
)
def test_linear_dot_gpu(cuda: torch.device, rows: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    """Every Qwen2.5-1.5B projection at batch sizes linear() gives linear_dot (24 rows: the
    32-row tile), both products (``x W^T`` on qkv and o_proj, ``W x^T`` on the rest); qkv,
    o_proj and down split K, so the second call's bitwise equality checks the ordered reduction."""
    check_linear((rows,), n, k, bias, dtype, cuda, strided=rows == 8, kernel=linear.linear_dot)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(
    ("rows", "n", "k", "splits"),
    [
        (1, HIDDEN, HIDDEN, 1),
        (2, HIDDEN, HIDDEN, 1),
        (8, HIDDEN, HIDDEN, 3),
        (24, HIDDEN, HIDDEN, 3),
        (2, HIDDEN, INTER, 5),
        (16, HIDDEN, INTER, 5),
        (32, HIDDEN, INTER, 5),
        (33, HIDDEN, INTER, 1),
    ],
)
def test_linear_partial_sums_gpu(
    cuda: torch.device, rows: int, n: int, k: int, splits: int, dtype: torch.dtype
) -> None:
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
        (1, "narrow"): "linear_kernel",
        (1, "wide"): "linear_kernel",
        (1, "long"): "linear_kernel",
        (2, "narrow"): "linear_kernel",
        (2, "wide"): "linear_dot",
        (2, "long"): "linear_dot",
        (3, "narrow"): "linear_dot",
        (16, "narrow"): "linear_dot",
        (16, "wide"): "linear_dot",
        (16, "long"): "linear_dot",
        (17, "narrow"): "linear_dot",
        (17, "wide"): "linear_dot",
        (17, "long"): "linear_dot",
        (linear.MAX_DOT_ROWS, "narrow"): "linear_dot",
        (linear.MAX_DOT_ROWS, "wide"): "linear_dot",
        (linear.MAX_DOT_ROWS, "long"): "linear_dot",
        (linear.MAX_DOT_ROWS + 1, "narrow"): "F.linear",
        (linear.MAX_DOT_ROWS + 1, "wide"): "F.linear",
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
