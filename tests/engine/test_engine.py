"""The single-process engine against Hugging Face transformers on the same weights (fp32, CPU),
and overlapped steps against read-back-first ones."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.engine import ops
from pdserve.engine.engine import EngineStats, LLMEngine, RequestOutput
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.step_plan import build_plan, pending_token, write_pending_tokens
from pdserve.tests.engine.helpers import hf_greedy, hf_model, make_engine, make_prompts

PARITY_MODELS = ["tiny-qwen2", "tiny-llama-odd"]
PROMPT_LENGTHS = [1, 5, 16, 17, 40, 63]


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


@pytest.fixture
def triton_kernels(interpreter: None) -> Iterator[None]:
    """The engine built in the test binds every op to its Triton kernel (the interpreter, on
    CPU); the torch references are bound again afterwards, for the tests that follow."""
    yield
    ops.use_kernels("torch")


@pytest.mark.parametrize("name", PARITY_MODELS)
def test_greedy_on_triton_kernels_matches_transformers(
    triton_kernels: None, tiny_model_dirs: dict[str, Path], name: str
) -> None:
    """The model wired to the Triton kernels, as on a GPU (embedding, the norms, SiLU-mul, RoPE
    with the K/V store, prefill and decode attention; linears stay F.linear off the GPU), decodes
    as transformers does: a varlen prefill and continuous batching over two requests."""
    model_dir = tiny_model_dirs[name]
    engine = make_engine(model_dir, kernels="triton")
    prompts = make_prompts(engine.model_config.vocab_size, [5, 21], seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = hf_model(model_dir)
    assert engine.generate(prompts, params) == [hf_greedy(reference, prompt, 6) for prompt in prompts]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_preemption_keeps_greedy_output_and_frees_every_block(tiny_model_dirs: dict[str, Path], overlap: bool) -> None:
    """A pool too small for all requests forces preemption; outputs must not change: they stay
    those of a pool with room for all, which are transformers'."""
    model_dir = tiny_model_dirs["tiny-llama-odd"]
    prompts = make_prompts(500, [30, 31, 33, 35, 40, 45, 50, 20], seed=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = make_engine(model_dir, overlap=False).generate(prompts, params)
    if not overlap:  # once is enough
        reference = hf_model(model_dir)
        assert roomy == [hf_greedy(reference, prompt, 40) for prompt in prompts]
    engine = make_engine(model_dir, num_blocks=16, overlap=overlap)  # 256 tokens for 8 requests of up to 90
    tight = engine.generate(prompts, params)
    assert engine.stats().preemptions > 0
    assert tight == roomy
    assert engine.block_manager.num_free_blocks == 16


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_block_accounting_after_finish_abort_and_preemption(tiny_model_dirs: dict[str, Path], overlap: bool) -> None:
    engine = make_engine(
        tiny_model_dirs["tiny-qwen2"],
        num_blocks=12,
        max_model_len=128,
        overlap=overlap,
        max_num_batched_tokens=32,
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
    assert engine.stats().preemptions > 0
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
    assert {"queue", "prefill", "decode"} <= set(outs[-1].timings.as_dict())
    # The first output carries the timings so far (an abort may come before the last); the
    # others in between none.
    assert {"queue", "prefill"} <= set(outs[0].timings.as_dict()) and "decode" not in outs[0].timings.as_dict()
    assert all(not o.timings.as_dict() for o in outs[1:-1]) and len(outs) == 3


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


# -- overlapped steps ----------------------------------------------------------------------------
# The engine launches a step before reading back the one before it. The oracle is the same engine
# with overlap_scheduling=False (itself checked against transformers above): every request must
# end with the same tokens, reason and counts, and every block must come back, whatever stops,
# aborts or preempts it while a step is in flight.


def run_all(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[RequestOutput]] = {r: [] for r in requests}
    for step in engine.drain():
        for out in step:
            outputs[out.request_id].append(out)
    return outputs


def summary(outputs: list[RequestOutput]) -> tuple[list[int], str | None, int]:
    """(tokens, finish reason, output count of the final message) of one request."""
    assert sum(o.finished for o in outputs) == 1 and outputs[-1].finished
    return [t for o in outputs for t in o.new_token_ids], outputs[-1].finish_reason, outputs[-1].num_output_tokens


def test_outputs_come_one_call_later(tiny_model_dirs: dict[str, Path]) -> None:
    engine = make_engine(tiny_model_dirs["tiny-qwen2"])
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert engine.step() == []  # the prefill is launched, its token still on the device
    first = engine.step()
    assert [o.request_id for o in first] == ["r"] and not first[0].finished
    assert engine.step()[0].num_output_tokens == 2
    # Nothing left to schedule (the last token is known to be the last: no wasted step); it is
    # read back.
    last = engine.step()
    assert last[0].finished and last[0].finish_reason == "length" and last[0].num_output_tokens == 3
    assert not engine.has_unfinished()


def test_stop_tokens_end_requests_as_without_overlap(tiny_model_dirs: dict[str, Path]) -> None:
    """A stop id (and EOS) is only known once read back, a step after the next one was
    launched: the extra token is dropped and the request ends exactly where it would have."""
    model_dir = tiny_model_dirs["tiny-qwen2"]
    sync, overlap = make_engine(model_dir, overlap=False), make_engine(model_dir)
    prompts = make_prompts(sync.model_config.vocab_size, [5, 9, 17, 30], seed=7)
    free_run = sync.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    requests = {
        # stop at the 3rd, 1st and 7th generated token; the last request runs to its length
        str(i): (
            prompt,
            SamplingParams(
                max_tokens=12, temperature=0.0, stop_token_ids=(free_run[i][pick],) if pick is not None else ()
            ),
        )
        for i, (prompt, pick) in enumerate(zip(prompts, [2, 0, 6, None]))
    }
    expected = {r: summary(o) for r, o in run_all(sync, requests).items()}
    got = {r: summary(o) for r, o in run_all(overlap, requests).items()}
    assert got == expected
    assert [reason for _, reason, _ in got.values()] == ["stop", "stop", "stop", "length"]
    assert overlap.block_manager.num_free_blocks == overlap.block_manager.num_blocks
    assert not overlap.requests


def test_abort_with_a_token_in_flight(tiny_model_dirs: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs["tiny-llama"]
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(engine.model_config.vocab_size, [6, 11], seed=8)
    engine.add_request("kept", prompts[0], params)
    engine.add_request("aborted", prompts[1], params)
    seen: dict[str, list[int]] = {"kept": [], "aborted": []}
    for _ in range(3):
        for out in engine.step():
            seen[out.request_id].extend(out.new_token_ids)
    aborted = engine.abort("aborted")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert aborted.num_output_tokens == len(seen["aborted"])  # the in-flight token is not counted
    for step in engine.drain():
        for out in step:
            assert out.request_id == "kept"
            seen["kept"].extend(out.new_token_ids)
    assert seen["kept"] == make_engine(model_dir, overlap=False).generate([prompts[0]], params)[0]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefill_only_requests_run_no_extra_step(tiny_model_dirs: dict[str, Path]) -> None:
    """The prefill role's requests end with their first token, known ahead: they are not
    scheduled again, so their held blocks cover the prompt and nothing more."""
    engine = make_engine(tiny_model_dirs["tiny-qwen2"])
    block_size = engine.block_manager.block_size
    prompts = make_prompts(engine.model_config.vocab_size, [block_size, 2 * block_size + 3], seed=9)
    for i, prompt in enumerate(prompts):
        engine.add_request(
            str(i), prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), prefill_only=True
        )
    outputs = [out for step in engine.drain() for out in step]
    assert sorted(o.request_id for o in outputs) == ["0", "1"]
    for out in outputs:
        prompt = prompts[int(out.request_id)]
        assert out.finish_reason == "prefilled" and len(out.new_token_ids) == 1
        assert out.kv_block_ids is not None and len(out.kv_block_ids) == -(-len(prompt) // block_size)
        assert engine.held[out.request_id].num_computed_tokens == len(prompt)


def pool_and_queues(engine: LLMEngine) -> EngineStats:
    """``engine.stats()`` without the prefix cache's counters (test_prefix_cache_engine.py tests them)."""
    return dataclasses.replace(engine.stats(), prefix_cache=None)


def test_hand_off_api_counts_and_frees_every_block(tiny_model_dirs: dict[str, Path]) -> None:
    """What the roles call: a prefilled request holds its blocks until ``release`` (a second
    release is a no-op), a reservation holds ``blocks_for`` the prompt until admitted, and
    ``abort_all`` frees everything; ``stats`` counts all of it."""
    engine = make_engine(tiny_model_dirs["tiny-qwen2"], num_blocks=32)
    block_size = engine.config.cache.block_size
    prompt = make_prompts(engine.model_config.vocab_size, [2 * block_size + 1], seed=11)[0]
    assert engine.blocks_for(len(prompt)) == 3
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("p", prompt, params, prefill_only=True)
    assert engine.stats().waiting == 1
    [out] = [out for step in engine.drain() for out in step]
    assert out.finish_reason == "prefilled"
    assert pool_and_queues(engine) == EngineStats(num_blocks=32, free_blocks=29, running=0, waiting=0, kv_held=1)
    engine.release("p")
    engine.release("p")
    assert pool_and_queues(engine) == EngineStats(num_blocks=32, free_blocks=32, running=0, waiting=0, kv_held=0)
    reservation = engine.reserve("d", prompt, out.new_token_ids[0], params)
    # The prompt's two full blocks stayed in the prefix cache: the reservation starts with them.
    assert reservation is not None and len(reservation.block_ids) == 3 and reservation.num_cached_blocks == 2
    assert pool_and_queues(engine) == EngineStats(num_blocks=32, free_blocks=29, running=0, waiting=0, kv_held=1)
    engine.admit("d")
    engine.add_request("q", prompt, params)
    assert pool_and_queues(engine) == EngineStats(num_blocks=32, free_blocks=29, running=1, waiting=1, kv_held=0)
    engine.abort_all()
    engine.reserve("e", prompt, out.new_token_ids[0], params)
    engine.abort_all()
    while engine.has_unfinished():  # the overlapped engine may still hold a launched step
        engine.step()
    assert pool_and_queues(engine) == EngineStats(num_blocks=32, free_blocks=32, running=0, waiting=0, kv_held=0)


def test_a_reservation_keeps_a_free_block_for_its_own_first_step(tiny_model_dirs: dict[str, Path]) -> None:
    """A prompt that fills its last block needs a new one at its first step. ``reserve`` keeps a
    free block for each running or reserved sequence, the new one included: without its own,
    "b" was granted the last free blocks and the first step after both were admitted preempted
    one of them, its KV moved for nothing (review)."""
    engine = make_engine(tiny_model_dirs["tiny-qwen2"], num_blocks=4, max_model_len=64)
    block_size = engine.config.cache.block_size
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    a, b = make_prompts(engine.model_config.vocab_size, [2 * block_size, block_size], seed=12)
    assert engine.reserve("a", a, 1, params) is not None  # 2 blocks, and a free one for each of a's next tokens
    assert engine.reserve("b", b, 1, params) is None  # 1 block, and one free for a and one for b: 3 > 2
    engine.admit("a")
    outputs = [out for step in engine.drain() for out in step]
    assert engine.stats().preemptions == 0 and [o.finish_reason for o in outputs if o.finished] == ["length"]
    assert engine.reserve("b", b, 1, params) is not None  # once "a" is done


def test_a_prompt_that_fills_an_idle_pool_is_reserved(tiny_model_dirs: dict[str, Path]) -> None:
    """A request whose whole KV (prompt and output) fills the pool exactly fits an idle decode
    group, as it fits the colocated engine: its own headroom block is kept only if it will grow
    into another block. It was refused for ever, and the decode leader held every later request
    behind it until the prefill side's lease ran out (review)."""
    engine = make_engine(tiny_model_dirs["tiny-qwen2"], num_blocks=4, max_model_len=64)
    block_size = engine.config.cache.block_size
    prompt = make_prompts(engine.model_config.vocab_size, [4 * block_size - 4], seed=14)[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)  # 64 tokens: max_model_len
    assert engine.reserve("a", prompt, 1, params) is not None
    engine.admit("a")
    outputs = [out for step in engine.drain() for out in step]
    assert [o.finish_reason for o in outputs if o.finished] == ["length"] and engine.stats().preemptions == 0
    assert pool_and_queues(engine) == EngineStats(num_blocks=4, free_blocks=4, running=0, waiting=0, kv_held=0)


def test_reservations_stop_at_max_num_seqs(tiny_model_dirs: dict[str, Path]) -> None:
    """A decode group holds at most ``max_num_seqs`` sequences, running, waiting (preempted) or
    reserved: a reservation past that is refused (the prefill side asks again), as a prompt past
    it waits in the scheduler. Reservations were granted without bound, and a step then ran more
    sequences than the batch its memory and CUDA graphs were sized for (review)."""
    engine = make_engine(tiny_model_dirs["tiny-qwen2"], num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(engine.model_config.vocab_size, [5, 6, 7], seed=13)
    assert engine.reserve("a", prompts[0], 1, params) is not None
    engine.admit("a")
    assert engine.reserve("b", prompts[1], 1, params) is not None
    assert engine.reserve("c", prompts[2], 1, params) is None
    engine.admit("b")
    for step in engine.drain():
        assert len(step) <= 2
    assert engine.reserve("c", prompts[2], 1, params) is not None


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_moved_request_handed_to_decode_goes_on_from_its_first_token(
    tiny_model_dirs: dict[str, Path], overlap: bool
) -> None:
    """A request moved after a failure reaches its decode group with its output so far in the
    prompt (``generated``), all of whose KV moved: decoding goes on from the prefill's first
    token, a step a token, as on the engine it started on. Re-running the output so far would
    give the same tokens, a step each later."""
    model_dir = tiny_model_dirs["tiny-qwen2"]
    prompt = make_prompts(256, [20], seed=3)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    whole = make_engine(model_dir, overlap=overlap).generate([prompt], params)[0]
    k = 5
    moved = prompt + whole[:k]
    prefill = make_engine(model_dir, overlap=overlap)
    prefill.add_request("m", moved, params, prefill_only=True, generated=k)
    [prefilled] = [out for step in prefill.drain() for out in step]
    assert prefilled.kv_block_ids is not None
    first = prefilled.new_token_ids[0]
    decode = make_engine(model_dir, overlap=overlap)
    reservation = decode.reserve("m", moved, first, params, generated=k)
    assert reservation is not None and reservation.num_cached_blocks == 0
    decode.kv_cache[:, :, reservation.block_ids] = prefill.kv_cache[:, :, prefilled.kv_block_ids]
    decode.admit("m")
    steps = list(decode.drain())
    tokens = [token for step in steps for out in step for token in out.new_token_ids]
    assert whole[:k] + [first] + tokens == whole
    # A step a token after the first (the overlapped engine reads each step back in the next).
    assert len(steps) == len(whole) - k - 1 + overlap


def test_length_limit_at_max_model_len(tiny_model_dirs: dict[str, Path]) -> None:
    """A request that fills the model length ends there, as without overlap."""
    model_dir = tiny_model_dirs["tiny-qwen2"]
    max_model_len = 48
    prompt = make_prompts(500, [max_model_len - 3], seed=10)[0]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engines = [make_engine(model_dir, max_model_len=max_model_len, overlap=o) for o in (True, False)]
    got, expected = (summary(run_all(e, {"r": (prompt, params)})["r"]) for e in engines)
    assert got == expected and got[1:] == ("length", 3)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_mixed_batches_match_without_overlap(tiny_model_dirs: dict[str, Path], temperature: float) -> None:
    """Chunked prompts beside decodes, seeded sampling: the same tokens either way."""
    model_dir = tiny_model_dirs["tiny-llama-odd"]
    prompts = make_prompts(500, [3, 40, 17, 64, 25], seed=11)
    requests = {
        str(i): (prompt, SamplingParams(max_tokens=6 + 3 * i, temperature=temperature, seed=100 + i, ignore_eos=True))
        for i, prompt in enumerate(prompts)
    }
    results = []
    for overlap in (True, False):
        engine = make_engine(model_dir, overlap=overlap, max_num_batched_tokens=24, max_num_seqs=4)
        results.append({r: summary(o) for r, o in run_all(engine, requests).items()})
    assert results[0] == results[1]


def test_write_pending_tokens_fills_placeholders() -> None:
    sampled = torch.tensor([70, 71, 72])
    steady = torch.tensor([pending_token(0), pending_token(1), 5])
    write_pending_tokens(steady, steady.tolist(), sampled)
    assert steady.tolist() == [70, 71, 5]
    shuffled = [9, pending_token(2), 8, pending_token(0)]
    ids = torch.tensor(shuffled)
    write_pending_tokens(ids, shuffled, sampled)
    assert ids.tolist() == [9, 72, 8, 70]
    with pytest.raises(RuntimeError, match="no launched step"):
        write_pending_tokens(torch.tensor(shuffled), shuffled, None)


def test_outputs_read_back_ahead_of_an_eager_step_go_to_emit(tiny_model_dirs: dict[str, Path]) -> None:
    """On a CPU no step replays a graph, so every read-back comes ahead of the next launch and,
    given ``emit``, leaves through it before that launch; the tokens are the same either way."""
    model_dir = tiny_model_dirs["tiny-qwen2"]
    prompts = make_prompts(500, [4, 19], seed=12)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine = make_engine(model_dir)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    emitted: list[RequestOutput] = []
    returned: list[RequestOutput] = []
    per_call = []  # (outputs emitted, outputs returned)
    while engine.has_unfinished():
        before = len(emitted)
        outputs = engine.step(emit=emitted.extend)
        returned += outputs
        per_call.append((len(emitted) - before, len(outputs)))
    assert all(e == 0 or r == 0 for e, r in per_call) and any(e for e, _ in per_call)
    tokens: dict[str, list[int]] = {"0": [], "1": []}
    for out in emitted + returned:
        tokens[out.request_id] += out.new_token_ids
    assert [tokens["0"], tokens["1"]] == make_engine(model_dir, overlap=False).generate(prompts, params)


def test_a_seeded_request_stopped_by_a_token_leaves_nothing_behind(tiny_model_dirs: dict[str, Path]) -> None:
    """A seeded request that a stop token ends (overlap on: the step after it is launched once
    the read-back finished it) leaves no random state behind: a later request with the same id
    and seed draws its seed's tokens, not a continuation."""
    engine = make_engine(tiny_model_dirs["tiny-qwen2"])
    prompt = make_prompts(engine.model_config.vocab_size, [7], seed=21)[0]
    free = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    engine.add_request("a", prompt, free)
    run = [t for step in engine.drain() for o in step for t in o.new_token_ids]
    stop = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True, stop_token_ids=(run[2],))
    engine.add_request("b", prompt, stop)
    assert [t for step in engine.drain() for o in step for t in o.new_token_ids] == run[:3]
    engine.add_request("b", prompt, free)  # the id again, the same seed: the same tokens
    again = [t for step in engine.drain() for o in step for t in o.new_token_ids]
    assert again == run


def test_a_seeded_request_continued_from_its_tokens_draws_as_if_uninterrupted(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """What a moved request is: its prompt and tokens so far, prefilled again elsewhere (here
    another engine), with the same seed. It goes on with the tokens the first run drew."""
    model_dir = tiny_model_dirs["tiny-llama"]
    prompt = make_prompts(500, [9], seed=22)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, seed=77, ignore_eos=True)
    whole = make_engine(model_dir).generate([prompt], params)[0]
    rest = make_engine(model_dir).generate([prompt + whole[:5]], dataclasses.replace(params, max_tokens=7))[0]
    assert rest == whole[5:]


def test_an_unchunked_prefill_step_counts_the_running_sequences(tiny_model_dirs: dict[str, Path]) -> None:
    """Without chunked prefill a prefill step decodes nothing, and it admitted prompts as if no
    sequence were running: past max_num_seqs, the bound the CUDA graphs are sized for."""
    engine = make_engine(
        tiny_model_dirs["tiny-qwen2"], enable_chunked_prefill=False, max_num_batched_tokens=256, max_num_seqs=2
    )
    prompts = make_prompts(engine.model_config.vocab_size, [5, 6, 7], seed=22)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompts[0], params)
    engine.step()
    engine.add_request("b", prompts[1], params)
    engine.add_request("c", prompts[2], params)
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == 2
