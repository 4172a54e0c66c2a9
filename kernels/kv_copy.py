"""Paged-to-paged KV copy: blocks of one pool, sliced to some KV heads, into blocks of another.

Pools are ``[layers, 2, blocks, block_size, kv_heads, head_dim]`` (the engine's layout); the two
may have different block counts and head counts (a resharding piece takes heads ``src_heads`` of
the source and writes them at ``dst_heads`` of the destination). The source may live in another
process (a pool opened through CUDA IPC) or on a peer GPU. One launch moves every layer, K and
V, of every listed block: no staging buffer between the pools. A negative destination id is
padding and copies nothing, so that a CUDA graph captured for B blocks can move fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import check_float_dtype


def paged_kv_copy_ref(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    src_heads: slice,
    dst_heads: slice,
) -> None:
    """``dst[:, :, dst_blocks, :, dst_heads] = src[:, :, src_blocks, :, src_heads]`` in place,
    for the entries whose destination id is not negative (padding)."""
    _check_pools(src, dst, src_heads, dst_heads)
    _check_blocks(src_blocks, dst_blocks)
    real = dst_blocks >= 0
    src_blocks, dst_blocks = src_blocks[real], dst_blocks[real]
    gathered = src[:, :, :, :, src_heads].index_select(2, src_blocks.to(src.device))
    dst[:, :, :, :, dst_heads].index_copy_(2, dst_blocks.to(dst.device), gathered.to(dst.device))


# One program copies one block of one (layer, K|V) plane: block_size rows of the piece's heads,
# each row contiguous in both pools, so loads and stores are wide and coalesced.


@triton.jit
def _paged_kv_copy_kernel(
    src_ptr,
    dst_ptr,
    src_blocks_ptr,
    dst_blocks_ptr,
    stride_src_plane,
    stride_src_block,
    stride_src_token,
    stride_dst_plane,
    stride_dst_block,
    stride_dst_token,
    src_offset,
    dst_offset,
    row_elems,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,
):
    block = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    dst_block = tl.load(dst_blocks_ptr + block).to(tl.int64)
    if dst_block < 0:  # padding
        return
    src_block = tl.load(src_blocks_ptr + block).to(tl.int64)
    tokens = tl.arange(0, BLOCK_SIZE)[:, None]
    cols = tl.arange(0, ROW)[None, :]
    mask = cols < row_elems
    src = src_ptr + plane * stride_src_plane + src_block * stride_src_block + src_offset
    dst = dst_ptr + plane * stride_dst_plane + dst_block * stride_dst_block + dst_offset
    values = tl.load(src + tokens * stride_src_token + cols, mask=mask)
    tl.store(dst + tokens * stride_dst_token + cols, values, mask=mask)


class PagedKVCopy:
    """The Triton kernel for one (source pool, destination pool, head slices) pair: the pools are
    checked once, here, and each call checks only its block ids and launches, on the current
    device and stream (where the ids must be); either pool may be on a peer GPU of it (mapped
    through CUDA IPC or peer access)."""

    def __init__(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_heads: slice,
        dst_heads: slice,
    ) -> None:
        _check_pools(src, dst, src_heads, dst_heads)
        self.src, self.dst = src, dst
        layers, _, _, block_size, _, head_dim = src.shape
        heads = range(src.shape[4])[src_heads]
        row_elems = len(heads) * head_dim
        self._planes = 2 * layers
        self._args = (
            src.stride(1),
            src.stride(2),
            src.stride(3),
            dst.stride(1),
            dst.stride(2),
            dst.stride(3),
            heads.start * head_dim,
            range(dst.shape[4])[dst_heads].start * head_dim,
            row_elems,
        )
        self._meta = {
            "BLOCK_SIZE": block_size,
            "ROW": triton.next_power_of_2(row_elems),
            "num_warps": 4,
        }
        self._device = torch.device("cuda", torch.cuda.current_device()) if dst.is_cuda else dst.device

    def __call__(self, src_blocks: torch.Tensor, dst_blocks: torch.Tensor) -> None:
        """``dst[:, :, dst_blocks, :, dst_heads] = src[:, :, src_blocks, :, src_heads]``, skipping
        negative destination ids (padding)."""
        _check_blocks(src_blocks, dst_blocks)
        if src_blocks.device != self._device or dst_blocks.device != self._device:
            raise ValueError(f"block ids must be on the launching device {self._device}")
        if src_blocks.numel() == 0:
            return
        grid = (src_blocks.numel(), self._planes)
        _paged_kv_copy_kernel[grid](self.src, self.dst, src_blocks, dst_blocks, *self._args, **self._meta)


def paged_kv_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    src_heads: slice,
    dst_heads: slice,
) -> None:
    """The Triton kernel behind ``paged_kv_copy_ref``'s signature (see ``PagedKVCopy``, which a
    caller that copies between the same pools again and again keeps instead)."""
    PagedKVCopy(src, dst, src_heads, dst_heads)(src_blocks, dst_blocks)


def _check_pools(src: torch.Tensor, dst: torch.Tensor, src_heads: slice, dst_heads: slice) -> None:
    """ValueError before any launch unless both pools are contiguous paged pools of one dtype,
    layer count, block size and head size, and the head slices (step 1) have one length."""
    for name, pool in (("src", src), ("dst", dst)):
        if pool.dim() != 6 or pool.shape[1] != 2:
            raise ValueError(
                f"{name} has shape {tuple(pool.shape)}, expected [layers, 2, blocks, block_size, heads, dim]"
            )
        if not pool.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        check_float_dtype(name, pool)
    if src.dtype != dst.dtype:
        raise ValueError(f"src is {src.dtype} but dst is {dst.dtype}")
    if (src.shape[0], src.shape[3], src.shape[5]) != (dst.shape[0], dst.shape[3], dst.shape[5]):
        raise ValueError(f"pools {tuple(src.shape)} and {tuple(dst.shape)} differ in layers, block size or head size")
    src_range, dst_range = range(src.shape[4])[src_heads], range(dst.shape[4])[dst_heads]
    if src_range.step != 1 or dst_range.step != 1 or len(src_range) != len(dst_range) or not src_range:
        raise ValueError(f"head slices {src_heads} of {src.shape[4]} and {dst_heads} of {dst.shape[4]} do not match")


def _check_blocks(src_blocks: torch.Tensor, dst_blocks: torch.Tensor) -> None:
    """ValueError unless the block lists are 1-D integer tensors of one length."""
    for name, ids in (("src_blocks", src_blocks), ("dst_blocks", dst_blocks)):
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    if src_blocks.numel() != dst_blocks.numel():
        raise ValueError(f"{src_blocks.numel()} source blocks but {dst_blocks.numel()} destination blocks")
