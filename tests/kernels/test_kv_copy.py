"""kernels.kv_copy against its torch reference: blocks of one paged pool, sliced to some heads,
into other blocks of another pool with another head count (tests/kernels/conftest.py says how
the CPU and GPU cases run)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import kv_copy
from pdserve.tests.kernels.helpers import BLOCK, CPU, CPU_DTYPES, GPU_DTYPES, HEAD_DIM


def check_paged_kv_copy(
    layers: int,
    block_size: int,
    head_dim: int,
    src_heads: tuple[int, slice],
    dst_heads: tuple[int, slice],
    num_blocks: int,
    dtype: torch.dtype,
    device: torch.device,
    padding: int = 0,
) -> None:
    """The kernel writes exactly the reference's result: the listed blocks' heads bit for bit,
    and every other element of the destination untouched (it starts as NaN). ``padding``
    entries (destination -1) are appended to the lists and must copy nothing."""
    gen = torch.Generator().manual_seed(3)
    (src_count, src_slice), (dst_count, dst_slice) = src_heads, dst_heads
    src = torch.randn(layers, 2, num_blocks + 5, block_size, src_count, head_dim, generator=gen).to(device, dtype)
    dst = torch.full((layers, 2, num_blocks + 3, block_size, dst_count, head_dim), float("nan"), dtype=dtype)
    dst = dst.to(device)
    src_blocks = torch.randperm(num_blocks + 5, generator=gen)[:num_blocks].to(device)
    dst_blocks = torch.randperm(num_blocks + 3, generator=gen)[:num_blocks].to(device)
    expected = dst.clone()
    kv_copy.paged_kv_copy_ref(src, expected, src_blocks, dst_blocks, src_slice, dst_slice)
    src_before = src.clone()
    pad_src = torch.randint(num_blocks + 5, (padding,), generator=gen).to(device)
    pad_dst = torch.full((padding,), -1, dtype=dst_blocks.dtype, device=device)
    src_padded, dst_padded = torch.cat([src_blocks, pad_src]), torch.cat([dst_blocks, pad_dst])
    if padding:
        padded_ref = dst.clone()
        kv_copy.paged_kv_copy_ref(src, padded_ref, src_padded, dst_padded, src_slice, dst_slice)
        assert torch.equal(_bits(padded_ref), _bits(expected))
    kv_copy.paged_kv_copy(src, dst, src_padded, dst_padded, src_slice, dst_slice)
    assert torch.equal(_bits(dst), _bits(expected))
    assert torch.equal(src, src_before)
    copied = expected[:, :, dst_blocks][:, :, :, :, dst_slice]
    assert not copied.isnan().any()
    assert torch.equal(copied, src[:, :, src_blocks][:, :, :, :, src_slice])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that NaN compares equal to the same NaN."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


# (src heads, slice) -> (dst heads, slice): same layout, a piece of a wider pool into a narrower
# one (TP 1 -> 2), and a narrow pool into a slice of a wider one (TP 2 -> 1).
PIECES = [
    ((2, slice(0, 2)), (2, slice(0, 2))),
    ((2, slice(1, 2)), (1, slice(0, 1))),
    ((1, slice(0, 1)), (2, slice(1, 2))),
]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("src_heads", "dst_heads"), PIECES)
def test_paged_kv_copy_interpreted(
    interpreter: None, src_heads: tuple[int, slice], dst_heads: tuple[int, slice], dtype: torch.dtype
) -> None:
    check_paged_kv_copy(3, 4, 8, src_heads, dst_heads, 3, dtype, CPU)


@pytest.mark.parametrize("num_blocks", [0, 3])
def test_paged_kv_copy_skips_padding_interpreted(interpreter: None, num_blocks: int) -> None:
    check_paged_kv_copy(3, 4, 8, PIECES[1][0], PIECES[1][1], num_blocks, torch.float32, CPU, padding=5)


def test_paged_kv_copy_checks() -> None:
    """Mismatched pools, head slices and block lists are refused before any launch."""
    pool = torch.zeros(2, 2, 4, 4, 2, 8)
    ids = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="do not match"):
        kv_copy.paged_kv_copy(pool, pool.clone(), ids, ids, slice(0, 2), slice(0, 1))
    with pytest.raises(ValueError, match="differ in layers"):
        kv_copy.paged_kv_copy(pool, torch.zeros(3, 2, 4, 4, 2, 8), ids, ids, slice(0, 2), slice(0, 2))
    with pytest.raises(ValueError, match="float16"):
        kv_copy.paged_kv_copy(pool, pool.half(), ids, ids, slice(0, 2), slice(0, 2))
    with pytest.raises(ValueError, match="source blocks"):
        kv_copy.paged_kv_copy(pool, pool.clone(), ids, ids[:1], slice(0, 2), slice(0, 2))
    with pytest.raises(ValueError, match="contiguous"):
        kv_copy.paged_kv_copy(pool.transpose(3, 4), pool.clone(), ids, ids, slice(0, 2), slice(0, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(("src_heads", "dst_heads"), PIECES)
@pytest.mark.parametrize("num_blocks", [1, 64, 1024])
def test_paged_kv_copy_gpu(
    cuda: torch.device, num_blocks: int, src_heads: tuple[int, slice], dst_heads: tuple[int, slice], dtype: torch.dtype
) -> None:
    check_paged_kv_copy(28, BLOCK, HEAD_DIM, src_heads, dst_heads, num_blocks, dtype, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("num_blocks", [0, 1, 61])
def test_paged_kv_copy_skips_padding_gpu(cuda: torch.device, num_blocks: int) -> None:
    check_paged_kv_copy(28, BLOCK, HEAD_DIM, PIECES[2][0], PIECES[2][1], num_blocks, torch.bfloat16, cuda, padding=3)
