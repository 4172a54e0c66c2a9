"""Property-based fuzzing of the HTTP API's request parsing (no cluster): valid bodies with
some of the route's own fields given arbitrary JSON values, and arbitrary bytes. Every one is
either a checked request or an ``APIError`` with a 4xx status (what the client then reads),
never another exception, which the server would answer with a 500 for the client's own
mistake."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.router.openai_api import (
    APIError,
    ChatRequest,
    CompletionRequest,
    parse_detokenize,
    parse_request,
    parse_tokenize,
)

MODEL = "demo"
MAX_MODEL_LEN = 256
MAX_PROMPT_CHARS = 4096
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Values near what fields take and past their bounds, and anything else JSON holds.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([-1, 0, 1, 2, 5, 20, 255, 256, 2**31, 2**63, -(2**63) - 1, 2**64]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0, 1e-9, 1e30, -1e30]),
    st.floats(allow_nan=False),
    st.text(max_size=30),
    st.sampled_from([MODEL, "user", "assistant", "text", "json_object", "none", "auto", ""]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=15,
)
# Mostly well-formed messages, so that parsing reaches the fields past them.
text = st.text(max_size=40)
content = st.one_of(
    text,
    text,
    text,
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]), "text": text})),
    values,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "user", "user", "assistant", "tool"]), "content": content},
    optional={"name": st.one_of(text, values)},
)
prompt = st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 70_000), max_size=8), values)


def bodies(base: dict[str, Any], fields: list[str]) -> st.SearchStrategy[bytes]:
    """``base`` with up to three of ``fields`` (or an unknown one) set to any value."""
    overrides = st.dictionaries(st.sampled_from([*fields, "unknown_field"]), values, max_size=3)
    return st.builds(lambda o: json.dumps({**base, **o}).encode(), overrides)


COMPLETION = st.builds(lambda p: {"model": MODEL, "prompt": p, "max_tokens": 4}, prompt)
CHAT = st.builds(lambda m: {"model": MODEL, "messages": m, "max_tokens": 4}, st.lists(message, min_size=1, max_size=3))


raw = st.one_of(st.binary(max_size=60), st.sampled_from([b"", b"null", b"[]", b"{", b'{"prompt": "\\ud800"}']))


def parsed_or_4xx(parse: Any, *args: Any) -> None:
    try:
        parse(*args)
    except APIError as e:
        assert 400 <= e.status < 500, (e.status, e.message)


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


@FUZZ
@given(body=st.one_of(COMPLETION.flatmap(lambda b: bodies(b, list(CompletionRequest.model_fields))), raw))
def test_a_completion_body_is_parsed_or_refused_with_a_4xx(tokenizer: Any, body: bytes) -> None:
    parsed_or_4xx(parse_request, "completion", body, [MODEL], tokenizer, MAX_MODEL_LEN, MAX_PROMPT_CHARS)


@FUZZ
@given(body=st.one_of(CHAT.flatmap(lambda b: bodies(b, list(ChatRequest.model_fields))), raw))
def test_a_chat_body_is_parsed_or_refused_with_a_4xx(tokenizer: Any, body: bytes) -> None:
    parsed_or_4xx(parse_request, "chat", body, [MODEL], tokenizer, MAX_MODEL_LEN, MAX_PROMPT_CHARS)


@FUZZ
@given(
    body=st.one_of(
        st.one_of(COMPLETION, CHAT).flatmap(
            lambda b: bodies(b, ["model", "add_special_tokens", "add_generation_prompt", "return_token_strs"])
        ),
        raw,
    )
)
def test_a_tokenize_body_is_parsed_or_refused_with_a_4xx(tokenizer: Any, body: bytes) -> None:
    parsed_or_4xx(parse_tokenize, body, [MODEL], tokenizer, MAX_PROMPT_CHARS)


@FUZZ
@given(
    body=st.one_of(st.lists(st.integers(-5, 70_000)).flatmap(lambda t: bodies({"tokens": t}, ["model", "tokens"])), raw)
)
def test_a_detokenize_body_is_parsed_or_refused_with_a_4xx(tokenizer: Any, body: bytes) -> None:
    parsed_or_4xx(parse_detokenize, body, [MODEL], tokenizer)
