"""Sampling parameters of a request and the batched sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pdserve.engine.step_plan import device_tensor


class RequestError(ValueError):
    """A request the engine refuses; ``field`` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy; ``top_k == -1`` disables top-k."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise RequestError("top_k", f"must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
        ):
            raise RequestError("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids", "must be non-negative integers")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k and outside its top-p nucleus.

    logits ``[B, V]`` fp32; top_k ``[B]`` int (``>= V`` disables); top_p ``[B]`` fp32 (1 disables).
    The nucleus keeps the smallest set of most likely tokens whose mass reaches ``top_p``
    (the token that crosses the threshold is kept); at least one token always survives.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    drop = ranks[None, :] >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = drop | (mass_before >= top_p[:, None])
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked)


@dataclass
class Sampler:
    """Samples one token per row. Rows with a seed draw from their own generator."""

    generators: dict[str, torch.Generator] = field(default_factory=dict)

    def generator_for(self, request_id: str, seed: int, device: torch.device) -> torch.Generator:
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            self.generators[request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
    ) -> torch.Tensor:
        """logits ``[B, V]`` fp32 -> one token id per row, ``[B]`` int64 on the logits' device.
        No host sync: the engine reads the tokens back when it needs them."""
        vocab = logits.shape[-1]
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            device = logits.device
            # From pinned memory (device_tensor): the engine queues a step before it reads the
            # last one back, and a copy from pageable memory would wait for it.
            rows = device_tensor(sampled_rows, torch.int64, device)
            sub = logits[rows]
            temps = device_tensor([params[i].temperature for i in sampled_rows], torch.float32, device)
            top_k = device_tensor(  # -1 (off) and anything past the vocabulary keep every token
                [min(params[i].top_k, vocab) if params[i].top_k > 0 else vocab for i in sampled_rows],
                torch.int64, device,
            )
            top_p = device_tensor([params[i].top_p for i in sampled_rows], torch.float32, device)
            probs = top_k_top_p_mask(sub / temps[:, None], top_k, top_p).softmax(dim=-1)
            # Exponential race (Gumbel-max in disguise): argmax(p / E) with E ~ Exp(1) samples
            # from p; each seeded row draws its noise from its own generator.
            noise = torch.empty_like(probs).exponential_()
            for j, i in enumerate(sampled_rows):
                seed = params[i].seed
                if seed is not None:
                    gen = self.generator_for(request_ids[i], seed, logits.device)
                    noise[j] = torch.empty(vocab, device=logits.device).exponential_(generator=gen)
            tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens
