"""Attention metadata for the current forward, kept out of the model's argument list.

The model runner sets the context before a forward and resets it after; attention layers
read it. During CUDA-graph capture the tensors here are the graph's static buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionContext:
    """What the attention layers need about the batch being run.

    ``slot_mapping[i]`` is where token ``i``'s K/V go in the paged cache. ``block_tables[b]``
    maps sequence ``b``'s logical blocks to physical ones and ``context_lens[b]`` counts its
    tokens after this step (cached prefix + tokens of this step). Decode steps have exactly one
    query per sequence; other steps are described by ``cu_seqlens_q``.
    """

    is_decode: bool
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32
    max_context_len: int  # host int: bounds context_lens, sizes the decode split-KV grid
    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] int32, non-decode steps only


_context: AttentionContext | None = None


def set_context(context: AttentionContext | None) -> None:
    global _context
    _context = context


def get_context() -> AttentionContext:
    if _context is None:
        raise RuntimeError("no attention context is set: the model must be run by the model runner")
    return _context
