"""Layers that own their tensor-parallel sharding.

Every parameter carries a ``weight_loader(param, source, shard_id=None)`` that copies this
rank's piece out of ``source``, a full checkpoint tensor or a lazy safetensors slice (anything
indexable by slices), so a rank reads only the bytes it keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pdserve.engine import ops
from pdserve.engine.config import RopeConfig
from pdserve.engine.parallel import TensorParallel


def default_weight_loader(param: nn.Parameter, source: Any, shard_id: str | None = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} takes no shard id, got {shard_id!r}")
    param.data.copy_(_checked(source[:], tuple(param.shape)))


def _checked(piece: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``piece`` of a checkpoint tensor, if it has the shape this rank keeps (else the checkpoint
    is not this config's model)."""
    if tuple(piece.shape) != shape:
        raise ValueError(f"checkpoint tensor piece {tuple(piece.shape)} does not fit parameter piece {shape}")
    return piece


def _parameter(
    shape: Sequence[int], dtype: torch.dtype, loader: Any, shard_shapes: dict[str | None, tuple[int, ...]] | None = None
) -> nn.Parameter:
    """A parameter with its loader and ``shard_shapes``: for each checkpoint tensor it is
    assembled from, by shard id (None: the only one), the shape of this rank's piece of it, on
    one rank the tensor's whole shape."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.shard_shapes = shard_shapes or {None: tuple(shape)}  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` keeping only some output rows of one or more checkpoint weights.

    ``pieces`` lists ``(shard_id, start, end)``: rows ``[start, end)`` of the checkpoint tensor
    named by ``shard_id``, concatenated in that order (q/k/v into one QKV projection, gate/up
    into one). No communication: each rank's output is its own slice.
    """

    def __init__(
        self, in_features: int, pieces: Sequence[tuple[str, int, int]], bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.offsets: dict[str, tuple[int, int, int]] = {}
        offset = 0
        for shard_id, start, end in pieces:
            self.offsets[shard_id] = (start, end, offset)
            offset += end - start
        self.out_features = offset
        rows = {shard_id: end - start for shard_id, start, end in pieces}
        self.weight = _parameter(
            (offset, in_features), dtype, self._load, {s: (n, in_features) for s, n in rows.items()}
        )
        self.bias = _parameter((offset,), dtype, self._load, {s: (n,) for s, n in rows.items()}) if bias else None

    def _load(self, param: nn.Parameter, source: Any, shard_id: str | None = None) -> None:
        if shard_id not in self.offsets:
            raise ValueError(f"unknown shard id {shard_id!r}; expected one of {list(self.offsets)}")
        start, end, offset = self.offsets[shard_id]
        piece = _checked(source[start:end], param.shard_shapes[shard_id])  # type: ignore[attr-defined]
        param.data[offset : offset + end - start].copy_(piece)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r W_r^T) + b``: this rank keeps input columns ``[in_start, in_end)``.

    Its output feeds a residual add (o_proj, down), so :meth:`forward` returns it as partial
    sums for :class:`RMSNorm` to add (see there).
    """

    def __init__(
        self, in_start: int, in_end: int, out_features: int, bias: bool, dtype: torch.dtype, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.in_start, self.in_end = in_start, in_end
        self.tp = tp
        self.weight = _parameter((out_features, in_end - in_start), dtype, self._load_weight)
        # The bias is added once, after the reduction.
        self.bias = _parameter((out_features,), dtype, default_weight_loader) if bias else None

    def _load_weight(self, param: nn.Parameter, source: Any, shard_id: str | None = None) -> None:
        param.data.copy_(_checked(source[:, self.in_start : self.in_end], tuple(param.shape)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[splits, ..., out_features]`` partial sums of y (``ops.linear_partial_sums``): on one
        rank without a bias, the linear kernel's split-K partials, left for the norm's load to add
        (one launch fewer); otherwise a single split, y itself."""
        if self.tp.size == 1 and self.bias is None:
            return ops.linear_partial_sums(x, self.weight)
        y = self.tp.all_reduce(ops.linear(x, self.weight))
        return (y + self.bias if self.bias is not None else y).unsqueeze(0)


class Embedding(nn.Module):
    """Token embedding, replicated on every rank (small next to the layers for these models)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _parameter((vocab_size, hidden_size), dtype, default_weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return ops.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _parameter((hidden_size,), dtype, default_weight_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(norm(x + residual), x + residual)``; with no residual, ``(norm(x), x)``.

        With a residual, x is the layer output added to it, as :class:`RowParallelLinear`'s
        partial sums ``[splits, *residual.shape]`` (summed in order and rounded first).
        """
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Holds the ``[max_position, head_dim]`` cos|sin table the fused RoPE kernel reads."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.rope = head_dim, max_position, rope
        self.register_buffer("cos_sin_cache", torch.empty(max_position, head_dim), persistent=False)

    def reset_cache(self) -> None:
        """(Re)compute the table in place on the buffer's device; called after ``to_empty``."""
        inv_freq = self.rope.inv_freq(self.head_dim)
        positions = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.cos_sin_cache = table.to(self.cos_sin_cache.device)
