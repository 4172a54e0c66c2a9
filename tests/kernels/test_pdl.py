"""kernels.pdl: programmatic dependent launch is off where it must be, and changes no bits of a
decode layer's kernel chain where it is on."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from pdserve.kernels import activation, decode_attention, embedding, linear, pdl, rmsnorm
from pdserve.tests.kernels.helpers import (
    BLOCK,
    CPU,
    HEAD_DIM,
    HIDDEN,
    HKV,
    HQ,
    INTER,
    last_slots,
    make_paged_cache,
    rand,
)


def test_pdl_is_off_on_cpu_and_when_the_environment_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not pdl.enabled(CPU)
    assert pdl.launch_args(CPU) == {"USE_PDL": False, "launch_pdl": False}
    monkeypatch.setenv("PDSERVE_PDL", "0")
    pdl.enabled.cache_clear()
    try:
        assert not pdl.enabled(torch.device("cuda", 0))  # decided before any CUDA query
    finally:
        pdl.enabled.cache_clear()


def _decode_layer_chain(cuda: torch.device) -> list[torch.Tensor]:
    """One decode layer's kernels back to back, each reading the previous one's output."""
    gen = torch.Generator().manual_seed(9)
    dtype = torch.bfloat16
    _, _, k_cache, v_cache, tables = make_paged_cache([300], BLOCK, HKV, HEAD_DIM, dtype, cuda, gen)  # no NaN
    hidden = embedding.embedding(torch.tensor([7], device=cuda), rand(gen, 64, HIDDEN, dtype=dtype, device=cuda))
    residual = rand(gen, 1, HIDDEN, dtype=dtype, device=cuda)
    shapes = [((HQ + 2 * HKV) * HEAD_DIM, HIDDEN), (HIDDEN, HQ * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    weights = [rand(gen, *shape, dtype=dtype, device=cuda) / math.sqrt(shape[1]) for shape in shapes]
    norm = rand(gen, HIDDEN, dtype=dtype, device=cuda)
    freqs = torch.arange(512, dtype=torch.float32)[:, None] * torch.rand(HEAD_DIM // 2, generator=gen)[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(cuda)
    positions = torch.tensor([299], device=cuda)
    lens = torch.tensor([300], dtype=torch.int32, device=cuda)
    x, residual = rmsnorm.fused_add_rms_norm(hidden, residual, norm, 1e-6)
    q, k, v = linear.linear_kernel(x, weights[0]).split([HQ * HEAD_DIM, HKV * HEAD_DIM, HKV * HEAD_DIM], dim=-1)
    attn = decode_attention.paged_decode_attention(
        q.view(1, HQ, HEAD_DIM),
        k.view(1, HKV, HEAD_DIM),
        v.view(1, HKV, HEAD_DIM),
        positions,
        cos_sin,
        k_cache,
        v_cache,
        last_slots(tables, lens, BLOCK),
        tables,
        lens,
        HEAD_DIM**-0.5,
        4096,
    )
    o = linear.linear_kernel(attn.reshape(1, HQ * HEAD_DIM), weights[1])
    x, residual = rmsnorm.fused_add_rms_norm(o, residual, norm, 1e-6)
    down = linear.linear_kernel(linear.linear_silu_and_mul_kernel(x, weights[2]), weights[3])
    return [hidden, attn, o, down, residual, k_cache]


def _linear_dot_chain(cuda: torch.device) -> list[torch.Tensor]:
    """Batches of 4 and 24 rows (16- and 32-row tiles) through one layer's projections on
    linear_dot, each reading the previous kernel's output (qkv, o_proj and down split K: dot
    kernel, then reduce kernel)."""
    gen = torch.Generator().manual_seed(10)
    dtype = torch.bfloat16
    shapes = [((HQ + 2 * HKV) * HEAD_DIM, HIDDEN), (HIDDEN, HQ * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    weights = [rand(gen, *shape, dtype=dtype, device=cuda) / math.sqrt(shape[1]) for shape in shapes]
    qkv_bias = rand(gen, shapes[0][0], dtype=dtype, device=cuda)
    outputs = []
    for rows in (4, 24):
        x = rand(gen, rows, HIDDEN, dtype=dtype, device=cuda)
        qkv = linear.linear_dot(x, weights[0], qkv_bias)
        o = linear.linear_dot(qkv[:, : HQ * HEAD_DIM], weights[1])
        gate_up = linear.linear_dot(o, weights[2])
        down = linear.linear_dot(activation.silu_and_mul(gate_up), weights[3])
        outputs += [qkv, o, gate_up, down]
    return outputs


@pytest.mark.gpu
@pytest.mark.parametrize("chain", [_decode_layer_chain, _linear_dot_chain])
def test_pdl_changes_no_bits(
    cuda: torch.device, monkeypatch: pytest.MonkeyPatch, chain: Callable[[torch.device], list[torch.Tensor]]
) -> None:
    """With programmatic dependent launch every kernel still reads its predecessor's finished
    output: a decode layer's chain gives the same bits with PDL and without."""
    monkeypatch.setenv("PDSERVE_PDL", "1")  # whatever the caller's environment says
    pdl.enabled.cache_clear()
    try:
        if torch.cuda.get_device_capability(cuda)[0] < 9:
            pytest.skip("PDL needs compute capability 9.0+ (the H100 and H200 machines have it)")
        assert pdl.enabled(cuda)
        with_pdl = chain(cuda)
        monkeypatch.setenv("PDSERVE_PDL", "0")
        pdl.enabled.cache_clear()
        without = chain(cuda)
    finally:
        pdl.enabled.cache_clear()
    for a, b in zip(with_pdl, without):
        assert torch.equal(a, b)
