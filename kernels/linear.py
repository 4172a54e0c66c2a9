"""Linear layers for decode: ``y = x W^T + b`` when x has only a few rows.

A decode step feeds each linear layer one row per sequence, so up to a few dozen rows the layer
is bound by the weight read (an H200 needs ~200 flops a weight byte to be compute-bound; 16
rows use 16). :func:`linear` picks, from the shapes alone (a CUDA graph captured for a batch
size keeps its choice):

* 1 row: :func:`linear_kernel`, a GEMV with plain FMAs and many small programs: 1.9-4.8 TB/s
  on the Qwen2.5-1.5B shapes, where cuBLAS's kernels reach 0.8-4.1 TB/s (its o_proj GEMV takes
  6 us for 4.7 MB); 0.24 ms off a 1.71 ms batch-1 decode step (``python -m pdserve.bench.kernels``).
* 2 to ``MAX_DOT_ROWS`` = 32 rows: :func:`linear_dot`, one weight read for all rows on tensor
  cores (:func:`linear_kernel` re-reads it for every row: two rows take 1.4-1.7x the time of
  one on the large shapes). The narrow layers (qkv, o_proj: under 8192 outputs and 4096
  inputs) tile ``x W^T``, each program loading its whole weight slice before it waits on the
  kernel ahead (kernels.pdl). The wide and long layers (gate/up and the LM head; down) tile
  the transposed product ``W x^T``: the weight tile is the MMA's 64-row operand (wgmma on
  Hopper, which the batch's 16-32 rows are too few to be) and its stream is software-pipelined.
  Against ``x W^T`` tiles there up to 16 rows and cuBLAS (which also breaks the chain of PDL
  launches) above, on an H200: batch-8 decode step at 2048 tokens 1.622 -> 1.482 ms, batch 32
  2.123 -> 1.931 (Qwen2.5-1.5B, docs/benchmarks.md). At 2 rows the narrow layers go to
  :func:`linear_kernel`: these 5-6 MB reads take ~4 us either way, latency rather than
  bandwidth, and its many programs finish two rows in 2.7-3.1 us instead of 3.9-4.1 (about
  60 us a batch-2 step over Qwen2.5-1.5B's 28 layers).
* More rows: cuBLAS (``F.linear``).

:func:`linear_silu_and_mul` is the MLP's gate/up projection with the SwiGLU gate applied, in the
one-row kernel's epilogue where :func:`linear` runs that kernel.
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
# Shape classes of both kernels' launch configurations (and of linear()'s choice at 2 rows):
# "long" rows (the MLP's down projection), "wide" outputs (gate/up, LM head), else "narrow"
# (qkv, o_proj).
_LONG_K = 4096
_WIDE_N = 8192

LinearPath = Literal["linear_kernel", "linear_dot", "F.linear"]


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T + bias[N]`` (torch's ``F.linear``), copied into ``out``
    (``[..., N]``, contiguous, in x's dtype or fp32) when given and returned."""
    y = F.linear(x, weight, bias)
    if out is None:
        return y
    _check_out(x, weight.shape[0], out)
    return out.copy_(y)


def linear_path(x: torch.Tensor, weight: torch.Tensor) -> LinearPath:
    """What :func:`linear` runs for ``x [..., K]`` and ``weight [N, K]``: the name of
    :func:`linear_kernel`, :func:`linear_dot` or ``F.linear`` (cuBLAS; every non-CUDA tensor).
    Shapes and device only, so a CUDA graph captured for a batch size keeps the choice."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not x.is_cuda or rows == 0 or rows > MAX_DOT_ROWS:
        return "F.linear"
    if rows == 1:
        return "linear_kernel"
    n, k = weight.shape[0], weight.shape[-1]  # a bad weight is the kernels' ValueError
    narrow = n < _WIDE_N and k < _LONG_K
    # Two rows of a narrow layer: linear_kernel's two weight reads of 5-6 MB still finish first
    # (H200: 2.7-3.1 us against 3.9-4.1; see the module docstring). On the wide and long layers
    # linear_dot wins from 2 rows. Between 2 and 8 rows only those two counts were measured:
    # linear_dot takes the same time at both (one weight read), linear_kernel's grows with
    # every row, so from 3 rows on linear_dot.
    if rows == 2 and narrow:
        return "linear_kernel"
    return "linear_dot"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear_ref` through the implementation :func:`linear_path` names: a Triton
    kernel on a GPU up to ``MAX_DOT_ROWS`` rows, ``F.linear`` elsewhere.

    The Triton kernels store their fp32 accumulator straight into ``out``: fp32 logits come out
    of the LM head unrounded and with no cast kernel after it (0.015 ms of a batch-32 step on an
    H200). ``F.linear`` rounds to x's dtype first and then copies."""
    path = linear_path(x, weight)
    if path == "linear_kernel":
        return linear_kernel(x, weight, bias, out)
    if path == "linear_dot":
        return linear_dot(x, weight, bias, out)
    return linear_ref(x, weight, bias, out)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x as ``[rows, K]`` rows (a view), or ValueError for what neither kernel takes."""
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain (x [..., K], weight [N, K])")
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
        raise ValueError(f"out must be {list(shape)} in {x.dtype} or float32 on {x.device}, got "
                         f"{list(out.shape)} {out.dtype} on {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")


def _output(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """The tensor a kernel writes x's ``[..., N]`` output to: ``out`` (checked) or a new one in
    x's dtype."""
    if out is None:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    _check_out(x, n, out)
    return out


# --------------------------------------------------------------------------------------------
# Triton, one row: a program computes BLOCK_N output features of one row of x, walking K in
# BLOCK_K steps; the weight tile [BLOCK_N, BLOCK_K] is multiplied into the row with plain FMAs
# in fp32 (tensor cores would need 16-row tiles; the bound is the memory read anyway) and
# reduced over K at the end. Small BLOCK_N means many programs, which keeps enough loads in
# flight to approach the memory bandwidth for these narrow shapes. Rows are a grid axis: each
# row reads the weight again (measured: two rows take 1.4-1.7x the time of one on the large
# shapes).
#
# Triton pipelines a loop's loads that feed no tl.dot only when the loop itself asks for it
# (``tl.range(..., num_stages=S)``: cp.async into S - 1 shared-memory buffers; the kernel's
# num_stages does nothing here, Triton 3.6 and 3.9). So the loop after the first tile takes one
# of two forms:
# * DEPTH 1, ``STAGES`` >= 2: the wide outputs (gate/up, the LM head; 3 tiles a program). After
#   the wait their remaining tiles are in flight at once: B=1 decode step 1.060 -> 1.027 ms at
#   128 tokens, 1.175 -> 1.141 at 2048, the same logits bit for bit (gate/up 14.6 -> 13.6 us,
#   3.77 -> 4.05 TB/s). Without the first tile ahead of the wait it was slower than before;
# * DEPTH 2: the long rows (the down projection: 9 tiles a program, 768 programs). Their first
#   two tiles go out before the wait (three were no better than one), then each iteration
#   issues the next tile's loads before it multiplies the current one, in registers.
#   Pipelined through shared memory instead (1-8 features, 256-4096-wide tiles, 3-8 stages),
#   down was 0.01 ms faster at best at 128 tokens and slower at 2048.
# x's loads ask L1 to keep x (evict_last), which every program re-reads while the weights pass
# once; hints on the weights' loads (.cg, evict_first) were level or slower. With down's second
# early tile: B=1 decode step 1.028 -> 1.012 ms at 128 tokens, 1.140 -> 1.124 at 2048, same
# call, the same logits bit for bit (each alone gained 0.002-0.005 ms).
# (H200, Qwen2.5-1.5B; docs/benchmarks.md.)
# --------------------------------------------------------------------------------------------


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, SILU_AND_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DEPTH: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_N)
    if SILU_AND_MUL:
        # W = [gate | up] by rows, N = 2 * I. The program takes BLOCK_N / 2 features; tile row r
        # is feature r // 2 of the gate for even r, of the up projection for odd r, so that the
        # epilogue pairs neighbouring rows.
        features = tl.program_id(1) * (BLOCK_N // 2) + r // 2
        n = features + (r % 2) * (N // 2)
        n_mask = features < N // 2
    else:
        n = tl.program_id(1) * BLOCK_N + r
        n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :]
    x_ptrs = x_ptr + row * stride_xm + k
    # The first weight tile (on the narrow layers the whole slice: BLOCK_K >= K) is loaded
    # before the wait, as no kernel writes weights: under PDL it streams while the kernels
    # ahead finish (kernels.pdl).
    k_mask = k < K
    w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    if DEPTH == 1:
        # Converted here, so the program waits for its tile before it lets the next kernel
        # launch. Converting at the multiply instead made B=1 and B=2 steps 0.05 ms slower.
        w = w.to(tl.float32)
    else:  # the long rows' second tile goes out before the wait too
        k_mask1 = (BLOCK_K + k) < K
        w1 = tl.load(w_ptrs + BLOCK_K, mask=n_mask[:, None] & k_mask1[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # Every program reads all of x while the weights stream past once: x's lines are the ones
    # to keep in L1 (evict_last).
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
        tl.store(y_ptr + row * stride_ym + features, silu_mul(gate, up).to(y_ptr.dtype.element_ty),
                 mask=features < N // 2)
    else:
        tl.store(y_ptr + row * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def _launch_config(n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, STAGES, DEPTH), from sweeps on an H200 at one row (bf16).

    Long rows (the MLP's down projection) take 2 features a program, wide K tiles, more warps
    and the next tile's loads issued ahead (DEPTH 2: B=1 decode step 1.123 -> 1.104 ms; DEPTH 3
    gave the same). 2 features, not 4, since the gate/up kernel applies the SwiGLU gate (down
    follows it directly): B=1 step 1.089 -> 1.067 ms at 128 tokens, 1.189 -> 1.176 at 2048, same
    call; 8 features, 2048-wide or 512-wide tiles, or 4 warps were slower;
    wide outputs (the gate/up projection, the LM head) take 8 features a program and their
    tiles after the first in flight together (3 stages; see above); everything else
    ("narrow": qkv, o_proj) 4 features and the whole row in one tile, so a program loads its
    entire weight slice before the wait (kernels.pdl). That tile was measured in the model,
    where it beats the isolated sweep's (4, 512, 4, 3): B=1 decode step -0.04 ms; 512-wide
    tiles in 3 stages were 0.03 ms slower (docs/benchmarks.md).
    """
    if k >= _LONG_K:
        return 2, 1024, 8, 1, 2
    if n >= _WIDE_N:
        return 8, 512, 4, 3, 1
    return 4, 2048, 4, 1, 1


def linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton :func:`linear_ref` for a few rows, one weight read per row (at most 16;
    :func:`linear` uses it for 1 row, and for 2 on narrow layers).

    x ``[..., K]`` (a view with unit stride in K), weight ``[N, K]`` with unit stride in K, bias
    ``[N]``; one float dtype, one device. Returns the ``[..., N]`` output, accumulated in fp32
    and rounded once: ``out`` when given (contiguous, x's dtype or fp32), else a new tensor in
    x's dtype.
    """
    x2 = _check_rows(x, weight, bias)
    n = weight.shape[0]
    y = _output(x, n, out)
    if x2.shape[0] == 0 or n == 0:
        return y
    _launch_linear_kernel(x2, weight, bias, y, silu_and_mul=False)
    return y


def _check_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`_check_inputs` for the one-row kernel, which re-reads the weight for every row:
    ValueError above ``_MAX_KERNEL_ROWS`` rows."""
    x2 = _check_inputs(x, weight, bias)
    if x2.shape[0] > _MAX_KERNEL_ROWS:
        raise ValueError(f"the one-row linear kernel takes at most {_MAX_KERNEL_ROWS} rows, got {x2.shape[0]}: "
                         "use F.linear")
    return x2


def _launch_linear_kernel(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                          silu_and_mul: bool) -> None:
    """``_linear_kernel`` over x's rows ``x2`` into y (checked by the caller), in the weight
    shape's launch configuration; with ``silu_and_mul`` each program takes BLOCK_N / 2 features."""
    n, k = weight.shape
    block_n, block_k, warps, stages, depth = _launch_config(n, k)
    features = n // 2 if silu_and_mul else n
    per_program = block_n // 2 if silu_and_mul else block_n
    _linear_kernel[(x2.shape[0], triton.cdiv(features, per_program))](
        x2, weight, bias if bias is not None else weight, y,
        n, k, x2.stride(0), weight.stride(0), features,
        HAS_BIAS=bias is not None, SILU_AND_MUL=silu_and_mul, BLOCK_N=block_n, BLOCK_K=block_k, DEPTH=depth,
        STAGES=stages, num_warps=warps, num_stages=stages, **pdl.launch_args(x2.device),
    )


# --------------------------------------------------------------------------------------------
# The MLP's gate/up projection and its SwiGLU gate, ``silu(x W_gate^T) * (x W_up^T)``. Where
# linear() runs the one-row kernel, that kernel computes the gate in its epilogue: each program
# takes matching gate and up rows of W, so the step's SiLU-mul kernel, a launch and a boundary
# in the chain of PDL kernels, goes away (H200, same call, the same logits bit for bit: B=1
# decode step 1.094 -> 1.085 ms at 128 tokens, 1.211 -> 1.186 at 2048; 16 or 4 rows a program
# instead of 8, or DEPTH 2, were slower). Elsewhere it is silu_and_mul(linear(...)): from two
# rows on, the tensor-core tiles' features are not paired, and SiLU-mul costs nothing there
# (the step's critical path at 8-32 rows, docs/benchmarks.md).
# --------------------------------------------------------------------------------------------


def linear_silu_and_mul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~kernels.activation.silu_and_mul_ref` of :func:`linear_ref`: weight ``[2 * I, K]``
    holds the gate's rows, then the up projection's; returns ``[..., I]`` in x's dtype."""
    return silu_and_mul_ref(linear_ref(x, weight, bias))


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton :func:`linear_silu_and_mul_ref`: :func:`linear_silu_and_mul_kernel` where
    :func:`linear` runs the one-row kernel, else :func:`linear` then the SiLU-mul kernel. The
    same bits either way."""
    if linear_path(x, weight) == "linear_kernel":
        return linear_silu_and_mul_kernel(x, weight, bias)
    return silu_and_mul(linear(x, weight, bias))


def linear_silu_and_mul_kernel(x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear_kernel` with the SwiGLU gate in its epilogue, for a few rows (at most 16).

    x ``[..., K]``, weight ``[2 * I, K]`` (gate rows, then up rows) and bias ``[2 * I]`` as for
    :func:`linear_kernel`. Returns a new ``[..., I]`` tensor in x's dtype: each projection is
    rounded to x's dtype before the gate, so the output is bit for bit
    ``silu_and_mul(linear_kernel(x, weight, bias))``.
    """
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


# --------------------------------------------------------------------------------------------
# Triton, 2-32 rows on tensor cores: a program computes a [BLOCK_M, BLOCK_N] tile of y (rows of
# x by output features), walking its K range in BLOCK_K steps: acc += x[BLOCK_M, BLOCK_K] @
# W[BLOCK_N, BLOCK_K]^T with tl.dot (fp32 accumulate). BLOCK_M is 16 (tl.dot's minimum) or 32,
# so one program row covers a whole decode batch and the weight is read once; more rows take
# more programs along M, each reading the weight again (linear() sends those to cuBLAS). Rows
# past M are padded: the loads wrap their row and feature indices (m % M, n % N, as in Triton's
# matmul tutorial) so that they need no mask and stay vectorized, and only the store is masked.
# Loads along K are masked only when K is not a multiple of BLOCK_K (EVEN_K): a mask along the
# contiguous dimension costs the 16-byte vector loads.
#
# Layers with few outputs (o_proj, down: 1536 features; "narrow" and "long" below) give too few
# programs to keep 132 SMs busy, so SPLIT_K > 1 also splits K: program (n, m, s) covers K range
# [s * k_per_split, ...) and writes its fp32 partial tile to a workspace [splits, M, N];
# _split_k_reduce_kernel then sums the partials in a fixed order, adds the bias and casts.
# Unlike fp32 atomics, the result does not depend on program timing (bitwise reproducible,
# which CUDA-graph replays and tests rely on). The workspace moves 2 * splits * M * N * 4 bytes
# (mostly in L2), small against the weight's N * K * 2 when 4 * splits * M << K.
# --------------------------------------------------------------------------------------------


@triton.jit
def _dot_program_tile(w_ptr, N, K, k_per_split, stride_wn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A linear_dot program's part of the grid (feature tiles, row tiles, K ranges), as both
    products tile it: its K range's index, its rows m and features n, a tile's K offsets k,
    where its K range starts and how long it is (>= 1: the wrapper launches no empty range),
    and the pointers of its first weight tile ``[BLOCK_N, BLOCK_K]``."""
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
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym, stride_ys,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    # M is not specialized (do_not_specialize): batch sizes 2 to 16 share one compiled kernel.
    pid_k, m, n, k, k_start, k_len, w_ptrs = _dot_program_tile(w_ptr, N, K, k_per_split, stride_wn,
                                                               BLOCK_M, BLOCK_N, BLOCK_K)
    x_ptrs = x_ptr + (m % M).to(tl.int64)[:, None] * stride_xm + (k_start + k)[None, :]

    # The first weight tile (on the narrow layers the program's whole K range) is loaded before
    # the wait, as no kernel writes weights: under PDL it streams while the kernels ahead
    # finish (kernels.pdl). x may have been written by the previous kernel: after the wait.
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
            # K ranges start at multiples of BLOCK_K, so a tile never crosses into the next
            # program's range: bounding by K is enough.
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


# The wide and long layers' kernel: the same tiles and partial sums, but each program computes
# y^T's [BLOCK_N, BLOCK_M] tile as W[BLOCK_N, BLOCK_K] @ x^T[BLOCK_K, BLOCK_M], so the weight is
# the MMA's first operand. On Hopper that operand may have 64 rows, which makes the product a
# wgmma reading both tiles from shared memory, and Triton pipelines its loads over num_stages
# (x's rows alone, 16 or 32, are too few for wgmma: _linear_dot_kernel runs mma.sync). The loop
# starts after the PDL wait: loading the first weight tile before it, as _linear_dot_kernel
# does, peels it off the pipelined loop, and that measured slower on gate/up and down.
@triton.jit(do_not_specialize=["M"])
def _linear_dot_swap_ab_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym, stride_ys,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_k, m, n, k, k_start, k_len, w_ptrs = _dot_program_tile(w_ptr, N, K, k_per_split, stride_wn,
                                                               BLOCK_M, BLOCK_N, BLOCK_K)
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


# --------------------------------------------------------------------------------------------
# Triton, the split-K reduction: a program sums BLOCK_N features of one row over the splits of
# the workspace, in split order (deterministic), adds the bias and casts to y's dtype. The
# workspace is the dot kernel's output, so under PDL every read of it follows gdc_wait. SPLITS
# is a constexpr (a layer shape's split count: 2-3 compiled variants a model) so the loop
# unrolls and every split's load goes out before the first add; a loop over a runtime count
# waits for each load in turn (Triton does not pipeline loads that feed no tl.dot).
# --------------------------------------------------------------------------------------------


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr, b_ptr, y_ptr,
    N,
    stride_ws, stride_wm, stride_ym,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
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
    """Rows a :func:`linear_dot` program multiplies: 16 (tl.dot's minimum) up to 16 rows, else
    32, so that a decode batch of up to 32 reads the weight once."""
    return 16 if rows <= 16 else 32


class DotConfig(NamedTuple):
    """A :func:`linear_dot` launch: tile sizes, the K split, warps, pipeline stages, and whether
    the program tiles the transposed product (``_linear_dot_swap_ab_kernel``)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool


def _dot_config(n: int, k: int) -> DotConfig:
    """The :func:`linear_dot` launch for a weight ``[n, k]``, from sweeps on an H200 (bf16,
    Qwen2.5-1.5B shapes; docs/benchmarks.md), the last of them inside CUDA-graph decode steps at
    2-32 rows (one compiled kernel serves up to 16 rows, another 17-32).

    * wide outputs (gate/up 17920, LM head 151936): the transposed product in 64-feature tiles
      of 128-wide K steps, 280 and 2374 programs, no split, 3 stages (4, best in isolation, was
      0.03 ms a batch-32 step slower; 128-feature tiles 0.13 ms).
    * long rows (down, K 8960): the transposed product, 64 features, K split 5 ways into ranges
      of seven 256-wide steps, 120 programs, 3 stages. With the reduce kernel it was as fast as
      7 ranges of ten 128-wide steps at 4 stages; with the partials summed by the add + RMSNorm
      kernel (linear_partial_sums), fewer splits to load made batch-2 to 24 steps up to 0.03 ms
      faster (batch 32 within 0.007). 5 or 4 ranges of 128-wide steps at 4 stages were slower
      at 32 rows (+0.03, +0.06 ms), as were 5 ranges of 128-wide steps at 3 stages before
      (+0.1 ms).
    * narrow (qkv 2048, o_proj 1536): ``x W^T`` in 64 features a program and K split 3 ways
      into single 512-wide tiles, so that each program loads its whole weight slice (64 KB)
      before the wait (kernels.pdl); 8 warps, one stage. Measured in the model, against the
      sweep's best in isolation (32 features, 4 splits of 128-wide tiles): batch 8 and 16
      steps -10%. The transposed product on these layers, in the tiles that were fastest in
      isolation, made batch 8-32 steps 0.003-0.04 ms slower.

    Splits keep K ranges of 256 or more (shorter ones lost more to the partial sums than they
    gained); :func:`plan_split` may run fewer ranges than ``split_k``.
    """
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


def linear_dot(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton :func:`linear_ref` on tensor cores, one weight read for up to 32 rows
    (:func:`linear` uses it for 2 to ``MAX_DOT_ROWS`` rows; more rows work, each 32 reading the
    weight again).

    x ``[..., K]`` (a view with unit stride in K), weight ``[N, K]`` with unit stride in K, bias
    ``[N]``; one float dtype, one device. Returns the ``[..., N]`` output, accumulated in fp32
    (fp32 inputs multiply in full fp32, not tf32) and rounded once: ``out`` when given
    (contiguous, x's dtype or fp32), else a new tensor in x's dtype. Deterministic: split-K
    partial sums are added in a fixed order.
    """
    return _linear_dot(x, weight, bias, reduce=True, out=out)


def _linear_dot(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, reduce: bool,
                out: torch.Tensor | None = None) -> torch.Tensor:
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
    common = dict(EVEN_K=k % cfg.block_k == 0, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  DOT_PRECISION=dot_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  **launch)
    if splits == 1:
        kernel[grid](
            x2, weight, bias if bias is not None else weight, y,
            rows, n, k, k_per_split, x2.stride(0), weight.stride(0), n, 0,
            HAS_BIAS=bias is not None, PARTIAL=False, **common,
        )
        return y if reduce else y.unsqueeze(0)
    ws = torch.empty((splits, rows, n), dtype=torch.float32, device=x.device)
    kernel[grid](
        x2, weight, weight, ws,
        rows, n, k, k_per_split, x2.stride(0), weight.stride(0), n, rows * n,
        HAS_BIAS=False, PARTIAL=True, **common,
    )
    if not reduce:
        return ws.view(splits, *x.shape[:-1], n)
    block_r = min(1024, triton.next_power_of_2(n))
    # 8 warps: one 16-byte load a split per thread. Against 4 warps in the decode step (H200,
    # where qkv's reduce is the one left): batch 32 at 2048 tokens 0.007 ms faster, the same
    # elsewhere (docs/benchmarks.md).
    _split_k_reduce_kernel[(rows, triton.cdiv(n, block_r))](
        ws, bias if bias is not None else ws, y,
        n, rows * n, n, n,
        SPLITS=splits, HAS_BIAS=bias is not None, BLOCK_N=block_r, num_warps=8, **launch,
    )
    return y


# --------------------------------------------------------------------------------------------
# Partial sums for the consumer to add: a split-K linear's reduce kernel is one more launch in
# the decode chain, and its only work, reading the splits' partials, the next kernel can do as
# it loads its input. The layers whose output feeds the residual add (o_proj, down) hand their
# partials to the add + RMSNorm kernel (kernels.rmsnorm), which sums them in the reduce
# kernel's order: the same residual sum bit for bit, one launch fewer a layer each.
# --------------------------------------------------------------------------------------------


def linear_partial_sums_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`linear_ref` (no bias) as a single split: ``[1, ..., N]``."""
    return linear_ref(x, weight).unsqueeze(0)


def linear_partial_sums(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x W^T`` as partial sums over ranges of K, ``[splits, ..., N]``: their sum over the first
    dim, in order and in fp32, rounded to x's dtype, is :func:`linear`'s output bit for bit
    (kernels.rmsnorm.fused_add_rms_norm adds them so). Where :func:`linear` runs
    :func:`linear_dot` and it splits K, the fp32 partials its reduce kernel would have summed
    (that kernel does not run); otherwise one split, a view of :func:`linear`'s output in x's
    dtype."""
    if linear_path(x, weight) == "linear_dot":
        return _linear_dot(x, weight, None, reduce=False)
    return linear(x, weight).unsqueeze(0)
