"""CUDA graphs for the model's steps: decode steps by batch size, prefill (and mixed) steps by
token count and sequence count.

A step replays the graph of the smallest bucket that holds it; the graph reads static buffers
updated in place before each replay. Padding never touches a real sequence's cache: decode
padding rows are token 0 at position 0 writing the dummy slot and reading one token of the dummy
block; prefill padding tokens form one extra sequence over the dummy block (so every computed row
is finite), followed by empty sequences. A prefill bucket of ``T`` tokens has a graph for
``min(T, max_seqs)`` sequences, as a step has no more sequences than tokens, and one for
``FEW_SEQS`` where that is fewer: every empty sequence costs the attention kernel a spare tile
per KV head and the LM head a row, a real share of a short step over few prompts. Larger steps
run eagerly. Each runner's graphs share one memory pool (captured largest first), and on the
leader they all write fp32 logits into one buffer the model runner owns, consumed before the
next replay.

Invariant: graphs must be released (``release``) before the process group is destroyed; a
captured NCCL all-reduce that outlives its communicator hangs the process at exit.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Generic, NamedTuple, TypeVar

import numpy as np
import torch

from pdserve.engine.context import AttentionContext, set_context
from pdserve.engine.model import CausalLM
from pdserve.engine.step_plan import StepPlan, host_tensor, write_pending_tokens

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """Prefill graph sizes: 64, 128, 256, then multiples of 256, the last one covering
    ``max_tokens``. Past a few hundred tokens a step's matmuls are compute-bound, so padding costs
    its share of the step: at most a third from 512 tokens on."""
    buckets = [64]
    while buckets[-1] < max_tokens:
        buckets.append(buckets[-1] * 2 if buckets[-1] < 256 else buckets[-1] + 256)
    return buckets


FEW_SEQS = 4  # sequences of a token bucket's second, few-sequence prefill graph


class PrefillBucket(NamedTuple):
    """A prefill graph's shape: ``tokens`` (padded to) in up to ``seqs`` sequences."""

    tokens: int
    seqs: int


def prefill_buckets(max_tokens: int, max_seqs: int) -> list[PrefillBucket]:
    """The prefill graphs' shapes, ascending: per :func:`token_buckets` size ``T``, one for
    ``min(T, max_seqs)`` sequences and, where that is more, one for ``FEW_SEQS``."""
    buckets = []
    for tokens in token_buckets(max_tokens):
        seqs = min(tokens, max_seqs)
        if seqs > FEW_SEQS:
            buckets.append(PrefillBucket(tokens, FEW_SEQS))
        buckets.append(PrefillBucket(tokens, seqs))
    return buckets


def pad_prefill_plan(plan: StepPlan, bucket: int, max_seqs: int, dummy_block: int, block_size: int) -> StepPlan:
    """The step a prefill graph of ``bucket`` tokens and ``max_seqs`` sequences runs for ``plan``.

    Tokens ``T..bucket-1`` are one extra sequence: token 0 at position 0, K/V written to the
    dummy slot, a context of ``bucket - T`` tokens all in the dummy block (its attention reads
    only that block). ``max_seqs - B`` empty sequences follow. Block tables are as wide as the
    plan's or the padding sequence's needs; ``max_seqs`` rows are sampled (the plan's, then row
    0 again).
    """
    num_tokens, num_seqs = len(plan.input_ids), len(plan.context_lens)
    if plan.is_decode or num_tokens > bucket or num_seqs > max_seqs:
        raise ValueError(
            f"a prefill graph of {bucket} tokens and {max_seqs} sequences cannot run a "
            f"{'decode' if plan.is_decode else 'prefill'} step of {num_tokens} tokens in {num_seqs}"
        )
    pad = bucket - num_tokens
    plan_width = plan.block_tables.shape[1]
    block_tables = np.full((max_seqs + 1, max(plan_width, -(-pad // block_size), 1)), dummy_block, dtype=np.int32)
    block_tables[:num_seqs, :plan_width] = plan.block_tables
    return StepPlan(
        input_ids=plan.input_ids + [0] * pad,
        positions=plan.positions + [0] * pad,
        slot_mapping=plan.slot_mapping + [dummy_block * block_size] * pad,
        block_tables=block_tables,
        context_lens=plan.context_lens + [pad] + [0] * (max_seqs - num_seqs),
        cu_seqlens_q=plan.cu_seqlens_q + [bucket] * (max_seqs + 1 - num_seqs),
        sample_rows=plan.sample_rows + [0] * (max_seqs - len(plan.sample_rows)),
        is_decode=False,
    )


def _packed_fields(padded: StepPlan) -> tuple[list[int], ...]:
    """A padded prefill plan's fields in :class:`PrefillInputs` order."""
    return (
        padded.input_ids,
        padded.positions,
        padded.slot_mapping,
        padded.sample_rows,
        padded.context_lens,
        padded.cu_seqlens_q,
    )


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, then multiples of 8 (as vLLM does), the last one covering ``max_batch_size``."""
    buckets = [b for b in (1, 2, 4) if b < max_batch_size]
    if max_batch_size <= 4:
        return buckets + [max_batch_size]
    return buckets + list(range(8, -(-max_batch_size // 8) * 8 + 1, 8))


def _load(buffer: torch.Tensor, values: list | np.ndarray) -> None:
    """Copy host values into a static buffer straight from pinned memory (the caching host
    allocator keeps the pinned block until the copy has run)."""
    buffer.copy_(host_tensor(values, buffer.dtype, pin=True), non_blocking=True)


BucketT = TypeVar("BucketT", bound=Hashable)


class _StepGraphs(Generic[BucketT]):
    """One graph per bucket for one kind of step, all in one memory pool; subclasses own the
    static buffers and say what a bucket's step is (``_context``, ``_run_model``). Buckets are
    listed in ascending size."""

    kind: str  # "decode" | "prefill", for the log

    def __init__(
        self,
        model: CausalLM,
        buckets: list[BucketT],
        max_model_len: int,
        block_size: int,
        dummy_block: int,
        logits: torch.Tensor | None,
    ) -> None:
        """The subclass allocates its static inputs, then captures. ``logits``: the leader's fp32
        ``[rows, vocab]`` buffer the graphs write into (see the module docstring); None on a TP
        peer, whose graphs return hidden states."""
        self.model = model
        self.buckets = buckets
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.dummy_block = dummy_block
        self.logits = logits
        self.device = next(model.parameters()).device
        self.outputs: dict[BucketT, torch.Tensor] = {}
        self.graphs: dict[BucketT, torch.cuda.CUDAGraph] = {}

    def _context(self, bucket: BucketT) -> AttentionContext:
        raise NotImplementedError

    def _run_model(self, bucket: BucketT) -> torch.Tensor:
        raise NotImplementedError

    def _prepare_capture(self, bucket: BucketT) -> None:
        """Leave a valid step of ``bucket`` in the static buffers for the warm-up and capture."""

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for bucket in reversed(self.buckets):  # largest first: it sizes the shared pool
            self._prepare_capture(bucket)
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
        logger.info("captured %s graphs for %s", self.kind, self.buckets)

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class DecodeInputs(NamedTuple):
    """The per-sequence inputs of a decode graph of ``bucket`` rows: views of one int64 buffer
    (:func:`decode_inputs`)."""

    input_ids: torch.Tensor  # [bucket] int64
    positions: torch.Tensor  # [bucket] int64
    slot_mapping: torch.Tensor  # [bucket] int64
    context_lens: torch.Tensor  # [bucket] int32


def _segment(elements: int) -> int:
    """int64 elements rounded up to 16 bytes: a bucket's rows of one packed input, or a region of
    the buffer, so that every view starts 16-byte aligned (as the kernels are compiled for
    freshly allocated tensors)."""
    return 2 * -(-elements // 2)


def packed_len(bucket: int) -> int:
    """int64 elements of a bucket's packed inputs: ids, positions and slots, then the context
    lengths as int32 pairs."""
    return 3 * _segment(bucket) + _segment(bucket) // 2


class DecodeBufferLayout(NamedTuple):
    """Where a decode runner's static inputs lie in its one int64 buffer (offsets in int64
    elements, each 16-byte aligned): the packed inputs every bucket but 1 reads (at 0), bucket
    1's own packed inputs, then the block tables, ``[max_bucket, max_blocks]`` int32. Bucket 1's
    inputs sit right before the first block-table row, so a batch-1 step goes up in one copy."""

    one_row_at: int
    tables_at: int
    size: int

    def inputs_at(self, bucket: int) -> int:
        """Where bucket ``bucket``'s packed inputs (:func:`decode_inputs`) start."""
        return self.one_row_at if bucket == 1 else 0


def decode_buffer_layout(max_bucket: int, max_blocks: int) -> DecodeBufferLayout:
    """The layout for buckets of up to ``max_bucket`` rows and tables ``max_blocks`` wide."""
    one_row_at = _segment(packed_len(max_bucket))
    tables_at = one_row_at + _segment(packed_len(1))
    return DecodeBufferLayout(one_row_at, tables_at, tables_at + -(-max_bucket * max_blocks // 2))


def decode_inputs(packed: torch.Tensor | np.ndarray, bucket: int) -> DecodeInputs:
    """A bucket's inputs as views of ``packed`` (a device tensor or a host array, int64, at least
    :func:`packed_len` long), so that one copy fills them all."""
    b, seg = bucket, _segment(bucket)
    lens = packed[3 * seg : packed_len(b)]
    lens = lens.view(torch.int32) if isinstance(lens, torch.Tensor) else lens.view(np.int32)
    return DecodeInputs(packed[:b], packed[seg : seg + b], packed[2 * seg : 2 * seg + b], lens[:b])


def pack_decode_step(
    plan: StepPlan, bucket: int, layout: DecodeBufferLayout, dummy_block: int, block_size: int
) -> tuple[int, np.ndarray, np.ndarray | None]:
    """A decode ``plan`` padded to ``bucket`` rows, as host arrays for a runner's buffer:
    ``(start, host, tables)``. ``host`` (int64) goes to the buffer at int64 offset ``start``;
    ``tables``, the block tables' rows in the plan's columns, to the block tables' top-left
    corner, or None where ``host`` holds them (bucket 1, :func:`decode_buffer_layout`; an odd
    width gets one more, dummy, column). Padding rows are token 0 at position 0, written to the
    dummy slot, with a context of one token in the dummy block."""
    batch = len(plan.input_ids)
    # The plan's columns only: copying whole rows (max_model_len wide) measured slower.
    tables = np.full((bucket, plan.block_tables.shape[1]), dummy_block, dtype=np.int32)
    tables[:batch] = plan.block_tables
    start = layout.inputs_at(bucket)
    if bucket == 1:
        table_at = layout.tables_at - start
        host = np.zeros(table_at + -(-tables.shape[1] // 2), dtype=np.int64)
        row = host[table_at:].view(np.int32)
        row[:] = dummy_block
        row[: tables.shape[1]] = tables[0]
    else:
        host = np.zeros(packed_len(bucket), dtype=np.int64)
    rows = decode_inputs(host, bucket)
    for values, padding, dest in (
        (plan.input_ids, 0, rows.input_ids),
        (plan.positions, 0, rows.positions),
        (plan.slot_mapping, dummy_block * block_size, rows.slot_mapping),
        (plan.context_lens, 1, rows.context_lens),
    ):
        dest[:batch] = values
        dest[batch:] = padding
    return start, host, None if bucket == 1 else tables


class PrefillInputs(NamedTuple):
    """The per-step inputs of a prefill graph of :class:`PrefillBucket` ``(T, S)``: views of one
    int64 buffer (:func:`prefill_inputs`); the padding sequence is the last of ``S + 1``."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    sample_rows: torch.Tensor  # [S] int64
    context_lens: torch.Tensor  # [S + 1] int32
    cu_seqlens_q: torch.Tensor  # [S + 2] int32


def _int32_segment(elements: int) -> int:
    """int64 elements that hold ``elements`` int32 values, 16-byte aligned."""
    return _segment(-(-elements // 2))


def prefill_packed_len(bucket: PrefillBucket) -> int:
    """int64 elements of a prefill bucket's packed inputs (:class:`PrefillInputs`, in order)."""
    t, s = bucket
    return 3 * _segment(t) + _segment(s) + _int32_segment(s + 1) + _int32_segment(s + 2)


def prefill_inputs(packed: torch.Tensor | np.ndarray, bucket: PrefillBucket) -> PrefillInputs:
    """A prefill bucket's inputs as views of ``packed`` (a device tensor or a host array, int64,
    at least :func:`prefill_packed_len` long), so that one copy fills them all."""
    t, s = bucket
    views: list[torch.Tensor | np.ndarray] = []
    at = 0
    for elements, int32 in ((t, False), (t, False), (t, False), (s, False), (s + 1, True), (s + 2, True)):
        size = _int32_segment(elements) if int32 else _segment(elements)
        region = packed[at : at + size]
        if int32:
            region = region.view(torch.int32) if isinstance(region, torch.Tensor) else region.view(np.int32)
        views.append(region[:elements])
        at += size
    return PrefillInputs(*views)


class CudaGraphRunner(_StepGraphs[int]):
    """Decode steps of up to ``max_batch_size`` sequences, one graph per :func:`batch_buckets`
    size (see the module docstring).

    A step's inputs go up in two copies ahead of its replay, rather than one per tensor plus
    padding fills: the bucket's packed ids, positions, slots and context lengths
    (:func:`decode_inputs`), and the block tables' rows in the plan's columns. Bucket 1's packed
    inputs sit right before the first block-table row, so a batch-1 step takes one copy.
    """

    kind = "decode"

    def __init__(
        self,
        model: CausalLM,
        max_batch_size: int,
        max_model_len: int,
        block_size: int,
        dummy_block: int,
        logits: torch.Tensor | None,
    ) -> None:
        super().__init__(model, batch_buckets(max_batch_size), max_model_len, block_size, dummy_block, logits)
        self.max_batch_size = n = self.buckets[-1]
        if logits is not None and logits.shape[0] < n:
            raise ValueError(f"the logits buffer has {logits.shape[0]} rows, the largest decode bucket {n}")
        max_blocks = -(-max_model_len // block_size)
        self.layout = layout = decode_buffer_layout(n, max_blocks)
        self.buffer = torch.zeros(layout.size, dtype=torch.int64, device=self.device)
        self.inputs = {b: decode_inputs(self.buffer[layout.inputs_at(b) :], b) for b in self.buckets}
        self.block_tables = self.buffer[layout.tables_at :].view(torch.int32)[: n * max_blocks].view(n, max_blocks)
        self.block_tables.fill_(dummy_block)
        self._capture_all()

    def _prepare_capture(self, bucket: int) -> None:
        """Padding rows only (context length 1 in the dummy block) for the warm-up and capture."""
        self._load_plan(StepPlan([], [], [], np.zeros((0, 1), dtype=np.int32), [], [0], [], True), bucket)

    def _context(self, bucket: int) -> AttentionContext:
        inputs = self.inputs[bucket]
        return AttentionContext(
            is_decode=True,
            slot_mapping=inputs.slot_mapping,
            block_tables=self.block_tables[:bucket],
            context_lens=inputs.context_lens,
            max_context_len=self.max_model_len,  # static: sizes the split-KV grid for any context
        )

    def _run_model(self, bucket: int) -> torch.Tensor:
        inputs = self.inputs[bucket]
        hidden = self.model(inputs.input_ids, inputs.positions)
        return hidden if self.logits is None else self.model.compute_logits(hidden, self.logits[:bucket])

    def can_run(self, plan: StepPlan) -> bool:
        return plan.is_decode and len(plan.input_ids) <= self.max_batch_size

    def _load_plan(self, plan: StepPlan, bucket: int) -> None:
        """Copy ``plan`` padded to ``bucket`` rows (:func:`pack_decode_step`) into the bucket's
        static inputs, straight from pinned memory."""
        start, host, tables = pack_decode_step(plan, bucket, self.layout, self.dummy_block, self.block_size)
        _load(self.buffer[start : start + len(host)], host)
        if tables is not None:
            _load(self.block_tables[:bucket, : tables.shape[1]], tables)

    def run(self, plan: StepPlan, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the bucket's graph for a decode plan; logits (leader) or hidden states ``[B, ...]``.
        ``sampled``: the tokens the plan's placeholders name (``write_pending_tokens``)."""
        batch = len(plan.input_ids)
        bucket = next(b for b in self.buckets if b >= batch)
        self._load_plan(plan, bucket)
        write_pending_tokens(self.inputs[bucket].input_ids[:batch], plan.input_ids, sampled)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:batch]


class PrefillGraphRunner(_StepGraphs[PrefillBucket]):
    """Prefill and mixed steps of up to ``max_tokens`` tokens in up to ``max_seqs`` sequences,
    one graph per :func:`prefill_buckets` shape (see the module docstring)."""

    kind = "prefill"

    def __init__(
        self,
        model: CausalLM,
        max_tokens: int,
        max_seqs: int,
        max_model_len: int,
        block_size: int,
        dummy_block: int,
        logits: torch.Tensor | None,
    ) -> None:
        buckets = prefill_buckets(max_tokens, max_seqs)
        super().__init__(model, buckets, max_model_len, block_size, dummy_block, logits)
        self.max_tokens = buckets[-1].tokens
        self.max_seqs = max_seqs
        if logits is not None and logits.shape[0] < max_seqs:
            raise ValueError(f"the logits buffer has {logits.shape[0]} rows, a prefill step samples up to {max_seqs}")
        # Every bucket's packed inputs start at 0: a step goes up in two copies, these and the
        # block tables' rows in the plan's columns.
        size = max(prefill_packed_len(b) for b in buckets)
        self.buffer = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.inputs = {b: prefill_inputs(self.buffer, b) for b in buckets}
        # Wide enough for a sequence of max_model_len and for the padding sequence of any bucket.
        table_width = -(-max(max_model_len, self.max_tokens) // block_size)
        s = max_seqs + 1  # + the padding sequence
        self.block_tables = torch.full((s, table_width), dummy_block, dtype=torch.int32, device=self.device)
        self._capture_all()

    def bucket_for(self, plan: StepPlan) -> PrefillBucket:
        """The smallest graph that holds ``plan`` (which :meth:`can_run`): the fewest tokens,
        then the fewest sequences and sampled rows."""
        num_tokens, num_seqs = len(plan.input_ids), max(len(plan.context_lens), len(plan.sample_rows))
        return next(b for b in self.buckets if b.tokens >= num_tokens and b.seqs >= num_seqs)

    def _context(self, bucket: PrefillBucket) -> AttentionContext:
        inputs = self.inputs[bucket]
        return AttentionContext(
            is_decode=False,
            slot_mapping=inputs.slot_mapping,
            block_tables=self.block_tables[: bucket.seqs + 1],  # + the padding sequence
            context_lens=inputs.context_lens,
            max_context_len=self.max_model_len,
            cu_seqlens_q=inputs.cu_seqlens_q,
        )

    def _run_model(self, bucket: PrefillBucket) -> torch.Tensor:
        inputs = self.inputs[bucket]
        hidden = self.model(inputs.input_ids, inputs.positions)
        if self.logits is None:
            return hidden
        return self.model.compute_logits(hidden[inputs.sample_rows], self.logits[: bucket.seqs])

    def _prepare_capture(self, bucket: PrefillBucket) -> None:
        empty = StepPlan([], [], [], np.zeros((0, 0), dtype=np.int32), [], [0], [], False)
        self._load_plan(empty, bucket)  # all padding

    def _load_plan(self, plan: StepPlan, bucket: PrefillBucket) -> None:
        """Copy ``plan`` padded to ``bucket`` into the static buffers in two copies straight
        from pinned memory: the packed inputs, then the block tables of the plan's and the
        padding sequence (the empty sequences' rows are never read)."""
        padded = pad_prefill_plan(plan, bucket.tokens, bucket.seqs, self.dummy_block, self.block_size)
        host = np.zeros(prefill_packed_len(bucket), dtype=np.int64)
        for dest, values in zip(prefill_inputs(host, bucket), _packed_fields(padded)):
            dest[:] = values
        _load(self.buffer[: len(host)], host)
        tables = padded.block_tables[: len(plan.context_lens) + 1]
        _load(self.block_tables[: len(tables), : tables.shape[1]], tables)

    def can_run(self, plan: StepPlan) -> bool:
        # Logits rows are captured for max_seqs sampled rows: a step sampling every token (a
        # teacher-forced prompt) runs eagerly.
        return (
            not plan.is_decode
            and len(plan.input_ids) <= self.max_tokens
            and len(plan.context_lens) <= self.max_seqs
            and len(plan.sample_rows) <= self.max_seqs
            and not plan.prompt_rows
        )

    def run(self, plan: StepPlan, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the bucket's graph; logits of the plan's sampled rows (leader) or the hidden
        states of its ``T`` tokens. ``sampled`` as for decode graphs."""
        num_tokens = len(plan.input_ids)
        bucket = self.bucket_for(plan)
        self._load_plan(plan, bucket)
        write_pending_tokens(self.inputs[bucket].input_ids[:num_tokens], plan.input_ids, sampled)
        self.graphs[bucket].replay()
        output = self.outputs[bucket]
        return output[:num_tokens] if self.logits is None else output[: len(plan.sample_rows)]
