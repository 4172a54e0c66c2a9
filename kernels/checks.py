"""What the kernel wrappers share: input checks (ValueError before any launch) and the
precision of ``tl.dot``."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float_dtype(name: str, t: torch.Tensor) -> None:
    """ValueError naming ``name`` unless ``t`` is float32, float16 or bfloat16."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def as_rows(name: str, t: torch.Tensor, width: int) -> torch.Tensor:
    """``t [..., width]`` (a float tensor) as a ``[rows, width]`` view with unit stride along
    ``width`` (no copy), or ValueError naming ``name``."""
    if t.dim() == 0 or t.shape[-1] != width:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [..., {width}]")
    check_float_dtype(name, t)
    try:
        rows = t.view(-1, width)
    except RuntimeError as exc:
        raise ValueError(f"{name} (strides {t.stride()}) cannot be viewed as [rows, {width}]") from exc
    if width > 1 and rows.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {t.stride()}")
    return rows


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for operands of ``dtype``: fp32 gets exact fp32 products (the
    default would be tf32); 16-bit inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"
