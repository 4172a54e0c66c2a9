"""What changes the logits before sampling (a logit bias; repetition, frequency and presence
penalties; ``min_tokens``' ban on stop tokens): the engine against transformers (fp32, CPU) and
against the rules written out a token at a time, with steps overlapped or not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.engine.engine import LLMEngine
from pdserve.engine.penalties import History, penalize
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.step_plan import pending_token
from pdserve.engine.tokenization import encode_prompt
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


def test_a_penalized_request_after_a_step_that_sampled_nothing_decodes_as_alone(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """A step that runs only part of a prompt asking for its log-probabilities samples nothing;
    the next step's penalized row with output so far (a moved request) looked its tokens up in
    that empty sample and raised IndexError (a device assert on a GPU: the group dies)."""
    model_dir = tiny_model_dirs["tiny-llama"]
    penalized = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, frequency_penalty=1.0)
    moved = [5, 6, 7, 8, 9]  # three prompt tokens and two of output so far

    def run(engine: LLMEngine) -> dict[str, list[int]]:
        engine.add_request("moved", moved, penalized, generated=2)
        tokens: dict[str, list[int]] = {"long": [], "moved": []}
        for outputs in engine.drain():
            for out in outputs:
                tokens[out.request_id] += out.new_token_ids
        return tokens

    alone = run(make_engine(model_dir))["moved"]
    engine = make_engine(model_dir, max_num_batched_tokens=32, max_num_seqs=8)
    prompt_logprobs = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    engine.add_request("long", list(range(1, 41)), prompt_logprobs)
    assert engine.step() == []  # its first 32 tokens: nothing sampled
    beside = run(engine)
    assert len(beside["long"]) == 4 and beside["moved"] == alone and len(alone) == 4  # 6 less the 2 it had


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_min_tokens_holds_back_the_end_of_sequence_as_transformers_does(demo_model_dir: Path, overlap: bool) -> None:
    """The demo model's greedy answer ends after 8 tokens; ``min_tokens`` bans its EOS until the
    output is that long, as transformers' ``min_new_tokens`` does, then lets it end."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    prompt = encode_prompt(tokenizer, "What is the capital of France?")
    engine = make_engine(demo_model_dir, num_blocks=64, overlap=overlap)
    limits = [(48, 0), (48, 12), (20, 20)]  # (max_tokens, min_tokens)
    got = engine.generate(
        [prompt] * 3, [SamplingParams(max_tokens=n, min_tokens=m, temperature=0.0) for n, m in limits]
    )
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    for output, (n, m) in zip(got, limits):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=m)
        assert output == expected[0, len(prompt) :].tolist()
    assert len(got[0]) < 12 and got[0][-1] in engine.model_config.eos_token_ids  # else nothing was held back
    assert len(got[1]) > 12 and got[1][-1] in engine.model_config.eos_token_ids
    assert len(got[2]) == 20 and got[2][-1] not in engine.model_config.eos_token_ids


def test_min_tokens_holds_back_the_end_of_sequence_under_ignore_eos_too(tiny_model_dirs: dict[str, Path]) -> None:
    """As vLLM's: ``ignore_eos`` lets an end-of-sequence token be drawn without ending the
    request, but not before ``min_tokens`` (a bias that makes it the argmax shows it)."""
    engine = make_engine(tiny_model_dirs["tiny-qwen2"])
    eos = engine.model_config.eos_token_ids[0]
    params = SamplingParams(max_tokens=6, min_tokens=3, temperature=0.0, ignore_eos=True, logit_bias=((eos, 100.0),))
    [tokens] = engine.generate([[5, 6, 7]], params)
    assert len(tokens) == 6 and eos not in tokens[:3] and tokens[3:] == [eos] * 3


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_min_tokens_holds_back_stop_token_ids(tiny_model_dirs: dict[str, Path], overlap: bool) -> None:
    """A stop id greedy would draw second may not come before ``min_tokens``; once allowed it
    ends the request where it first wins the argmax (the rule written out on transformers' logits)."""
    model_dir = tiny_model_dirs["tiny-qwen2"]
    engine = make_engine(model_dir, overlap=overlap)
    prompts = make_prompts(engine.model_config.vocab_size, [7, 21, 12], seed=3)
    reference = hf_model(model_dir)
    plain = [hf_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    params = [greedy(stop_token_ids=(plain[i][1], plain[i][3]), min_tokens=m) for i, m in enumerate([6, 0, MAX_TOKENS])]
    got = engine.generate(prompts, params)
    for prompt, p, output in zip(prompts, params, got):
        expected: list[int] = []
        with torch.no_grad():
            while len(expected) < MAX_TOKENS and not set(expected[-1:]) & set(p.stop_token_ids):
                logits = reference(torch.tensor([prompt + expected])).logits[0, -1].float()
                if len(expected) < p.min_tokens:
                    logits[list(p.stop_token_ids)] = float("-inf")
                expected.append(int(logits.argmax()))
        assert output == expected
    assert len(got[1]) <= 2 and len(got[0]) > 6 and len(got[2]) == MAX_TOKENS
    assert not set(got[2]) & set(params[2].stop_token_ids)


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


def test_min_tokens_holds_even_where_every_token_stops(tiny_model_dirs: dict[str, Path]) -> None:
    """Banned everywhere, a stop id is drawn anyway; as in vLLM it ends nothing before ``min_tokens``."""
    engine = make_engine(tiny_model_dirs["tiny-qwen2"])
    every = tuple(range(engine.model_config.vocab_size))
    engine.add_request(
        "r", [5, 6, 7], SamplingParams(max_tokens=6, min_tokens=3, temperature=0.0, stop_token_ids=every)
    )
    outputs = [out for step in engine.drain() for out in step]
    assert sum(len(out.new_token_ids) for out in outputs) == 3 and outputs[-1].finish_reason == "stop"


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_moved_request_goes_on_as_on_its_first_engine(tiny_model_dirs: dict[str, Path], overlap: bool) -> None:
    """A request moved after a failure is prefilled again with its output so far (``generated``):
    its penalties, ``min_tokens`` and ``max_tokens`` count that output as output, so the rest is
    what the engine it started on would have given."""
    model_dir = tiny_model_dirs["tiny-qwen2"]
    prompts = make_prompts(256, [9, 20], seed=11)
    params = [
        greedy(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=5, min_tokens=MAX_TOKENS, stop_token_ids=(3, 4)),
    ]
    whole = make_engine(model_dir, overlap=overlap).generate(prompts, params)
    k = 7
    moved = make_engine(model_dir, overlap=overlap)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        moved.add_request(str(i), prompt + whole[i][:k], p, generated=k)
    rest = {str(i): [] for i in range(len(prompts))}
    for outputs in moved.drain():
        for out in outputs:
            rest[out.request_id] += out.new_token_ids
    assert [whole[i][:k] + rest[str(i)] for i in range(len(prompts))] == whole
    # Counted as prompt instead, the penalties and the limit would differ.
    as_prompt = make_engine(model_dir, overlap=overlap).generate([prompts[0] + whole[0][:k]], params[0])[0]
    assert whole[0][:k] + as_prompt != whole[0]
