"""kernels.activation (SiLU-and-mul) against its torch reference (tests/kernels/conftest.py says
how the CPU and GPU cases run)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import activation
from pdserve.tests.kernels.helpers import CPU, CPU_DTYPES, ELEMENTWISE_TOL, GPU_DTYPES, INTER, assert_close, rand


def check_silu_and_mul(rows: tuple[int, ...], inter: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(2)
    x = rand(gen, *rows, 2 * inter, dtype=dtype, device=device) * 3
    out = activation.silu_and_mul(x)
    assert out.shape == (*rows, inter)
    assert_close(out, activation.silu_and_mul_ref(x), *ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [((3,), 50), ((1, 2), 1100)])  # 1100: two column blocks
def test_silu_and_mul_interpreted(interpreter: None, rows: tuple[int, ...], inter: int, dtype: torch.dtype) -> None:
    check_silu_and_mul(rows, inter, dtype, CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("rows", [1, 32, 2048])
def test_silu_and_mul_gpu(cuda: torch.device, rows: int, dtype: torch.dtype) -> None:
    check_silu_and_mul((rows,), INTER, dtype, cuda)
