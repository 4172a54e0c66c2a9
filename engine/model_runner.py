"""Runs the model for a scheduled batch on one rank: input tensors, KV pool, forward, logits."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
from pathlib import Path

import torch

from pdserve.engine import ops
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.context import AttentionContext, set_context
from pdserve.engine.graph_runner import (
    CudaGraphRunner,
    PrefillGraphRunner,
    batch_buckets,
    prefill_buckets,
    token_buckets,
)
from pdserve.engine.parallel import TensorParallel, head_shard
from pdserve.engine.step_channel import KVCommand, LoopProgress, PeerTransfers, StepReceiver, StepSender
from pdserve.engine.step_plan import StepPlan, device_tensor, write_pending_tokens
from pdserve.engine.weights import build_model

logger = logging.getLogger(__name__)

SINGLE_RANK = TensorParallel()  # no tensor parallelism (frozen: one shared default)


class ModelRunner:
    """Owns this rank's model and KV pool.

    The pool is one tensor ``[num_layers, 2, num_blocks + 1, block_size, kv_heads, head_dim]``;
    block ``num_blocks`` is the dummy block that padding tokens write to.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        if tp.size != config.parallel.tp_size or tp.rank != config.parallel.tp_rank:
            raise ValueError(f"process group (rank {tp.rank} of {tp.size}) disagrees with {config.parallel}")
        self.config = config
        self.model_config = model_config
        self.tp = tp
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.block_size = config.cache.block_size
        self.max_model_len = config.resolved_max_model_len(model_config)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        ops.use_kernels(config.resolved_kernels())
        self.model = build_model(model_config, Path(config.model), tp, self.dtype, self.device, self.max_model_len)
        shard = head_shard(model_config.num_heads, model_config.num_kv_heads, tp.size, tp.rank)
        self.num_kv_heads = shard.num_kv_heads
        self.num_blocks = config.cache.num_blocks or self._num_blocks_from_memory()
        if tp.size > 1:  # every rank of a group must agree on the pool, the smallest one wins
            agreed = torch.tensor([self.num_blocks], device=self.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=tp.group)
            self.num_blocks = int(agreed.item())
        # Zeroed so that the dummy block, read by graph padding rows, never holds NaN.
        self.kv_cache = torch.zeros(
            model_config.num_layers,
            2,
            self.num_blocks + 1,
            self.block_size,
            self.num_kv_heads,
            model_config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        leads_peers = tp.size > 1 and config.parallel.is_leader
        self._sender = StepSender(config.parallel.step_address or "", tp.size) if leads_peers else None
        self.graph_runner: CudaGraphRunner | None = None
        self.prefill_graph_runner: PrefillGraphRunner | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            rows = self._graph_logits_rows()
            logits = (
                torch.empty(rows, model_config.vocab_size, dtype=torch.float32, device=self.device) if rows else None
            )
            self.graph_runner = CudaGraphRunner(
                self.model,
                self._graph_max_batch(),
                self.max_model_len,
                self.block_size,
                dummy_block=self.num_blocks,
                logits=logits,
            )
            max_tokens, max_seqs = self._prefill_graph_limits()
            if max_tokens:
                self.prefill_graph_runner = PrefillGraphRunner(
                    self.model,
                    max_tokens,
                    max_seqs,
                    self.max_model_len,
                    self.block_size,
                    dummy_block=self.num_blocks,
                    logits=logits,
                )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K and V over all layers on this rank."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return (
            2 * self.model_config.num_layers * self.block_size * self.num_kv_heads * self.model_config.head_dim * elem
        )

    def _prefill_graph_limits(self) -> tuple[int, int]:
        """(tokens, sequences) of the largest captured prefill step (its token bucket); (0, 0)
        without prefill graphs."""
        config = self.config
        if self.device.type != "cuda" or config.enforce_eager or not config.cuda_graph_max_prefill_tokens:
            return 0, 0
        tokens = min(config.cuda_graph_max_prefill_tokens, config.scheduler.max_num_batched_tokens)
        return token_buckets(tokens)[-1], min(config.cuda_graph_max_prefill_seqs, config.scheduler.max_num_seqs)

    def _graph_max_batch(self) -> int:
        """The largest decode batch the decode graphs are asked to cover (their last bucket may
        round it up)."""
        return min(self.config.cuda_graph_max_batch, self.config.scheduler.max_num_seqs)

    def _graph_logits_rows(self) -> int:
        """Rows of the leader's logits buffer that every graph writes into: the largest decode
        bucket or prefill step's sampled rows, whichever is more; 0 without graphs or on a peer
        (its graphs return hidden states)."""
        config = self.config
        if self.device.type != "cuda" or config.enforce_eager or not config.parallel.is_leader:
            return 0
        return max(batch_buckets(self._graph_max_batch())[-1], self._prefill_graph_limits()[1])

    def _prefill_graph_output_bytes(self) -> int:
        """Bytes the prefill graphs' outputs keep besides their pool's activations: none on the
        leader (its graphs write into the logits buffer), every graph's hidden states on a peer."""
        if self.config.parallel.is_leader:
            return 0
        elem = torch.empty((), dtype=self.dtype).element_size()
        tokens = sum(b.tokens for b in prefill_buckets(*self._prefill_graph_limits()))
        return tokens * self.model_config.hidden_size * elem

    def _scratch_step(self, num_tokens: int, num_sampled: int) -> None:
        """One prefill forward of ``num_tokens`` tokens (one sequence) sampling ``num_sampled``
        rows, on whatever one-block cache the attention layers hold: for measuring memory."""
        context = AttentionContext(
            is_decode=False,
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros(1, -(-num_tokens // self.block_size), dtype=torch.int32, device=self.device),
            context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            max_context_len=num_tokens,
            cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
        )
        tokens = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        self.forward(tokens, torch.arange(num_tokens, device=self.device), context, tokens[:num_sampled])
        torch.cuda.synchronize()

    def _num_blocks_from_memory(self) -> int:
        if self.device.type != "cuda":
            return max(1, self.config.cache.cpu_kv_cache_bytes // self.block_bytes)
        # Measure the activation peak of the largest step with a one-block scratch cache, then
        # give the KV pool what the utilisation budget leaves. The weights are counted from the
        # model's own tensors, not as the growth of the process's allocation since this runner
        # began: other objects' memory freed meanwhile (an earlier engine collected by the GC)
        # would hide part of them, and the pool would take more than its share. Garbage is
        # collected first for the same reason: freed inside the measured step, it would hide
        # part of the activation peak.
        weights = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))
        gc.collect()
        torch.cuda.synchronize()
        scratch = torch.empty(
            self.model_config.num_layers,
            2,
            1,
            self.block_size,
            self.num_kv_heads,
            self.model_config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = scratch[i, 0], scratch[i, 1]
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self._scratch_step(min(self.config.scheduler.max_num_batched_tokens, self.max_model_len), 1)
        activations = torch.cuda.max_memory_allocated() - resident
        peak = weights + activations
        # The prefill graphs' pool keeps the activations of their largest step for good: measured
        # the same way (the padding makes a captured step one sequence longer, not larger).
        graph_tokens, graph_seqs = self._prefill_graph_limits()
        graph_pool = 0
        if graph_tokens:
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self._scratch_step(graph_tokens, graph_seqs)
            graph_pool = torch.cuda.max_memory_allocated() - resident + self._prefill_graph_output_bytes()
        # The logits buffer every graph writes into (the scratch step's own logits counted it in
        # part already: a bound, not an estimate).
        graph_pool += self._graph_logits_rows() * self.model_config.vocab_size * 4
        free, total = torch.cuda.mem_get_info()
        # Other processes and this one's CUDA context; on a shared GPU the others have budgets of their own.
        others = 0 if self.config.cache.gpu_shared else total - free - torch.cuda.memory_reserved()
        del scratch
        torch.cuda.empty_cache()
        share = int(total * self.config.cache.gpu_memory_utilization) - peak - graph_pool - others
        # Never more than is there once the step's activations have their room again (other
        # engines of this process keep what they hold).
        available = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        room = available - activations - graph_pool
        budget = min(share, room)
        num_blocks = budget // self.block_bytes
        if num_blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (weights+activations peak {peak / 2**30:.1f} GiB, "
                f"budget {total * self.config.cache.gpu_memory_utilization / 2**30:.1f} GiB): "
                "raise gpu_memory_utilization or lower max_num_batched_tokens"
            )
        gib = 2**30
        logger.info(
            "KV pool: %d blocks of %d tokens (%.1f GiB), bounded by %s; weights + activations %.1f GiB, "
            "graphs %.1f GiB, outside this process's allocator %.1f GiB, free on the device %.1f GiB",
            num_blocks,
            self.block_size,
            num_blocks * self.block_bytes / gib,
            "gpu_memory_utilization" if share <= room else "the free device memory",
            peak / gib,
            graph_pool / gib,
            others / gib,
            available / gib,
        )
        return int(num_blocks)

    def inputs(
        self, plan: StepPlan, sampled: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionContext, torch.Tensor]:
        """Device tensors of a plan: token ids (placeholders replaced from ``sampled``, see
        ``write_pending_tokens``), positions, attention context, sampled rows."""
        to = functools.partial(device_tensor, device=self.device)
        context = AttentionContext(
            is_decode=plan.is_decode,
            slot_mapping=to(plan.slot_mapping, torch.int64),
            block_tables=to(plan.block_tables, torch.int32),
            context_lens=to(plan.context_lens, torch.int32),
            max_context_len=max(plan.context_lens),
            cu_seqlens_q=to(plan.cu_seqlens_q, torch.int32),
        )
        input_ids = to(plan.input_ids, torch.int64)
        write_pending_tokens(input_ids, plan.input_ids, sampled)
        return input_ids, to(plan.positions, torch.int64), context, to(plan.sample_rows, torch.int64)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: AttentionContext,
        sample_rows: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Run the model; fp32 logits ``[len(sample_rows), vocab]``, or None without rows to sample."""
        hidden = self.hidden_states(input_ids, positions, context)
        return None if sample_rows is None else self.model.compute_logits(hidden[sample_rows])

    @torch.inference_mode()
    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, context: AttentionContext
    ) -> torch.Tensor:
        """Run the model up to its LM head: ``[T, hidden]``."""
        set_context(context)
        try:
            return self.model(input_ids, positions)
        finally:
            set_context(None)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: ``[N, hidden]`` -> fp32 ``[N, vocab]``."""
        return self.model.compute_logits(hidden)

    def _graphs_for(self, plan: StepPlan) -> CudaGraphRunner | PrefillGraphRunner | None:
        """The captured graphs that hold this plan, if any."""
        return next(
            (
                graphs
                for graphs in (self.graph_runner, self.prefill_graph_runner)
                if graphs is not None and graphs.can_run(plan)
            ),
            None,
        )

    def replays(self, plan: StepPlan) -> bool:
        """Whether ``run`` replays a captured graph for this plan (else the host launches every
        kernel itself, which takes longer than the GPU's work)."""
        return self._graphs_for(plan) is not None

    def run(self, plan: StepPlan, sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run one step: a captured graph for steps that fit one, else eagerly. ``sampled``:
        the tokens the plan's placeholders name (``engine.step_plan.write_pending_tokens``).

        Returns the logits of the sampled rows on the leader, None on peers.
        """
        graphs = self._graphs_for(plan)
        if graphs is not None:
            out = graphs.run(plan, sampled)
            return out if self.config.parallel.is_leader else None
        input_ids, positions, context, sample_rows = self.inputs(plan, sampled)
        return self.forward(input_ids, positions, context, sample_rows if self.config.parallel.is_leader else None)

    def step(self, plan: StepPlan, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Leader: send a ready plan to the TP peers and run it; the logits of its sampled rows.
        ``sampled`` (overlapped steps): the tokens the plan's placeholders name, still on the
        device; the peers get them from a broadcast on the TP group, in stream order."""
        self._share(plan, sampled)
        logits = self.run(plan, sampled)
        assert logits is not None
        return logits

    def step_with_prompt_rows(
        self, plan: StepPlan, sampled: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Leader: ``step`` of a plan with ``prompt_rows`` (eagerly, as no graph holds one): the
        logits of its sampled rows and the hidden states of its prompt rows, whose logits the
        caller takes a slice at a time (``logits``): all at once they take ``[rows, vocab]``."""
        self._share(plan, sampled)
        input_ids, positions, context, sample_rows = self.inputs(plan, sampled)
        hidden = self.hidden_states(input_ids, positions, context)
        prompt_rows = device_tensor(plan.prompt_rows, torch.int64, self.device)
        return self.logits(hidden[sample_rows]), hidden[prompt_rows]

    def _share(self, plan: StepPlan, sampled: torch.Tensor | None) -> None:
        """Send the plan (and the sampled tokens its placeholders name) to the TP peers."""
        if self._sender is not None:
            self._sender.send(plan if sampled is None else dataclasses.replace(plan, num_pending=len(sampled)))
            if sampled is not None:
                self.tp.broadcast_from_leader(sampled)

    @property
    def step_channel(self) -> StepSender | None:
        """Leader of a group with peers: the channel its steps go to them on, for other commands
        that every rank must see in step order (KV transfers); None otherwise."""
        return self._sender

    def run_peer(self, kv_agent: PeerTransfers | None = None, progress: LoopProgress | None = None) -> None:
        """TP peer: follow the leader's steps and KV commands until it shuts the group down,
        telling ``progress`` when it works and when it waits for the leader."""
        receiver = StepReceiver(self.config.parallel.step_address or "", self.tp.rank)
        try:
            while True:
                if progress is not None:
                    progress.idle()
                if (message := receiver.receive()) is None:
                    break
                if progress is not None:
                    progress.tick()
                if isinstance(message, KVCommand):
                    if kv_agent is None:
                        raise RuntimeError("KV command for a group without a transfer backend")
                    kv_agent.execute(message)
                    continue
                for transfer_id in message.kv_ready:
                    assert kv_agent is not None
                    kv_agent.wait(transfer_id)
                sampled = None
                if message.num_pending:  # the leader's sampled tokens, for the placeholders
                    sampled = torch.empty(message.num_pending, dtype=torch.int64, device=self.device)
                    self.tp.broadcast_from_leader(sampled)
                self.run(message, sampled)
        finally:
            receiver.close()
            if kv_agent is not None:
                kv_agent.close()
            self.close()

    def close(self) -> None:
        """Release the TP peers (leader) and the CUDA graphs, before the process group goes."""
        if self._sender is not None:
            self._sender.shutdown()
            self._sender = None
        for graphs in (self.graph_runner, self.prefill_graph_runner):
            if graphs is not None:
                graphs.release()
        self.graph_runner = self.prefill_graph_runner = None
