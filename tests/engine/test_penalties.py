"""What changes the logits before sampling (a logit bias; repetition, frequency and presence
penalties): the engine against transformers (fp32, CPU) and against the rules written out a
token at a time, with steps overlapped or not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.penalties import History, penalize
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.step_plan import pending_token
from pdserve.tests.engine.helpers import hf_greedy, hf_model, make_engine, make_prompts

MAX_TOKENS = 24


def penalized_reference(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """vLLM's rules, a token at a time: the oracle of ``penalize``."""
    out = logits.clone()
    for t in set(prompt) | set(output):
        if params.repetition_penalty != 1:
            value = out[t]
            out[t] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for t in set(output):
        out[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return out


def reference_greedy(model: torch.nn.Module, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding by hand: transformers' logits, the rules above, argmax."""
    output: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
            output.append(int(penalized_reference(logits, params, prompt, output).argmax()))
    return output


def greedy(**penalty: float) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **penalty)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize(
    "sched", [{}, {"max_num_batched_tokens": 24, "max_num_seqs": 4}], ids=["default", "small-budget-chunked"]
)
def test_repetition_penalty_matches_transformers(tiny_model_dirs: dict[str, Path], overlap: bool, sched: dict) -> None:
    """Penalized and plain requests batched together each decode as transformers does with and
    without its ``repetition_penalty`` (which, as vLLM's, counts the prompt)."""
    model_dir = tiny_model_dirs["tiny-qwen2"]
    engine = make_engine(model_dir, overlap=overlap, **sched)
    prompts = make_prompts(engine.model_config.vocab_size, [5, 17, 40, 9], seed=4)
    params = [greedy(repetition_penalty=1.8), greedy(), greedy(repetition_penalty=0.7), greedy(repetition_penalty=1.8)]
    got = engine.generate(prompts, params)
    reference = hf_model(model_dir)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        assert got[i] == hf_greedy(reference, prompt, MAX_TOKENS, repetition_penalty=p.repetition_penalty), (
            f"request {i}"
        )
    # The penalty must change something here, or this test could not fail.
    assert got[0] != hf_greedy(reference, prompts[0], MAX_TOKENS)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_logit_bias_matches_transformers_sequence_bias(tiny_model_dirs: dict[str, Path], overlap: bool) -> None:
    """A bias on single tokens is transformers' ``sequence_bias`` of one-token sequences; with a
    repetition penalty too, the bias comes first (as vLLM orders them)."""
    model_dir = tiny_model_dirs["tiny-qwen2"]
    engine = make_engine(model_dir, overlap=overlap)
    prompts = make_prompts(engine.model_config.vocab_size, [6, 19, 33], seed=7)
    reference = hf_model(model_dir)
    plain = [hf_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    # Ban each request's first greedy token and favour two others.
    biases = [((plain[i][0], -100.0), (7, 3.5), (11 + i, 2.0)) for i in range(len(prompts))]
    params = [greedy(logit_bias=biases[0]), greedy(logit_bias=biases[1], repetition_penalty=1.4), greedy()]
    got = engine.generate(prompts, params)
    for i, p in enumerate(params):
        sequence_bias = {(token,): bias for token, bias in p.logit_bias} or None
        expected = hf_greedy(
            reference, prompts[i], MAX_TOKENS, sequence_bias=sequence_bias, repetition_penalty=p.repetition_penalty
        )
        assert got[i] == expected, f"request {i}"
    assert got[0][0] != plain[0][0] and got[2] == plain[2]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_frequency_and_presence_penalties_match_the_rules(tiny_model_dirs: dict[str, Path], overlap: bool) -> None:
    model_dir = tiny_model_dirs["tiny-llama-odd"]
    engine = make_engine(model_dir, overlap=overlap)
    prompts = make_prompts(engine.model_config.vocab_size, [6, 23, 11, 30], seed=5)
    params = [
        greedy(frequency_penalty=1.5),
        greedy(presence_penalty=2.0),
        greedy(frequency_penalty=-0.5, presence_penalty=0.8, repetition_penalty=1.3),
        greedy(),
    ]
    got = engine.generate(prompts, params)
    reference = hf_model(model_dir)
    expected = [reference_greedy(reference, prompt, p) for prompt, p in zip(prompts, params)]
    assert got == expected
    assert expected[:2] != [reference_greedy(reference, prompt, greedy()) for prompt in prompts[:2]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_placeholders_count_as_the_tokens_they_name(device: str) -> None:
    """An overlapped step's last output is still on the device: ``sampled`` resolves it."""
    logits = torch.randn(2, 50).to(device)
    params = [
        SamplingParams(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.4),
        SamplingParams(presence_penalty=-1.0),
    ]
    prompts, outputs = [[3, 4, 5], [9]], [[7, 7, 11], [12, 13]]
    sampled = torch.tensor([40, 11, 13], device=device)  # rows 1 and 2 of the step before: 11 and 13
    with_placeholders = [
        History(prompts[0] + [7, 7, pending_token(1)], 3),
        History(prompts[1] + [12, pending_token(2)], 1),
    ]
    got = penalize(logits, params, with_placeholders, sampled)
    for row in range(2):
        expected = penalized_reference(logits[row].cpu(), params[row], prompts[row], outputs[row])
        torch.testing.assert_close(got[row].cpu(), expected)


def test_placeholders_without_sampled_tokens_are_refused() -> None:
    with pytest.raises(RuntimeError, match="placeholders"):
        penalize(torch.zeros(1, 8), [SamplingParams(presence_penalty=1.0)], [History([1, pending_token(0)], 1)])
