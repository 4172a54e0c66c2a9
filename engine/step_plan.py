"""What one step runs: the host-side plan of a forward, and its tensors on the device.

Only the leader (TP rank 0) schedules. It turns a scheduled batch into a ``StepPlan`` (token
ids, positions, slots, block tables, ...), which every rank of its group turns into the same
tensors (its peers get the plan over ``engine.step_channel``). Sampled tokens not yet read back
from the device stand in the plan as placeholders (``pending_token``).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceType
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence


@dataclass(eq=False)  # block_tables is an array: compare plans field by field
class StepPlan:
    """Host-side description of one forward; every rank turns it into the same tensors."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32, zero past a sequence's blocks
    context_lens: list[int]
    cu_seqlens_q: list[int]
    sample_rows: list[int]
    is_decode: bool
    # Rows whose logits are wanted beside the sampled ones: prompt positions of requests that
    # asked for their prompt's log-probabilities (such a step runs eagerly).
    prompt_rows: list[int] = field(default_factory=list)
    # Decode role: transfers whose received KV this step reads; each rank waits for its part.
    kv_ready: list[str] = field(default_factory=list)
    # Overlapped steps of a TP group: how many tokens the step before sampled. The plan's
    # placeholders name them; the leader broadcasts them to its peers before the step.
    num_pending: int = 0


def build_plan(batch: ScheduledBatch, block_size: int) -> StepPlan:
    """The host-side inputs of ``batch``; a sequence is sampled when this step reaches its last token."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_seqlens = [0]
    context_lens: list[int] = []
    sample_rows: list[int] = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        if n == 1:  # a decode token: per-call costs of slices, ranges and numpy exceed the work
            input_ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(int(seq.block_table[start // block_size]) * block_size + start % block_size)
        else:
            # A prompt chunk never holds a token still on the device: only a sequence that ran the
            # last step has one, and it is scheduled as a decode (or preempted, and waits).
            assert seq.token_ids[end - 1] >= 0, f"{seq.request_id}: prefill of a pending token"
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(_slots(seq.block_table, start, end, block_size))
        cu_seqlens.append(cu_seqlens[-1] + n)
        context_lens.append(end)
        if end == seq.num_tokens:
            sample_rows.append(cu_seqlens[-1] - 1)
    return StepPlan(
        input_ids,
        positions,
        slots,
        padded_block_tables([seq.block_table for seq in batch.seqs]),
        context_lens,
        cu_seqlens,
        sample_rows,
        batch.is_decode,
    )


def prompt_logprob_positions(batch: ScheduledBatch, cu_seqlens_q: list[int]) -> list[tuple[int, Sequence, int]]:
    """``(row, sequence, position)`` of each prompt position in ``batch`` whose next prompt
    token's log-probability its request asked for (the prompt's last token predicts the output)."""
    wanted = []
    for seq, n, row in zip(batch.seqs, batch.num_new_tokens, cu_seqlens_q):
        if seq.wants_prompt_logprobs:
            start = seq.num_computed_tokens
            wanted += [(row + p - start, seq, p) for p in range(start, min(start + n, seq.num_prompt_tokens - 1))]
    return wanted


def padded_block_tables(tables: SequenceType[SequenceType[int] | np.ndarray]) -> np.ndarray:
    """A plan's ``[num_seqs, max_blocks]`` int32 block tables, zero past each row's blocks. One
    array, so that it becomes a tensor or a peer message as one buffer (docs/decisions.md, "Step
    inputs")."""
    padded = np.zeros((len(tables), max((len(t) for t in tables), default=0)), dtype=np.int32)
    for row, table in zip(padded, tables):
        row[: len(table)] = table
    return padded


def _slots(block_table: np.ndarray, start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions ``start .. end - 1`` under ``block_table``."""
    pos = np.arange(start, end)
    return (block_table[pos // block_size].astype(np.int64) * block_size + pos % block_size).tolist()


_NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}


def host_tensor(values: list | np.ndarray, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A plan's list of ints (or its block tables, or the sampler's float parameters) as a new
    CPU tensor, page-locked if ``pin`` (so that a non-blocking copy to the GPU is asynchronous).
    Through numpy, which converts Python ints faster than ``torch.tensor``: paid every decode step."""
    host = torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype]))
    return host.pin_memory() if pin else host


def device_tensor(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`host_tensor` on ``device``, copied from pinned memory on a GPU: asynchronous, where
    a copy from pageable memory would wait for every kernel queued ahead."""
    return host_tensor(values, dtype, pin=device.type == "cuda").to(device, non_blocking=True)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy in page-locked host memory, queued on the stream (complete once the
    stream passes it; record an event to wait for it). A CPU tensor is returned as it is."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def pending_token(row: int) -> int:
    """The placeholder id of a sampled token not yet read back from the device: row ``row`` of
    the sampled tokens of the step that produced it (the last one launched)."""
    return -1 - row


def write_pending_tokens(input_ids: torch.Tensor, plan_ids: list[int], sampled: torch.Tensor | None) -> None:
    """Replace, on the device, the placeholders among ``plan_ids`` (already copied to
    ``input_ids``) by the sampled tokens they name; asynchronous, in stream order after the
    step that sampled them. A steady decode batch (row i reads sampled row i) is one copy."""
    rows = [i for i, t in enumerate(plan_ids) if t < 0]
    if not rows:
        return
    if sampled is None:
        raise RuntimeError("a step plan reads sampled tokens that no launched step produced")
    sources = [-1 - plan_ids[i] for i in rows]
    if rows == sources == list(range(len(rows))):
        input_ids[: len(rows)].copy_(sampled[: len(rows)])
        return
    dst, src = (device_tensor(v, torch.int64, input_ids.device) for v in (rows, sources))
    input_ids.index_copy_(0, dst, sampled.index_select(0, src))
