"""Sampler masks on constructed distributions, and seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.penalties import History
from pdserve.engine.sampler import Sampler, min_p_mask, position_seed, top_k_top_p_mask
from pdserve.engine.sampling import RequestError, SamplingParams


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    masked = top_k_top_p_mask(logits, torch.tensor([2, 5]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(masked[0]).tolist() == [False, True, False, False, True]
    assert torch.isfinite(masked[1]).all()
    torch.testing.assert_close(masked[0, [1, 4]], logits[0, [1, 4]])


def test_top_k_keeps_every_token_as_likely_as_the_kth() -> None:
    """As vLLM's: a tie with the k-th token is kept, not broken by the sort's order (bf16 LM
    heads tie often)."""
    logits = torch.tensor([[2.0, 1.5, 1.5, 0.0]])
    masked = top_k_top_p_mask(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(masked[0]).tolist() == [True, True, True, False]


def test_top_p_of_one_keeps_the_whole_vocabulary() -> None:
    """``top_p`` 1 is off: float32's running sum reached 1 before the end of a 151936-token
    vocabulary, and the tail (half the tokens here) was cut."""
    logits = torch.randn(2, 151_936, generator=torch.Generator().manual_seed(0)) * 4
    masked = top_k_top_p_mask(logits, torch.tensor([151_936, 151_936]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(masked).all()


def test_top_p_keeps_the_smallest_nucleus_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.1, 0.6, 0.2, 0.1]])
    logits = probs.log()
    masked = top_k_top_p_mask(logits, torch.tensor([4, 4]), torch.tensor([0.7, 0.55]))
    # row 0: 0.5 < 0.7, 0.5 + 0.25 >= 0.7 -> keep {0, 1}; row 1: 0.6 >= 0.55 -> keep {1}
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(masked[1]).tolist() == [False, True, False, False]


def test_top_p_always_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    masked = top_k_top_p_mask(logits, torch.tensor([4]), torch.tensor([1e-6]))
    assert int(torch.isfinite(masked).sum()) == 1


def test_min_p_keeps_the_tokens_at_least_that_share_of_the_likeliest() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.08], [0.25, 0.25, 0.25, 0.25]])
    masked = min_p_mask(probs.log(), torch.tensor([0.25, 0.99]))
    # row 0: threshold 0.125 drops 0.12 and 0.08; row 1: a uniform row keeps all
    assert torch.isfinite(masked).tolist() == [[True, True, False, False], [True] * 4]
    assert torch.isfinite(min_p_mask(probs.log(), torch.tensor([1.0, 0.0])))[0].tolist() == [True, False, False, False]


def test_sampled_frequencies_follow_the_min_p_distribution() -> None:
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]]).repeat(4000, 1)
    torch.manual_seed(0)
    tokens = Sampler()(logits, [SamplingParams(temperature=1.0, min_p=0.2)] * 4000, [0] * 4000)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=0.03, rtol=0)


def test_a_penalty_changes_a_greedy_row_beside_plain_rows() -> None:
    """Greedy rows see their penalties; rows without one keep the argmax of the raw logits."""
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, presence_penalty=1.5)] * 2
    histories = [History([2, 0], 1), History([2, 0], 1), History([1, 1], 1)]
    tokens = Sampler()(logits, params[:3], [2, 2, 2], histories)
    assert tokens.tolist() == [0, 1, 0]  # row 1: 3 - 1.5 < 2
    with pytest.raises(ValueError, match="histories"):
        Sampler()(logits, params[:2], [2, 2])


def test_a_logit_bias_moves_its_rows_only() -> None:
    logits = torch.zeros(3, 6)
    params = [
        SamplingParams(temperature=0.0, logit_bias=((4, 2.0), (1, 1.0))),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, logit_bias=tuple((t, -100.0) for t in range(6) if t != 2)),
    ]
    torch.manual_seed(0)
    for _ in range(20):  # the sampled row: every token but 2 banned
        assert Sampler()(logits, params, [1, 1, 1]).tolist() == [4, 0, 2]


def test_banned_tokens_are_never_drawn_whatever_their_bias() -> None:
    logits = torch.zeros(3, 6)
    params = [
        SamplingParams(temperature=0.0, logit_bias=((4, 100.0),)),
        SamplingParams(temperature=1.0, logit_bias=((4, 100.0),)),
        SamplingParams(temperature=0.0, logit_bias=((4, 100.0),)),
    ]
    banned = [(4, 0), (4, 0, 1, 2, 3), ()]  # the last row bans nothing: its bias wins
    torch.manual_seed(0)
    for _ in range(20):
        assert Sampler()(logits, params, [1, 1, 1], banned=banned).tolist() == [1, 5, 4]


def test_top_k_and_top_p_combine() -> None:
    logits = torch.tensor([[4.0, 3.9, 3.8, 0.0, -2.0]])
    # top-k 3 renormalises over three near-equal tokens; top-p 0.5 then needs two of them.
    masked = top_k_top_p_mask(logits, torch.tensor([3]), torch.tensor([0.5]))
    assert torch.isfinite(masked).tolist() == [[True, True, False, False, False]]


def test_sampled_frequencies_follow_the_masked_distribution() -> None:
    sampler = Sampler()
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]]).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0, top_k=3)] * 4000
    torch.manual_seed(0)
    tokens = sampler(logits, params, [0] * 4000)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    torch.testing.assert_close(freq, expected, atol=0.03, rtol=0)


@pytest.mark.filterwarnings("error")
def test_a_temperature_past_float32_samples_uniformly_without_overflow() -> None:
    """Any finite temperature is valid; one past float32's range asks for the uniform distribution."""
    logits = torch.tensor([[8.0, 0.0, 0.0, 0.0]]).repeat(4000, 1)
    torch.manual_seed(0)
    tokens = Sampler()(logits, [SamplingParams(temperature=1e300)] * 4000, [0] * 4000)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.full((4,), 0.25), atol=0.03, rtol=0)


def test_greedy_rows_take_the_argmax_beside_sampled_rows() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0)]
    tokens = Sampler()(logits, params, [5, 5, 5]).tolist()
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


def test_seed_repeats_and_differs() -> None:
    logits = torch.zeros(1, 1000)

    def draw(seed: int) -> list[int]:
        sampler = Sampler()
        p = [SamplingParams(temperature=1.0, seed=seed)]
        return [int(sampler(logits, p, [position])[0]) for position in range(10)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    assert len(set(draw(7))) > 1  # each position its own noise


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_seeded_token_depends_on_its_seed_and_position_only(device: str) -> None:
    """Whichever sampler draws it, in whatever order and beside whatever rows: a request sampled
    by two engines (prefill, then decode; or moved to another group) draws as one would."""
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(2)).to(device)
    seeded = SamplingParams(temperature=1.0, seed=11)
    alone = [int(Sampler()(logits[:1], [seeded], [p])[0]) for p in (3, 4, 5)]
    sampler = Sampler()
    sampler(logits[:1], [seeded], [4])  # a draw before, at another position
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=12), SamplingParams()]
    batched = [int(sampler(logits, [seeded, *others], [p, 7, 8, 9])[0]) for p in (5, 3, 4)]
    assert batched == [alone[2], alone[0], alone[1]]


def test_position_seeds_differ_across_seeds_and_positions() -> None:
    seeds = {position_seed(seed, position) for seed in range(64) for position in range(512)}
    assert len(seeds) == 64 * 512
    assert all(0 <= s < 2**64 for s in seeds)
    assert position_seed(2**63 - 1, 10**6) < 2**64


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": True}, "min_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-38}, "repetition_penalty"),  # 0 in float32: the logits over 0 were NaN
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),
        ({"logit_bias": ((5, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((True, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((5,),)}, "logit_bias"),
        ({"logit_bias": ((5, float("nan")),)}, "logit_bias"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and field in str(info.value)


def test_top_k_beyond_the_vocabulary_keeps_every_token() -> None:
    """A huge top_k (msgpack allows up to 2^64 - 1) must not overflow the sampler."""
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(1))
    tokens = Sampler()(logits, [SamplingParams(temperature=1.0, top_k=2**64 - 1, seed=3)] * 2, [4, 9])
    assert all(0 <= t < 10 for t in tokens.tolist())
