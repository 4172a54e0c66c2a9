"""Allocation of fixed-size KV blocks to sequences."""

from __future__ import annotations

from collections import deque

import numpy as np

from pdserve.engine.sequence import Sequence


class BlockManager:
    """Hands out blocks ``0 .. num_blocks-1`` of a rank's KV pool.

    The pool itself has one more block, ``num_blocks`` (the *dummy* block), that is never
    handed out: padding tokens (CUDA-graph batch padding) write their K/V there.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` lacks to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed == 0:  # most decode steps: the last block has room
            return
        if needed > len(self._free):
            raise RuntimeError(f"allocating {needed} blocks with {len(self._free)} free: check can_allocate first")
        new = np.fromiter((self._free.popleft() for _ in range(needed)), dtype=np.int32, count=needed)
        seq.block_table = np.concatenate([seq.block_table, new])

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table.tolist())
        seq.block_table = np.empty(0, dtype=np.int32)
