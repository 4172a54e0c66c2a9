"""The resharding plan against the partition rule, for every small combination of degrees."""

from __future__ import annotations

import pytest

from pdserve.engine.parallel import head_shard
from pdserve.kvtransfer.plan import resharding_plan


@pytest.mark.parametrize("num_kv_heads", range(1, 9))
def test_each_decode_rank_receives_exactly_its_heads_once(num_kv_heads: int) -> None:
    num_heads = num_kv_heads * 2
    for p in range(1, 9):
        for d in range(1, 9):
            if p > num_heads or d > num_heads:
                continue
            plan = resharding_plan(num_heads, num_kv_heads, p, d)
            for dst in range(d):
                own = head_shard(num_heads, num_kv_heads, d, dst)
                received = [h for piece in plan if piece.dst_rank == dst for h in range(piece.kv_start, piece.kv_end)]
                assert sorted(received) == list(range(own.kv_start, own.kv_end)), (p, d, dst)
            for piece in plan:
                src = head_shard(num_heads, num_kv_heads, p, piece.src_rank)
                assert src.kv_start <= piece.kv_start < piece.kv_end <= src.kv_end, "sender lacks the heads"
                dst = head_shard(num_heads, num_kv_heads, d, piece.dst_rank)
                s, t = piece.src_slice(src), piece.dst_slice(dst)
                assert s.stop - s.start == t.stop - t.start == piece.num_heads


def test_pieces_are_coalesced_per_source_and_destination() -> None:
    # 8 KV heads, prefill tp 2 -> decode tp 1: two pieces of 4 heads, not eight of one.
    plan = resharding_plan(16, 8, 2, 1)
    assert [(p.src_rank, p.dst_rank, p.kv_start, p.kv_end) for p in plan] == [(0, 0, 0, 4), (1, 0, 4, 8)]


def test_replicated_heads_come_from_one_source_each_and_spread_over_sources() -> None:
    # 2 KV heads on prefill tp 4 (each held twice) -> decode tp 2.
    plan = resharding_plan(8, 2, 4, 2)
    assert [(p.src_rank, p.dst_rank, p.kv_start) for p in plan] == [(0, 0, 0), (3, 1, 1)]
