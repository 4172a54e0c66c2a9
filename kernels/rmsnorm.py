"""RMSNorm, plain and with the residual add fused."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.checks import FLOAT_DTYPES, as_rows


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim; computed in fp32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``; the sum is rounded to x.dtype first."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(summed, weight, eps), summed


# --------------------------------------------------------------------------------------------
# Triton kernels. One program normalises one row; the whole row sits in registers (hidden
# sizes are a few thousand), so x is read once and the output written once.
# --------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, stride_x, stride_out, hidden, eps,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # fp32 right after the load: bf16 arithmetic is wrong under the interpreter, and the
    # reference computes in fp32 too.
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    tl.store(out_ptr + row * stride_out + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    stride_x, stride_res, stride_out, stride_sum, hidden, eps,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    # The reference rounds the sum to x's dtype before normalising it: do the same round trip.
    summed = (x + r).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * stride_sum + cols, summed, mask=mask)
    s = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / hidden + eps)
    tl.store(out_ptr + row * stride_out + cols, (s * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> int:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if weight.dtype not in FLOAT_DTYPES or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous float tensor, got {weight.dtype} {weight.stride()}")
    return hidden


def _launch_config(hidden: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the row padded to a power of two, about 256 elements a warp."""
    block = triton.next_power_of_2(hidden)
    return block, min(max(block // 256, 1), 16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton :func:`rms_norm_ref`: x ``[..., H]`` (unit stride in H), weight ``[H]``.

    Returns a new contiguous tensor of x's shape and dtype.
    """
    hidden = _check_weight(x, weight)
    x2 = as_rows("x", x, hidden)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if x2.shape[0] == 0:
        return out
    block, num_warps = _launch_config(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, weight, out2, x2.stride(0), out2.stride(0), hidden, eps, BLOCK=block, num_warps=num_warps,
        **pdl.launch_args(x.device),
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`fused_add_rms_norm_ref`: one pass reads x and residual, writes both outputs.

    x and residual ``[..., H]`` of the same shape (dtypes may differ; the sum takes x's).
    Returns new tensors ``(rms_norm(x + residual), x + residual)``; the inputs are untouched.
    """
    hidden = _check_weight(x, weight)
    if residual.shape != x.shape or residual.device != x.device:
        raise ValueError(f"residual {tuple(residual.shape)} on {residual.device} must match x "
                         f"{tuple(x.shape)} on {x.device}")
    x2, r2 = as_rows("x", x, hidden), as_rows("residual", residual, hidden)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2, sum2 = out.view(-1, hidden), summed.view(-1, hidden)
    if x2.shape[0] == 0:
        return out, summed
    block, num_warps = _launch_config(hidden)
    _fused_add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out2, sum2,
        x2.stride(0), r2.stride(0), out2.stride(0), sum2.stride(0), hidden, eps,
        BLOCK=block, num_warps=num_warps, **pdl.launch_args(x.device),
    )
    return out, summed
