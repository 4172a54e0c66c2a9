"""Linear layers for decode: ``y = x W^T + b`` when x has only a few rows.

With a few rows the layer is bound by the weight read. :func:`linear` picks the implementation
from the shapes alone, so a CUDA graph captured for a batch size keeps its choice: 1 row goes to
:func:`linear_kernel` (a GEMV), 2 to ``MAX_DOT_ROWS`` rows to :func:`linear_dot` (tensor cores,
one weight read for all rows; 2-row narrow layers stay on :func:`linear_kernel`), more rows to
cuBLAS. :func:`linear_silu_and_mul` is the MLP's gate/up projection with the SwiGLU gate applied.
The measurements behind these choices are in docs/decisions.md.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.kernels import pdl
from pdserve.kernels.activation import silu_and_mul, silu_and_mul_ref, silu_mul
from pdserve.kernels.checks import as_rows, dot_precision

MAX_DOT_ROWS = 32  # rows of x up to which linear() runs a Triton kernel; more go to cuBLAS
_MAX_KERNEL_ROWS = 16  # linear_kernel: each row re-reads the weight, a few rows at most
# Shape classes for launch configurations: "long" rows (down), "wide" outputs (gate/up, LM head),
# else "narrow" (qkv, o_proj).
_LONG_K = 4096
_WIDE_N = 8192

LinearPath = Literal["linear_kernel", "linear_dot", "F.linear"]


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T + bias[N]`` (torch's ``F.linear``), copied into ``out``
    (``[..., N]``, contiguous, in x's dtype or fp32) when given and returned."""
    y = F.linear(x, weight, bias)
    if out is None:
        return y
    _check_out(x, weight.shape[0], out)
    return out.copy_(y)


def linear_path(x: torch.Tensor, weight: torch.Tensor) -> LinearPath:
    """What :func:`linear` runs for ``x [..., K]`` and ``weight [N, K]``, from shapes and device
    only: ``F.linear`` (cuBLAS) for every non-CUDA tensor and above ``MAX_DOT_ROWS`` rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not x.is_cuda or rows == 0 or rows > MAX_DOT_ROWS:
        return "F.linear"
    if rows == 1:
        return "linear_kernel"
    n, k = weight.shape[0], weight.shape[-1]  # a bad weight is the kernels' ValueError
    narrow = n < _WIDE_N and k < _LONG_K
    # A narrow layer's small weight is latency-bound: two reads by linear_kernel still finish first.
    if rows == 2 and narrow:
        return "linear_kernel"
    return "linear_dot"


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`linear_ref` through the implementation :func:`linear_path` names.

    The Triton kernels store their fp32 accumulator straight into an fp32 ``out`` (unrounded
    logits, no cast kernel); ``F.linear`` rounds to x's dtype first and then copies."""
    path = linear_path(x, weight)
    if path == "linear_kernel":
        return linear_kernel(x, weight, bias, out)
    if path == "linear_dot":
        return linear_dot(x, weight, bias, out)
    return linear_ref(x, weight, bias, out)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x as ``[rows, K]`` rows (a view), or ValueError for what neither kernel takes."""
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain (x [..., K], weight [N, K])"
        )
    n, k = weight.shape
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    x2 = as_rows("x", x, k)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name} is {t.dtype} on {t.device}, x is {x.dtype} on {x.device}")
    if weight.stride(1) != 1:
        raise ValueError(f"weight must have unit stride in K, got strides {weight.stride()}")
    if bias is not None and bias.stride(0) != 1:
        raise ValueError(f"bias must have unit stride, got strides {bias.stride()}")
    return x2


def _check_out(x: torch.Tensor, n: int, out: torch.Tensor) -> None:
    """ValueError unless ``out`` can take the ``[..., N]`` output of x: contiguous, on x's
    device, in x's dtype or fp32."""
    shape = (*x.shape[:-1], n)
    if out.shape != shape or out.device != x.device or out.dtype not in (x.dtype, torch.float32):
        raise ValueError(
            f"out must be {list(shape)} in {x.dtype} or float32 on {x.device}, got "
            f"{list(out.shape)} {out.dtype} on {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")


def _output(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """Where a kernel writes x's ``[..., N]`` output: ``out`` (checked) or a new tensor in x's dtype."""
    if out is None:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    _check_out(x, n, out)
    return out


# Triton, one row: a program computes BLOCK_N features of one row with plain fp32 FMAs over K
# tiles (the bound is the memory read, not the math); small BLOCK_N gives many programs and
# enough loads in flight. Rows are a grid axis, each re-reading the weight. Triton pipelines
# loads that feed no tl.dot only via tl.range(num_stages=...), so the loop has two forms:
# DEPTH 1 (STAGES tiles in flight) and DEPTH 2 (next tile loaded into registers ahead).


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DEPTH: tl.constexpr,
    STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_N)
    if SILU_AND_MUL:
        # W = [gate | up] by rows. Tile row r is feature r // 2 of gate (even r) or up (odd r),
        # so the epilogue pairs neighbouring rows.
        features = tl.program_id(1) * (BLOCK_N // 2) + r // 2
        n = features + (r % 2) * (N // 2)
        n_mask = features < N // 2
    else:
        n = tl.program_id(1) * BLOCK_N + r
        n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :]
    x_ptrs = x_ptr + row * stride_xm + k
    # Weights are never written: the first tile loads before the PDL wait (kernels.pdl).
    k_mask = k < K
    w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    if DEPTH == 1:
        # Converted here, so the tile has arrived before the next kernel may launch.
        w = w.to(tl.float32)
    else:  # the long rows' second tile goes out before the wait too
        k_mask1 = (BLOCK_K + k) < K
        w1 = tl.load(w_ptrs + BLOCK_K, mask=n_mask[:, None] & k_mask1[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # Every program re-reads x while the weights pass once: keep x in L1 (evict_last).
    if DEPTH == 1:
        x = tl.load(x_ptrs, mask=k_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        acc = w * x[None, :]
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
            k_mask = (k0 + k) < K
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptrs + k0, mask=k_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            acc += w * x[None, :]
    else:  # DEPTH 2: the next tile's loads go out before this one's multiply
        x = tl.load(x_ptrs, mask=k_mask, other=0.0, eviction_policy="evict_last")
        x1 = tl.load(x_ptrs + BLOCK_K, mask=k_mask1, other=0.0, eviction_policy="evict_last")
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w, x = w1, x1
        for k0 in range(2 * BLOCK_K, K, BLOCK_K):
            k_mask = (k0 + k) < K
            w_next = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x_next = tl.load(x_ptrs + k0, mask=k_mask, other=0.0, eviction_policy="evict_last")
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w, x = w_next, x_next
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    if SILU_AND_MUL:
        # Rounded to y's dtype (x's) first, as the unfused linear stores what silu_and_mul loads.
        gate, up = tl.split(tl.reshape(y.to(y_ptr.dtype.element_ty).to(tl.float32), [BLOCK_N // 2, 2]))
        features = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(
            y_ptr + row * stride_ym + features, silu_mul(gate, up).to(y_ptr.dtype.element_ty), mask=features < N // 2
        )
    else:
        tl.store(y_ptr + row * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def _launch_config(n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, STAGES, DEPTH) of the one-row kernel, tuned per shape class
    in decode steps. Narrow layers take the whole row in one tile, so a program loads its whole
    weight slice before the PDL wait."""
    if k >= _LONG_K:
        return 2, 1024, 8, 1, 2
    if n >= _WIDE_N:
        return 8, 512, 4, 3, 1
    return 4, 2048, 4, 1, 1


def linear_kernel(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton :func:`linear_ref` for up to 16 rows, one weight read per row. x ``[..., K]`` and
    weight ``[N, K]`` with unit stride in K, bias ``[N]``, one float dtype and device. The output
    is accumulated in fp32 and rounded once, into ``out`` (contiguous, x's dtype or fp32) or a
    new tensor in x's dtype."""
    x2 = _check_rows(x, weight, bias)
    n = weight.shape[0]
    y = _output(x, n, out)
    if x2.shape[0] == 0 or n == 0:
        return y
    _launch_linear_kernel(x2, weight, bias, y, silu_and_mul=False)
    return y


def _check_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`_check_inputs`, plus ValueError above ``_MAX_KERNEL_ROWS`` rows."""
    x2 = _check_inputs(x, weight, bias)
    if x2.shape[0] > _MAX_KERNEL_ROWS:
        raise ValueError(
            f"the one-row linear kernel takes at most {_MAX_KERNEL_ROWS} rows, got {x2.shape[0]}: use F.linear"
        )
    return x2


def _launch_linear_kernel(
    x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, silu_and_mul: bool
) -> None:
    """``_linear_kernel`` over x's rows ``x2`` into y (both checked by the caller)."""
    n, k = weight.shape
    block_n, block_k, warps, stages, depth = _launch_config(n, k)
    features = n // 2 if silu_and_mul else n
    per_program = block_n // 2 if silu_and_mul else block_n
    _linear_kernel[(x2.shape[0], triton.cdiv(features, per_program))](
        x2,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        features,
        HAS_BIAS=bias is not None,
        SILU_AND_MUL=silu_and_mul,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DEPTH=depth,
        STAGES=stages,
        num_warps=warps,
        num_stages=stages,
        **pdl.launch_args(x2.device),
    )


# The MLP's gate/up projection with its SwiGLU gate. At one row the linear kernel applies the
# gate in its epilogue, saving a launch; from two rows on it is silu_and_mul(linear(...)), as the
# tensor-core tiles do not pair gate and up features.


def linear_silu_and_mul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~kernels.activation.silu_and_mul_ref` of :func:`linear_ref`: weight ``[2 * I, K]``
    holds the gate's rows, then the up projection's; returns ``[..., I]`` in x's dtype."""
    return silu_and_mul_ref(linear_ref(x, weight, bias))


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton :func:`linear_silu_and_mul_ref`, fused where :func:`linear` runs the one-row kernel,
    else :func:`linear` then the SiLU-mul kernel; the same bits either way."""
    if linear_path(x, weight) == "linear_kernel":
        return linear_silu_and_mul_kernel(x, weight, bias)
    return silu_and_mul(linear(x, weight, bias))


def linear_silu_and_mul_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear_kernel` with the SwiGLU gate in its epilogue: weight ``[2 * I, K]`` (gate
    rows, then up rows). Returns a new ``[..., I]`` tensor in x's dtype, bit for bit
    ``silu_and_mul(linear_kernel(x, weight, bias))``."""
    x2 = _check_rows(x, weight, bias)
    n = weight.shape[0]
    if n % 2:
        raise ValueError(f"weight must have an even number of rows (gate | up), got {tuple(weight.shape)}")
    rows = x2.shape[0]
    y = torch.empty((*x.shape[:-1], n // 2), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    _launch_linear_kernel(x2, weight, bias, y.view(rows, n // 2), silu_and_mul=True)
    return y


# Triton, 2-32 rows on tensor cores: a program computes a [BLOCK_M, BLOCK_N] tile of y over its K
# range; BLOCK_M of 16 or 32 covers a decode batch, so the weight is read once. Loads wrap their
# indices (m % M, n % N) and mask K only when needed (EVEN_K), to keep 16-byte vector loads.
# Few-output layers split K too; _split_k_reduce_kernel sums the fp32 partials in a fixed order,
# so results are bitwise reproducible (unlike atomics).


@triton.jit
def _dot_program_tile(
    w_ptr, N, K, k_per_split, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """A linear_dot program's share of the grid: (K range index, rows m, features n, tile K
    offsets k, K range start, K range length >= 1, pointers of its first weight tile)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_len = tl.minimum(k_per_split, K - k_start)
    # int64 row offsets: the LM head's weight is 151936 x 1536 elements.
    w_ptrs = w_ptr + (n % N).to(tl.int64)[:, None] * stride_wn + (k_start + k)[None, :]
    return pid_k, m, n, k, k_start, k_len, w_ptrs


@triton.jit(do_not_specialize=["M"])
def _linear_dot_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_ys,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # M is not specialized: batch sizes 2 to 16 share one compiled kernel.
    pid_k, m, n, k, k_start, k_len, w_ptrs = _dot_program_tile(
        w_ptr, N, K, k_per_split, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K
    )
    x_ptrs = x_ptr + (m % M).to(tl.int64)[:, None] * stride_xm + (k_start + k)[None, :]

    # Weights load before the PDL wait (kernels.pdl); x may be the previous kernel's output.
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=(k_start + k)[None, :] < K, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if EVEN_K:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=(k_start + k)[None, :] < K, other=0.0)
    acc = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    for k0 in range(BLOCK_K, k_len, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            x = tl.load(x_ptrs + k0)
        else:
            # K ranges start at multiples of BLOCK_K: bounding by K is enough.
            k_mask = (k_start + k0 + k)[None, :] < K
            w = tl.load(w_ptrs + k0, mask=k_mask, other=0.0)
            x = tl.load(x_ptrs + k0, mask=k_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)

    out_mask = (m < M)[:, None] & (n < N)[None, :]
    y_ptrs = y_ptr + pid_k.to(tl.int64) * stride_ys + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
    if PARTIAL:
        tl.store(y_ptrs, acc, mask=out_mask)  # fp32 partial sums; the reduce kernel adds the bias
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


# The wide and long layers' kernel computes y^T = W @ x^T, so the 64-row weight tile is the MMA's
# first operand: a pipelined wgmma on Hopper (x's 16-32 rows are too few for one). No weight load
# before the PDL wait here: it would peel the first tile off the pipelined loop.
@triton.jit(do_not_specialize=["M"])
def _linear_dot_swap_ab_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_ys,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_k, m, n, k, k_start, k_len, w_ptrs = _dot_program_tile(
        w_ptr, N, K, k_per_split, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K
    )
    xt_ptrs = x_ptr + (m % M).to(tl.int64)[None, :] * stride_xm + (k_start + k)[:, None]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, k_len, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            xt = tl.load(xt_ptrs + k0)
        else:
            w = tl.load(w_ptrs + k0, mask=(k_start + k0 + k)[None, :] < K, other=0.0)
            xt = tl.load(xt_ptrs + k0, mask=(k_start + k0 + k)[:, None] < K, other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)

    out_mask = (n < N)[:, None] & (m < M)[None, :]
    y_ptrs = y_ptr + pid_k.to(tl.int64) * stride_ys + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    if PARTIAL:
        tl.store(y_ptrs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


# The split-K reduction sums BLOCK_N features of one row over the splits in order, adds the bias
# and casts. SPLITS is a constexpr so the loop unrolls and every split's load is issued up front.


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr,
    b_ptr,
    y_ptr,
    N,
    stride_ws,
    stride_wm,
    stride_ym,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # the workspace is the previous kernel's output
    ptrs = ws_ptr + row * stride_wm + n
    acc = tl.load(ptrs, mask=n_mask, other=0.0)
    for _ in tl.static_range(1, SPLITS):
        ptrs += stride_ws  # advancing the pointer: s * stride_ws could overflow int32
        acc += tl.load(ptrs, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


def _dot_block_m(rows: int) -> int:
    """Rows a :func:`linear_dot` program multiplies: 16 (tl.dot's minimum) or 32."""
    return 16 if rows <= 16 else 32


class DotConfig(NamedTuple):
    """A :func:`linear_dot` launch; ``swap_ab`` tiles the transposed product ``W x^T``."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool


def _dot_config(n: int, k: int) -> DotConfig:
    """The :func:`linear_dot` launch for a weight ``[n, k]``, tuned per shape class in decode
    steps: wide and long layers tile the transposed product; narrow ones split K into single
    tiles so each program loads its whole weight slice before the PDL wait. K ranges stay >= 256
    (shorter ones lose more to the partial sums than they gain)."""
    if n >= _WIDE_N:  # before the long-row test: a wide grid needs no split, whatever K
        return DotConfig(64, 128, 1, 4, 3, swap_ab=True)
    if k >= _LONG_K:
        return DotConfig(64, 256, max(1, min(5, k // 256)), 4, 3, swap_ab=True)
    return DotConfig(64, 512, max(1, min(3, k // 256)), 8, 1, swap_ab=False)


def plan_split(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(k_per_split, splits): K ranges of whole BLOCK_K tiles, at most ``split_k`` of them and
    none empty (K 1536 in 8 splits of 128-tiles gives 6 ranges of 256, not 8 with 2 empty)."""
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return k_per_split, triton.cdiv(k, k_per_split)


def linear_dot(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton :func:`linear_ref` on tensor cores, one weight read per 32 rows. Inputs and output
    as for :func:`linear_kernel` (fp32 inputs multiply in full fp32, not tf32). Deterministic:
    split-K partial sums are added in a fixed order."""
    return _linear_dot(x, weight, bias, reduce=True, out=out)


def _linear_dot(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, reduce: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`linear_dot`'s launches. ``reduce=False`` (no bias, no ``out``) skips the split-K
    reduce and returns the workspace as :func:`linear_partial_sums` describes."""
    x2 = _check_inputs(x, weight, bias)
    n, k = weight.shape
    rows = x2.shape[0]
    y = _output(x, n, out)
    if rows == 0 or n == 0:
        return y if reduce else y.unsqueeze(0)
    cfg = _dot_config(n, k)
    k_per_split, splits = plan_split(k, cfg.block_k, cfg.split_k)
    launch = pdl.launch_args(x.device)
    block_m = _dot_block_m(rows)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(rows, block_m), splits)
    kernel = _linear_dot_swap_ab_kernel if cfg.swap_ab else _linear_dot_kernel
    common = dict(
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch,
    )
    if splits == 1:
        kernel[grid](
            x2,
            weight,
            bias if bias is not None else weight,
            y,
            rows,
            n,
            k,
            k_per_split,
            x2.stride(0),
            weight.stride(0),
            n,
            0,
            HAS_BIAS=bias is not None,
            PARTIAL=False,
            **common,
        )
        return y if reduce else y.unsqueeze(0)
    ws = torch.empty((splits, rows, n), dtype=torch.float32, device=x.device)
    kernel[grid](
        x2,
        weight,
        weight,
        ws,
        rows,
        n,
        k,
        k_per_split,
        x2.stride(0),
        weight.stride(0),
        n,
        rows * n,
        HAS_BIAS=False,
        PARTIAL=True,
        **common,
    )
    if not reduce:
        return ws.view(splits, *x.shape[:-1], n)
    block_r = min(1024, triton.next_power_of_2(n))
    # 8 warps: one 16-byte load a split per thread.
    _split_k_reduce_kernel[(rows, triton.cdiv(n, block_r))](
        ws,
        bias if bias is not None else ws,
        y,
        n,
        rows * n,
        n,
        n,
        SPLITS=splits,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_r,
        num_warps=8,
        **launch,
    )
    return y


# Partial sums for the consumer to add: o_proj and down hand their split-K partials to the
# add + RMSNorm kernel, which sums them in the reduce kernel's order (same bits, one launch fewer).


def linear_partial_sums_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`linear_ref` (no bias) as a single split: ``[1, ..., N]``."""
    return linear_ref(x, weight).unsqueeze(0)


def linear_partial_sums(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x W^T`` as partial sums over ranges of K, ``[splits, ..., N]``: summed over dim 0 in
    order in fp32 and rounded to x's dtype, they are :func:`linear`'s output bit for bit. The fp32
    partials where :func:`linear_dot` splits K, else one split holding :func:`linear`'s output."""
    if linear_path(x, weight) == "linear_dot":
        return _linear_dot(x, weight, None, reduce=False)
    return linear(x, weight).unsqueeze(0)
