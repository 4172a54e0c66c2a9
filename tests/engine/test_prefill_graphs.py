"""What a prefill CUDA graph runs (engine.graph_runner.pad_prefill_plan), checked on CPU with the
torch reference model: the padded step computes the real rows exactly as the plain step does
and writes no real sequence's cache. The replay itself is tested on a GPU (test_gpu_engine.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.bench.common import block_tables, prefill_plan
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.graph_runner import (
    FEW_SEQS,
    PrefillBucket,
    pad_prefill_plan,
    prefill_buckets,
    prefill_inputs,
    prefill_packed_len,
    token_buckets,
)
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.step_plan import StepPlan, padded_block_tables

BLOCK = 4


@pytest.fixture(scope="module")
def runner(tiny_model_dirs: dict[str, Path]) -> ModelRunner:
    path = tiny_model_dirs["tiny-qwen2"]
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        device="cpu",
        max_model_len=128,
        cache=CacheConfig(block_size=BLOCK, num_blocks=64),
    )
    return ModelRunner(config, ModelConfig.from_pretrained(path))


def mixed_plan(runner: ModelRunner, gen: torch.Generator) -> StepPlan:
    """Two whole prompts (5 and 9 tokens) and a 3-token chunk of a third whose first 6 tokens are
    cached (context 9), the chunk not sampled: the shapes a chunked-prefill step has."""
    tables = block_tables([5, 9, 9], BLOCK, runner.num_blocks, gen)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (5, 9)]
    plan = prefill_plan(tables[:2], prompts, BLOCK)
    chunk = torch.randint(0, 500, (3,), generator=gen).tolist()
    table = tables[2]
    plan.input_ids += chunk
    plan.positions += [6, 7, 8]
    plan.slot_mapping += [table[p // BLOCK] * BLOCK + p % BLOCK for p in (6, 7, 8)]
    plan.block_tables = padded_block_tables(tables)
    plan.context_lens.append(9)
    plan.cu_seqlens_q.append(plan.cu_seqlens_q[-1] + 3)
    return plan


def test_token_buckets() -> None:
    assert token_buckets(1) == [64]
    assert token_buckets(64) == [64]
    assert token_buckets(200) == [64, 128, 256]
    assert token_buckets(2048) == [64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(1000) == [64, 128, 256, 512, 768, 1024]


def test_prefill_buckets() -> None:
    """Each token bucket: a graph for as many sequences as it can hold and, where that is more
    than FEW_SEQS, one for FEW_SEQS; ascending, so capture goes largest first."""
    assert FEW_SEQS == 4
    assert prefill_buckets(200, 256) == [(64, 4), (64, 64), (128, 4), (128, 128), (256, 4), (256, 256)]
    assert prefill_buckets(128, 100) == [(64, 4), (64, 64), (128, 4), (128, 100)]
    assert prefill_buckets(128, 4) == [(64, 4), (128, 4)]
    assert prefill_buckets(64, 2) == [PrefillBucket(tokens=64, seqs=2)]


@pytest.mark.parametrize("bucket", [PrefillBucket(64, 4), PrefillBucket(64, 63), PrefillBucket(2048, 256)])
def test_prefill_inputs_are_apart_and_aligned(bucket: PrefillBucket) -> None:
    """The packed inputs of a prefill graph: each field as long as the padded plan's, 16-byte
    aligned (as the kernels are compiled for), none overlapping another, inside the packed
    length; the same views on a tensor as on the host array copied into it."""
    tokens, seqs = bucket
    host = np.zeros(prefill_packed_len(bucket), dtype=np.int64)
    views = prefill_inputs(host, bucket)
    assert [len(v) for v in views] == [tokens] * 3 + [seqs, seqs + 1, seqs + 2]
    assert [v.dtype for v in views] == [np.int64] * 4 + [np.int32] * 2
    for i, view in enumerate(views):
        assert (view.ctypes.data - host.ctypes.data) % 16 == 0
        view[:] = np.arange(len(view)) + 1000 * (i + 1)
    for i, view in enumerate(views):
        assert np.array_equal(view, np.arange(len(view)) + 1000 * (i + 1)), f"field {i} was overwritten"
    device = prefill_inputs(torch.from_numpy(host.copy()), bucket)
    for view, tensor in zip(views, device):
        assert np.array_equal(view, tensor.numpy())


def test_pad_prefill_plan_layout() -> None:
    plan = StepPlan(
        input_ids=[1, 2, 3],
        positions=[0, 1, 4],
        slot_mapping=[8, 9, 20],
        block_tables=np.array([[2, 0], [3, 5]], dtype=np.int32),
        context_lens=[2, 5],
        cu_seqlens_q=[0, 2, 3],
        sample_rows=[1],
        is_decode=False,
    )
    padded = pad_prefill_plan(plan, 64, 4, dummy_block=7, block_size=BLOCK)
    assert padded.input_ids == [1, 2, 3] + [0] * 61 and padded.positions == [0, 1, 4] + [0] * 61
    assert padded.slot_mapping == [8, 9, 20] + [28] * 61  # the dummy block's first slot
    # the padding sequence (61 tokens, 16 blocks of the dummy block), then 2 empty ones
    assert padded.cu_seqlens_q == [0, 2, 3, 64, 64, 64] and padded.context_lens == [2, 5, 61, 0, 0]
    assert padded.block_tables[:2].tolist() == [[2, 0] + [7] * 14, [3, 5] + [7] * 14]
    assert padded.block_tables[2:].tolist() == [[7] * 16] * 3
    assert padded.sample_rows == [1, 0, 0, 0] and not padded.is_decode
    with pytest.raises(ValueError, match="cannot run"):
        pad_prefill_plan(plan, 2, 4, 7, BLOCK)  # more tokens than the bucket
    with pytest.raises(ValueError, match="cannot run"):
        pad_prefill_plan(plan, 64, 1, 7, BLOCK)  # more sequences than the graph
    with pytest.raises(ValueError, match="decode"):
        pad_prefill_plan(
            StepPlan([1], [0], [0], np.zeros((1, 1), dtype=np.int32), [1], [0, 1], [0], True), 64, 4, 7, BLOCK
        )


@pytest.mark.parametrize("bucket", [17, 64])
def test_padded_step_computes_the_real_rows_and_leaves_real_kv_alone(runner: ModelRunner, bucket: int) -> None:
    """The padded step (bucket 17: the plan's own 17 tokens and empty sequences; 64: a 47-token
    padding sequence too) gives the plain step's logits for the sampled rows and the plain
    step's K/V in the plan's slots; nothing else changes but the dummy block, which stays finite."""
    gen = torch.Generator().manual_seed(0)
    plan = mixed_plan(runner, gen)
    assert len(plan.input_ids) == 17
    runner.kv_cache.normal_(generator=torch.Generator().manual_seed(1))
    runner.kv_cache[:, :, runner.num_blocks].zero_()  # the dummy block starts as the runner leaves it
    before = runner.kv_cache.clone()
    plain = runner.forward(*runner.inputs(plan))
    after_plain = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    padded = pad_prefill_plan(plan, bucket, 4, runner.num_blocks, BLOCK)
    logits = runner.forward(*runner.inputs(padded))
    assert plain is not None and logits is not None
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[: len(plan.sample_rows)], plain, atol=1e-5, rtol=1e-5)
    real = slice(0, runner.num_blocks)
    torch.testing.assert_close(runner.kv_cache[:, :, real], after_plain[:, :, real], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(runner.kv_cache[:, :, runner.num_blocks]).all()


def test_prefill_graph_limits(runner: ModelRunner) -> None:
    with pytest.raises(ValueError, match="cuda_graph_max_prefill_tokens"):
        EngineConfig(model="m", cuda_graph_max_prefill_tokens=-1)
    with pytest.raises(ValueError, match="cuda_graph_max_prefill_seqs"):
        EngineConfig(model="m", cuda_graph_max_prefill_seqs=0)
    assert runner.prefill_graph_runner is None and runner._prefill_graph_limits() == (0, 0)  # CPU: no graphs
