"""Token embedding: a gather of weight rows by token id, the first kernel of every step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.kernels import pdl
from pdserve.kernels.checks import check_float_dtype


def embedding_ref(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[input_ids]``: ids ``[T]`` (integers in ``[0, vocab)``), weight ``[vocab, H]``
    -> a new ``[T, H]`` tensor in weight's dtype (torch's ``F.embedding``)."""
    return F.embedding(input_ids, weight)


@triton.jit
def _embedding_kernel(
    ids_ptr,
    w_ptr,
    out_ptr,
    hidden,
    stride_ids,
    stride_w,
    stride_out,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per token: its whole row."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # Token ids are a step input and weights never change, so both load before the wait
    # (kernels.pdl); only the store waits on the kernel ahead.
    token = tl.load(ids_ptr + t * stride_ids).to(tl.int64)
    row = tl.load(w_ptr + token * stride_w + cols, mask=mask)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    tl.store(out_ptr + t * stride_out + cols, row, mask=mask)


def embedding(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Triton :func:`embedding_ref`: one PDL launch, so the step's chain of PDL kernels starts at
    once (torch's gather takes two kernels without PDL). Ids are not range-checked (that needs a
    host sync): the engine rejects out-of-vocabulary ids when a request arrives.
    """
    if input_ids.dim() != 1 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be a 1-D integer tensor, got {tuple(input_ids.shape)} {input_ids.dtype}")
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be [vocab, hidden] with unit stride in hidden, got "
            f"{tuple(weight.shape)} strides {weight.stride()}"
        )
    check_float_dtype("weight", weight)
    if input_ids.device != weight.device:
        raise ValueError(f"input_ids are on {input_ids.device}, weight on {weight.device}")
    hidden = weight.shape[1]
    out = torch.empty((input_ids.shape[0], hidden), dtype=weight.dtype, device=weight.device)
    if out.numel() == 0:
        return out
    block = triton.next_power_of_2(hidden)
    # Warps for two 16-byte loads a thread: a 1536-wide bf16 row (2048 with padding) takes 4.
    warps = max(1, min(8, block * weight.element_size() // (16 * 32 * 2)))
    _embedding_kernel[(input_ids.shape[0],)](
        input_ids,
        weight,
        out,
        hidden,
        input_ids.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=warps,
        **pdl.launch_args(weight.device),
    )
    return out
