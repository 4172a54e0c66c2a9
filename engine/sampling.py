"""What a request may ask for: its sampling parameters, and the checks that refuse a request.

Plain Python, no torch: the router runs the same checks before dispatch as the engine on arrival.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


class RequestError(ValueError):
    """A request the engine refuses; ``field`` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# Below this temperature sampling is greedy, which is what such a temperature asks for: the
# sampler's float32 logits divided by it would overflow (or the temperature rounds to 0).
GREEDY_BELOW = 1e-5
# The most alternatives a request may ask to see beside each token (vLLM's default cap).
MAX_LOGPROBS = 20
# OpenAI's bound on a logit bias: -100 bans a token, 100 all but forces it.
MAX_LOGIT_BIAS = 100.0
# Past these a repeated token's logit is all but zeroed, or multiplied past float32's range (a
# penalty that underflows to 0 divided by it, and the sampler drew from NaNs): bounds that keep
# the arithmetic finite rather than limits any use reaches.
MAX_REPETITION_PENALTY = 1e4
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature < GREEDY_BELOW`` (0 among them) is greedy; ``top_k == -1``
    disables top-k; ``min_p`` drops tokens less likely than that share of the likeliest one.

    The penalties are vLLM's (and OpenAI's): ``repetition_penalty`` divides the positive logits
    (multiplies the negative ones) of every token in the prompt or the output so far; then
    ``frequency_penalty`` times a token's count in the output, and ``presence_penalty`` once if
    it occurs there, are subtracted. They apply to greedy requests too.

    ``logit_bias``: (token id, bias) pairs added to those tokens' logits before anything else,
    greedy requests included (OpenAI's).

    ``min_tokens``: the end-of-sequence tokens (with ``ignore_eos`` too) and ``stop_token_ids``
    cannot be sampled before the output holds this many tokens (vLLM's).

    ``logprobs`` (not None) asks for each generated token's log-probability and those of the
    ``logprobs`` likeliest tokens, under the model's own distribution (before penalties,
    temperature and masks, as vLLM reports them).

    ``prompt_logprobs`` (not None) asks the same of every prompt token after the first, given
    those before it (vLLM's): the prompt is then computed whole, none of it from the prefix
    cache, whose blocks hold no logits."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

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
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise RequestError("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise RequestError("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise RequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise RequestError(name, f"must be in [-2, 2], got {value!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise RequestError(name, f"must be null or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if not all(isinstance(entry, (tuple, list)) and len(entry) == 2 for entry in self.logit_bias):
            raise RequestError("logit_bias", "must be (token id, bias) pairs")
        object.__setattr__(self, "logit_bias", tuple(tuple(entry) for entry in self.logit_bias))
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise RequestError("logit_bias", f"keys must be token ids, got {token!r}")
            if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise RequestError("logit_bias", f"token {token}: the bias must be in [-100, 100], got {bias!r}")
        if not _is_real(self.repetition_penalty) or not (
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise RequestError(
                "repetition_penalty",
                f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether the tokens seen so far change this request's logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def validate_request(
    token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    tokens_field: str = "prompt_token_ids",
    generated: int = 0,
) -> None:
    """Raise ``RequestError`` naming the field if a model of this vocabulary and length cannot
    serve the request. The router calls it before dispatch, the engine again on arrival.
    ``generated``: a moved request's output so far, the last of ``token_ids``."""
    if len(token_ids) == 0:
        raise RequestError("prompt", "is empty")
    if not 0 <= generated < min(len(token_ids), params.max_tokens):
        raise RequestError("generated", f"must leave a prompt and tokens to generate, got {generated}")
    num_prompt_tokens = len(token_ids) - generated
    total = num_prompt_tokens + params.max_tokens
    if num_prompt_tokens >= max_model_len:  # first: refused without a scan of its ids
        raise RequestError(
            "prompt",
            f"has {num_prompt_tokens} tokens: the maximum model length {max_model_len} leaves no room to answer",
        )
    if total > max_model_len:
        raise RequestError(
            "max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the maximum model length {max_model_len}",
        )
    # Every request pays this scan on each process it enters: first a check by C builtins, then,
    # only where that fails, the loop that names the first bad id.
    if not (set(map(type, token_ids)) <= {int} and min(token_ids) >= 0 and max(token_ids) < vocab_size):
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise RequestError(tokens_field, f"token id {t!r} is outside the vocabulary [0, {vocab_size})")
    for t in params.stop_token_ids:
        if t >= vocab_size:
            raise RequestError("stop_token_ids", f"token id {t} is outside the vocabulary [0, {vocab_size})")
    for t, _ in params.logit_bias:
        if t >= vocab_size:
            raise RequestError("logit_bias", f"token id {t} is outside the vocabulary [0, {vocab_size})")
