"""RMSNorm, plain and with the residual add fused."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import pdl
from pdserve.kernels.checks import FLOAT_DTYPES, as_rows
from pdserve.kernels.pdl import prefetch_l2


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim; computed in fp32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)`` in residual's dtype. x is rounded to
    that dtype first, and so is the sum, before the norm.

    x has residual's shape, or is a split-K linear's partial sums ``[splits, *residual.shape]``
    (kernels.linear.linear_partial_sums): those are added in split order in fp32, then rounded,
    as the linear's own reduction would have.
    """
    if x.shape != residual.shape:
        _check_partials(x, residual)
        total = x[0].to(torch.float32, copy=True)  # never an alias of x: added into below
        for part in x[1:]:
            total += part.float()
        x = total
    x = x.to(residual.dtype)
    summed = (x.float() + residual.float()).to(residual.dtype)
    return rms_norm_ref(summed, weight, eps), summed


def _check_partials(x: torch.Tensor, residual: torch.Tensor) -> None:
    if x.dim() != residual.dim() + 1 or x.shape[1:] != residual.shape or x.shape[0] < 1:
        raise ValueError(
            f"x {tuple(x.shape)} must be residual's shape {tuple(residual.shape)} or "
            f"[splits, *{tuple(residual.shape)}] partial sums"
        )


# One program normalises one row held in registers: x is read once, the output written once.


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_out,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
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
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    stride_xs,
    stride_x,
    stride_res,
    stride_out,
    stride_sum,
    hidden,
    eps,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        # The residual was written kernels ago and has likely left L2: prefetch it during the wait.
        lines = tl.arange(0, BLOCK // LINE_ELEMS) * LINE_ELEMS
        prefetch_l2(res_ptr + row * stride_res + lines, lines < hidden)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # x's splits added in order and rounded, as kernels.linear's split-K reduce does.
    x_ptrs = x_ptr + row * stride_x + cols
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    for _ in tl.static_range(1, SPLITS):
        x_ptrs += stride_xs
        x += tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x = x.to(sum_ptr.dtype.element_ty).to(tl.float32)
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    # The reference rounds the sum to the residual's dtype before normalising it: the same round trip.
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


def _launch_config(hidden: int, splits: int = 1) -> tuple[int, int]:
    """(BLOCK, num_warps): the row padded to a power of two, about 256 elements a warp; 16 warps
    when summing a split-K linear's partials, to keep more of their loads in flight."""
    block = triton.next_power_of_2(hidden)
    return block, 16 if splits > 1 else min(max(block // 256, 1), 16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton :func:`rms_norm_ref`: x ``[..., H]`` (unit stride in H), weight ``[H]``; returns a new
    contiguous tensor of x's shape and dtype."""
    hidden = _check_weight(x, weight)
    x2 = as_rows("x", x, hidden)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if x2.shape[0] == 0:
        return out
    block, num_warps = _launch_config(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        weight,
        out2,
        x2.stride(0),
        out2.stride(0),
        hidden,
        eps,
        BLOCK=block,
        num_warps=num_warps,
        **pdl.launch_args(x.device),
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`fused_add_rms_norm_ref` in one pass. residual ``[..., H]``; x of its shape or
    ``[splits, ..., H]`` partial sums (any float dtypes; unit stride in H). Returns new tensors in
    residual's dtype; the inputs are untouched."""
    hidden = _check_weight(residual, weight)
    if x.device != residual.device:
        raise ValueError(f"x is on {x.device}, residual on {residual.device}")
    if x.shape == residual.shape:
        x = x.unsqueeze(0)
    _check_partials(x, residual)
    r2 = as_rows("residual", residual, hidden)
    x3 = as_rows("x", x, hidden).view(x.shape[0], r2.shape[0], hidden)
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    summed = torch.empty_like(out)
    out2, sum2 = out.view(-1, hidden), summed.view(-1, hidden)
    if r2.shape[0] == 0:
        return out, summed
    block, num_warps = _launch_config(hidden, x3.shape[0])
    _fused_add_rms_norm_kernel[(r2.shape[0],)](
        x3,
        r2,
        weight,
        out2,
        sum2,
        x3.stride(0),
        x3.stride(1),
        r2.stride(0),
        out2.stride(0),
        sum2.stride(0),
        hidden,
        eps,
        SPLITS=x3.shape[0],
        BLOCK=block,
        LINE_ELEMS=min(block, pdl.L2_LINE_BYTES // residual.element_size()),
        num_warps=num_warps,
        **pdl.launch_args(x.device),
    )
    return out, summed
