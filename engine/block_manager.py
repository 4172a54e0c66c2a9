"""Allocation of fixed-size KV blocks to sequences, through the prefix cache when there is one.

With a :class:`PrefixCache`, a block is free, owned by one sequence, or owned by the cache (and
then shared by every sequence whose prompt starts with its tokens). A sequence starts at its
longest cached prefix (``match_prefix``), hands its full computed blocks to the cache once its
prompt is done and again when it leaves (``cache_blocks``, ``free``), and cached blocks that no
sequence uses are evicted when an allocation finds too few free ones.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pdserve.engine.prefix_cache import PrefixCache, PrefixCacheStats
from pdserve.engine.sequence import Sequence


class BlockManager:
    """Hands out blocks ``0 .. num_blocks-1`` of a rank's KV pool.

    The pool itself has one more block, ``num_blocks`` (the *dummy* block), that is never
    handed out: padding tokens (CUDA-graph batch padding) write their K/V there.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: PrefixCache | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones, and cached ones that no sequence uses."""
        if self.prefix_cache is None:
            return len(self._free)
        return len(self._free) + self.prefix_cache.num_evictable_blocks

    def cache_stats(self) -> PrefixCacheStats | None:
        return None if self.prefix_cache is None else self.prefix_cache.stats()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` lacks to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens, evicting cached blocks
        that no sequence uses when too few are free."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed == 0:  # most decode steps: the last block has room
            return
        if needed > len(self._free) and self.prefix_cache is not None:
            self._free.extend(self.prefix_cache.evict(needed - len(self._free)))
        if needed > len(self._free):
            raise RuntimeError(f"allocating {needed} blocks with {len(self._free)} free: check can_allocate first")
        new = np.fromiter((self._free.popleft() for _ in range(needed)), dtype=np.int32, count=needed)
        seq.block_table = np.concatenate([seq.block_table, new])

    def match_prefix(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Start ``seq`` (no blocks yet) after the longest cached prefix of full blocks of its
        first ``num_tokens`` tokens: those blocks, locked, become the head of its block table
        and count as computed. By default the last token is left to compute: its logits give
        the next token. Counted nowhere: see ``count_match``."""
        if self.prefix_cache is None:
            return
        assert len(seq.block_table) == 0 and seq.cache_node is None, f"{seq.request_id} already has blocks"
        limit = seq.num_tokens - 1 if num_tokens is None else num_tokens
        block_ids, node = self.prefix_cache.match(seq.token_ids[:limit], count=False)
        self.prefix_cache.lock(node)
        seq.cache_node = node
        seq.num_shared_blocks = len(block_ids)
        seq.block_table = np.array(block_ids, dtype=np.int32)
        seq.num_computed_tokens = len(block_ids) * self.block_size

    def count_match(self, seq: Sequence) -> None:
        """``seq``'s match of its prompt (all but its last token), once, in the cache's hit and
        miss counts."""
        if self.prefix_cache is not None:
            self.prefix_cache.count_query(seq.num_shared_blocks * self.block_size, seq.num_tokens - 1)

    def cache_blocks(self, seq: Sequence) -> None:
        """Hand ``seq``'s full computed blocks to the prefix cache, which keeps them locked for
        ``seq``. Where the cache already held the same tokens in another block, ``seq`` switches
        to that block and its own is freed."""
        cache = self.prefix_cache
        if cache is None or seq.cache_node is None:
            return
        num_full = seq.num_computed_tokens // self.block_size
        shared = seq.num_shared_blocks
        if num_full <= shared:
            return
        # Only the blocks after the shared ones, below their node: the cache holds those already.
        assert seq.cache_node.depth == shared, f"{seq.request_id}: its node is not its last shared block"
        tokens = seq.token_ids[shared * self.block_size : num_full * self.block_size]
        assert tokens[-1] >= 0, f"{seq.request_id}: a computed token is still a placeholder"
        result = cache.insert(tokens, seq.block_table[shared:num_full], parent=seq.cache_node)
        cache.move_lock(seq.cache_node, result.handle)
        self._free.extend(result.duplicates)
        seq.block_table[shared:num_full] = result.block_ids
        seq.cache_node = result.handle
        seq.num_shared_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Take back ``seq``'s blocks: its full computed ones go to the prefix cache (unlocked:
        evictable once no other sequence uses them), the rest to the free list."""
        self.cache_blocks(seq)
        if self.prefix_cache is not None and seq.cache_node is not None:
            self.prefix_cache.unlock(seq.cache_node)
        self._free.extend(seq.block_table[seq.num_shared_blocks :].tolist())
        seq.block_table = np.empty(0, dtype=np.int32)
        seq.cache_node = None
        seq.num_shared_blocks = 0
