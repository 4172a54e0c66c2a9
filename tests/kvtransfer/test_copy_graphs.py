"""The cuda-ipc backend's graph-issued pulls (``kvtransfer.ipc.CopyGraphs``) against the torch
reference copy, in one process: the pools need no IPC for the graphs' logic (padding, buckets,
slots that must not be rewritten while their replay is queued)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.kernels.kv_copy import PagedKVCopy, paged_kv_copy_ref
from pdserve.kvtransfer.ipc import CopyGraphs

LAYERS, BLOCK, HEAD_DIM, NUM_BLOCKS = 4, 16, 128, 600
# Prefill TP 1 (2 KV heads) into decode TP 2: one piece per decode rank's pool.
PIECES = ((slice(0, 1), slice(0, 1)), (slice(1, 2), slice(0, 1)))


def _pools(device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(0)
    src = torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK, 2, HEAD_DIM, device=device, generator=gen).bfloat16()
    dsts = [
        torch.full((LAYERS, 2, NUM_BLOCKS, BLOCK, 1, HEAD_DIM), float("nan"), device=device).bfloat16() for _ in PIECES
    ]
    return src, dsts


def _expected(
    src: torch.Tensor, dsts: list[torch.Tensor], pulls: list[tuple[list[int], list[int]]]
) -> list[torch.Tensor]:
    expected = [d.clone() for d in dsts]
    for src_ids, dst_ids in pulls:
        for (src_heads, dst_heads), out in zip(PIECES, expected, strict=True):
            ids = torch.tensor([src_ids, dst_ids], device=src.device)
            paged_kv_copy_ref(src, out, ids[0], ids[1], src_heads, dst_heads)
    return expected


def _equal_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b, strict=True))


def _draw(rng: random.Random, count: int, taken: set[int]) -> list[int]:
    ids = rng.sample(sorted(set(range(NUM_BLOCKS)) - taken), count)
    taken.update(ids)
    return ids


def _graphs(num_slots: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], CopyGraphs]:
    """The source pool, the destination pools, their contents before any pull, and the graphs."""
    device = torch.device("cuda")
    src, dsts = _pools(device)
    copiers = [PagedKVCopy(src, d, s, t) for (s, t), d in zip(PIECES, dsts, strict=True)]
    return src, dsts, [d.clone() for d in dsts], CopyGraphs(copiers, device, max_blocks=64, num_slots=num_slots)


@pytest.mark.gpu
def test_graph_pulls_copy_exactly_the_listed_blocks_for_every_bucket() -> None:
    src, dsts, before, graphs = _graphs(num_slots=2)
    rng = random.Random(1)
    stream = torch.cuda.Stream()
    pulls, taken = [], set()
    with torch.cuda.stream(stream):
        for count in (1, 3, 4, 5, 33, 64, 2, 33):  # new buckets, reused buckets, partial buckets
            pull = (rng.sample(range(NUM_BLOCKS), count), _draw(rng, count, taken))
            assert graphs.replay(*pull)
            pulls.append(pull)
            stream.synchronize()
        assert not graphs.replay(list(range(65)), list(range(65)))  # more than any graph: eager
        assert not graphs.replay([], [])
    torch.cuda.synchronize()
    assert _equal_bits(dsts, _expected(src, before, pulls))


@pytest.mark.gpu
def test_a_queued_graph_pull_keeps_its_ids_while_later_pulls_are_issued() -> None:
    """With the stream held busy, each pull takes a slot of its own; with every slot queued, the
    next is refused (the caller issues it eagerly) instead of rewriting a queued slot's ids."""
    src, dsts, before, graphs = _graphs(num_slots=3)
    rng = random.Random(2)
    stream = torch.cuda.Stream()
    taken: set[int] = set()
    with torch.cuda.stream(stream):
        pulls = [(rng.sample(range(NUM_BLOCKS), 2), _draw(rng, 2, taken))]
        assert graphs.replay(*pulls[0])  # the kernel compiles here, before the stream is held
        stream.synchronize()
        torch.cuda._sleep(1_000_000_000)  # holds the stream while the host goes on
        for _ in range(3):
            pulls.append((rng.sample(range(NUM_BLOCKS), 16), _draw(rng, 16, taken)))
            assert graphs.replay(*pulls[-1])
        assert not graphs.replay(rng.sample(range(NUM_BLOCKS), 16), rng.sample(range(NUM_BLOCKS), 16))
        stream.synchronize()
        pulls.append((rng.sample(range(NUM_BLOCKS), 16), _draw(rng, 16, taken)))
        assert graphs.replay(*pulls[-1])  # the slots are free again
    torch.cuda.synchronize()
    assert _equal_bits(dsts, _expected(src, before, pulls))
