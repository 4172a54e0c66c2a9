"""Continuous batching: which sequences run in the next step, and how many tokens each.

Two policies, chosen by ``SchedulerConfig.enable_chunked_prefill``:

* chunked (vLLM's default): every running sequence decodes one token, and the rest of the
  step's token budget goes to prompt chunks of waiting sequences, in arrival order. A prompt
  longer than the remaining budget is split; its remainder goes first in the next step.
* unchunked: a step either prefills whole prompts (prefill first, as vLLM v0 did) or decodes
  every running sequence.

When a running sequence needs a block and none is free, the most recently admitted running
sequence is preempted: its blocks are freed and it goes back to waiting to be recomputed
later. Memory pressure therefore slows requests down; it never crashes the engine.

With prefix caching, a waiting sequence starts after its longest cached prefix when it gets to
the head of the queue (``BlockManager.match_prefix``), matched again while it waits there with no
blocks of its own if more blocks were cached meanwhile: its prompt work, chunked or not, covers
only the rest. A preempted sequence's computed blocks stay cached until evicted, so it usually
resumes where it stopped. A sequence that wants its prompt's log-probabilities computes its
whole prompt, and caches it like any other.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """``num_new_tokens[i]`` tokens of ``seqs[i]`` (from its ``num_computed_tokens``) run now."""

    seqs: list[Sequence]
    num_new_tokens: list[int]

    @property
    def is_decode(self) -> bool:
        """Every sequence runs exactly its one uncomputed token (the decode fast path)."""
        return all(n == 1 and s.num_computed_tokens + 1 == s.num_tokens for s, n in zip(self.seqs, self.num_new_tokens))

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order, oldest first
        self.num_preemptions = 0
        # The head's last prefix match and the cache's insert count then: matched again only
        # once the cache has grown.
        self._matched: Sequence | None = None
        self._matched_at = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's work, or None when there is nothing to run."""
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted = False
        if self.config.enable_chunked_prefill or not self._prefill_possible():
            decodes, preempted = self._schedule_decodes()
            seqs = list(decodes)  # not the running list itself, which admitted prompts extend
            counts = [1] * len(seqs)
            budget -= len(seqs)
        if not preempted and budget > 0:
            # Every running sequence holds a slot, decoded this step or not (an unchunked prefill
            # step decodes none); a finishing one leaves at its read-back.
            active = sum(1 for seq in self.running if not seq.finishing)
            for seq, n in self._schedule_prefills(budget, self.config.max_num_seqs - active):
                seqs.append(seq)
                counts.append(n)
        if not seqs:
            return None
        now = time.monotonic()
        for seq in seqs:
            if seq.milestones.first_scheduled is None:
                seq.milestones.first_scheduled = now
        return ScheduledBatch(seqs, counts)

    def _prefill_possible(self) -> bool:
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        seq = self.waiting[0]
        return self.block_manager.can_allocate(seq, seq.num_tokens)

    def _schedule_decodes(self) -> tuple[list[Sequence], bool]:
        """One token for every running sequence, preempting the youngest to make room.

        A ``finishing`` sequence (its last token still on the device) stays running without a
        step, and is never preempted: a prefill-only one keeps its blocks for the transfer."""
        scheduled: list[Sequence] = []
        preempted = False
        finishing = [seq for seq in self.running if seq.finishing]
        queue = deque(seq for seq in self.running if not seq.finishing)
        while queue:
            seq = queue.popleft()
            while not self.block_manager.can_allocate(seq, seq.num_tokens):
                preempted = True
                if queue:
                    self._preempt(queue.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.allocate(seq, seq.num_tokens)
                scheduled.append(seq)
        self.running = finishing + scheduled  # the finishing leave at the next read-back
        return scheduled, preempted

    def _schedule_prefills(self, budget: int, free_seq_slots: int) -> list[tuple[Sequence, int]]:
        """Prompt work for waiting sequences, in order, within ``budget`` tokens."""
        chunked = self.config.enable_chunked_prefill
        scheduled: list[tuple[Sequence, int]] = []
        while self.waiting and budget > 0 and free_seq_slots > 0:
            seq = self.waiting[0]
            # A preempted sequence's return is not another request, in the cache's counts nor in
            # its own cached tokens.
            first = seq.milestones.first_scheduled is None
            self._match_prefix(seq, first)
            remaining = seq.num_tokens - seq.num_computed_tokens
            chunk = min(remaining, budget) if chunked else remaining
            if chunk > budget:
                break
            if not self.block_manager.can_allocate(seq, seq.num_computed_tokens + chunk):
                if not chunked:
                    break
                # Take what the free blocks hold; the rest waits for blocks to come back.
                free_tokens = (
                    len(seq.block_table) + self.block_manager.num_free_blocks
                ) * self.block_manager.block_size - seq.num_computed_tokens
                chunk = min(chunk, free_tokens)
                if chunk <= 0:
                    break
            self.block_manager.allocate(seq, seq.num_computed_tokens + chunk)
            if first and not seq.wants_prompt_logprobs:
                self.block_manager.count_match(seq)
            scheduled.append((seq, chunk))
            budget -= chunk
            if chunk < remaining:
                break  # a partial prompt stays at the head of the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            free_seq_slots -= 1
        return scheduled

    def _match_prefix(self, seq: Sequence, first: bool) -> None:
        """Start the head of the queue after its longest cached prefix: when it has no blocks
        (new, or preempted), and again while it holds only a match made before the cache grew
        (it waited for blocks or a slot, and the requests ahead may have cached its prefix)."""
        manager = self.block_manager
        cache = manager.prefix_cache
        if cache is None:
            return
        if seq.cache_node is not None:
            shared = seq.num_shared_blocks
            holds_only_its_match = (
                len(seq.block_table) == shared and seq.num_computed_tokens == shared * manager.block_size
            )
            unchanged = self._matched is seq and self._matched_at == cache.num_inserts
            if not holds_only_its_match or seq.wants_prompt_logprobs or unchanged:
                return
            manager.free(seq)  # unlocks the old match
        # Every prompt position's logits are needed: none of its KV may come from the cache, but
        # its own prompt goes there (a match of no tokens ties it to the root).
        manager.match_prefix(seq, 0 if seq.wants_prompt_logprobs else None)
        self._matched, self._matched_at = seq, cache.num_inserts
        if first:
            seq.num_cached_tokens = seq.num_computed_tokens

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it for recomputation, behind a partial prompt if any.

        Called only while decodes are scheduled, which rebuilds ``running`` without ``seq``.
        """
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        head_is_partial = bool(self.waiting) and self.waiting[0].num_computed_tokens > 0
        self.waiting.insert(1 if head_is_partial else 0, seq)
        self.num_preemptions += 1

    def admit_running(self, seq: Sequence) -> None:
        """Add a sequence whose KV is already in its blocks (received from a prefill group)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str, free_blocks: bool = True) -> None:
        """Take ``seq`` out of the scheduler (finished or aborted), freeing its blocks unless
        the caller keeps them (a prefilled request whose KV still has to move)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free_blocks:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.milestones.finished = time.monotonic()
