"""Overlapped steps: the engine launches a step before reading back the one before it.

The oracle is the same engine with ``overlap_scheduling=False`` (itself checked against
transformers in test_engine.py): every request must end with the same tokens, reason and counts,
and every block must come back, whatever stops, aborts or preempts it while a step is in flight.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import LLMEngine, RequestOutput
from engine.sampling import SamplingParams
from engine.step_plan import pending_token, write_pending_tokens
from tests.test_engine import make_engine, make_prompts


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
        str(i): (prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                        stop_token_ids=(free_run[i][pick],) if pick is not None else ()))
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
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           prefill_only=True)
    outputs = [out for step in engine.drain() for out in step]
    assert sorted(o.request_id for o in outputs) == ["0", "1"]
    for out in outputs:
        prompt = prompts[int(out.request_id)]
        assert out.finish_reason == "prefilled" and len(out.new_token_ids) == 1
        assert out.kv_block_ids is not None and len(out.kv_block_ids) == -(-len(prompt) // block_size)
        assert engine.held[out.request_id].num_computed_tokens == len(prompt)


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
