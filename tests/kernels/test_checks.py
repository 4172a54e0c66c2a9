"""The kernel wrappers' input checks (kernels.checks and each wrapper's own): ValueError before
any launch."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import activation, decode_attention, embedding, linear, prefill_attention, rmsnorm


def test_wrappers_reject_bad_inputs() -> None:
    """Shape, dtype and stride errors are ValueErrors raised before any launch."""
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm.rms_norm(x, torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="unit stride"):
        rmsnorm.rms_norm(x.t(), torch.randn(4), 1e-6)
    with pytest.raises(ValueError, match="do not chain"):
        linear.linear_kernel(x, torch.randn(3, 7))
    with pytest.raises(ValueError, match="at most 16 rows"):
        linear.linear_kernel(torch.randn(17, 8), torch.randn(3, 8))
    with pytest.raises(ValueError, match="bias"):
        linear.linear_kernel(x, torch.randn(3, 8), torch.randn(4))
    with pytest.raises(ValueError, match="even number of rows"):
        linear.linear_silu_and_mul_kernel(x, torch.randn(3, 8))
    with pytest.raises(ValueError, match="at most 16 rows"):
        linear.linear_silu_and_mul_kernel(torch.randn(17, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="do not chain"):
        linear.linear_silu_and_mul_kernel(x, torch.randn(4, 7))
    with pytest.raises(ValueError, match="do not chain"):
        linear.linear_dot(x, torch.randn(3, 7))
    with pytest.raises(ValueError, match="bias"):
        linear.linear_dot(x, torch.randn(3, 8), torch.randn(4))
    with pytest.raises(ValueError, match="bias must have unit stride"):
        linear.linear_dot(x, torch.randn(3, 8), torch.randn(3, 2)[:, 0])
    with pytest.raises(ValueError, match="weight must have unit stride"):
        linear.linear_dot(x, torch.randn(8, 3).t())
    with pytest.raises(ValueError, match="weight is torch.float16"):
        linear.linear_dot(x, torch.randn(3, 8).half())
    with pytest.raises(ValueError, match="unit stride in its last dim"):
        linear.linear_dot(torch.randn(8, 4).t(), torch.randn(3, 8))
    for kernel in (linear.linear_kernel, linear.linear_dot, linear.linear_ref):
        with pytest.raises(ValueError, match=r"out must be \[4, 3\]"):
            kernel(x, torch.randn(3, 8), out=torch.empty(4, 4))
        with pytest.raises(ValueError, match="float32"):
            kernel(x, torch.randn(3, 8), out=torch.empty(4, 3, dtype=torch.float16))
        with pytest.raises(ValueError, match="out must be contiguous"):
            kernel(x, torch.randn(3, 8), out=torch.empty(3, 4).t())
    with pytest.raises(ValueError, match="partial sums"):
        rmsnorm.fused_add_rms_norm(torch.randn(2, 4, 7), x, torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="partial sums"):
        rmsnorm.fused_add_rms_norm_ref(torch.randn(4, 7), x, torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="even"):
        activation.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="1-D integer"):
        embedding.embedding(torch.zeros(2, 3, dtype=torch.int64), torch.randn(5, 8))
    with pytest.raises(ValueError, match="1-D integer"):
        embedding.embedding(torch.zeros(3), torch.randn(5, 8))
    with pytest.raises(ValueError, match="unit stride in hidden"):
        embedding.embedding(torch.zeros(3, dtype=torch.int64), torch.randn(8, 5).t())
    with pytest.raises(ValueError, match="weight must be float32, float16 or bfloat16"):
        embedding.embedding(torch.zeros(3, dtype=torch.int64), torch.randn(5, 8, dtype=torch.float64))
    new = (
        torch.randn(2, 4, 16),
        torch.randn(2, 2, 16),
        torch.randn(2, 2, 16),
        torch.zeros(2, dtype=torch.int64),
        torch.randn(8, 16),
        torch.randn(8, 4, 2, 16),
        torch.randn(8, 4, 2, 16),
        torch.zeros(2, dtype=torch.int64),
    )
    with pytest.raises(ValueError, match="int32"):
        decode_attention.paged_decode_attention(
            *new, torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, dtype=torch.int32), 0.25, 8
        )
    with pytest.raises(ValueError, match="slot_mapping"):
        decode_attention.paged_decode_attention(
            *new[:7],
            torch.zeros(3, dtype=torch.int64),
            torch.zeros(2, 3, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32),
            0.25,
            8,
        )
    with pytest.raises(ValueError, match="multiple of KV heads"):
        prefill_attention.paged_prefill_attention(
            torch.randn(3, 3, 16),
            torch.randn(8, 4, 2, 16),
            torch.randn(8, 4, 2, 16),
            torch.tensor([0, 3], dtype=torch.int32),
            torch.zeros(1, 3, dtype=torch.int32),
            torch.full((1,), 3, dtype=torch.int32),
            0.25,
        )
    # every wrapper's float-dtype check (kernels.checks.check_float_dtype)
    with pytest.raises(ValueError, match="x must be float32, float16 or bfloat16, got torch.float64"):
        rmsnorm.rms_norm(x.double(), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="cos_sin_cache must be float32, float16 or bfloat16, got torch.float64"):
        decode_attention.paged_decode_attention(
            *new[:4],
            new[4].double(),
            *new[5:],
            torch.zeros(2, 3, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32),
            0.25,
            8,
        )
    with pytest.raises(ValueError, match="q must be float32, float16 or bfloat16, got torch.float64"):
        prefill_attention.paged_prefill_attention(
            torch.randn(3, 4, 16, dtype=torch.float64),
            torch.randn(8, 4, 2, 16),
            torch.randn(8, 4, 2, 16),
            torch.tensor([0, 3], dtype=torch.int32),
            torch.zeros(1, 3, dtype=torch.int32),
            torch.full((1,), 3, dtype=torch.int32),
            0.25,
        )
