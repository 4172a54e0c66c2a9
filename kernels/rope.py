"""Rotary embedding of q and k, fused with the store of k and v into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import pdl
from pdserve.kernels.checks import check_float_dtype


def rope_and_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (rotate-half style); return them and write rotated k, plain v to the cache.

    q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``, positions ``[T]`` int, cos_sin_cache ``[max_pos, D]``
    fp32 (cos, then sin), caches ``[num_blocks, block_size, Hkv, D]``, slot_mapping ``[T]`` int,
    ``slot = block * block_size + offset`` (padding tokens point at a dummy slot).
    """
    half = q.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    q_rot, k_rot = rotate(q), rotate(k)
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k_rot.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)
    return q_rot, k_rot


@triton.jit
def _rotate_half(x_ptr, out_ptr, cos, sin, heads, d, mask, half, stride_h, stride_out_h):
    """Rotate ``heads x 2*half`` values at ``x_ptr``; returns the two rotated halves in fp32."""
    x1 = tl.load(x_ptr + heads * stride_h + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + heads * stride_h + half + d, mask=mask, other=0.0).to(tl.float32)
    # Round to the output dtype as the reference does (it returns x.dtype tensors).
    o1 = (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty)
    o2 = (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + heads * stride_out_h + d, o1, mask=mask)
    tl.store(out_ptr + heads * stride_out_h + half + d, o2, mask=mask)
    return o1, o2


@triton.jit
def _rope_and_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cb,
    stride_cs_slot,
    stride_ch,
    num_q_heads,
    num_kv_heads,
    half,
    block_size,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per token: all its q heads, k heads and v heads."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < half
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + d, mask=d_mask, other=0.0).to(tl.float32)

    hq = tl.arange(0, BLOCK_HQ)[:, None]
    _rotate_half(
        q_ptr + t * stride_qt,
        q_out_ptr + t * stride_qot,
        cos,
        sin,
        hq,
        d,
        (hq < num_q_heads) & d_mask,
        half,
        stride_qh,
        stride_qoh,
    )

    hk = tl.arange(0, BLOCK_HKV)[:, None]
    kv_mask = (hk < num_kv_heads) & d_mask
    k1, k2 = _rotate_half(
        k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, cos, sin, hk, d, kv_mask, half, stride_kh, stride_koh
    )
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cache_off = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs_slot + hk * stride_ch + d
    tl.store(k_cache_ptr + cache_off, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(k_cache_ptr + cache_off + half, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    # v is copied untouched: no fp32 round trip needed for a pure move.
    v_off = t * stride_vt + hk * stride_vh + d
    v1 = tl.load(v_ptr + v_off, mask=kv_mask)
    v2 = tl.load(v_ptr + v_off + half, mask=kv_mask)
    tl.store(v_cache_ptr + cache_off, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(v_cache_ptr + cache_off + half, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def _check_unit_stride(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_new_tokens(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """ValueError unless the arguments fit :func:`rope_and_store_kv_ref`'s contract (shared by
    the kernels that rotate and store a step's new tokens)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [{num_tokens}, Hkv, {head_dim}]")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} {v_cache.stride()} must match k_cache "
            f"{tuple(k_cache.shape)} {k_cache.stride()}"
        )
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [max_pos, {head_dim}], got {tuple(cos_sin_cache.shape)}")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} must be [{num_tokens}]"
        )
    if positions.is_floating_point() or slot_mapping.is_floating_point():
        raise ValueError("positions and slot_mapping must be integer tensors")
    tensors = {
        "q": q,
        "k": k,
        "v": v,
        "positions": positions,
        "cos_sin_cache": cos_sin_cache,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "slot_mapping": slot_mapping,
    }
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        _check_unit_stride(name, t)
    for name in ("q", "k", "v", "k_cache", "v_cache", "cos_sin_cache"):
        check_float_dtype(name, tensors[name])


def rope_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`rope_and_store_kv_ref`, one program per token: same shapes and results.
    q, k, v may be strided views with unit stride in D and are left untouched; the rotated q and k
    are new contiguous tensors. Every slot must lie in ``[0, num_blocks * block_size)``.
    """
    check_new_tokens(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    block_hq, block_hkv = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(num_kv_heads)
    block_half = triton.next_power_of_2(half)
    _rope_and_store_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_q_heads,
        num_kv_heads,
        half,
        k_cache.shape[1],
        BLOCK_HQ=block_hq,
        BLOCK_HKV=block_hkv,
        BLOCK_HALF=block_half,
        num_warps=4 if block_hq * block_half >= 512 else 1,
        **pdl.launch_args(q.device),
    )
    return q_out, k_out
