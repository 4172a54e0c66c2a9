"""Tensor parallelism: the head partition rule, and TP groups (gloo, fp32) against tp = 1."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from pdserve.bench.harness import generate_tp
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.parallel import check_tp_size, head_shard, split_range
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.step_channel import KVCommand, decode_message, encode_message
from pdserve.engine.step_plan import StepPlan, host_tensor


def test_peer_messages_round_trip() -> None:
    """What the leader sends its peers comes back equal, the block-table array included."""
    tables = np.array([[4, 1], [2, 0], [2**31 - 1, 7]], dtype=np.int32)
    plan = StepPlan(
        input_ids=[5, 6, 7],
        positions=[3, 0, 1],
        slot_mapping=[19, 32, 113],
        block_tables=tables,
        context_lens=[4, 1, 2],
        cu_seqlens_q=[0, 1, 2, 3],
        sample_rows=[0, 1, 2],
        is_decode=True,
        kv_ready=["t7"],
        num_pending=3,
    )
    command = KVCommand(op="recv", transfer_id="t7", block_ids=[2, 9], peer_group=1)
    got = decode_message(encode_message(plan))
    assert isinstance(got, StepPlan)
    for name in (
        "input_ids",
        "positions",
        "slot_mapping",
        "context_lens",
        "cu_seqlens_q",
        "sample_rows",
        "is_decode",
        "kv_ready",
        "num_pending",
    ):
        assert getattr(got, name) == getattr(plan, name)
    assert got.block_tables.dtype == np.int32 and np.array_equal(got.block_tables, tables)
    empty = dataclasses.replace(plan, block_tables=np.zeros((0, 0), dtype=np.int32))
    assert decode_message(encode_message(empty)).block_tables.shape == (0, 0)
    assert decode_message(encode_message(command)) == command


def test_peer_messages_carry_only_integer_arrays() -> None:
    plan = StepPlan([1], [0], [0], np.zeros((1, 1), dtype=np.float32), [1], [0, 1], [0], True)
    with pytest.raises(TypeError, match="cannot encode ndarray"):
        encode_message(plan)
    forged = msgpack.packb(
        {
            "kind": "step",
            "block_tables": msgpack.ExtType(1, msgpack.packb(["<f4", [1], np.zeros(1, np.float32).tobytes()])),
        }
    )
    with pytest.raises(ValueError, match="only integer arrays"):
        decode_message(forged)


def test_host_tensor_matches_torch_tensor() -> None:
    """The numpy route gives torch.tensor's values, shapes and dtypes (block tables, slots, empty lists)."""
    for values, dtype in (
        ([[4, 1, 0], [2, 9, 7]], torch.int32),
        ([2**40, 3], torch.int64),
        ([], torch.int64),
        (np.array([[4, 1], [2, 9]], dtype=np.int32), torch.int32),
    ):
        got = host_tensor(values, dtype, pin=False)
        assert got.dtype == dtype and torch.equal(got, torch.tensor(values, dtype=dtype))


@pytest.mark.parametrize("num_kv_heads", range(1, 9))
@pytest.mark.parametrize("group", [1, 2, 3])
def test_partition_rule_places_every_head(num_kv_heads: int, group: int) -> None:
    """Each query head is computed on exactly one rank, next to the KV head it reads."""
    num_heads = num_kv_heads * group
    for tp in range(1, 9):
        if tp > num_heads:
            with pytest.raises(ValueError, match="exceeds"):
                check_tp_size(num_heads, num_kv_heads, tp)
            continue
        owner = [-1] * num_heads
        for rank in range(tp):
            shard = head_shard(num_heads, num_kv_heads, tp, rank)
            assert shard.num_q_heads >= 1 and shard.num_kv_heads >= 1
            for q in range(shard.q_start, shard.q_end):
                assert owner[q] == -1, f"query head {q} on two ranks"
                owner[q] = rank
                assert shard.kv_start <= q // group < shard.kv_end, "rank lacks the KV head its query head reads"
            # Local mapping as the kernels see it: local q head h reads local KV head h // local group.
            local_group = shard.num_q_heads // shard.num_kv_heads
            assert shard.num_q_heads % shard.num_kv_heads == 0
            for h in range(shard.num_q_heads):
                assert shard.kv_start + h // local_group == (shard.q_start + h) // group
            if tp <= num_kv_heads:
                assert (shard.kv_start, shard.kv_end) == split_range(num_kv_heads, tp, rank)
            else:
                assert shard.num_kv_heads == 1
        assert -1 not in owner


def _engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), dtype="float32", device="cpu", max_model_len=256, cache=CacheConfig(num_blocks=160)
    )


def _mixed_prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 9, 16, 17, 31, 45, 64, 80)]


CASES = [
    ("tiny-qwen2", 2),  # 6 query / 3 KV heads: uneven KV split
    ("tiny-qwen2", 3),
    ("tiny-llama", 4),  # 8 query / 2 KV heads: KV heads replicated
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "tp"), CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_tp_greedy_matches_tp1(tiny_model_dirs: dict[str, Path], name: str, tp: int) -> None:
    config = _engine_config(tiny_model_dirs[name])
    prompts = _mixed_prompts(512)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = LLMEngine(config).generate(prompts, params)
    assert generate_tp(config, tp, prompts, params) == expected


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_demo_model_tp_matches_tp1(demo_model_dir: Path, tp: int) -> None:
    """9 query / 3 KV heads: tp 2 splits them unevenly, tp 4 (> 3 KV heads) replicates."""
    config = _engine_config(demo_model_dir)
    prompts = _mixed_prompts(49152)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = LLMEngine(config).generate(prompts, params)
    assert generate_tp(config, tp, prompts, params) == expected


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "read-back-first"])
def test_tp_peers_follow_overlapped_steps(tiny_model_dirs: dict[str, Path], overlap: bool) -> None:
    """Overlapped steps in a TP group: each peer fills the plan's placeholders from the leader's
    broadcast of the sampled tokens (a peer with wrong tokens would write wrong K/V for its heads
    and the outputs would part). Against tp 1 reading each step back first, with seeded sampling
    beside greedy requests, mixed lengths and a pool small enough to preempt."""
    base = dataclasses.replace(_engine_config(tiny_model_dirs["tiny-qwen2"]), cache=CacheConfig(num_blocks=20))
    prompts = _mixed_prompts(512)
    params = [
        SamplingParams(max_tokens=8 + 3 * i, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    expected = LLMEngine(dataclasses.replace(base, overlap_scheduling=False)).generate(prompts, params)
    assert generate_tp(dataclasses.replace(base, overlap_scheduling=overlap), 2, prompts, params) == expected


def _rank_dies_or_waits(rank: int, init: str) -> None:
    """Rank 1 dies right after joining; rank 0 then waits in an all-reduce that never completes."""
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, world_size=2, rank=rank)
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def test_a_dead_peer_stops_the_group_with_its_rank_named() -> None:
    from pdserve.cluster.group import RankProcesses, free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    group = RankProcesses(_rank_dies_or_waits, [(0, init), (1, init)])
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3"):
        group.wait(timeout=120)
    assert not group.alive()
