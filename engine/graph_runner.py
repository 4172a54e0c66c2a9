"""CUDA graphs for decode steps, one per batch-size bucket.

A decode step of ``B`` sequences replays the graph of the smallest bucket ``>= B``. The graph
reads static buffers that are updated in place before each replay; rows ``B..bucket-1`` are
padding: token 0 at position 0, written to the dummy slot, reading one token of the dummy
block, so they never touch a real sequence's cache. Every bucket's graph shares one memory
pool (captured largest first). Steps larger than the largest bucket run eagerly.

Invariant: graphs must be released (``release``) before the process group is destroyed; a
captured NCCL all-reduce that outlives its communicator hangs the process at exit.
"""

from __future__ import annotations

import logging

import torch

from engine.context import AttentionContext, set_context
from engine.model import CausalLM
from engine.step_plan import StepPlan, host_tensor

logger = logging.getLogger(__name__)


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, then multiples of 8 (as vLLM does), the last one covering ``max_batch_size``."""
    buckets = [b for b in (1, 2, 4) if b < max_batch_size]
    if max_batch_size <= 4:
        return buckets + [max_batch_size]
    return buckets + list(range(8, -(-max_batch_size // 8) * 8 + 1, 8))


class CudaGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        max_batch_size: int,
        max_model_len: int,
        block_size: int,
        dummy_block: int,
        compute_logits: bool,
    ) -> None:
        self.model = model
        self.buckets = batch_buckets(max_batch_size)
        self.max_batch_size = self.buckets[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.dummy_block = dummy_block
        self.compute_logits = compute_logits
        device = next(model.parameters()).device
        n = self.max_batch_size
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), dummy_block * block_size, dtype=torch.int64, device=device)
        self.block_tables = torch.full((n, max_blocks), dummy_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all()

    def _context(self, bucket: int) -> AttentionContext:
        return AttentionContext(
            is_decode=True,
            slot_mapping=self.slot_mapping[:bucket],
            block_tables=self.block_tables[:bucket],
            context_lens=self.context_lens[:bucket],
            max_context_len=self.max_model_len,  # static: sizes the split-KV grid for any context
        )

    def _run_model(self, bucket: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket])
        return self.model.compute_logits(hidden) if self.compute_logits else hidden

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for bucket in reversed(self.buckets):  # largest first: it sizes the shared pool
            set_context(self._context(bucket))
            try:
                self._run_model(bucket)  # warm-up: Triton compiles outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bucket] = self._run_model(bucket)
            finally:
                set_context(None)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        logger.info("captured decode graphs for batch sizes %s", self.buckets)

    def can_run(self, plan: StepPlan) -> bool:
        return plan.is_decode and len(plan.input_ids) <= self.max_batch_size

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Replay the bucket's graph for a decode plan; logits (leader) or hidden states ``[B, ...]``."""
        batch = len(plan.input_ids)
        bucket = next(b for b in self.buckets if b >= batch)

        def load(buffer: torch.Tensor, values: list) -> None:
            # Straight from pinned memory into the static buffer; the caching host allocator
            # keeps the pinned block until the copy has run.
            buffer.copy_(host_tensor(values, buffer.dtype, pin=True), non_blocking=True)

        load(self.input_ids[:batch], plan.input_ids)
        load(self.positions[:batch], plan.positions)
        load(self.slot_mapping[:batch], plan.slot_mapping)
        load(self.context_lens[:batch], plan.context_lens)
        load(self.block_tables[:batch, : len(plan.block_tables[0])], plan.block_tables)
        # Padding rows: reset whatever an earlier, larger batch left there.
        self.input_ids[batch:bucket].zero_()
        self.positions[batch:bucket].zero_()
        self.slot_mapping[batch:bucket].fill_(self.dummy_block * self.block_size)
        self.context_lens[batch:bucket].fill_(1)
        self.block_tables[batch:bucket, 0].fill_(self.dummy_block)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:batch]

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
