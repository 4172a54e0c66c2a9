"""A request's state inside one engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from pdserve.engine.prefix_cache import CacheNode
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.timings import Milestones


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself: identity, not field-wise (an array field has no ==)
class Sequence:
    """One request: its tokens, how many of them the KV cache holds, and its blocks.

    Invariant: ``num_computed_tokens <= len(token_ids)`` and the block table covers every
    computed token. A running sequence has exactly one uncomputed token (the last sampled).

    With overlapped steps a sampled token is appended at once as a placeholder
    (``engine.step_plan.pending_token``: a negative id naming its row of the step's sampled
    tokens, still on the device) and replaced when the step is read back; only the last one or
    two tokens can be pending. ``finishing``: the pending token is certainly the last (length,
    or a prefill-only request), so the sequence is neither scheduled nor preempted again.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # int32 block ids, an array so that a step's block tables are built by row copies
    block_table: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    finish_reason: str | None = None
    milestones: Milestones = field(default_factory=Milestones)
    # Prefill role: stop after the first token and keep the KV blocks for the transfer.
    prefill_only: bool = False
    finishing: bool = False
    # Prefix caching: the first ``num_shared_blocks`` blocks of ``block_table`` belong to the
    # prefix cache, locked for this sequence through ``cache_node`` (the node of the last one).
    num_shared_blocks: int = 0
    cache_node: CacheNode | None = None
    num_cached_tokens: int = 0  # prompt tokens the cache held when the sequence was first scheduled

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are still to come: every prompt position's logits are
        needed, so none of its KV may come from the prefix cache."""
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0

    def drop_pending(self) -> None:
        """Forget the placeholders of tokens not yet read back (a finished sequence's)."""
        while self.token_ids and self.token_ids[-1] < 0:
            self.token_ids.pop()
