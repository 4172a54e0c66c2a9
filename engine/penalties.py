"""Repetition, frequency and presence penalties: logits changed by the tokens a sequence holds.

The rules are vLLM's. Only the rows that ask for a penalty pay for it: their token ids go up once
per step as one flat array, and the counts are built on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.sampling import SamplingParams
from pdserve.engine.step_plan import device_tensor


@dataclass(frozen=True)
class History:
    """The tokens a sampled row's sequence holds: its prompt, then its output so far. Output ids
    below 0 are placeholders (``step_plan.pending_token``) for tokens still on the device."""

    token_ids: list[int]
    num_prompt_tokens: int


def penalize(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[History],
    sampled: torch.Tensor | None = None,
) -> torch.Tensor:
    """``logits`` ``[R, V]`` fp32, one row per entry of ``params`` and ``histories``, with the
    penalties applied (a new tensor). ``sampled``: the tokens the placeholders name."""
    rows = len(params)
    device = logits.device
    vocab = logits.shape[-1]
    out_rows: list[np.ndarray] = []
    out_ids: list[np.ndarray] = []
    seen_rows: list[np.ndarray] = []
    seen_ids: list[np.ndarray] = []
    for row, (p, history) in enumerate(zip(params, histories)):
        output = np.asarray(history.token_ids[history.num_prompt_tokens :], dtype=np.int64)
        out_rows.append(np.full(len(output), row, dtype=np.int64))
        out_ids.append(output)
        if p.repetition_penalty != 1:  # only it looks at the prompt
            prompt = np.asarray(history.token_ids[: history.num_prompt_tokens], dtype=np.int64)
            seen_rows.append(np.full(len(prompt), row, dtype=np.int64))
            seen_ids.append(prompt)
    flat = np.concatenate(out_ids)
    if sampled is None and flat.size and flat.min() < 0:
        raise RuntimeError("a history holds placeholders but no sampled tokens were given")
    ids = _resolve(device_tensor(flat, torch.int64, device), sampled)
    counts = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
    counts.index_put_(
        (device_tensor(np.concatenate(out_rows), torch.int64, device), ids),
        torch.ones_like(ids, dtype=torch.float32),
        accumulate=True,
    )
    occurs = counts > 0
    seen = occurs.clone()
    if seen_ids:
        prompt_rows = device_tensor(np.concatenate(seen_rows), torch.int64, device)
        prompt_ids = device_tensor(np.concatenate(seen_ids), torch.int64, device)
        # A tensor of Trues, not ``= True``: the Python scalar would go up from pageable memory,
        # which waits for the whole stream.
        seen.index_put_((prompt_rows, prompt_ids), torch.ones_like(prompt_ids, dtype=torch.bool))
    repetition = device_tensor([p.repetition_penalty for p in params], torch.float32, device)[:, None]
    frequency = device_tensor([p.frequency_penalty for p in params], torch.float32, device)[:, None]
    presence = device_tensor([p.presence_penalty for p in params], torch.float32, device)[:, None]
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, repeated, logits)
    return logits - frequency * counts - presence * occurs


def _resolve(ids: torch.Tensor, sampled: torch.Tensor | None) -> torch.Tensor:
    """``ids`` with each placeholder replaced by the sampled token it names, on the device."""
    if sampled is None:
        return ids
    return torch.where(ids < 0, sampled[(-1 - ids).clamp(min=0)], ids)
