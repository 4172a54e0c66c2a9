"""Linear layers for decode: ``y = x W^T + b`` when x has only a few rows.

A decode step of one sequence feeds each linear layer a single row, so the layer is a
matrix-vector product bound by the weight read. cuBLAS's kernels for these shapes reach
0.8-4.1 TB/s on an H200 (its o_proj GEMV takes 6 us for 4.7 MB); the kernel here streams the
weight with many small programs and reaches 1.9-4.8 TB/s on the Qwen2.5-1.5B shapes
(`python -m bench.kernels`): 0.24 ms off a 1.71 ms batch-1 decode step. With two rows or more
it loses to cuBLAS on the large shapes (each row re-reads the weight), so :func:`linear` uses
it for ``MAX_ROWS`` = 1 only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl
from kernels.checks import as_rows

MAX_ROWS = 1  # rows of x up to which linear() runs the Triton kernel; more go to cuBLAS
_MAX_KERNEL_ROWS = 16  # each row re-reads the weight: a few rows at most


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T + bias[N]`` (torch's ``F.linear``)."""
    return F.linear(x, weight, bias)


# --------------------------------------------------------------------------------------------
# Triton: a program computes BLOCK_N output features of one row of x, walking K in BLOCK_K
# steps; the weight tile [BLOCK_N, BLOCK_K] is multiplied into the row with plain FMAs in fp32
# (tensor cores would need 16-row tiles; the bound is the memory read anyway) and reduced over
# K at the end. Small BLOCK_N means many programs, which keeps enough loads in flight to
# approach the memory bandwidth for these narrow shapes. Rows are a grid axis: each row reads
# the weight again (measured: two rows take 1.4-1.7x the time of one on the large shapes).
# --------------------------------------------------------------------------------------------


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_mask = n < N
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :]
    x_ptrs = x_ptr + row * stride_xm + k
    # The first weight tile is loaded before waiting on the previous kernel (it never writes
    # weights): under PDL that read overlaps the previous kernel's tail.
    k_mask = k < K
    w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    acc = w * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k_mask = (k0 + k) < K
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptrs + k0, mask=k_mask, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def _launch_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), from a sweep on an H200 at one row (bf16).

    Long rows (the MLP's down projection) take wide K tiles and more warps; wide outputs (the
    gate/up projection, the LM head) take 8 features a program; everything else 4.
    """
    if k >= 4096:
        block_n, block_k, warps, stages = 4, 1024, 8, 2
    elif n >= 8192:
        block_n, block_k, warps, stages = 8, 512, 4, 2
    else:
        block_n, block_k, warps, stages = 4, 512, 4, 3
    return block_n, block_k, warps, stages


def uses_kernel(x: torch.Tensor) -> bool:
    """Whether :func:`linear` runs the Triton kernel for ``x`` (else cuBLAS via ``F.linear``)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.is_cuda and 1 <= rows <= MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear_ref` through :func:`linear_kernel` where it wins (a GPU, at most
    ``MAX_ROWS`` rows), through ``F.linear`` elsewhere. The choice depends only on shapes, so a
    CUDA graph captured for a batch size keeps it."""
    return linear_kernel(x, weight, bias) if uses_kernel(x) else F.linear(x, weight, bias)


def linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton :func:`linear_ref` for a few rows (at most 16; :func:`linear` uses it up to ``MAX_ROWS``).

    x ``[..., K]`` (a view with unit stride in K), weight ``[N, K]`` with unit stride in K, bias
    ``[N]``; one float dtype, one device. Returns a new ``[..., N]`` tensor in x's dtype,
    accumulated in fp32.
    """
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
    rows = x2.shape[0]
    if rows > _MAX_KERNEL_ROWS:
        raise ValueError(f"linear_kernel takes at most {_MAX_KERNEL_ROWS} rows, got {rows}: use F.linear")
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    block_n, block_k, warps, stages = _launch_config(n, k)
    _linear_kernel[(rows, triton.cdiv(n, block_n))](
        x2, weight, bias if bias is not None else weight, y,
        n, k, x2.stride(0), weight.stride(0), n,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        **pdl.launch_args(x.device),
    )
    return y
