"""Log-probabilities of generated tokens against transformers' on the same weights (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampler import PromptLogprobs, TokenLogprobs
from pdserve.engine.sampling import RequestError, SamplingParams
from pdserve.tests.engine.helpers import hf_model, make_engine, make_prompts


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, tuple[list, list]]:
    """Request id -> (its tokens, its logprobs entries), stepping until every request ends."""
    results: dict[str, tuple[list, list]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
        results[str(i)] = ([], [])
    for outputs in engine.drain():
        for out in outputs:
            tokens, logprobs = results[out.request_id]
            tokens.extend(out.new_token_ids)
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_token_ids)
                logprobs.extend(out.logprobs)
    return results


def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(output), V]``: transformers' log-softmax at each generated position, teacher-forced."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) + len(output) - 1].log_softmax(dim=-1)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_logprobs_match_transformers(tiny_model_dirs: dict[str, Path], overlap: bool) -> None:
    """Each token's log-probability and its alternatives are the model's own (before the
    penalty and the temperature), for greedy and sampled requests batched with one that asks for none."""
    model_dir = tiny_model_dirs["tiny-qwen2"]
    engine = make_engine(model_dir, overlap=overlap, max_num_batched_tokens=24, max_num_seqs=4)
    prompts = make_prompts(engine.model_config.vocab_size, [7, 30, 12], seed=6)
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=10, temperature=1.3, seed=3, ignore_eos=True, repetition_penalty=1.5, logprobs=0),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    ]
    results = run(engine, prompts, params)
    reference = hf_model(model_dir)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        tokens, logprobs = results[str(i)]
        assert len(tokens) == p.max_tokens
        if p.logprobs is None:
            assert logprobs == []
            continue
        expected = hf_logprobs(reference, prompt, tokens)
        assert len(logprobs) == len(tokens)
        for position, (token, entry) in enumerate(zip(tokens, logprobs)):
            assert isinstance(entry, TokenLogprobs)
            assert entry.logprob == pytest.approx(float(expected[position, token]), abs=1e-4)
            top = expected[position].topk(p.logprobs)
            assert entry.top_ids == top.indices.tolist(), f"request {i}, token {position}"
            assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
            if p.greedy:
                assert entry.top_ids[0] == token


@pytest.mark.parametrize("value", [-1, 21, True, 2.0])
def test_logprobs_out_of_range_are_refused(value: object) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(logprobs=value)  # type: ignore[arg-type]
    assert info.value.field == "logprobs"


@pytest.mark.parametrize("value", [-1, 21, True])
def test_prompt_logprobs_out_of_range_are_refused(value: object) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
    assert info.value.field == "prompt_logprobs"


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_prompt_logprobs_match_transformers(
    tiny_model_dirs: dict[str, Path], overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each prompt token's log-probability given those before it, and the likeliest tokens there,
    are transformers' (teacher-forced over the prompt), chunked over several steps beside other
    requests, and whole even where the prefix cache holds the prompt's start."""
    monkeypatch.setattr(PromptLogprobs, "SLICE", 7)  # a step's prompt rows go through the LM head in slices
    model_dir = tiny_model_dirs["tiny-qwen2"]
    engine = make_engine(model_dir, overlap=overlap, max_num_batched_tokens=24, max_num_seqs=4)
    vocab = engine.model_config.vocab_size
    shared, tail, other = make_prompts(vocab, [40, 9, 17], seed=8)
    engine.generate([shared], SamplingParams(max_tokens=1))  # leaves the shared prompt's blocks cached
    prompts = [shared + tail, other, shared + tail, [5]]
    params = [
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=4),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=2),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=3),
    ]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    firsts: dict[str, list] = {}
    for outputs in engine.drain():
        for out in outputs:
            if out.request_id not in firsts:
                firsts[out.request_id] = out.prompt_logprobs  # only the first output carries them
            else:
                assert out.prompt_logprobs is None
    reference = hf_model(model_dir)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        entries = firsts[str(i)]
        if p.prompt_logprobs is None:
            assert entries is None
            continue
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(dim=-1)
        assert entries is not None and len(entries) == len(prompt) - 1
        for position, entry in enumerate(entries):
            assert entry.logprob == pytest.approx(float(expected[position, prompt[position + 1]]), abs=1e-4)
            top = expected[position].topk(p.prompt_logprobs)
            assert entry.top_ids == top.indices.tolist(), f"request {i}, position {position}"
            assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
    # The request with the cached prefix computed all of it: nothing was served from the cache.
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_reused_id_gets_none_of_the_aborted_requests_prompt_logprobs(tiny_model_dirs: dict[str, Path]) -> None:
    """A request aborted while a prompt chunk of its was in flight, and a new one under the same
    id: that chunk's read-back wrote its positions into the new request's prompt log-probabilities
    (IndexError for a shorter prompt)."""
    engine = make_engine(
        tiny_model_dirs["tiny-llama"], enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)
    engine.add_request("a", list(range(10, 40)), params)
    engine.step()  # a 16-token chunk with its prompt rows in flight
    engine.abort("a")
    engine.add_request("a", [7, 8, 9], params)
    outputs = [out for step in engine.drain() for out in step]
    [first] = [out for out in outputs if out.prompt_logprobs is not None]
    assert len(first.prompt_logprobs or []) == 2 and outputs[-1].finish_reason == "length"
