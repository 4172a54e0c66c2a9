"""kernels.embedding against its torch reference (tests/kernels/conftest.py says how the CPU and
GPU cases run)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import embedding
from pdserve.tests.kernels.helpers import CPU, CPU_DTYPES, GPU_DTYPES, HIDDEN, rand


def check_embedding(
    num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, strided_ids: bool = False
) -> None:
    """A gather: bitwise the reference, for ids that repeat and that hit both ends of the table."""
    gen = torch.Generator().manual_seed(11)
    weight = rand(gen, vocab, hidden, dtype=dtype, device=device)
    ids = torch.randint(0, vocab, (num_tokens * (2 if strided_ids else 1),), generator=gen)
    ids[:3] = torch.tensor([0, vocab - 1, 0])[: len(ids)]
    ids = ids.to(device)[:: 2 if strided_ids else 1]  # every other id: a stride-2 view when strided
    out = embedding.embedding(ids, weight)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    assert torch.equal(out, embedding.embedding_ref(ids, weight))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("num_tokens", "vocab", "hidden", "strided_ids"), [(5, 50, 40, False), (4, 17, 96, True)])
def test_embedding_interpreted(
    interpreter: None, num_tokens: int, vocab: int, hidden: int, strided_ids: bool, dtype: torch.dtype
) -> None:
    check_embedding(num_tokens, vocab, hidden, dtype, CPU, strided_ids)


def test_embedding_of_no_tokens() -> None:
    out = embedding.embedding(torch.zeros(0, dtype=torch.int64), torch.randn(5, 8))
    assert out.shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 32, 2048])
def test_embedding_gpu(cuda: torch.device, num_tokens: int, dtype: torch.dtype) -> None:
    check_embedding(num_tokens, 151936, HIDDEN, dtype, cuda, strided_ids=num_tokens == 32)
