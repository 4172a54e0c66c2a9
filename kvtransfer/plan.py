"""The resharding plan: which prefill rank sends which KV heads to which decode rank.

Computed once per (model, prefill TP, decode TP) from the same partition rule that shards the
weights (``engine.parallel.head_shard``), so the sender's slice and the receiver's placement
agree by construction. Any degrees are valid, including non-multiples and degrees above the
KV-head count: a replicated head is sent once to each decode rank that needs it, from one of
the prefill ranks holding it (chosen round-robin over decode ranks to spread the load).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pdserve.engine.parallel import HeadShard, head_shard


@dataclass(frozen=True)
class Piece:
    """KV heads ``[kv_start, kv_end)`` (global indices) move from ``src_rank`` to ``dst_rank``."""

    src_rank: int  # TP rank in the prefill group
    dst_rank: int  # TP rank in the decode group
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.kv_end - self.kv_start

    def src_slice(self, src: HeadShard) -> slice:
        """The piece's heads within the sender's local KV heads."""
        return slice(self.kv_start - src.kv_start, self.kv_end - src.kv_start)

    def dst_slice(self, dst: HeadShard) -> slice:
        """The piece's heads within the receiver's local KV heads."""
        return slice(self.kv_start - dst.kv_start, self.kv_end - dst.kv_start)


@lru_cache(maxsize=64)
def resharding_plan(num_heads: int, num_kv_heads: int, tp_prefill: int, tp_decode: int) -> tuple[Piece, ...]:
    """Every piece, ordered by (decode rank, head); contiguous heads from one source merge."""
    src_shards = [head_shard(num_heads, num_kv_heads, tp_prefill, r) for r in range(tp_prefill)]
    pieces: list[Piece] = []
    for dst in range(tp_decode):
        shard = head_shard(num_heads, num_kv_heads, tp_decode, dst)
        for head in range(shard.kv_start, shard.kv_end):
            holders = [r for r, s in enumerate(src_shards) if s.kv_start <= head < s.kv_end]
            src = holders[dst % len(holders)]
            last = pieces[-1] if pieces else None
            if last is not None and last.dst_rank == dst and last.src_rank == src and last.kv_end == head:
                pieces[-1] = Piece(src, dst, last.kv_start, head + 1)
            else:
                pieces.append(Piece(src, dst, head, head + 1))
    return tuple(pieces)
