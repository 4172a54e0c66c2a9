"""Each bad request is refused with an error naming its field; the engine keeps serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import RequestError, SamplingParams, validate_request


@pytest.fixture(scope="module")
def engine(tiny_model_dirs: dict[str, Path]) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(tiny_model_dirs["tiny-qwen2"]), device="cpu", max_model_len=64, cache=CacheConfig(num_blocks=32)
        )
    )


BAD_REQUESTS = [
    ([], {}, "prompt"),
    ([1, 2, 512], {}, "prompt_token_ids"),  # vocab is 512
    ([1, -1], {}, "prompt_token_ids"),
    ([1, True], {}, "prompt_token_ids"),  # a bool is not a token id
    ([1, 2.0], {}, "prompt_token_ids"),
    ([1, "2"], {}, "prompt_token_ids"),
    ([1, 2], {"max_tokens": 0}, "max_tokens"),
    ([1, 2], {"temperature": -1.0}, "temperature"),
    ([1, 2], {"top_p": 0.0}, "top_p"),
    ([1, 2], {"top_p": 1.01}, "top_p"),
    ([1, 2], {"top_k": 0}, "top_k"),
    ([1, 2], {"top_k": -5}, "top_k"),
    (list(range(60)), {"max_tokens": 5}, "max_tokens"),  # 60 + 5 > max_model_len 64
    (list(range(64)), {"max_tokens": 1}, "prompt"),  # no room to answer: the prompt is what to shorten
    ([1, 2], {"stop_token_ids": (9999,)}, "stop_token_ids"),
]


@pytest.mark.parametrize(("prompt", "kwargs", "field"), BAD_REQUESTS)
def test_bad_request_is_refused_and_a_good_one_beside_it_completes(
    engine: LLMEngine, prompt: list[int], kwargs: dict, field: str
) -> None:
    engine.add_request("good", [3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    with pytest.raises(RequestError) as info:
        engine.add_request("bad", prompt, SamplingParams(**kwargs))
    assert info.value.field == field and field in str(info.value)
    outputs = [out for step in engine.drain() for out in step]
    assert [o.request_id for o in outputs if o.finished] == ["good"]
    assert sum(len(o.new_token_ids) for o in outputs) == 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_duplicate_request_id_is_refused(engine: LLMEngine) -> None:
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2, temperature=0.0))
    with pytest.raises(RequestError, match="request_id"):
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    list(engine.drain())


@pytest.mark.parametrize(
    ("prompt", "named"),
    [([5, 600, -1], "600"), ([5, -1, 600], "-1"), ([5, 2.5, 600], "2.5"), ([5, False, -1], "False")],
)
def test_error_names_the_first_bad_token_id(prompt: list[object], named: str) -> None:
    with pytest.raises(RequestError, match=f"token id {named} is outside"):
        validate_request(prompt, SamplingParams(max_tokens=1), vocab_size=512, max_model_len=64)  # type: ignore[arg-type]
