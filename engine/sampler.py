"""The batched sampler: one token per row of logits, on the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pdserve.engine.penalties import History, penalize
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.step_plan import device_tensor, host_copy

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k and outside its top-p nucleus.

    logits ``[B, V]`` fp32; top_k ``[B]`` int (``>= V`` disables); top_p ``[B]`` fp32 (1 disables).
    Top-k keeps every token as likely as the k-th (ties included, as vLLM's). The nucleus keeps
    the smallest set of most likely tokens whose mass reaches ``top_p`` (the token that crosses
    the threshold is kept); at least one token always survives.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(-1, (top_k.clamp(1, logits.shape[-1]) - 1)[:, None])
    drop = sorted_logits < kth
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # A token goes when it and every less likely one hold at most 1 - top_p, summed from the
    # least likely up, as vLLM does: a running sum from the top reaches 1.0 in float32 before
    # the end of a large vocabulary, and top_p 1 would cut the tail.
    tail_mass = probs.flip(-1).cumsum(dim=-1).flip(-1)
    drop = drop | (tail_mass <= 1 - top_p[:, None])
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked)


def add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits`` ``[B, V]`` with each row's ``logit_bias`` added (a new tensor)."""
    rows = [row for row, p in enumerate(params) for _ in p.logit_bias]
    ids = [token for p in params for token, _ in p.logit_bias]
    return _add_at(logits, rows, ids, [bias for p in params for _, bias in p.logit_bias])


def ban_tokens(logits: torch.Tensor, banned: list[tuple[int, ...]]) -> torch.Tensor:
    """``logits`` ``[B, V]`` with the ids ``banned[row]`` of each row set to -inf (a new tensor)."""
    rows = [row for row, ids in enumerate(banned) for _ in ids]
    ids = [token for row_ids in banned for token in row_ids]
    return _add_at(logits, rows, ids, [float("-inf")] * len(ids))


def _add_at(logits: torch.Tensor, rows: list[int], ids: list[int], values: list[float]) -> torch.Tensor:
    """``logits`` with ``values[i]`` added at ``(rows[i], ids[i])``, repeats summed (a new tensor).
    The indices go up from pinned memory: no wait for the steps queued ahead."""
    device = logits.device
    index = (device_tensor(rows, torch.int64, device), device_tensor(ids, torch.int64, device))
    return logits.index_put(index, device_tensor(values, torch.float32, device), accumulate=True)


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit whose probability is below ``min_p`` times its row's largest.

    logits ``[B, V]`` fp32 (after the temperature); min_p ``[B]`` fp32 in [0, 1] (0 disables).
    The likeliest token always survives.
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


class TokenLogprobs(NamedTuple):
    """A sampled token's log-probability, and the likeliest tokens' ids and theirs, best first."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SampledLogprobs:
    """The log-probabilities of one step's sampled tokens, for the rows that asked: ``chosen``
    ``[R]`` the sampled tokens', ``top_ids``/``top_logprobs`` ``[R, K]`` the K likeliest."""

    rows: list[int]
    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> SampledLogprobs | None:
        """Those of the rows whose ``logprobs`` is set, under the raw ``logits``; None if none is."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return None
        index = device_tensor(rows, torch.int64, logits.device)
        logprobs = logits[index].log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens[index, None]).squeeze(1)
        top = logprobs.topk(max(params[i].logprobs or 0 for i in rows), dim=-1)
        return cls(rows, chosen, top.indices, top.values)

    def to_host(self) -> SampledLogprobs:
        """Copies in pinned memory, queued behind the sampling (complete once the stream passes)."""
        return SampledLogprobs(self.rows, *(host_copy(t) for t in (self.chosen, self.top_ids, self.top_logprobs)))

    def per_row(self, params: list[SamplingParams]) -> dict[int, TokenLogprobs]:
        """Row -> its token's log-probabilities, each with as many alternatives as it asked."""
        chosen, top_ids, top_logprobs = self.chosen.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
        out = {}
        for j, row in enumerate(self.rows):
            k = params[row].logprobs or 0
            out[row] = TokenLogprobs(chosen[j], top_ids[j][:k], top_logprobs[j][:k])
        return out


@dataclass
class PromptLogprobs:
    """The log-probabilities of prompt tokens, one row per prompt position: ``chosen`` ``[P]``
    the next prompt token's, ``top_ids``/``top_logprobs`` ``[P, K]`` the K likeliest."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    # Rows at a time: a whole prompt chunk's logits would take [tokens, vocab] fp32.
    SLICE = 512

    @classmethod
    def of(
        cls, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], targets: list[int], k: int
    ) -> PromptLogprobs:
        """Those of ``targets[i]`` under the raw logits of ``hidden[i]`` (by ``head``, the LM
        head), with the ``k`` likeliest."""
        index = device_tensor(targets, torch.int64, hidden.device)
        parts = []
        for start in range(0, len(targets), cls.SLICE):
            logprobs = head(hidden[start : start + cls.SLICE]).log_softmax(dim=-1)
            top = logprobs.topk(k, dim=-1)
            chosen = logprobs.gather(1, index[start : start + cls.SLICE, None]).squeeze(1)
            parts.append((chosen, top.indices, top.values))
        return cls(*(torch.cat(column) for column in zip(*parts)))

    def to_host(self) -> PromptLogprobs:
        """Copies in pinned memory, queued behind the computation."""
        return PromptLogprobs(*(host_copy(t) for t in (self.chosen, self.top_ids, self.top_logprobs)))

    def rows(self, ks: list[int]) -> list[TokenLogprobs]:
        """Row i's, with ``ks[i]`` alternatives."""
        chosen, top_ids, top_logprobs = self.chosen.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
        return [TokenLogprobs(chosen[i], top_ids[i][:k], top_logprobs[i][:k]) for i, k in enumerate(ks)]


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's token at ``position`` (the number of tokens
    before it). A token's noise depends on the request's seed and its position only, so a request
    draws the same tokens whichever engine samples each of them: prefill's first token and
    decode's next ones, a request moved to another group, a preempted one recomputed."""
    return _splitmix64(_splitmix64(seed) ^ position)


@dataclass
class Sampler:
    """Samples one token per row. A seeded row draws its noise from a generator seeded by its
    seed and position (``position_seed``); the others from the device's default generator."""

    _generator: torch.Generator | None = field(default=None, repr=False)

    def _seeded(self, seed: int, position: int, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        self._generator.manual_seed(position_seed(seed, position))
        return self._generator

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        histories: list[History] | None = None,
        sampled: torch.Tensor | None = None,
        banned: list[tuple[int, ...]] | None = None,
    ) -> torch.Tensor:
        """logits ``[B, V]`` fp32 -> one token id per row, ``[B]`` int64 on the logits' device;
        ``positions[i]``: how many tokens row i's sequence holds before the one sampled;
        ``histories``: each row's tokens, needed where a row asks for a penalty; ``sampled``: the
        tokens their placeholders name; ``banned``: ids each row may not draw (a ``min_tokens``
        row's stop tokens). No host sync: the engine reads the tokens back when it needs them."""
        vocab = logits.shape[-1]
        device = logits.device
        if any(p.logit_bias for p in params):
            logits = add_logit_bias(logits, params)
        if banned is not None and any(banned):
            logits = ban_tokens(logits, banned)
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if penalized:
            if histories is None:
                raise ValueError("rows that ask for a penalty need their histories")
            rows = device_tensor(penalized, torch.int64, device)
            changed = penalize(logits[rows], [params[i] for i in penalized], [histories[i] for i in penalized], sampled)
            logits = logits.index_put((rows,), changed)
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            # From pinned memory (device_tensor): the engine queues a step before it reads the
            # last one back, and a copy from pageable memory would wait for it.
            rows = device_tensor(sampled_rows, torch.int64, device)
            sub = logits[rows]
            # Past float32's range a temperature would become inf (with numpy's overflow warning);
            # float32's largest already flattens every row to uniform, which is what it asks for.
            temps = device_tensor(
                [min(params[i].temperature, _FLOAT32_MAX) for i in sampled_rows], torch.float32, device
            )
            scaled = sub / temps[:, None]
            min_p = [params[i].min_p for i in sampled_rows]
            if any(min_p):
                scaled = min_p_mask(scaled, device_tensor(min_p, torch.float32, device))
            # -1 (off) and anything past the vocabulary keep every token.
            top_k = [min(params[i].top_k, vocab) if params[i].top_k > 0 else vocab for i in sampled_rows]
            top_p = [params[i].top_p for i in sampled_rows]
            if min(top_k) < vocab or min(top_p) < 1.0:  # else no row needs the sort of its vocabulary
                scaled = top_k_top_p_mask(
                    scaled, device_tensor(top_k, torch.int64, device), device_tensor(top_p, torch.float32, device)
                )
            probs = scaled.softmax(dim=-1)
            # Exponential race (Gumbel-max in disguise): argmax(p / E) with E ~ Exp(1) samples
            # from p; each seeded row draws its noise from its seed and position.
            noise = torch.empty_like(probs).exponential_()
            for j, i in enumerate(sampled_rows):
                seed = params[i].seed
                if seed is not None:
                    gen = self._seeded(seed, positions[i], device)
                    noise[j].exponential_(generator=gen)
            tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens
