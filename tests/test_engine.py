"""The single-process engine against Hugging Face transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.step_plan import build_plan

PARITY_MODELS = ["tiny-qwen2", "tiny-llama-odd"]
PROMPT_LENGTHS = [1, 5, 16, 17, 40, 63]


def make_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def make_engine(model_dir: Path, num_blocks: int = 256, max_model_len: int = 256, overlap: bool = True,
                **sched: object) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model_dir), dtype="float32", device="cpu", max_model_len=max_model_len,
        overlap_scheduling=overlap, cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(**sched),  # type: ignore[arg-type]
    ))


GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("name", PARITY_MODELS)
def test_prefill_logits_match_transformers(tiny_model_dirs: dict[str, Path], name: str) -> None:
    engine = make_engine(tiny_model_dirs[name])
    prompts = make_prompts(engine.model_config.vocab_size, PROMPT_LENGTHS)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    batch = engine.scheduler.schedule()
    assert batch is not None and len(batch.seqs) == len(prompts)  # one varlen prefill step
    input_ids, positions, context, _ = engine.runner.inputs(build_plan(batch, engine.runner.block_size))
    every_row = torch.arange(batch.num_tokens)
    logits = engine.runner.forward(input_ids, positions, context, every_row)
    reference = hf_model(tiny_model_dirs[name])
    start = 0
    for prompt in prompts:
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].float()
        got = logits[start : start + len(prompt)]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        start += len(prompt)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("name", PARITY_MODELS)
@pytest.mark.parametrize(
    "sched",
    [
        {},
        {"max_num_batched_tokens": 24, "max_num_seqs": 4},  # chunked prompts mixed with decodes
        {"enable_chunked_prefill": False},
    ],
    ids=["default", "small-budget-chunked", "unchunked"],
)
def test_greedy_matches_transformers(tiny_model_dirs: dict[str, Path], name: str, sched: dict, overlap: bool) -> None:
    """Requests arriving at different times, batched continuously, decode exactly as HF does,
    with steps overlapped or not."""
    model_dir = tiny_model_dirs[name]
    engine = make_engine(model_dir, overlap=overlap, **sched)
    prompts = make_prompts(engine.model_config.vocab_size, PROMPT_LENGTHS, seed=1)
    results: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i in range(3):
        engine.add_request(str(i), prompts[i], GREEDY)
    for _ in range(3):
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
    for i in range(3, len(prompts)):
        engine.add_request(str(i), prompts[i], GREEDY)
    for outputs in engine.drain():
        for out in outputs:
            results[out.request_id].extend(out.new_token_ids)
    reference = hf_model(model_dir)
    for i, prompt in enumerate(prompts):
        assert results[str(i)] == hf_greedy(reference, prompt, 32), f"prompt {i} ({len(prompt)} tokens)"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_preemption_keeps_greedy_output_and_frees_every_block(tiny_model_dirs: dict[str, Path], overlap: bool) -> None:
    """A pool too small for all requests forces preemption; outputs must not change."""
    model_dir = tiny_model_dirs["tiny-llama-odd"]
    prompts = make_prompts(500, [30, 31, 33, 35, 40, 45, 50, 20], seed=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = make_engine(model_dir, overlap=False).generate(prompts, params)
    engine = make_engine(model_dir, num_blocks=16, overlap=overlap)  # 256 tokens for 8 requests of up to 90
    tight = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert tight == roomy
    assert engine.block_manager.num_free_blocks == 16


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_block_accounting_after_finish_abort_and_preemption(tiny_model_dirs: dict[str, Path], overlap: bool) -> None:
    engine = make_engine(
        tiny_model_dirs["tiny-qwen2"], num_blocks=12, max_model_len=128, overlap=overlap, max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    prompts = make_prompts(engine.model_config.vocab_size, [10, 20, 30, 40, 15, 25], seed=3)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=20 + i, temperature=0.0, ignore_eos=True))
    finished: dict[str, str] = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason or ""
        step += 1
        if step == 2:  # abort one running and one still waiting
            for request_id in ("0", "5"):
                out = engine.abort(request_id)
                assert out is not None and out.finished and out.finish_reason == "abort"
                finished[request_id] = "abort"
        assert step < 500
    assert engine.scheduler.num_preemptions > 0
    assert sorted(finished) == [str(i) for i in range(6)]
    assert engine.abort("0") is None  # already gone
    assert engine.block_manager.num_free_blocks == 12
    assert not engine.requests


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_stop_conditions(tiny_model_dirs: dict[str, Path], overlap: bool) -> None:
    engine = make_engine(tiny_model_dirs["tiny-qwen2"], overlap=overlap)
    prompt = make_prompts(engine.model_config.vocab_size, [8], seed=4)[0]
    free_run = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert len(free_run) == 10
    stop_at = free_run[4]
    first = free_run.index(stop_at)
    stopped = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_at,)))[0]
    assert stopped == free_run[: first + 1]
    engine.add_request("r", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    outs = [o for step in engine.drain() for o in step]
    assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 3
    assert {"queue", "prefill", "decode"} <= set(outs[-1].timings)


def test_seeded_sampling_is_reproducible(tiny_model_dirs: dict[str, Path]) -> None:
    engine = make_engine(tiny_model_dirs["tiny-llama"])
    prompts = make_prompts(engine.model_config.vocab_size, [7, 12], seed=5)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    first = engine.generate(prompts, params)
    # Batched with other, unseeded requests the seeded ones still repeat exactly.
    noisy = engine.generate(prompts + prompts, [params, params, SamplingParams(max_tokens=24, ignore_eos=True)] * 2)
    assert noisy[:2] == first
    other_seed = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True))
    assert other_seed != first


def test_plan_builds_slot_mapping_from_block_tables(tiny_model_dirs: dict[str, Path]) -> None:
    engine = make_engine(tiny_model_dirs["tiny-qwen2"], num_blocks=8, max_model_len=128)
    engine.add_request("a", list(range(20)), GREEDY)
    batch = engine.scheduler.schedule()
    assert isinstance(batch, ScheduledBatch)
    seq = batch.seqs[0]
    seq.block_table = np.array([5, 2], dtype=np.int32)  # any physical blocks, any order
    plan = build_plan(batch, engine.runner.block_size)
    bs = engine.block_manager.block_size
    expected = [5 * bs + p if p < bs else 2 * bs + p - bs for p in range(20)]
    assert plan.slot_mapping == expected
    assert plan.positions == list(range(20))
    assert plan.context_lens == [20] and plan.sample_rows == [19]
    assert plan.block_tables.dtype == np.int32 and plan.block_tables.tolist() == [[5, 2]]
