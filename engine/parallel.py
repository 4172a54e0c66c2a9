"""Tensor-parallel state and the head partition rule.

`head_shard` is the one rule (DESIGN.md) that places attention heads on TP ranks. Weight
sharding, the KV-cache layout of a rank and the KV resharding plan between groups all call it,
so they cannot disagree.

For ``N`` KV heads, ``H = N * G`` query heads and a group of ``t`` ranks:

* ``t <= N``: rank ``r`` owns KV heads ``[floor(r*N/t), floor((r+1)*N/t))`` (uneven splits
  allowed) and the query heads that use them.
* ``t > N``: rank ``r`` holds the one KV head ``h = floor(r*N/t)`` (a replica when several
  ranks map to ``h``); the ``G`` query heads of ``h`` are split evenly, by the same floor rule,
  across the ranks that hold ``h``. Requires ``t <= H`` so that no rank is left without a
  query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[floor(index*total/parts), floor((index+1)*total/parts))``: the uneven even split."""
    return index * total // parts, (index + 1) * total // parts


@dataclass(frozen=True)
class HeadShard:
    """The heads one TP rank computes and stores."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_q_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start


def check_tp_size(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    if tp_size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp_size}")
    if tp_size > num_heads:
        raise ValueError(
            f"tensor-parallel size {tp_size} exceeds the model's {num_heads} attention heads: "
            "some rank would hold no query head"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    check_tp_size(num_heads, num_kv_heads, tp_size)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside a group of {tp_size}")
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        kv_start, kv_end = split_range(num_kv_heads, tp_size, rank)
        return HeadShard(kv_start * group, kv_end * group, kv_start, kv_end)
    kv_head = rank * num_kv_heads // tp_size
    replicas = [r for r in range(tp_size) if r * num_kv_heads // tp_size == kv_head]
    q_start, q_end = split_range(group, len(replicas), replicas.index(rank))
    return HeadShard(kv_head * group + q_start, kv_head * group + q_end, kv_head, kv_head + 1)


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its TP group. ``group`` is None when ``size == 1``."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} outside a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("a TP group of size > 1 needs a process group")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast_from_leader(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the group's rank 0 holds it, on every rank (in place; in stream order on
        CUDA, no host sync)."""
        if self.size > 1:
            dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)
        return x
