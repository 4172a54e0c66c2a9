"""The cuda-ipc backend's graph-issued pulls (``kvtransfer.ipc.CopyGraphs``) against the torch
reference copy, in one process: the pools need no IPC for the graphs' logic (padding, buckets,
slots that must not be rewritten while their replay is queued); and its warm-up
(``compile_copies``), after which no pull compiles a kernel."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve.cluster.group import RankProcesses
from pdserve.kernels.kv_copy import PagedKVCopy, paged_kv_copy_ref
from pdserve.kvtransfer.ipc import CopyGraphs, compile_copies, upload_block_ids

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
    compile_copies(copiers, device)
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
        assert graphs.replay(*pulls[0])  # the first capture happens here, before the stream is held
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


def test_the_warm_up_hands_each_copier_only_padding_in_both_id_alignments() -> None:
    """Triton compiles a variant per 16-byte alignment of a pointer argument: an eager pull of an
    odd count hands the copy a destination row 8 bytes past the alignment of an even count's."""
    calls: list[tuple[int, int, torch.Tensor]] = []

    def record(src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        calls.append((src_ids.data_ptr() % 16, dst_ids.data_ptr() % 16, dst_ids.clone()))

    compile_copies([record, record], torch.device("cpu"))
    assert len(calls) == 4
    assert {(src_align, dst_align) for src_align, dst_align, _ in calls} == {(0, 0), (0, 8)}
    assert all(bool((dst < 0).all()) for _, _, dst in calls), "the warm-up must write no block"
    for count in (1, 2, 3, 16):  # what a pull hands the copies has those layouts only
        ids = upload_block_ids(list(range(count)), list(range(count)), torch.device("cpu"))
        assert (ids[0].data_ptr() % 16, ids[1].data_ptr() % 16) == (0, 8 * (count % 2))


def _pulls_after_the_warm_up(cache_dir: str) -> None:
    """In a process whose Triton cache starts empty, as on a new machine."""
    device = torch.device("cuda")
    src, dsts = _pools(device)
    copiers = [PagedKVCopy(src, d, s, t) for (s, t), d in zip(PIECES, dsts, strict=True)]
    compile_copies(copiers, device)
    torch.cuda.synchronize()
    compiled = sorted(Path(cache_dir).rglob("*"))
    assert compiled, "no file in Triton's cache: the test's TRITON_CACHE_DIR is not in use"
    graphs = CopyGraphs(copiers, device, max_blocks=64, num_slots=1)
    with torch.cuda.stream(torch.cuda.Stream()):
        for count in (1, 2, 3, 7, 16):  # eager pulls: both alignments of the destination row
            ids = upload_block_ids(list(range(count)), list(range(100, 100 + count)), device)
            for copy in copiers:
                copy(ids[0], ids[1])
        assert graphs.replay([0, 1, 2], [200, 201, 202])
    torch.cuda.synchronize()
    assert sorted(Path(cache_dir).rglob("*")) == compiled, "a pull after the warm-up compiled a kernel"


@pytest.mark.gpu
def test_after_the_warm_up_no_pull_compiles_a_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache_dir = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache_dir))  # the spawned process inherits it
    RankProcesses(_pulls_after_the_warm_up, [(str(cache_dir),)]).wait(300)
