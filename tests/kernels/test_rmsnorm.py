"""kernels.rmsnorm against its torch reference: RMSNorm, and the add + RMSNorm that also adds
split-K partial sums (tests/kernels/conftest.py says how the CPU and GPU cases run)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import rmsnorm
from pdserve.tests.kernels.helpers import CPU, CPU_DTYPES, ELEMENTWISE_TOL, GPU_DTYPES, HIDDEN, assert_close, rand


def check_rms_norm(
    rows: tuple[int, ...], hidden: int, dtype: torch.dtype, device: torch.device, strided: bool = False
) -> None:
    gen = torch.Generator().manual_seed(1)
    wide = rand(gen, *rows, hidden + (16 if strided else 0), dtype=dtype, device=device)
    x = wide[..., :hidden]  # a row stride larger than hidden when strided
    residual = rand(gen, *rows, hidden, dtype=dtype, device=device)
    weight = rand(gen, hidden, dtype=dtype, device=device)
    x_before, r_before = x.clone(), residual.clone()
    atol, rtol = ELEMENTWISE_TOL[dtype]
    assert_close(rmsnorm.rms_norm(x, weight, 1e-6), rmsnorm.rms_norm_ref(x, weight, 1e-6), atol, rtol)
    out, summed = rmsnorm.fused_add_rms_norm(x, residual, weight, 1e-6)
    out_ref, summed_ref = rmsnorm.fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(summed, summed_ref)  # one fp32 add, one rounding: bit-exact
    assert_close(out, out_ref, atol, rtol)
    assert torch.equal(x, x_before) and torch.equal(residual, r_before)
    # Split-K partial sums in place of x: three fp32 splits, added in order and rounded first.
    partials = rand(gen, 3, *rows, hidden, dtype=torch.float32, device=device) * 4
    partials_before = partials.clone()
    out, summed = rmsnorm.fused_add_rms_norm(partials, residual, weight, 1e-6)
    out_ref, summed_ref = rmsnorm.fused_add_rms_norm_ref(partials, residual, weight, 1e-6)
    assert summed.dtype == dtype and torch.equal(summed, summed_ref)
    assert torch.equal(
        summed, ((partials[0] + partials[1] + partials[2]).to(dtype).float() + residual.float()).to(dtype)
    )
    assert_close(out, out_ref, atol, rtol)
    assert torch.equal(partials, partials_before)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("rows", "hidden", "strided"), [((3,), 40, False), ((2, 2), 64, True)])
def test_rms_norm_interpreted(
    interpreter: None, rows: tuple[int, ...], hidden: int, strided: bool, dtype: torch.dtype
) -> None:
    check_rms_norm(rows, hidden, dtype, CPU, strided)


def test_fused_add_rms_norm_of_no_rows() -> None:
    """An empty batch, plain or as partial sums, gives empty outputs and launches nothing."""
    residual, weight = torch.randn(0, 8), torch.randn(8)
    for x in (torch.randn(0, 8), torch.randn(3, 0, 8)):
        out, summed = rmsnorm.fused_add_rms_norm(x, residual, weight, 1e-6)
        assert out.shape == summed.shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("rows", [1, 8, 32, 128, 2048])
def test_rms_norm_gpu(cuda: torch.device, rows: int, dtype: torch.dtype) -> None:
    check_rms_norm((rows,), HIDDEN, dtype, cuda, strided=rows == 8)
