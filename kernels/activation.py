"""SiLU-and-multiply, the SwiGLU gate of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.kernels import pdl
from pdserve.kernels.checks import as_rows


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``x = [gate | up]`` on the last dim (size 2*I); returns ``silu(gate) * up`` (size I)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


@triton.jit
def silu_mul(gate, up):
    """``silu(gate) * up`` of fp32 tensors, as every kernel computes the SwiGLU gate (so that
    the fused gate/up kernel, kernels.linear, gives this kernel's bits)."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    inter,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, silu_mul(gate, up).to(out_ptr.dtype.element_ty), mask=mask)


_BLOCK = 1024  # columns per program: 4 KB of each half in bf16
# 8 warps: one 16-byte load of each half per thread.
_NUM_WARPS = 8


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton :func:`silu_and_mul_ref`: x ``[..., 2*I]`` (unit stride in the last dim) -> a new
    contiguous ``[..., I]`` tensor in x's dtype."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x's last dim must be even (gate | up), got shape {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    x2 = as_rows("x", x, 2 * inter)
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if out2.numel() == 0:
        return out
    grid = (x2.shape[0], triton.cdiv(inter, _BLOCK))
    _silu_and_mul_kernel[grid](
        x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=_BLOCK, num_warps=_NUM_WARPS, **pdl.launch_args(x.device)
    )
    return out
