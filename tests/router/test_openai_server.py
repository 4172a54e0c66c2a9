"""The OpenAI-compatible HTTP front end against a real CPU cluster on the demo model.

One cluster (``launch.py``, 1 prefill + 1 decode group) and one front end
(``python -m pdserve.router.openai_server``) per module, both subprocesses. The official
``openai`` client must get the ZMQ client's greedy text; raw HTTP (httpx) checks the SSE framing,
each bad-input class's status and error body, and that a client going away frees its KV. The
module's last test drains the cluster, so the tests run in file order.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.compare import LaunchedCluster, LoggedProcess
from pdserve.cluster.client import Client, ClusterError, ClusterUnavailable, Final
from pdserve.cluster.group import free_port
from pdserve.cluster.protocol import Chunk, Error, GroupInfo, Logprobs, Stats
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.tokenization import encode_chat, encode_prompt
from pdserve.router.openai_api import APIError, ChatRequest, Prompt, parse_request
from pdserve.router.openai_app import Frontend, _Run
from pdserve.router.openai_server import RepeatLimit
from pdserve.router.stop_strings import StopStringMatcher
from pdserve.tests.cluster.helpers import oracle

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 512
MODEL = "smollm2-demo"  # the name the served cluster answers to (--served-model-name)
QUESTION = "What is the capital of France?"
TEXT_PROMPT = "The three primary colours are"


# -- stop strings (no cluster) --------------------------------------------------------------


def feed(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out, stopped = [], False
    for delta in deltas:
        text, stopped = matcher.add(delta)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), stopped


def test_stop_strings_cut_before_the_first_match_even_across_deltas() -> None:
    assert feed(["STOP"], ["abc ST", "O", "P def"]) == ("abc ", True)
    assert feed(["xyz", "c d"], ["ab", "c de", "xyz"]) == ("ab", True)  # the earliest match wins
    assert feed(["STOP"], ["abc ST", "OP"]) == ("abc ", True)
    assert feed(["STOP"], ["abc ST", "ART"]) == ("abc START", False)  # held-back tail released
    assert feed([], ["a", "b"]) == ("ab", False)
    assert feed(["\n"], ["one\ntwo"]) == ("one", True)


def test_stop_strings_kept_in_the_output_or_not_yet_allowed() -> None:
    """``include_stop_str_in_output`` ends the text after the match, holding nothing back;
    ``min_tokens`` (``may_stop`` false) lets no match end in a delta, though one that starts
    there and ends in a later, allowed delta counts, as vLLM's do."""
    include = StopStringMatcher(["STOP", "P d"], include=True)
    assert [include.add(d) for d in ["abc ST", "OP def"]] == [("abc ST", False), ("OP", True)]
    assert include.matched == "STOP"  # the earliest match
    late = StopStringMatcher(["ab", "STOP"])
    steps = [late.add("x ab ST", may_stop=False), late.add("O", may_stop=False), late.add("Pab")]
    assert steps == [("x ab ", False), ("", False), ("", True)]  # "ab" was in text that could not stop
    held = StopStringMatcher(["ab"])
    assert [held.add("xa", may_stop=False), held.add("b")] == [("x", False), ("", True)]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_delta_events_are_the_chunk_bodies_events(kind: str) -> None:
    """The stream's pre-rendered events hold exactly what rendering each chunk's body would."""
    from pdserve.router.openai_api import GenerationRequest
    from pdserve.router.openai_app import _DeltaEvents, _event

    gen = GenerationRequest(kind, 'a "model" \\ é', [Prompt([1, 2])], {"max_tokens": 4})
    delta = _DeltaEvents(gen)
    for text in ["", "Paris", ' "quoted" \\ back', "line\nbreak\t\x00", "é 東京 🚀", gen.id, "data: [DONE]\n\n"]:
        assert delta(text) == _event(gen.chunk(text)), text
        assert json.loads(delta(text).removeprefix(b"data: ")) == gen.chunk(text)


def test_an_image_in_a_chat_is_refused_by_name() -> None:
    """What a chat UI sends for a picture: refused as such, not as pydantic's failed union branch
    ("messages.0.content.str: Input should be a valid string")."""
    from pdserve.router.openai_api import APIError, parse_request

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]}
    with pytest.raises(APIError) as refused:
        parse_request("chat", json.dumps(body).encode(), [MODEL], None, MAX_MODEL_LEN, 1000)
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "invalid_value", "messages")
    assert refused.value.message == (
        "Invalid value for messages.0.content: only text content parts are supported, got type 'image_url'"
    )


def refusal(messages: list[Any]) -> APIError:
    body = {"model": MODEL, "messages": messages}
    with pytest.raises(APIError) as refused:
        parse_request("chat", json.dumps(body).encode(), [MODEL], None, MAX_MODEL_LEN, 1000)
    return refused.value


@pytest.mark.parametrize("role", ["system", "developer", "user"])
def test_a_chat_message_without_content_is_refused_unless_an_assistants(role: str) -> None:
    """OpenAI requires content but for an assistant message (which then carries tool calls)."""
    hi = {"role": "user", "content": "hi"}
    for bad in ({"role": role}, {"role": role, "content": None}):
        refused = refusal([hi, bad])
        assert (refused.status, refused.code, refused.param) == (400, "missing_required_parameter", "messages")
        assert refused.message == "Missing required parameter: messages.1.content"
    request = ChatRequest.model_validate({"model": MODEL, "messages": [hi, {"role": "assistant"}, hi]})
    assert request.messages[1].content is None


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (5, "expected a string or a list of text parts, got a number"),
        ({"type": "text", "text": "hi"}, "expected a string or a list of text parts, got an object"),
        ([{"type": "text", "text": 5}], "part 0 needs its text as a string, got a number"),
        ([{"type": "text", "text": "a"}, {"type": "text"}], "part 1 has no text"),
        (["hi"], "part 0 must be an object (a text part), got a string"),
        (
            [{"type": "text", "text": "a", "colour": "red"}],
            "part 0 has the unrecognized key 'colour' (a text part has type and text)",
        ),
    ],
)
def test_bad_content_is_explained_not_named_by_the_unions_branches(content: Any, why: str) -> None:
    """Without this, pydantic names the first branch that failed: "messages.0.content.str: Input
    should be a valid string", which says nothing of the list of text parts also accepted."""
    refused = refusal([{"role": "user", "content": content}])
    assert (refused.status, refused.code, refused.param) == (400, "invalid_value", "messages")
    assert refused.message == f"Invalid value for messages.0.content: {why}"


@pytest.mark.parametrize(
    ("extra", "param", "why"),
    [
        ({"prompt": [-1]}, "prompt", "item 0 must be a token id in [0, 2147483647], got -1"),
        ({"prompt": [[1], [2, 1.5]]}, "prompt", "item 1.1 must be a token id (an integer), got a number"),
        ({"prompt": [1, True]}, "prompt", "item 1 must be a token id (an integer), got a boolean"),
        ({"prompt": ["a", 1]}, "prompt", "item 1 must be a string, as item 0 is, got a number"),
        ({"prompt": [[1], 2]}, "prompt", "item 1 must be a list of token ids, as item 0 is, got a number"),
        ({"prompt": 5}, "prompt", "expected a string or a list of token ids, got a number"),
        ({"prompt": None}, "prompt", "expected a string or a list of token ids, got null"),
        ({"prompt": "hi", "stop": [1]}, "stop", "item 0 must be a string, got a number"),
        ({"prompt": "hi", "stop": {"a": 1}}, "stop", "expected a string or a list of strings, got an object"),
        # An empty stop string would end every output at its first token: vLLM refuses it too.
        ({"prompt": "hi", "stop": ""}, "stop", "a stop string must not be empty"),
        ({"prompt": "hi", "stop": ["a", ""]}, "stop", "item 1 must not be empty"),
        ({"prompt": "hi", "stop": ["s"] * 129}, "stop", "at most 128 stop strings, got 129"),
    ],
)
def test_a_bad_prompt_or_stop_is_explained_not_named_by_the_unions_branches(
    extra: dict[str, Any], param: str, why: str
) -> None:
    """Not "Invalid value for prompt.str: Input should be a valid string" for a token id of -1."""
    with pytest.raises(APIError) as refused:
        parsed("completion", extra, None)
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "invalid_value", param)
    assert refused.value.message == f"Invalid value for {param}: {why}"


def test_every_prompt_and_stop_shape_is_still_accepted(demo_tokenizer: Any) -> None:
    for prompt in ([5, 7], [[5, 7]]):
        assert parsed("completion", {"prompt": prompt}, None).prompts == [Prompt([5, 7])]
    assert parsed("completion", {"prompt": [0, 2**31 - 1]}, None).prompts == [Prompt([0, 2**31 - 1])]
    # Stop strings match text: a model with a tokenizer's (one without refuses them).
    assert parsed("completion", {"prompt": [1], "stop": "a"}, demo_tokenizer).stop == ["a"]
    assert parsed("completion", {"prompt": [1], "stop": ["a", "b"]}, demo_tokenizer).stop == ["a", "b"]


# What SDKs, frameworks and chat UIs send besides the prompt, each with a value that changes
# nothing of the output: accepted, and the request checked is the one without them.
NEUTRAL_FIELDS: dict[str, dict[str, Any]] = {
    "user": {"user": "user-1234"},
    "stream_options null": {"stream_options": None},
    "stream null": {"stream": None},
    "zero penalties": {"presence_penalty": 0, "frequency_penalty": 0.0},
    "vLLM's neutral penalty and min_p": {"repetition_penalty": 1, "min_p": 0.0},
    "logit_bias null": {"logit_bias": None},
    "logit_bias empty": {"logit_bias": {}},
    "logprobs false": {"logprobs": False},
    "return_tokens_as_token_ids null": {"return_tokens_as_token_ids": None},
    "n 1": {"n": 1},
    "null sampling": {"temperature": None, "top_p": None, "seed": None, "n": None},
    "max_tokens null": {"max_tokens": None},
    "stop null": {"stop": None},
    "stop empty": {"stop": []},
    # vLLM's extensions at their defaults, as a client configured for vLLM sends them.
    "vLLM's beam search off": {"use_beam_search": False, "length_penalty": 1.0},
    "vLLM's priority 0": {"priority": 0},
    "vLLM's nulls": {"truncate_prompt_tokens": None, "guided_json": None, "structured_outputs": None},
    "vLLM's bad_words empty": {"bad_words": []},
    "vLLM's spaces_between_special_tokens": {"spaces_between_special_tokens": True},
    "vLLM's unused tuning": {
        "guided_decoding_backend": "xgrammar",
        "guided_whitespace_pattern": None,
        "mm_processor_kwargs": {},
        "media_io_kwargs": None,
        "logits_processors": None,
        "vllm_xargs": {},
    },
    "vLLM's off switches": {
        "return_token_ids": False,
        "structural_tag": None,
        "kv_transfer_params": None,
        "cache_salt": None,
    },
}
CHAT_NEUTRAL_FIELDS: dict[str, dict[str, Any]] = {
    "response_format text": {"response_format": {"type": "text"}},
    "parallel_tool_calls true": {"parallel_tool_calls": True},
    "parallel_tool_calls false": {"parallel_tool_calls": False},
    "tools empty": {"tools": []},
    "tool_choice none": {"tool_choice": "none"},
    "store and metadata": {"store": False, "metadata": {"session": "abc"}},
    "store true, metadata null": {"store": True, "metadata": None},
    "top_logprobs 0": {"logprobs": False, "top_logprobs": 0},
    "max_completion_tokens null": {"max_completion_tokens": None},
    # OpenAI's newer fields: a service tier, a cache key and an end-user id mean nothing here.
    "service_tier": {"service_tier": "auto"},
    "prompt_cache_key and safety_identifier": {"prompt_cache_key": "tenant-7", "safety_identifier": "u-9"},
    "modalities text": {"modalities": ["text"]},
    "null reasoning_effort, verbosity, functions": {"reasoning_effort": None, "verbosity": None, "functions": None},
    "chat_template_kwargs empty": {"chat_template_kwargs": {}},
    "OpenAI's prompt caching hints": {
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"ttl": "30m"},
        "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION, "prompt_cache_breakpoint": {}}]}],
    },
    "moderation null": {"moderation": None},
    "vLLM's chat defaults": {
        "add_special_tokens": False,
        "chat_template": None,
        "documents": None,
        "include_reasoning": True,
    },
    "a text part's cache_control": {
        "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION, "cache_control": {"type": "x"}}]}]
    },
}
COMPLETION_NEUTRAL_FIELDS: dict[str, dict[str, Any]] = {
    "echo false": {"echo": False},
    "suffix null": {"suffix": None},
    "best_of 1": {"best_of": 1},
    "logprobs null": {"logprobs": None},
    "vLLM's completion defaults": {"add_special_tokens": True, "response_format": None, "prompt_embeds": None},
}


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model_dir: Path) -> Any:
    from pdserve.engine.tokenization import load_tokenizer

    return load_tokenizer(str(demo_model_dir))


def parsed(kind: str, body: dict[str, Any], tokenizer: Any) -> Any:
    return parse_request(kind, json.dumps({"model": MODEL, **body}).encode(), [MODEL], tokenizer, MAX_MODEL_LEN, 1000)


@pytest.mark.parametrize("model", [{}, {"model": None}, {"model": ""}], ids=["absent", "null", "empty"])
def test_a_request_that_names_no_model_gets_the_served_one(model: dict[str, Any]) -> None:
    """As vLLM's server: a deployment of one model need not be named by every client."""
    body = json.dumps({"prompt": [1, 2], **model}).encode()
    gen = parse_request("completion", body, [MODEL], None, MAX_MODEL_LEN, 1000)
    assert gen.model == MODEL and gen.response("", "stop", {})["model"] == MODEL


QWEN_GENERATION_CONFIG = {  # Qwen2.5-Instruct's, as its repository ships it
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "transformers_version": "4.37.0",
}


def test_a_models_generation_config_gives_the_fields_a_request_leaves_out(tmp_path: Path) -> None:
    """As vLLM's --generation-config auto: Qwen2.5-Instruct sampled at OpenAI's defaults
    (temperature 1, no top-k) instead of its own got other, usually worse, text."""
    from pdserve.router.openai_api import generation_defaults

    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN_GENERATION_CONFIG))
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}

    def sampling(body: dict[str, Any]) -> dict[str, Any]:
        encoded = json.dumps({"prompt": [1, 2], **body}).encode()
        sampling = parse_request("completion", encoded, [MODEL], None, MAX_MODEL_LEN, 1000, defaults=defaults)
        return {k: sampling.sampling[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}

    assert sampling({}) == {**defaults, "min_p": 0.0}
    # A request's own values win, the ones that turn a field off included.
    own = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.0}
    assert sampling(own) == own
    assert sampling({"top_k": 0})["top_k"] == -1  # vLLM's other "off"
    assert sampling({"temperature": 0.3}) == {**defaults, "temperature": 0.3, "min_p": 0.0}

    (tmp_path / "generation_config.json").write_text(json.dumps({**QWEN_GENERATION_CONFIG, "top_p": 2}))
    with pytest.raises(ValueError, match=r"generation_config.json: Invalid value for top_p"):
        generation_defaults(tmp_path)


def test_a_negative_seed_is_a_seed_as_in_vllm() -> None:
    """Any int64, as vLLM takes it (tools send -1): each one its own seed in the cluster's range."""
    seeds = [parsed("completion", {"prompt": [1], "seed": seed}, None).sampling["seed"] for seed in (-1, -(2**63), 5)]
    assert seeds == [2**63 - 1, 0, 5]


def test_choices_are_requests_of_their_own_with_seeds_one_apart() -> None:
    gen = parsed("completion", {"prompt": [1, 2], "n": 3, "seed": 2**63 - 2, "temperature": 1.0}, None)
    assert gen.n == 3
    assert [gen.sampling_of(i)["seed"] for i in range(3)] == [2**63 - 2, 2**63 - 1, 0]
    unseeded = parsed("completion", {"prompt": [1, 2], "n": 2}, None)
    assert unseeded.sampling_of(1) == unseeded.sampling
    with pytest.raises(APIError) as info:
        parsed("completion", {"prompt": [1, 2], "n": 129}, None)
    assert (info.value.status, info.value.param) == (400, "n")


def test_a_batch_of_prompts_is_a_choice_per_prompt_and_n(demo_tokenizer: Any) -> None:
    """A completion's list of prompts (lm-evaluation-harness batches its requests so): choices
    ``i * n`` to ``i * n + n - 1`` are prompt i's, each prompt's first choice as its own request
    would be; each is checked as one, and a fault names its place in the batch."""
    body = {"prompt": ["The sky is", "Paris is in"], "n": 2, "seed": 3, "temperature": 1.0, "echo": True}
    gen = parsed("completion", body, demo_tokenizer)
    alone = [parsed("completion", {**body, "prompt": p, "n": 1}, demo_tokenizer) for p in body["prompt"]]
    assert gen.choices == 4 and gen.prompts == [a.prompts[0] for a in alone]
    assert [gen.prompt_of(i).echo for i in range(4)] == ["The sky is"] * 2 + ["Paris is in"] * 2
    assert [gen.sampling_of(i)["seed"] for i in range(4)] == [3, 4, 3, 4]
    assert gen.sampling_of(2) == alone[1].sampling
    by_ids = parsed("completion", {"prompt": [[5, 7], [9]]}, None)
    assert by_ids.prompts == [Prompt([5, 7]), Prompt([9])] and by_ids.choices == 2
    refused = {
        "prompt.1 is empty": {"prompt": [[5], []]},
        "in the prompt.1, 16 to generate": {"prompt": [[5], [5] * MAX_MODEL_LEN]},
        f"prompt.1 holds {MAX_MODEL_LEN}, and a prompt scored with max_tokens 0 may hold at most {MAX_MODEL_LEN - 1}": {
            "prompt": [[5], [5] * MAX_MODEL_LEN],
            "max_tokens": 0,
            "echo": True,
        },
        "characters in the prompts together": {"prompt": ["a" * 600, "b" * 600]},
        "3000 requests, more than this server starts for one (2048)": {"prompt": [[5]] * 1000, "n": 3},
    }
    for why, extra in refused.items():
        with pytest.raises(APIError) as info:
            parsed("completion", extra, demo_tokenizer)
        assert info.value.param == "prompt" and why in info.value.message, info.value.message


def test_a_request_of_several_choices_is_checked_before_it_fans_out(demo_model_dir: Path) -> None:
    """The cluster's checks run in the front end first: one refusal, not one per choice (each
    a warning in the router's log)."""
    frontend = Frontend("tcp://127.0.0.1:1", str(demo_model_dir), MODEL)  # never connects
    frontend.max_model_len = MAX_MODEL_LEN
    bodies = {
        "logit_bias": {"prompt": [1, 2], "n": 3, "logit_bias": {"49152": 1}},
        "stop_token_ids": {"prompt": [1, 2], "n": 2, "stop_token_ids": [50_000]},
        "prompt": {"prompt": [1, 49_152], "n": 2},
    }
    for field, body in bodies.items():
        gen = parse_request("completion", json.dumps(body).encode(), [MODEL], frontend.tokenizer, MAX_MODEL_LEN, 1000)
        with pytest.raises(APIError) as info:
            frontend._check_sampling(gen)
        assert (info.value.status, info.value.param) == (400, field), info.value.message
    frontend._check_sampling(
        parse_request("completion", b'{"prompt": [1, 2], "n": 2}', [MODEL], None, MAX_MODEL_LEN, 1000)
    )
    batch = parse_request("completion", b'{"prompt": [[1], [49152]]}', [MODEL], None, MAX_MODEL_LEN, 1000)
    with pytest.raises(APIError) as info:  # a batch's fault names the prompt
        frontend._check_sampling(batch)
    assert info.value.param == "prompt" and info.value.message.startswith("prompt.1: "), info.value.message


def test_logprobs_are_asked_for_as_each_endpoint_spells_it(demo_tokenizer: Any) -> None:
    """A completion's ``logprobs: N`` (0: the tokens' own only; false: none); a chat's
    ``logprobs: true`` with ``top_logprobs: N``."""
    completion, chat = {"prompt": [1, 2]}, {"messages": [{"role": "user", "content": "hi"}]}
    assert parsed("completion", {**completion, "logprobs": 3}, None).sampling["logprobs"] == 3
    assert parsed("completion", {**completion, "logprobs": 0}, None).sampling["logprobs"] == 0
    assert parsed("completion", {**completion, "logprobs": False}, None).sampling["logprobs"] is None
    assert parsed("chat", {**chat, "logprobs": True, "top_logprobs": 2}, demo_tokenizer).sampling["logprobs"] == 2
    assert parsed("chat", {**chat, "logprobs": True}, demo_tokenizer).sampling["logprobs"] == 0
    refused = {
        "top_logprobs": ("chat", {**chat, "top_logprobs": 2}),
        "logprobs": ("completion", {**completion, "logprobs": 21}),
    }
    for param, (kind, body) in refused.items():
        with pytest.raises(APIError) as info:
            parsed(kind, body, demo_tokenizer)
        assert (info.value.status, info.value.param) == (400, param), info.value.message


def test_a_chat_that_fills_the_context_without_max_tokens_is_told_so(demo_tokenizer: Any) -> None:
    """Without max_tokens a chat may generate what its messages leave; messages that leave nothing
    are refused in those words, not with a negative count of tokens to generate."""
    with pytest.raises(APIError) as refused:
        parsed("chat", {"messages": [{"role": "user", "content": "7" * 600}]}, demo_tokenizer)  # a token a digit
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"
    assert "which leaves none to generate" in refused.value.message and "-" not in refused.value.message
    fits = parsed("chat", {"messages": [{"role": "user", "content": "hi"}]}, demo_tokenizer)
    assert len(fits.prompts[0].token_ids) + fits.sampling["max_tokens"] == MAX_MODEL_LEN


def same_request(a: Any, b: Any) -> bool:
    """Two checked requests the cluster would run alike and answer in the same shape."""
    keys = ("kind", "model", "prompts", "sampling", "stop", "stream", "include_usage")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


@pytest.mark.parametrize(
    ("kind", "extra"),
    [("chat", e) for e in (*NEUTRAL_FIELDS.values(), *CHAT_NEUTRAL_FIELDS.values())]
    + [("completion", e) for e in (*NEUTRAL_FIELDS.values(), *COMPLETION_NEUTRAL_FIELDS.values())],
    ids=[f"chat: {n}" for n in (*NEUTRAL_FIELDS, *CHAT_NEUTRAL_FIELDS)]
    + [f"completion: {n}" for n in (*NEUTRAL_FIELDS, *COMPLETION_NEUTRAL_FIELDS)],
)
def test_fields_clients_send_with_their_unused_values_are_accepted_and_change_nothing(
    kind: str, extra: dict[str, Any], demo_tokenizer: Any
) -> None:
    base: dict[str, Any] = (
        {"prompt": TEXT_PROMPT} if kind == "completion" else {"messages": [{"role": "user", "content": QUESTION}]}
    )
    assert same_request(parsed(kind, {**base, **extra}, demo_tokenizer), parsed(kind, base, demo_tokenizer))


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}


def test_tools_the_model_may_not_call_are_accepted_and_change_nothing(demo_tokenizer: Any) -> None:
    """``tool_choice: none`` with tools (agent frameworks send their tools on every turn): the
    tools stay out of the prompt, as vLLM's ``--exclude-tools-when-tool-choice-none`` leaves them."""
    base = {"messages": [{"role": "user", "content": QUESTION}]}
    with_tools = {**base, "tools": [TOOL], "tool_choice": "none"}
    assert same_request(parsed("chat", with_tools, demo_tokenizer), parsed("chat", base, demo_tokenizer))


def test_every_field_the_official_client_declares_gets_an_answer_of_its_own() -> None:
    """Each field of the installed SDK's create parameters (the stream options and a text part
    too) is one this server reads, ignores or refuses by name: never "Unrecognized request
    argument", which is for fields neither OpenAI nor vLLM has."""
    from openai.types import completion_create_params as completion
    from openai.types.chat import chat_completion_content_part_text_param as text_part
    from openai.types.chat import chat_completion_stream_options_param as stream_options
    from openai.types.chat import completion_create_params as chat

    from pdserve.router.openai_api import ChatRequest, CompletionRequest, StreamOptions, TextPart

    def declared(typed_dict: type) -> set[str]:
        return {name for cls in typed_dict.__mro__ for name in getattr(cls, "__annotations__", {})}

    for sdk, ours in (
        (completion.CompletionCreateParamsStreaming, CompletionRequest),
        (chat.CompletionCreateParamsStreaming, ChatRequest),
        (stream_options.ChatCompletionStreamOptionsParam, StreamOptions),
        (text_part.ChatCompletionContentPartTextParam, TextPart),
    ):
        assert declared(sdk) - set(ours.model_fields) == set(), sdk.__name__


def test_a_request_id_names_the_response_as_vllms_does(demo_tokenizer: Any) -> None:
    """vLLM's ``request_id``: the response's id after its route's prefix, and the cluster's."""
    chat = parsed("chat", {"messages": [{"role": "user", "content": "hi"}], "request_id": "trace-7"}, demo_tokenizer)
    assert chat.id == "chatcmpl-trace-7" and chat.response("", "stop", {})["id"] == "chatcmpl-trace-7"
    assert parsed("completion", {"prompt": [1, 2], "request_id": "trace-7"}, None).id == "cmpl-trace-7"
    assert parsed("completion", {"prompt": [1, 2]}, None).id.startswith("cmpl-")
    with pytest.raises(APIError) as refused:
        parsed("completion", {"prompt": [1, 2], "request_id": "x" * 300}, None)
    assert (refused.value.code, refused.value.param) == ("invalid_value", "request_id")


def test_a_completion_may_leave_the_special_tokens_out(demo_tokenizer: Any) -> None:
    """vLLM's ``add_special_tokens: false``: the text's tokens alone, as /tokenize gives them."""
    from pdserve.engine.tokenization import encode_prompt

    bare = parsed("completion", {"prompt": TEXT_PROMPT, "add_special_tokens": False}, demo_tokenizer)
    assert bare.prompts[0].token_ids == encode_prompt(demo_tokenizer, TEXT_PROMPT, False, add_special_tokens=False)
    assert same_request(
        parsed("completion", {"prompt": TEXT_PROMPT, "add_special_tokens": True}, demo_tokenizer),
        parsed("completion", {"prompt": TEXT_PROMPT}, demo_tokenizer),
    )


def test_stream_options_may_leave_include_usage_null(demo_tokenizer: Any) -> None:
    body = {"prompt": TEXT_PROMPT, "stream": True}
    for options, usage in (
        ({"include_usage": None}, False),
        ({}, False),
        ({"include_usage": True}, True),
        ({"include_obfuscation": True}, False),  # OpenAI's padding of each event: ignored
    ):
        request = parsed("completion", {**body, "stream_options": options}, demo_tokenizer)
        assert request.stream and request.include_usage is usage, options


def test_a_reply_as_the_official_client_dumps_it_is_a_valid_next_turn(demo_tokenizer: Any) -> None:
    """``messages.append(reply.choices[0].message.model_dump())``: the dump carries refusal,
    tool_calls, audio, ... as null beside role and content; the turn reads as role and content."""
    from openai.types.chat import ChatCompletionMessage

    reply = ChatCompletionMessage(role="assistant", content="Paris.").model_dump()
    assert {"refusal", "tool_calls", "function_call", "audio", "annotations"} <= set(reply)
    question = {"role": "user", "content": QUESTION}
    again = {"role": "user", "content": "And of Spain?"}
    plain = {"role": "assistant", "content": "Paris."}
    dumped = parsed("chat", {"messages": [question, reply, again]}, demo_tokenizer)
    assert same_request(dumped, parsed("chat", {"messages": [question, plain, again]}, demo_tokenizer))
    empty_lists = {**plain, "tool_calls": [], "annotations": []}
    assert same_request(parsed("chat", {"messages": [question, empty_lists, again]}, demo_tokenizer), dumped)


@pytest.mark.parametrize(
    ("kind", "extra", "param", "message"),
    [
        ("completion", {"best_of": True}, "best_of", "best_of is not supported by this server"),
        ("completion", {"suffix": "and so on"}, "suffix", "suffix is not supported by this server"),
        ("chat", {"tool_choice": "auto"}, "tool_choice", "tool_choice is not supported by this server"),
        ("chat", {"tools": [TOOL]}, "tools", "tools is not supported by this server"),  # OpenAI's choice: auto
        (
            "chat",
            {"response_format": {"type": "json_object"}},
            "response_format",
            "response_format is not supported by this server",
        ),
        # Fields OpenAI or vLLM know, which used to be "Unrecognized request argument".
        ("chat", {"reasoning_effort": "low"}, "reasoning_effort", "reasoning_effort is not supported by this server"),
        ("chat", {"modalities": ["text", "audio"]}, "modalities", "modalities is not supported by this server"),
        ("completion", {"guided_json": {}}, "guided_json", "guided_json is not supported by this server"),
        ("completion", {"use_beam_search": True}, "use_beam_search", "use_beam_search is not supported by this server"),
        ("completion", {"prompt_logprobs": 1}, "prompt_logprobs", "prompt_logprobs is not supported by this server"),
        ("chat", {"cache_salt": "tenant-7"}, "cache_salt", "cache_salt is not supported by this server"),
        ("chat", {"return_token_ids": True}, "return_token_ids", "return_token_ids is not supported by this server"),
        ("chat", {"chat_template": "{{ x }}"}, "chat_template", "chat_template is not supported by this server"),
        (
            "chat",
            {"add_special_tokens": True},
            "add_special_tokens",
            "add_special_tokens is not supported by this server",
        ),
        ("completion", {"prompt_embeds": "AAAA"}, "prompt_embeds", "prompt_embeds is not supported by this server"),
        (
            "completion",
            {"response_format": {"type": "json_object"}},
            "response_format",
            "response_format is not supported by this server",
        ),
        (
            "chat",
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [{}]},
                ]
            },
            "messages",
            "messages.1.tool_calls is not supported by this server",
        ),
        (
            "chat",
            {"messages": [{"role": "assistant", "content": None, "refusal": "I can't."}]},
            "messages",
            "messages.0.refusal is not supported by this server",
        ),
    ],
)
def test_values_that_would_change_the_output_are_refused_by_name(
    kind: str, extra: dict[str, Any], param: str, message: str
) -> None:
    base: dict[str, Any] = (
        {"prompt": "hi"} if kind == "completion" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    with pytest.raises(APIError) as refused:
        parsed(kind, {**base, **extra}, None)
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "unsupported_parameter", param)
    assert refused.value.message == message


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"parallel_tool_calls": "yes"}, "Invalid value for parallel_tool_calls: Input should be a valid boolean"),
        ({"metadata": {"n": 1}}, "Invalid value for metadata.n: Input should be a valid string"),
        ({"stream": "true"}, "Invalid value for stream: Input should be a valid boolean"),
    ],
)
def test_accepted_fields_are_still_typed(extra: dict[str, Any], why: str) -> None:
    with pytest.raises(APIError) as refused:
        parsed("chat", {"messages": [{"role": "user", "content": "hi"}], **extra}, None)
    assert (refused.value.status, refused.value.code, refused.value.message) == (400, "invalid_value", why)


def test_chat_template_kwargs_reach_the_template(demo_model_dir: Path) -> None:
    """vLLM's ``chat_template_kwargs`` (``enable_thinking``): more variables for the template,
    none that replaces the server's own rendering."""
    from pdserve.engine.tokenization import load_tokenizer

    tokenizer = load_tokenizer(str(demo_model_dir))
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}"
    )
    base = {"messages": [{"role": "user", "content": "hi"}]}
    assert parsed("chat", base, tokenizer).prompts[0].token_ids == tokenizer.encode("hi", add_special_tokens=False)
    off = parsed("chat", {**base, "chat_template_kwargs": {"enable_thinking": False}}, tokenizer)
    assert off.prompts[0].token_ids == tokenizer.encode("hi /no_think", add_special_tokens=False)
    with pytest.raises(APIError) as refused:
        parsed("chat", {**base, "chat_template_kwargs": {"messages": []}}, tokenizer)
    assert (refused.value.code, refused.value.param) == ("invalid_request", "chat_template_kwargs")
    assert "'messages'" in refused.value.message


def test_an_unknown_field_inside_a_message_is_named_in_full() -> None:
    """Not "Unrecognized request argument supplied: messages", which names the whole list."""
    with pytest.raises(APIError) as refused:
        parsed("chat", {"messages": [{"role": "user", "content": "hi", "tool_call_id": "call_1"}]}, None)
    assert (refused.value.code, refused.value.param) == ("unrecognized_argument", "messages")
    assert refused.value.message == "Unrecognized request argument supplied: messages.0.tool_call_id"
    with pytest.raises(APIError) as refused:
        parsed("completion", {"prompt": "hi", "stream": True, "stream_options": {"include_colour": True}}, None)
    assert refused.value.message == "Unrecognized request argument supplied: stream_options.include_colour"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_bodies_have_openais_shapes_with_a_null_system_fingerprint(kind: str) -> None:
    """The official client's own types read every body; each carries system_fingerprint (null)
    as OpenAI's do, the id its endpoint's prefix."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from pdserve.router.openai_api import GenerationRequest

    gen = GenerationRequest(kind, MODEL, [Prompt([1, 2])], {"max_tokens": 4})
    usage = {"prompt_tokens": 2, "completion_tokens": 3}
    whole = gen.response("Paris", "stop", usage, cached_tokens=0)
    chunks = [gen.chunk("Par", first=True), gen.chunk("is"), gen.chunk(None, "length"), gen.usage_chunk(usage)]
    for body in (whole, *chunks):
        assert "system_fingerprint" in body and body["system_fingerprint"] is None
        assert body["id"].startswith("cmpl-" if kind == "completion" else "chatcmpl-") and body["id"] == gen.id
    whole_type, chunk_type = (Completion, Completion) if kind == "completion" else (ChatCompletion, ChatCompletionChunk)
    read = whole_type.model_validate(whole)
    assert (read.object, read.usage.total_tokens, read.choices[0].finish_reason) == (
        "text_completion" if kind == "completion" else "chat.completion",
        5,
        "stop",
    )
    # The SDK reads a completion's stream with its Completion type, whose finish_reason may not be
    # null: only the last chunks validate (as OpenAI's own stream's would).
    for chunk in chunks if kind == "chat" else chunks[2:]:
        assert chunk_type.model_validate(chunk).object == (
            "text_completion" if kind == "completion" else "chat.completion.chunk"
        )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5


class StalledCluster:
    """A cluster client whose requests never get a token: what a long queue or prefill looks like."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def stream(self, **_: Any) -> Any:
        await asyncio.Event().wait()
        yield  # an async generator, as AsyncClient.stream

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


def completions_call(
    frontend: Frontend, request: dict[str, Any], client_leaves_after: float | None, path: str = "/v1/completions"
) -> list[dict[str, Any]]:
    """``POST path`` straight to the front end's ASGI app: the messages it sends. The client
    disconnects ``client_leaves_after`` seconds after its body was read (None: it stays)."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", b"application/json")],
        "query_string": b"",
    }
    sent: list[dict[str, Any]] = []

    async def serve() -> None:
        messages = [{"type": "http.request", "body": json.dumps(request).encode(), "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            if client_leaves_after is None:
                await asyncio.Event().wait()
            await asyncio.sleep(client_leaves_after or 0.0)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await asyncio.wait_for(frontend.app()(scope, receive, send), 10)
        await asyncio.sleep(0.1)  # an abort runs on its own task

    asyncio.run(serve())
    return sent


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_before_the_first_token_has_its_request_aborted(
    demo_model_dir: Path, stream: bool
) -> None:
    """Waiting for the first token (a long queue, a long prompt), streamed or not, the front end
    still watches the connection: a client that leaves then gets its request aborted in the
    cluster, not prefilled for nobody; the answer is a 499, not an internal error."""
    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL)
    frontend.max_model_len = MAX_MODEL_LEN
    cluster = frontend.client = StalledCluster()  # type: ignore[assignment]
    request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream}
    sent = completions_call(frontend, request, client_leaves_after=0.2)  # the request is in the cluster by then
    assert sent[0]["status"] == 499
    assert [c[:5] for c in cluster.cancelled] == ["cmpl-"] and frontend.in_flight == 0


class SilentCluster:
    """A cluster client that sends one token, then stops answering within the client's timeout
    (a live but overloaded cluster); the abort that follows is answered after all."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def stream(self, request_id: str, **_: Any) -> Any:
        yield Chunk(request_id, [7], "a")
        raise ClusterUnavailable("tcp://127.0.0.1:1", 30.0, connected=True)

    async def cancel(self, request_id: str) -> Final:
        self.cancelled.append(request_id)
        return Final(request_id, "abort", [7, 7], "aa", {"prompt_tokens": 3, "completion_tokens": 2}, {})


def counter_samples(frontend: Frontend) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The front end's counters as exposed, by name and labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(frontend.metrics.exposition().decode())
        for s in family.samples
        if s.name.endswith("_total")
    }


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_the_cluster_stops_answering_counts_once_as_an_error(demo_model_dir: Path, stream: bool) -> None:
    """The client gets cluster_unavailable and the request is aborted in the cluster (its KV
    freed there); the metrics count it once, as that error, not also as a finished abort."""
    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL)
    frontend.max_model_len = MAX_MODEL_LEN
    cluster = frontend.client = SilentCluster()  # type: ignore[assignment]
    request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream}
    sent = completions_call(frontend, request, client_leaves_after=None)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    assert "cluster_unavailable" in body
    assert [c[:5] for c in cluster.cancelled] == ["cmpl-"] and frontend.in_flight == 0
    counters = {key: value for key, value in counter_samples(frontend).items() if value}
    expected = {("pdserve:request_error_total", (("model_name", MODEL), ("reason", "cluster_unavailable"))): 1.0}
    assert counters == expected, counters


class GoneCluster(SilentCluster):
    """As ``SilentCluster``, but the abort gets no final either (the router stopped answering)."""

    async def cancel(self, request_id: str) -> None:  # type: ignore[override]
        self.cancelled.append(request_id)


def test_a_request_left_with_no_final_to_be_had_counts_what_it_used(demo_model_dir: Path) -> None:
    """A client that leaves mid-stream while the cluster no longer answers: its request counts
    once, as an abort, with the tokens the front end saw. The counter was given one label of
    two: a ValueError in the accounting task, and no count at all (review)."""
    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL)
    frontend.max_model_len = MAX_MODEL_LEN
    run = _Run(frontend, parsed("completion", {"prompt": [1, 2, 3], "max_tokens": 4}, None), time.perf_counter())
    frontend.client = GoneCluster()  # type: ignore[assignment]
    run.generated = 2
    asyncio.run(run._abandoned(time.perf_counter(), counted=False))
    counters = {key: value for key, value in counter_samples(frontend).items() if value}
    assert counters == {
        ("pdserve:request_success_total", (("finished_reason", "abort"), ("model_name", MODEL))): 1.0,
        ("pdserve:prompt_tokens_total", (("model_name", MODEL),)): 3.0,
        ("pdserve:generation_tokens_total", (("model_name", MODEL),)): 2.0,
    }, counters


class FailingChoiceCluster:
    """A cluster client whose requests each send a token; then choice 1 of several (or the one
    request) meets ``fault`` while the others wait for more."""

    def __init__(self, fault: Exception, n: int) -> None:
        self.fault = fault
        self.n = n
        self.cancelled: list[str] = []

    async def stream(self, request_id: str, **_: Any) -> Any:
        yield Chunk(request_id, [7], "a")
        if self.n == 1 or request_id.endswith("-1"):
            raise self.fault
        await asyncio.Event().wait()

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("fault", ["cluster", "bug"])
def test_a_choice_that_fails_ends_the_response_with_its_error_and_aborts_the_others(
    demo_model_dir: Path, fault: str, stream: bool, n: int
) -> None:
    """A failure in one choice mid-run (the cluster's error, or a fault of the front end's own):
    a whole response gets the error's status (500 for the front end's own, with its body); a
    stream, whose 200 went out with its first chunk, ends with the error event and ``[DONE]``,
    never cut off. Every other choice is aborted in the cluster (its KV freed), and so is the
    failing one where the cluster did not end it itself; the error is counted once."""
    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL)
    frontend.max_model_len = MAX_MODEL_LEN
    error = ClusterError(Error("x", "worker_failed", "decode group 0 failed")) if fault == "cluster" else KeyError("x")
    cluster = frontend.client = FailingChoiceCluster(error, n)  # type: ignore[assignment]
    request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "n": n, "stream": stream}
    sent = completions_call(frontend, request, client_leaves_after=None)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    code, status = ("worker_failed", 503) if fault == "cluster" else ("internal_error", 500)
    if stream:
        assert sent[0]["status"] == 200 and body.endswith("\n\ndata: [DONE]\n\n"), body
        last = json.loads(body.split("data: ")[-2])
    else:
        assert sent[0]["status"] == status
        last = json.loads(body)
    assert last["error"]["code"] == code and last["error"]["type"] == "server_error", last
    # Choices by their index (the request id's suffix); the one request of n=1 as "only".
    aborted = {c.rsplit("-", 1)[-1] if n > 1 else "only" for c in cluster.cancelled}
    failing = "1" if n > 1 else "only"
    assert aborted == ({"0", "2"} if n > 1 else set()) | ({failing} if fault == "bug" else set())
    assert frontend.in_flight == 0
    errors = {k: v for k, v in counter_samples(frontend).items() if v and k[0] == "pdserve:request_error_total"}
    assert errors == {("pdserve:request_error_total", (("model_name", MODEL), ("reason", code))): 1.0}, errors


class StatsOnlyCluster:
    """A cluster client that answers only ``stats``: ready, of ``vocab_size`` token ids."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    async def stats(self, timeout: float | None = None) -> Stats:
        return Stats(0, {}, ready=True, max_model_len=MAX_MODEL_LEN, vocab_size=self.vocab_size)


class RefusingHandshakeCluster:
    """A cluster client whose handshakes the router refused (it wants CURVE keys)."""

    refused = True

    async def stats(self, timeout: float | None = None) -> Stats:
        raise ClusterUnavailable("tcp://127.0.0.1:1", timeout or 0.0, refused=True)


def test_a_cluster_that_wants_keys_is_told_from_one_that_is_down(demo_model_dir: Path) -> None:
    """Both answer 503 cluster_unavailable; the one whose router refused the handshake says which
    setting is missing, as the ZMQ client does."""
    from fastapi.testclient import TestClient

    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL)
    frontend.client = RefusingHandshakeCluster()  # type: ignore[assignment]
    health = TestClient(frontend.app()).get("/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "cluster_unavailable"
    assert "--auth-keys DIR" in health.json()["error"]["message"]


class GroupsCluster(StatsOnlyCluster):
    """One ready prefill group and decode groups in the given states."""

    def __init__(self, vocab_size: int, decode_states: list[str]) -> None:
        super().__init__(vocab_size)
        self.decode_states = decode_states

    async def stats(self, timeout: float | None = None) -> Stats:
        states = [("prefill", 0, "ready"), *(("decode", g, state) for g, state in enumerate(self.decode_states))]
        members = [GroupInfo(r, g, 1, state, "ipc://x", ["cpu"], False, 0, 0, 0) for r, g, state in states]
        unserved = [] if "ready" in self.decode_states else ["decode"]
        return Stats(
            0, {}, False, True, MAX_MODEL_LEN, members=members, vocab_size=self.vocab_size, unserved_roles=unserved
        )


def test_health_is_ok_while_requests_run_though_a_group_restarts(demo_model_dir: Path) -> None:
    """A load balancer's probe: one group of several restarting leaves the cluster serving (200);
    with no decode group ready, 503 not_ready, naming the role and every group's state."""
    vocab = json.loads((demo_model_dir / "config.json").read_text())["vocab_size"]
    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL)

    async def health(decode_states: list[str]) -> httpx.Response:
        frontend.client = GroupsCluster(vocab, decode_states)  # type: ignore[assignment]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=frontend.app()), base_url="http://x") as http:
            return await http.get("/health")

    assert asyncio.run(health(["starting", "ready"])).status_code == 200
    for decode_states, why in (
        (["starting", "down"], "no ready decode group (groups: prefill0 ready, decode0 starting, decode1 down)"),
        ([], "no ready decode group (groups: prefill0 ready)"),  # none yet joined
    ):
        response = asyncio.run(health(decode_states))
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "not_ready" and error["message"] == f"the cluster cannot serve now: {why}", error


def test_a_cluster_of_another_model_is_refused_with_the_reason(
    demo_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server started with another --model than the cluster's would tokenize every prompt into
    ids the cluster refuses (blamed on the client's prompt) or, within its vocabulary, into
    garbage: it answers 503 model_mismatch instead, and logs why once."""
    vocab = json.loads((demo_model_dir / "config.json").read_text())["vocab_size"]
    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL)
    frontend.client = StatsOnlyCluster(512)  # type: ignore[assignment]
    request = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    with caplog.at_level(logging.ERROR):
        for _ in range(2):
            sent = completions_call(frontend, request, client_leaves_after=None)
            body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
            assert sent[0]["status"] == 503 and body["error"]["code"] == "model_mismatch", body
            assert f"{vocab} token ids" not in body["error"]["message"]
            assert "512 token ids" in body["error"]["message"] and f"one of {vocab}" in body["error"]["message"]
    assert sum("model_mismatch" in r.message or "512 token ids" in r.message for r in caplog.records) == 1
    assert frontend.max_model_len is None
    frontend.client = StatsOnlyCluster(vocab)  # type: ignore[assignment]
    asyncio.run(frontend._stats())
    assert frontend.max_model_len == MAX_MODEL_LEN


def test_a_repeated_warning_is_logged_once_a_minute_with_a_count() -> None:
    """A client that is not HTTP (a ZMQ client on the HTTP port) gets uvicorn's warning once a
    minute, not once a retry; the next line counts the held ones, other lines pass."""
    now = [0.0]
    limit = RepeatLimit(("Invalid HTTP request received.",), interval=60.0, clock=lambda: now[0])

    def passes(message: str) -> str | None:
        record = logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, message, None, None)
        return record.getMessage() if limit.filter(record) else None

    assert passes("Invalid HTTP request received.") == "Invalid HTTP request received."
    for t in (0.1, 0.2, 59.9):
        now[0] = t
        assert passes("Invalid HTTP request received.") is None
        assert passes("something else") == "something else"
    now[0] = 60.5
    assert (
        passes("Invalid HTTP request received.") == "Invalid HTTP request received. (3 more since the last such line)"
    )
    now[0] = 200.0
    assert passes("Invalid HTTP request received.") == "Invalid HTTP request received."


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text("ab<", min_size=1, max_size=6), min_size=1, max_size=4),
    deltas=st.lists(st.text("ab<x", max_size=5), max_size=12),
)
def test_stop_strings_hold_back_exactly_the_text_that_could_still_start_one(
    stops: list[str], deltas: list[str]
) -> None:
    """After each delta the matcher has sent all the text but its longest end that a stop string
    starts with (and does not complete), until a stop string ends the output."""
    matcher = StopStringMatcher(stops)
    sent, text = "", ""
    for delta in deltas:
        out, stopped = matcher.add(delta)
        sent, text = sent + out, text + delta
        if stopped:
            assert not any(stop in sent for stop in stops)
            return
        held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        assert sent == text[: len(text) - held]


def test_stop_strings_never_send_a_character_of_a_stop_string() -> None:
    matcher = StopStringMatcher(["</end>"])
    sent = [matcher.add(d)[0] for d in ["x<", "/e", "n"]]
    assert "".join(sent) == "x"  # "</en" could still become the stop string
    assert matcher.add("d> tail") == ("", True)
    assert matcher.flush() == ""


class LaggingCluster:
    """A cluster client whose request goes on two tokens past a stop string before the abort
    reaches it (a front end behind the router): the abort's final counts those too."""

    async def stream(self, request_id: str, **_: Any) -> Any:
        for text in ("a", " STOP", "b", "c"):
            yield Chunk(request_id, [7], text)
        yield Final(request_id, "abort", [7, 7, 7, 7], "a STOPbc", {"prompt_tokens": 3, "completion_tokens": 4}, {})

    async def abort(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("stream", [True, False])
def test_a_completion_cut_at_a_stop_string_counts_its_tokens_up_to_it(demo_model_dir: Path, stream: bool) -> None:
    """Usage is the completion's: the tokens up to the one that completed the stop string, as
    vLLM counts, not what the cluster generated until the abort reached it."""
    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL)
    frontend.max_model_len = MAX_MODEL_LEN
    frontend.client = LaggingCluster()  # type: ignore[assignment]
    request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 8, "stop": ["STOP"], "stream": stream}
    if stream:
        request["stream_options"] = {"include_usage": True}
    sent = completions_call(frontend, request, client_leaves_after=None)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    if stream:
        events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        text = "".join(choice["text"] for event in events for choice in event["choices"])
        usage = events[-1]["usage"]
    else:
        text, usage = json.loads(body)["choices"][0]["text"], json.loads(body)["usage"]
    assert text == "a "
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (3, 2, 5)


class ScriptedCluster(LaggingCluster):
    """A cluster client that answers every request with ``texts``, a token each, then stops."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    async def stream(self, request_id: str, **_: Any) -> Any:
        for text in self.texts:
            yield Chunk(request_id, [7], text)
        usage = {"prompt_tokens": 3, "completion_tokens": len(self.texts)}
        yield Final(request_id, "stop", [7] * len(self.texts), "".join(self.texts), usage, {})


class LogprobsCluster(LaggingCluster):
    """A cluster client that answers with two tokens and their log-probabilities, no text (a
    model with no tokenizer)."""

    async def stream(self, request_id: str, **_: Any) -> Any:
        for token in (7, 9):
            yield Chunk(request_id, [token], "", logprobs=Logprobs([-0.5], [[token]], [[-0.5]]))
        yield Final(request_id, "length", [7, 9], "", {"prompt_tokens": 3, "completion_tokens": 2}, {})


@pytest.mark.parametrize("stream", [True, False])
def test_logprobs_of_a_model_with_no_tokenizer_name_their_tokens_by_id(
    tiny_model_dirs: dict[str, Path], stream: bool
) -> None:
    """With no tokenizer a token's text is ``token_id:<id>``, as ``return_tokens_as_token_ids``
    asks: decoding it was a 500, and a stream cut off with no error event and no [DONE]; stop
    strings, which match text, are refused (review)."""
    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(tiny_model_dirs["tiny-llama"]), served_model_name=MODEL)
    assert frontend.tokenizer is None
    frontend.max_model_len = MAX_MODEL_LEN
    frontend.client = LogprobsCluster()  # type: ignore[assignment]
    request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 1, "stream": stream}
    sent = completions_call(frontend, request, client_leaves_after=None)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    assert sent[0]["status"] == 200, body
    if stream:
        assert body.endswith("data: [DONE]\n\n")
        events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        tokens = [t for event in events for c in event["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    else:
        tokens = json.loads(body)["choices"][0]["logprobs"]["tokens"]
    assert tokens == ["token_id:7", "token_id:9"]
    with pytest.raises(APIError) as info:
        parsed("completion", {"prompt": [1, 2], "stop": ["x"]}, None)
    assert (info.value.status, info.value.param) == (400, "stop")
    with pytest.raises(APIError) as info:  # not "no chat template: use /v1/completions", which a text refuses too
        parsed("chat", {"messages": [{"role": "user", "content": "hi"}]}, None)
    assert "no tokenizer: use /v1/completions with a prompt of token ids" in info.value.message


@pytest.mark.parametrize("texts", [["Hel", "lo", "!"], []], ids=["text", "stopped at once"])
def test_a_streamed_chats_chunks_have_openais_shape(demo_model_dir: Path, texts: list[str]) -> None:
    """The first chunk always carries content ("" before any text: a stop string or EOS at the
    first token left it out), and with include_usage every chunk before the usage chunk says
    ``usage: null``, as OpenAI's and vLLM's do: clients that read ``delta["content"]`` or
    ``chunk["usage"]`` raised KeyError."""
    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL)
    frontend.max_model_len = MAX_MODEL_LEN
    frontend.client = ScriptedCluster(texts)  # type: ignore[assignment]
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = completions_call(frontend, request, client_leaves_after=None, path="/v1/chat/completions")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    assert body.endswith("data: [DONE]\n\n")
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    *chunks, usage = events
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": texts[0] if texts else ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "".join(texts)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert all("usage" in c and c["usage"] is None for c in chunks), chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(texts)


class RecordingCluster(LaggingCluster):
    """A cluster client that keeps the token ids of each request it is sent."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.requests: list[dict[str, Any]] = []

    async def stream(self, request_id: str, **kwargs: Any) -> Any:
        self.prompts.append(kwargs["token_ids"])
        self.requests.append(kwargs)
        async for message in super().stream(request_id):
            yield message


def recording_frontend(model_dir: Path, **settings: Any) -> tuple[Frontend, RecordingCluster]:
    """A front end of ``model_dir`` with ``settings``, in front of a ``RecordingCluster``."""
    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(model_dir), served_model_name=MODEL, **settings)
    frontend.max_model_len = MAX_MODEL_LEN
    cluster = frontend.client = RecordingCluster()  # type: ignore[assignment]
    return frontend, cluster


@pytest.mark.parametrize("generation_config", ["auto", "none"])
def test_the_front_end_samples_as_the_models_generation_config_says(
    demo_model_dir: Path, tmp_path: Path, generation_config: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``--generation-config`` reaches the front end: auto (the default) takes the fields a
    request leaves out from the model's generation_config.json, and says so; none, OpenAI's."""
    shutil.copytree(demo_model_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN_GENERATION_CONFIG))
    with caplog.at_level(logging.WARNING):
        frontend, cluster = recording_frontend(tmp_path, generation_config=generation_config)
    completions_call(frontend, {"model": MODEL, "prompt": [1, 2], "top_p": 0.5}, client_leaves_after=None)
    [sent] = cluster.requests
    fields = {k: sent[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty")}
    if generation_config == "auto":
        assert fields == {"temperature": 0.7, "top_p": 0.5, "top_k": 20, "repetition_penalty": 1.05}
        [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert "generation_config.json values: temperature=0.7, top_p=0.8, top_k=20" in warning
    else:
        assert fields == {"temperature": 1.0, "top_p": 0.5, "top_k": -1, "repetition_penalty": 1.0}
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("parse_special_tokens", [True, False])
def test_special_token_text_is_read_as_the_clusters_setting_says(
    demo_model_dir: Path, demo_tokenizer: Any, parse_special_tokens: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """``--parse-special-tokens`` reaches the front end: its prompts get the ids the router gives
    the same text (docs/protocol.md), control tokens with it, plain text without. Without it, the
    first such completion prompt tells the operator, once, that vLLM would read them as tokens."""
    frontend, cluster = recording_frontend(demo_model_dir, parse_special_tokens=parse_special_tokens)
    prompt = "<|im_start|>user\nHi<|im_end|>\n"
    with caplog.at_level(logging.WARNING, logger="pdserve.router.openai_app"):
        for _ in range(2):
            completions_call(frontend, {"model": MODEL, "prompt": prompt, "max_tokens": 8}, client_leaves_after=None)
    told = [r.getMessage() for r in caplog.records if "--parse-special-tokens" in r.getMessage()]
    assert len(told) == (0 if parse_special_tokens else 1), told
    expected = encode_prompt(demo_tokenizer, prompt, chat=False, parse_special_tokens=parse_special_tokens)
    assert cluster.prompts == [expected, expected]
    assert (expected != encode_prompt(demo_tokenizer, prompt, chat=False)) == parse_special_tokens
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
    args = ([MODEL], demo_tokenizer, MAX_MODEL_LEN, 1000, parse_special_tokens)
    assert parse_request("chat", json.dumps(chat).encode(), *args).prompts == [
        Prompt(encode_chat(demo_tokenizer, chat["messages"], parse_special_tokens))
    ]


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_whose_body_ends_after_the_drain_began_is_refused(demo_model_dir: Path, stream: bool) -> None:
    """A drain waits only for requests in flight: one still sending its body when SIGTERM came
    was not, so it gets the 503 a new request gets, not a run the exit cuts off unanswered."""
    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL)
    frontend.max_model_len = MAX_MODEL_LEN
    frontend.client = LaggingCluster()  # type: ignore[assignment]
    body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 8, "stream": stream}).encode()
    parts = [body[:10], body[10:]]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if len(parts) == 1:  # SIGTERM between the body's two parts
            frontend.start_draining()
        if parts:
            return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(frontend.app()(scope, receive, send), 10))
    assert sent[0]["status"] == 503 and json.loads(sent[1]["body"])["error"]["code"] == "shutting_down"
    assert frontend.in_flight == 0 and frontend.drained()


class EndlessCluster:
    """A cluster client whose request generates one token, then runs until it is aborted."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self._abort: asyncio.Event | None = None

    async def stream(self, request_id: str, **_: Any) -> Any:
        self._abort = asyncio.Event()
        yield Chunk(request_id, [7], "a")
        await self._abort.wait()
        yield Final(request_id, "abort", [7], "a", {"prompt_tokens": 3, "completion_tokens": 1}, {})

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        assert self._abort is not None
        self._abort.set()


class OneAtATimeCluster(EndlessCluster):
    """An ``EndlessCluster`` that, as ``AsyncClient`` does, refuses a request whose id is running."""

    def __init__(self) -> None:
        super().__init__()
        self.live: set[str] = set()

    async def stream(self, request_id: str, **kwargs: Any) -> Any:
        if request_id in self.live:
            raise ClusterError(Error(request_id, "duplicate_request_id", f"request_id {request_id!r} is running"))
        self.live.add(request_id)
        try:
            async for message in super().stream(request_id, **kwargs):
                yield message
        finally:
            self.live.discard(request_id)


def test_a_duplicate_request_id_refused_leaves_the_running_request_counted(demo_model_dir: Path) -> None:
    """A second request with the request_id of one still running gets 400 duplicate_request_id,
    and the first still counts as in flight: a drain waits for it (its refusal used to take the
    first's place in the front end's running set, and SIGTERM then exited under it)."""
    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL)
    frontend.max_model_len = MAX_MODEL_LEN
    frontend.client = OneAtATimeCluster()  # type: ignore[assignment]
    request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 8, "stream": True, "request_id": "same"}
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}

    async def call(leave: asyncio.Event | None, sent: list[dict[str, Any]]) -> None:
        messages = [{"type": "http.request", "body": json.dumps(request).encode(), "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await (leave or asyncio.Event()).wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await frontend.app()(scope, receive, send)

    async def main() -> None:
        first: list[dict[str, Any]] = []
        second: list[dict[str, Any]] = []
        leave = asyncio.Event()
        running = asyncio.ensure_future(call(leave, first))
        while not frontend.in_flight:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(call(None, second), 10)
        error = json.loads(second[1]["body"])["error"]
        assert second[0]["status"] == 400 and error["code"] == "duplicate_request_id"
        assert error["message"] == "request_id 'same' is already running"  # the client's id, not the cluster's
        assert frontend.in_flight == 1 and not running.done()
        frontend.start_draining()
        assert not frontend.drained()
        leave.set()  # the first request's client leaves: it is aborted and ends
        await asyncio.wait_for(running, 10)
        assert frontend.in_flight == 0

    asyncio.run(main())


class TailCluster(LaggingCluster):
    """A cluster client whose request ends (length) with text a stop string might still have
    begun: the front end holds it back until the final."""

    async def stream(self, request_id: str, **_: Any) -> Any:
        yield Chunk(request_id, [5], "a")
        yield Chunk(request_id, [6], "\n")
        yield Final(request_id, "length", [5, 6], "a\n", {"prompt_tokens": 3, "completion_tokens": 2}, {})


def test_a_stream_whose_client_leaves_during_its_held_back_tail_is_counted(demo_model_dir: Path) -> None:
    """The request ran to its end: it counts as finished in the metrics though its client left
    while its last text (held back for a stop string) was being sent, and nothing is aborted."""
    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL)
    frontend.max_model_len = MAX_MODEL_LEN
    frontend.client = TailCluster()  # type: ignore[assignment]
    request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "stream": True, "stop": ["\n\n"]}
    messages = [{"type": "http.request", "body": json.dumps(request).encode(), "more_body": False}]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.sleep(0.3)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and b"\\n" in message.get("body", b""):
            await asyncio.sleep(5)  # the client stops reading as the tail goes out

    asyncio.run(asyncio.wait_for(frontend.app()(scope, receive, send), 10))
    counters = {key: value for key, value in counter_samples(frontend).items() if value}
    finished = ("pdserve:request_success_total", (("finished_reason", "length"), ("model_name", MODEL)))
    assert counters.get(finished) == 1.0, counters
    assert counters.get(("pdserve:generation_tokens_total", (("model_name", MODEL),))) == 2.0, counters


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_the_drain_outlasts_is_aborted_and_still_answered(demo_model_dir: Path, stream: bool) -> None:
    """Past --drain-timeout a running request is aborted in the cluster (its KV freed there) and
    its client gets the request's end, finish_reason "abort", before the server may exit, not
    a connection the exit cuts off."""
    frontend = Frontend(
        f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL, drain_timeout=0.2
    )
    frontend.max_model_len = MAX_MODEL_LEN
    cluster = frontend.client = EndlessCluster()  # type: ignore[assignment]
    body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 8, "stream": stream}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def serve_then_drain() -> bool:
        served = asyncio.ensure_future(frontend.app()(scope, receive, send))
        while not frontend.in_flight:
            await asyncio.sleep(0.01)
        frontend.start_draining()
        while not frontend.drained():  # as the server's tick polls it
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)
        return served.done()

    assert asyncio.run(asyncio.wait_for(serve_then_drain(), 10)), "the server may exit with the request unanswered"
    assert [c[:5] for c in cluster.aborted] == ["cmpl-"] and frontend.in_flight == 0
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    assert sent[0]["status"] == 200
    if stream:
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "abort" and text.rstrip().endswith("data: [DONE]")
    else:
        assert json.loads(text)["choices"][0]["finish_reason"] == "abort"


# -- the HTTP app without a cluster ---------------------------------------------------------


def frontend_app(demo_model_dir: Path, **kwargs: Any) -> Any:
    """The front end's app on a port no cluster listens on: what it answers by itself."""
    from pdserve.router.openai_app import Frontend

    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), **{"served_model_name": MODEL, **kwargs})
    frontend.max_model_len = MAX_MODEL_LEN  # what the cluster would say
    return frontend.app()


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_client_that_leaves_while_sending_its_body_is_no_internal_error(
    demo_model_dir: Path, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Starlette raises ClientDisconnect when the body ends in a disconnect: that is a 499 (the
    client closed the request), not a 500 logged with a traceback and counted as internal_error."""
    app = frontend_app(demo_model_dir)
    incoming = [{"type": "http.request", "body": b'{"prompt": "he', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "client": ("127.0.0.1", 5),
        "server": ("127.0.0.1", 8000),
    }
    with caplog.at_level(logging.ERROR):
        asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert "internal error" not in caplog.text


def openai_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> str:
    """The response's error message, once its status and body are OpenAI's."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert (error["code"], error["param"]) == (code, param), error
    return error["message"]


def test_a_server_started_before_its_cluster_says_so(demo_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """It used to start without a word, answering 503 to every request."""
    from fastapi.testclient import TestClient

    from pdserve.router.openai_app import Frontend

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING), TestClient(Frontend(endpoint, str(demo_model_dir)).app()) as http:
        assert http.get("/health").status_code == 503
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"the cluster at {endpoint} does not answer (yet): requests get 503 cluster_unavailable" in warnings[0]


def test_unknown_routes_and_methods_get_openais_error_body(demo_model_dir: Path) -> None:
    from fastapi.testclient import TestClient

    http = TestClient(frontend_app(demo_model_dir))
    assert openai_error(http.post("/v1/embeddings", json={}), 404, "not_found") == "Invalid URL (POST /v1/embeddings)"
    wrong_method = http.get("/v1/chat/completions")
    message = openai_error(wrong_method, 405, "method_not_allowed")
    assert message == "Invalid method for URL (GET /v1/chat/completions)" and wrong_method.headers["allow"] == "POST"
    for path in ("/v1/completions/", "/v1/chat/completions/"):  # a trailing slash serves the route too
        openai_error(http.post(path, content=b"{not json"), 400, "malformed_json")
    deep = b'{"prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # past the stack of json.loads
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        openai_error(http.post(path, content=deep), 400, "malformed_json")


def test_cluster_errors_get_the_status_a_client_retries_on_or_not() -> None:
    """A refusal that a later try may not meet (the cluster busy, restarting or stopping) is a
    503, which OpenAI's clients retry; a request the cluster cannot serve is a 400."""
    from pdserve.router.openai_app import _cluster_error

    def status(code: str, message: str = "m") -> int:
        return _cluster_error(ClusterError(Error("http-0", code, message))).status

    for code in ("overloaded", "shutting_down", "shutdown", "worker_failed", "no_group"):
        assert status(code) == 503, code
    assert status("invalid_request", "max_tokens: too many") == 400
    assert status("request_too_large") == 413  # larger as the cluster's message than its JSON was
    assert status("internal_error") == 500
    duplicate = _cluster_error(ClusterError(Error("cmpl-x", "duplicate_request_id", "request_id 'cmpl-x' is running")))
    assert (duplicate.status, duplicate.code, duplicate.param) == (400, "duplicate_request_id", "request_id")


class RefusingCluster(LaggingCluster):
    """A cluster client whose router finds a fault in the prompt's token ids."""

    async def stream(self, request_id: str, **_: Any) -> Any:
        raise ClusterError(Error(request_id, "invalid_request", "token_ids: 9 tokens with max_tokens 8 exceed 16"))
        yield  # an async generator, as the client's


def test_a_prompt_the_cluster_refuses_names_the_chats_messages(demo_model_dir: Path) -> None:
    """The router refuses a prompt by its ids; over HTTP the field, in ``param`` and the message,
    is what the client sent: a completion's ``prompt``, a chat's ``messages``."""
    from fastapi.testclient import TestClient

    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name=MODEL)
    frontend.max_model_len = MAX_MODEL_LEN
    http = TestClient(frontend.app())
    frontend.client = RefusingCluster()  # type: ignore[assignment]  # after TestClient: no lifespan ran
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    message = openai_error(http.post("/v1/chat/completions", json=chat), 400, "invalid_request", "messages")
    assert message == "messages: 9 tokens with max_tokens 8 exceed 16"  # not the ids' wire name
    completion = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 8}
    message = openai_error(http.post("/v1/completions", json=completion), 400, "invalid_request", "prompt")
    assert message == "prompt: 9 tokens with max_tokens 8 exceed 16"


def test_a_model_is_retrieved_by_its_id(demo_model_dir: Path) -> None:
    """``client.models.retrieve(id)``: the card /v1/models lists; another id is a 404, as OpenAI's."""
    from fastapi.testclient import TestClient

    http = TestClient(frontend_app(demo_model_dir))
    (card,) = http.get("/v1/models").json()["data"]
    assert http.get(f"/v1/models/{MODEL}").json() == card
    assert http.get("/v1/models/").json() == http.get("/v1/models").json()  # a trailing slash: the list
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    message = openai_error(http.get("/v1/models/gpt-4"), 404, "model_not_found", "model")
    assert message == f"The model 'gpt-4' does not exist: this server serves '{MODEL}'"
    # A served name with a slash, as Hugging Face names go; the official client sends it escaped.
    http = TestClient(frontend_app(demo_model_dir, served_model_name="org/some-model"))
    for path in ("/v1/models/org/some-model", "/v1/models/org%2Fsome-model"):
        assert http.get(path).json()["id"] == "org/some-model", path
    # Several names (vLLM's aliases): each listed and answered to; responses name the first.
    http = TestClient(frontend_app(demo_model_dir, served_model_name="qwen, gpt-4o"))
    assert [card["id"] for card in http.get("/v1/models").json()["data"]] == ["qwen", "gpt-4o"]
    assert http.get("/v1/models/gpt-4o").json()["id"] == "gpt-4o"
    message = openai_error(http.get("/v1/models/gpt-4"), 404, "model_not_found", "model")
    assert message == "The model 'gpt-4' does not exist: this server serves 'qwen' or 'gpt-4o'"
    for asked in ("gpt-4o", "qwen", None):
        body = json.dumps({"model": asked, "prompt": [1, 2]}).encode()
        assert parse_request("completion", body, ["qwen", "gpt-4o"], None, MAX_MODEL_LEN, 1000).model == "qwen"


def test_an_api_key_guards_every_v1_and_token_route_and_leaves_health_and_metrics_open(
    demo_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As vLLM's --api-key, with OpenAI's 401 body: the key must come as a bearer token; a
    refused one is counted and logged, without the key it tried."""
    from fastapi.testclient import TestClient

    key = "sk-test-\u00e9l\u00e8ve"  # bytes beyond ASCII travel as the header's own
    with TestClient(frontend_app(demo_model_dir, api_key=key)) as http:
        missing = openai_error(http.get("/v1/models"), 401, "invalid_api_key")
        assert "Authorization: Bearer" in missing
        with caplog.at_level(logging.WARNING, logger="pdserve.router.openai_app"):
            for wrong in ("Bearer sk-guess", f"Basic {key}", f"Bearer {key}x", "Bearer "):
                response = http.get(f"/v1/models/{MODEL}", headers={"Authorization": wrong.encode()})
                assert response.status_code == 401, wrong
        assert "sk-guess" not in caplog.text and "401 invalid_api_key" in caplog.text
        good = {"Authorization": f"Bearer {key}".encode()}
        assert http.get("/v1/models", headers=good).json()["data"][0]["id"] == MODEL
        assert http.get(f"/v1/models/{MODEL}", headers={"Authorization": f"bearer {key}".encode()}).status_code == 200
        # Generation checks the key first: an unauthenticated body is not even read.
        openai_error(http.post("/v1/completions", content=b"{not json"), 401, "invalid_api_key")
        openai_error(http.post("/v1/chat/completions", content=b"{not json"), 401, "invalid_api_key")
        openai_error(http.post("/v1/completions", content=b"{not json", headers=good), 400, "malformed_json")
        # So do vLLM's token routes, which spend the server's CPU as generation does.
        openai_error(http.post("/tokenize", json={"prompt": "hi"}), 401, "invalid_api_key")
        openai_error(http.post("/detokenize", json={"tokens": [1]}), 401, "invalid_api_key")
        assert http.post("/tokenize", json={"prompt": "hi"}, headers=good).json()["count"] > 0
        # Probes and scrapers need no key (no cluster here: health says so).
        assert http.get("/health").json()["error"]["code"] == "cluster_unavailable"
        assert http.get("/version").json() == {"version": importlib.metadata.version("pdserve")}
        metrics = http.get("/metrics")
        assert metrics.status_code == 200
        assert f'pdserve:request_error_total{{model_name="{MODEL}",reason="invalid_api_key"}} 9.0' in metrics.text


def test_cors_is_off_unless_origins_are_allowed_and_then_needs_no_key_to_ask(demo_model_dir: Path) -> None:
    """A browser asks first (OPTIONS, with the headers the openai client adds): without
    --allowed-origins it gets no CORS header; an allowed origin gets its answer, and the key is
    needed only by the request that follows, as vLLM does it."""
    from fastapi.testclient import TestClient

    ui = "https://ui.example"
    preflight = {
        "Origin": ui,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os",
    }
    closed = TestClient(frontend_app(demo_model_dir))
    assert "access-control-allow-origin" not in closed.options("/v1/chat/completions", headers=preflight).headers
    assert "access-control-allow-origin" not in closed.get("/v1/models", headers={"Origin": ui}).headers

    http = TestClient(frontend_app(demo_model_dir, api_key="sk-1", allowed_origins=f"{ui}, https://other.example"))
    asked = http.options("/v1/chat/completions", headers=preflight)
    assert asked.status_code == 200 and asked.headers["access-control-allow-origin"] == ui
    assert "x-stainless-os" in asked.headers["access-control-allow-headers"].lower()
    listed = http.get("/v1/models", headers={"Origin": ui, "Authorization": "Bearer sk-1"})
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == ui
    refused = http.get("/v1/models", headers={"Origin": ui})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ui  # readable
    for route in ("/v1/completions", "/v1/chat/completions"):  # served apart from the other routes
        refused = http.post(route, json={}, headers={"Origin": ui})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ui, route
    stranger = http.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert stranger.status_code == 400 and "access-control-allow-origin" not in stranger.headers

    anyone = TestClient(frontend_app(demo_model_dir, allowed_origins="*"))
    assert (
        anyone.get("/v1/models", headers={"Origin": "https://a.example"}).headers["access-control-allow-origin"] == "*"
    )


# -- the cluster and the front end -----------------------------------------------------------


class FrontendProcess(LoggedProcess):
    """``python -m pdserve.router.openai_server`` on a free port; started on construction."""

    def __init__(
        self, endpoint: str, log_path: Path, *args: str, timeout: float = 120.0, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "pdserve.router.openai_server",
            "--endpoint",
            endpoint,
            "--model",
            "demo",
            "--served-model-name",
            MODEL,
            "--port",
            str(self.port),
            *args,
        ]
        self.start(command, log_path, {**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout
        key = (env or {}).get("PDSERVE_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        while True:  # listening once /v1/models answers (/health also needs the cluster)
            try:
                if httpx.get(f"{self.base_url}/v1/models", headers=headers, timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the front end did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.2)


@dataclass
class Served:
    cluster: LaunchedCluster
    base_url: str
    zmq: Client
    http: httpx.Client
    client: openai.OpenAI


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Served]:
    """A cluster started as a user would, ``launch.py ... --http-port PORT``."""
    logs = tmp_path_factory.mktemp("openai")
    http_port = free_port()
    args = [
        "--model",
        "demo",
        "--prefill-tp",
        "1",
        "--decode-tp",
        "1",
        "--transfer",
        "gloo-async",
        "--num-blocks",
        "400",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--http-port",
        str(http_port),
        "--served-model-name",
        MODEL,
        "--log-stats-interval",
        "1",
    ]
    cluster = LaunchedCluster(args, logs / "launch.log", start_timeout=300)
    base_url = f"http://127.0.0.1:{http_port}"
    try:
        assert f"http {base_url}/v1 (OpenAI-compatible, model {MODEL!r})" in cluster.output()
        with (
            Client(cluster.endpoint, timeout=120) as zmq_client,
            httpx.Client(base_url=base_url, timeout=120) as http,
        ):
            wait_for(lambda: http.get("/health").status_code == 200, 60, "the front end never became healthy")
            client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
            yield Served(cluster, base_url, zmq_client, http, client)
            client.close()
    finally:
        cluster.kill()


def wait_for(condition: Any, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.1)


def zmq_greedy(served: Served, prompt: str | None = None, **kwargs: Any) -> Final:
    kwargs.setdefault("temperature", 0.0)
    return served.zmq.generate(prompt, **kwargs)


def sse_events(response: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of a server-sent event stream, each event checked for its framing."""
    body = response.read().decode()
    assert body.endswith("\n\n"), body[-200:]
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    payloads = [e.removeprefix("data: ") for e in events]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def metric_samples(served: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed with prometheus_client's own parser."""
    response = served.http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float:
    """A sample of the served model's (every metric carries its name, as vLLM's do)."""
    return samples.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


def idle(stats: Any) -> bool:
    return stats.requests_in_flight == 0 and all(
        g["free_blocks"] == g["num_blocks"] and g["kv_held"] == 0 for g in stats.groups.values()
    )


@pytest.mark.slow
def test_models_and_health(served: Served) -> None:
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served.http.get("/v1/models").json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    health = served.http.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_the_launcher_logs_throughput_and_load_while_the_cluster_works(served: Served) -> None:
    """The stats line, as vLLM's (--log-stats-interval, 1 s here): token rates, requests in
    flight, each group's queues and KV use."""
    served.zmq.generate(token_ids=[1, 504, 3458, 314], max_tokens=8, temperature=0.0)
    line = re.compile(
        r"launcher INFO prompt \d+\.\d tok/s, generation \d+\.\d tok/s \| \d+ request\(s\) in flight"
        r" \| prefill0: \d+ running, \d+ waiting, KV \d+\.\d% \| decode0: \d+ running"
    )
    wait_for(lambda: line.search(served.cluster.output()), 10, "no stats line in the launcher's log")


@pytest.mark.slow
def test_official_client_gets_the_zmq_clients_greedy_text(served: Served, demo_model_dir: Path) -> None:
    """The ZMQ client's greedy answers are the single engine's; every HTTP route gives their text."""
    raw = zmq_greedy(served, TEXT_PROMPT, chat=False, max_tokens=8)
    chat = zmq_greedy(served, QUESTION, chat=True, max_tokens=8)
    ids = zmq_greedy(served, token_ids=[1, 504, 3458, 314], max_tokens=8)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    prompts = [
        encode_prompt(tokenizer, TEXT_PROMPT, chat=False),
        encode_prompt(tokenizer, QUESTION),
        [1, 504, 3458, 314],
    ]
    expected = oracle(demo_model_dir, prompts, [SamplingParams(max_tokens=8, temperature=0.0)] * 3)
    assert [raw.token_ids, chat.token_ids, ids.token_ids] == expected
    assert [f.usage["prompt_tokens"] for f in (raw, chat, ids)] == [len(p) for p in prompts]
    assert raw.text and chat.text and ids.text
    client = served.client

    completion = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=8, temperature=0)
    assert completion.choices[0].text == raw.text
    assert completion.choices[0].finish_reason == raw.finish_reason
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        raw.usage["prompt_tokens"],
        raw.usage["completion_tokens"],
    )
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens

    stream = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == raw.text

    by_ids = client.completions.create(model=MODEL, prompt=[1, 504, 3458, 314], max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == ids.text

    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_completion_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content == chat.text and reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.prompt_tokens == chat.usage["prompt_tokens"]
    # The ZMQ request before it left the prompt's full blocks (16 tokens) in the prefix cache,
    # but for the last token, which is always computed.
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == (reply.usage.prompt_tokens - 1) // 16 * 16 > 0

    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.text

    async def with_async_client() -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0) as aclient:
            text_stream = await aclient.completions.create(
                model=MODEL, prompt=TEXT_PROMPT, max_tokens=8, temperature=0, stream=True
            )
            streamed = "".join([c.choices[0].text async for c in text_stream])
            whole = await aclient.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
                max_tokens=8,
                temperature=0,
            )
            return streamed, whole.choices[0].message.content or ""

    assert asyncio.run(with_async_client()) == (raw.text, chat.text)


@pytest.mark.slow
def test_what_sdks_and_uis_send_unused_changes_nothing_for_the_official_client(served: Served) -> None:
    """Fields SDKs and chat UIs fill in with their "not used" values, a reply dumped and sent back
    as the next turn, and the model retrieved by id: the same greedy answers as plain requests."""
    client = served.client
    question = [{"role": "user", "content": QUESTION}]
    plain = client.chat.completions.create(model=MODEL, messages=question, max_tokens=8, temperature=0)
    assert plain.system_fingerprint is None and plain.id.startswith("chatcmpl-")
    filled = client.chat.completions.create(
        model=MODEL,
        messages=question,
        max_tokens=8,
        temperature=0,
        user="user-1",
        n=1,
        presence_penalty=0,
        frequency_penalty=0,
        logit_bias={},
        logprobs=False,
        response_format={"type": "text"},
        parallel_tool_calls=True,
        store=False,
        metadata={"conversation": "42"},
        stop=None,
        extra_body={"stream_options": None, "tools": []},
    )
    assert filled.choices[0].message.content == plain.choices[0].message.content
    assert filled.usage is not None and plain.usage is not None
    assert filled.usage.prompt_tokens == plain.usage.prompt_tokens

    next_turn = [*question, plain.choices[0].message.model_dump(), {"role": "user", "content": "And of Spain?"}]
    as_dumped = client.chat.completions.create(model=MODEL, messages=next_turn, max_tokens=8, temperature=0)
    by_hand = [*question, {"role": "assistant", "content": plain.choices[0].message.content}, next_turn[-1]]
    expected = client.chat.completions.create(model=MODEL, messages=by_hand, max_tokens=8, temperature=0)
    assert as_dumped.choices[0].message.content == expected.choices[0].message.content

    completion = client.completions.create(model=MODEL, prompt=[TEXT_PROMPT], max_tokens=6, temperature=0)
    filled_completion = client.completions.create(
        model=MODEL, prompt=TEXT_PROMPT, max_tokens=6, temperature=0, echo=False, best_of=1, suffix=None, user="u"
    )
    assert filled_completion.choices[0].text == completion.choices[0].text and completion.system_fingerprint is None

    model = client.models.retrieve(MODEL)
    assert (model.id, model.object) == (MODEL, "model")
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"


@pytest.mark.slow
def test_an_api_key_from_the_environment_guards_the_front_end(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PDSERVE_API_KEY, as vLLM's VLLM_API_KEY: the official client gets in with it, and gets
    AuthenticationError (401, invalid_api_key) with another."""
    frontend = FrontendProcess(served.cluster.endpoint, tmp_path / "frontend.log", env={"PDSERVE_API_KEY": "sk-one"})
    try:
        url = f"{frontend.base_url}/v1"
        with openai.OpenAI(base_url=url, api_key="sk-one", max_retries=0) as client:
            reply = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=4, temperature=0)
        assert reply.choices[0].text == zmq_greedy(served, TEXT_PROMPT, chat=False, max_tokens=4).text
        with (
            openai.OpenAI(base_url=url, api_key="sk-two", max_retries=0) as client,
            pytest.raises(openai.AuthenticationError) as refused,
        ):
            client.models.list()
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
        assert httpx.get(f"{frontend.base_url}/health", timeout=30).status_code == 200

        # bench.serve's HTTP backend sends OPENAI_API_KEY, as vLLM's bench serve does.
        from pdserve.bench.serve import BenchConfig, run_benchmark

        config = BenchConfig(workload="text", num_requests=2, warmup=0, output_len=4, concurrency=2, timeout=60)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-one")
        result = asyncio.run(run_benchmark(config, "", backend="openai", base_url=frontend.base_url))
        assert (result["completed"], result["failed"]) == (2, 0), result
        assert frontend.stop() == 0
    finally:
        frontend.kill()


@pytest.mark.slow
def test_sse_framing_usage_chunk_and_done(served: Served, demo_model_dir: Path) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with served.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    *content, finish, usage = events
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    assert all(e["choices"][0]["finish_reason"] is None for e in content)
    assert finish["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 6
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in content)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = zmq_greedy(
        served, token_ids=tokenizer.encode(rendered, add_special_tokens=False), max_tokens=6, ignore_eos=True
    )
    assert text == expected.text and usage["usage"]["prompt_tokens"] == expected.usage["prompt_tokens"]

    # Without include_usage: no usage chunk; a completion's finish chunk has empty text.
    body = {"model": MODEL, "prompt": TEXT_PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with served.http.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response)
    assert "usage" not in events[-1] and events[-1]["choices"][0]["text"] == ""
    assert all(e["object"] == "text_completion" for e in events)

    # vLLM's continuous_usage_stats: every chunk carries its choice's usage so far; the last
    # usage chunk is the whole request's, as without it.
    for n in (1, 2):
        options = {"include_usage": True, "continuous_usage_stats": True}
        with served.http.stream("POST", "/v1/completions", json={**body, "n": n, "stream_options": options}) as r:
            *chunks, last = [e for e in sse_events(r) if e != "[DONE]"]
        prompt_tokens = last["usage"]["prompt_tokens"]  # the prompt once, whatever n
        for index in range(n):
            counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"][0]["index"] == index]
            assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 3, (n, counts)
        assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3 * n


@pytest.mark.slow
def test_echo_shows_the_prompt_and_its_log_probabilities(served: Served, demo_tokenizer: Any) -> None:
    """Completions' ``echo``, as vLLM's (lm-evaluation-harness scores a text with it): the
    prompt's text before the output's and, with ``logprobs``, its tokens too, the first without
    a log-probability; the values are what the cluster gives the ZMQ client's ``prompt_logprobs``."""
    request = {"model": MODEL, "prompt": TEXT_PROMPT, "max_tokens": 4, "temperature": 0}
    plain = served.http.post("/v1/completions", json=request).json()["choices"][0]["text"]
    echoed = served.http.post("/v1/completions", json={**request, "echo": True, "logprobs": 2}).json()["choices"][0]
    assert echoed["text"] == TEXT_PROMPT + plain
    ids = encode_prompt(demo_tokenizer, TEXT_PROMPT, chat=False)
    same = zmq_greedy(served, TEXT_PROMPT, chat=False, max_tokens=4, prompt_logprobs=2, logprobs=2)
    assert same.prompt_logprobs is not None and same.logprobs is not None
    logprobs, n = echoed["logprobs"], len(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(
        same.prompt_logprobs.token_logprobs + same.logprobs.token_logprobs, abs=1e-5
    )
    assert len(logprobs["tokens"]) == n + 4 and "".join(logprobs["tokens"][:n]) == TEXT_PROMPT
    assert all(token in top for token, top in zip(logprobs["tokens"][1:], logprobs["top_logprobs"][1:]))
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    # Streamed: the first chunk holds the prompt, and its log-probabilities with the first token's.
    with served.http.stream(
        "POST", "/v1/completions", json={**request, "echo": True, "logprobs": 2, "stream": True}
    ) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    assert events[0]["choices"][0]["text"].startswith(TEXT_PROMPT)
    assert "".join(e["choices"][0]["text"] for e in events) == echoed["text"]
    streamed = [v for e in events if e["choices"][0]["logprobs"] for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == logprobs["token_logprobs"]
    # max_tokens 0 (how GPT-3 was scored): the prompt and its log-probabilities alone, a batch too.
    scored = {**request, "prompt": [TEXT_PROMPT, TEXT_PROMPT], "max_tokens": 0, "echo": True, "logprobs": 2}
    alone = served.http.post("/v1/completions", json=scored).json()
    assert alone["usage"]["completion_tokens"] == 0 and alone["usage"]["prompt_tokens"] == 2 * n
    for choice in alone["choices"]:
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (TEXT_PROMPT, "length", None)
        assert choice["logprobs"]["tokens"] == logprobs["tokens"][:n]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs["token_logprobs"][:n], abs=1e-4)
    with served.http.stream("POST", "/v1/completions", json={**scored, "prompt": TEXT_PROMPT, "stream": True}) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == TEXT_PROMPT
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # A prompt of token ids echoes as the output shows text: its special tokens left out, as its tokens are.
    special = [demo_tokenizer.convert_tokens_to_ids("<|im_start|>"), *ids]
    marked = {**request, "prompt": special, "max_tokens": 1, "echo": True, "logprobs": 1}
    choice = served.http.post("/v1/completions", json=marked).json()["choices"][0]
    assert "".join(choice["logprobs"]["tokens"][: len(special)]) == TEXT_PROMPT
    assert choice["text"].startswith(TEXT_PROMPT) and choice["logprobs"]["tokens"][0] == ""
    # A prompt of token ids echoes as their text; no logprobs, none computed.
    by_ids = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert by_ids.choices[0].text == demo_tokenizer.decode(ids) + plain and by_ids.choices[0].logprobs is None


@pytest.mark.slow
def test_stop_reason_names_the_stop_string_or_token_that_ended_the_output(served: Served) -> None:
    """vLLM's ``stop_reason`` on each choice (and a stream's last chunk): the stop string, or the
    ``stop_token_ids`` member, that ended the output; null for the model's EOS (even when listed
    as a stop id, as the engine ends on it first), a length, or no stop at all."""
    full = zmq_greedy(served, TEXT_PROMPT, chat=False, max_tokens=24, ignore_eos=True)
    at = next(i for i in range(4, len(full.text) - 3) if full.text.find(full.text[i : i + 3]) == i)
    index = next(i for i in range(2, len(full.token_ids)) if full.token_ids.index(full.token_ids[i]) == i)
    base = {"model": MODEL, "prompt": TEXT_PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    cases: list[tuple[dict[str, Any], str, str | int | None]] = [
        ({"stop": ["never \u2603", full.text[at : at + 3]]}, "stop", full.text[at : at + 3]),
        ({"stop_token_ids": [full.token_ids[index]]}, "stop", full.token_ids[index]),
        ({}, "length", None),
    ]
    for extra, reason, stop_reason in cases:
        whole = served.http.post("/v1/completions", json={**base, **extra, "logprobs": 1}).json()["choices"][0]
        assert (whole["finish_reason"], whole["stop_reason"]) == (reason, stop_reason), extra
        # Streamed: the reason comes with the finish, in the last chunk. No chunk goes out without
        # text (a stop token's has none): the finish carries what tokens remain, as vLLM's does.
        with served.http.stream("POST", "/v1/completions", json={**base, **extra, "logprobs": 1, "stream": True}) as r:
            events = [e["choices"][0] for e in sse_events(r) if e != "[DONE]"]
        assert all(e["text"] and "stop_reason" not in e for e in events[:-1]), extra
        assert (events[-1]["finish_reason"], events[-1]["stop_reason"]) == (reason, stop_reason), extra
        tokens = [t for e in events if e["logprobs"] for t in e["logprobs"]["tokens"]]
        assert tokens == whole["logprobs"]["tokens"], extra

    eos = 2  # the demo model's <|im_end|>, which ends its chat turns
    chat = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 48, "temperature": 0}
    for extra, stop_reason in (
        ({}, None),
        ({"stop_token_ids": [eos]}, None),
        ({"stop_token_ids": [eos], "ignore_eos": True}, eos),
    ):
        choice = served.http.post("/v1/chat/completions", json={**chat, **extra}).json()["choices"][0]
        assert choice["message"]["content"] and choice["finish_reason"] == "stop", extra
        assert choice["stop_reason"] == stop_reason, extra


@pytest.mark.slow
def test_log_probabilities_may_show_tokens_as_their_ids(served: Served, demo_tokenizer: Any) -> None:
    """vLLM's ``return_tokens_as_token_ids``: each token of the log-probabilities (an echoed
    prompt's too, and the alternatives) reads ``token_id:<id>``; the values stay the same."""
    ids = encode_prompt(demo_tokenizer, TEXT_PROMPT, chat=False)
    same = zmq_greedy(served, TEXT_PROMPT, chat=False, max_tokens=4, logprobs=2)
    assert same.logprobs is not None
    request = {"model": MODEL, "prompt": TEXT_PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    asked = {**request, "return_tokens_as_token_ids": True}
    plain = served.http.post("/v1/completions", json=request).json()["choices"][0]
    as_ids = served.http.post("/v1/completions", json=asked).json()["choices"][0]
    assert as_ids["text"] == plain["text"]
    assert as_ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in same.token_ids]
    assert as_ids["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    for top, alternatives in zip(as_ids["logprobs"]["top_logprobs"], same.logprobs.top_token_ids):
        assert set(top) >= {f"token_id:{t}" for t in alternatives}
    echoed = served.http.post("/v1/completions", json={**asked, "echo": True, "max_tokens": 0}).json()
    assert echoed["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "temperature": 0}
    reply = served.http.post(
        "/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
    ).json()
    greedy = zmq_greedy(served, QUESTION, max_tokens=4)
    content = reply["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in greedy.token_ids]
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)


@pytest.mark.slow
def test_special_and_stop_tokens_show_in_the_text_only_when_asked(served: Served, demo_tokenizer: Any) -> None:
    """vLLM's ``skip_special_tokens`` and ``include_stop_str_in_output``: the chat's closing
    ``<|im_end|>`` (the EOS that stops it) shows in the text only with special tokens kept and the
    stop token's text included, which makes the text the tokenizer's whole decode; on the ZMQ
    protocol and the API. Its token and log-probability are there either way."""
    question = "What is the capital of France?"
    messages = [{"role": "user", "content": question}]
    default = zmq_greedy(served, question, max_tokens=24)
    assert default.finish_reason == "stop" and not default.text.endswith(">")
    for skip in (True, False):
        for include in (False, True):
            asked = {"skip_special_tokens": skip, "include_stop_str_in_output": include}
            zmq = zmq_greedy(served, question, max_tokens=24, **asked)
            assert zmq.token_ids == default.token_ids
            expected = default.text + ("<|im_end|>" if include and not skip else "")
            assert zmq.text == expected, asked
            if include and not skip:
                assert zmq.text == demo_tokenizer.decode(zmq.token_ids, skip_special_tokens=False)
            reply = served.client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=24,
                temperature=0,
                logprobs=True,
                extra_body=asked,
            )
            assert reply.choices[0].message.content == expected, asked
            assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content is not None
            assert reply.choices[0].logprobs.content[-1].token == ("" if skip else "<|im_end|>")


@pytest.mark.slow
def test_a_chat_may_continue_the_assistants_last_message(served: Served, demo_tokenizer: Any) -> None:
    """vLLM's ``continue_final_message`` (with ``add_generation_prompt: false``): the reply goes on
    from a begun assistant message, as the ZMQ client's request of the same template ids does;
    ``echo`` puts that message's text before it; ``/tokenize`` gives the ids the chat sends."""
    begun = "The capital of France is"
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": begun}]
    ids = encode_chat(demo_tokenizer, messages, add_generation_prompt=False, continue_final_message=True)
    assert demo_tokenizer.decode(ids).endswith(f"assistant\n{begun}")
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **flags}
    expected = zmq_greedy(served, token_ids=ids, max_tokens=8)
    reply = served.http.post("/v1/chat/completions", json=body).json()
    assert reply["choices"][0]["message"]["content"] == expected.text
    assert reply["usage"]["prompt_tokens"] == len(ids)
    tokenized = served.http.post("/tokenize", json={"messages": messages, **flags}).json()
    assert tokenized["tokens"] == ids
    echoed = served.http.post("/v1/chat/completions", json={**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == begun + expected.text
    with served.http.stream("POST", "/v1/chat/completions", json={**body, "echo": True, "stream": True}) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    assert events[0]["choices"][0]["delta"]["content"].startswith(begun)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == begun + expected.text
    # Without the flags the template closes the message and starts a new one; echo shows only
    # an assistant's last message.
    closed = encode_chat(demo_tokenizer, messages)
    assert closed != ids and served.http.post("/tokenize", json={"messages": messages}).json()["tokens"] == closed
    asked = {"model": MODEL, "messages": messages[:1], "max_tokens": 4, "temperature": 0}
    plain = served.http.post("/v1/chat/completions", json=asked).json()["choices"][0]["message"]["content"]
    echo_user = served.http.post("/v1/chat/completions", json={**asked, "echo": True}).json()
    assert echo_user["choices"][0]["message"]["content"] == plain


@pytest.mark.slow
def test_tokenize_gives_the_ids_generation_sends_and_detokenize_the_text(served: Served, demo_tokenizer: Any) -> None:
    """vLLM's ``/tokenize`` and ``/detokenize``: a prompt's and a chat's ids are those the
    generation routes send the cluster (their usage counts them), special-token text included."""
    http = served.http
    tokenized = http.post("/tokenize", json={"model": MODEL, "prompt": TEXT_PROMPT}).json()
    completion = served.client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=1)
    assert completion.usage is not None
    assert tokenized == {
        "count": completion.usage.prompt_tokens,
        "max_model_len": MAX_MODEL_LEN,
        "tokens": encode_prompt(demo_tokenizer, TEXT_PROMPT, chat=False),
        "token_strs": None,
    }
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say <|im_end|> twice"}]
    chat = http.post("/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    reply = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert reply.usage is not None and chat["count"] == reply.usage.prompt_tokens
    assert chat["tokens"] == encode_chat(demo_tokenizer, messages)  # the special-token text as plain text
    assert chat["token_strs"] == demo_tokenizer.convert_ids_to_tokens(chat["tokens"])
    # lm-evaluation-harness's remote tokenizer asks for the text's ids alone.
    bare = http.post("/tokenize", json={"prompt": TEXT_PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert bare == demo_tokenizer.encode(TEXT_PROMPT, add_special_tokens=False)
    detokenized = http.post("/detokenize", json={"model": MODEL, "tokens": tokenized["tokens"]})
    assert detokenized.json() == {"prompt": TEXT_PROMPT}
    refused = {
        "/tokenize": [
            (
                {"messages": messages, "continue_final_message": True},
                400,
                "invalid_request",
                "continue_final_message",
            ),
            ({"model": "other", "prompt": "hi"}, 404, "model_not_found", "model"),
            ({"prompt": "hi", "tokens": [1]}, 400, "unrecognized_argument", "tokens"),
            ({"messages": []}, 400, "invalid_value", "messages"),
            ({"prompt": "hi", "messages": messages}, 400, "invalid_request", "messages"),
        ],
        "/detokenize": [
            ({"tokens": [len(demo_tokenizer)]}, 400, "invalid_request", "tokens"),
            ({"tokens": ["a"]}, 400, "invalid_value", "tokens"),
            ({"prompt": "hi"}, 400, "missing_required_parameter", "tokens"),
        ],
    }
    for path, cases in refused.items():
        for body, status, code, param in cases:
            response = http.post(path, json=body)
            error = response.json()["error"]
            assert (response.status_code, error["code"], error["param"]) == (status, code, param), (path, body)


@pytest.mark.slow
def test_stop_strings_stop_token_ids_seed_top_k_and_ignore_eos(served: Served) -> None:
    client = served.client
    full = zmq_greedy(served, TEXT_PROMPT, chat=False, max_tokens=24, ignore_eos=True)
    # A stop string from the middle of the greedy text, where it first occurs.
    at = next(i for i in range(4, len(full.text) - 3) if full.text.find(full.text[i : i + 3]) == i)
    stop = full.text[at : at + 3]
    cut = client.completions.create(
        model=MODEL,
        prompt=TEXT_PROMPT,
        max_tokens=24,
        temperature=0,
        stop=[stop, "never in the text \u2603"],
        extra_body={"ignore_eos": True},
    )
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (full.text[:at], "stop")
    # The front end ends it (an abort): the usage still says what the prefix cache served.
    assert cut.usage is not None and cut.usage.prompt_tokens_details is not None
    assert cut.usage.prompt_tokens_details.cached_tokens == (cut.usage.prompt_tokens - 1) // 16 * 16
    streamed = client.completions.create(
        model=MODEL,
        prompt=TEXT_PROMPT,
        max_tokens=24,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == full.text[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"

    # A stop token: generation ends right after it; as in vLLM its text is left out unless
    # include_stop_str_in_output (it counts in the usage either way).
    index = next(i for i in range(2, len(full.token_ids)) if full.token_ids.index(full.token_ids[i]) == i)
    for include in (False, True):
        head = zmq_greedy(served, TEXT_PROMPT, chat=False, max_tokens=index + include)
        stopped = client.completions.create(
            model=MODEL,
            prompt=TEXT_PROMPT,
            max_tokens=24,
            temperature=0,
            extra_body={
                "stop_token_ids": [full.token_ids[index]],
                "ignore_eos": True,
                "include_stop_str_in_output": include,
            },
        )
        assert stopped.usage is not None and stopped.usage.completion_tokens == index + 1
        assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (head.text, "stop")
        zmq = zmq_greedy(
            served,
            TEXT_PROMPT,
            chat=False,
            max_tokens=24,
            stop_token_ids=[full.token_ids[index]],
            ignore_eos=True,
            include_stop_str_in_output=include,
        )
        assert (zmq.text, zmq.token_ids) == (head.text, full.token_ids[: index + 1])

    # vLLM's include_stop_str_in_output: the text ends after the stop string, whole or streamed.
    for stream in (False, True):
        kept = client.completions.create(
            model=MODEL,
            prompt=TEXT_PROMPT,
            max_tokens=24,
            temperature=0,
            stop=stop,
            stream=stream,
            extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
        )
        pieces = list(kept) if stream else [kept]
        assert "".join(c.choices[0].text for c in pieces) == full.text[: at + 3]
        assert pieces[-1].choices[0].finish_reason == "stop"
    # min_tokens: no stop string ends the output before it, nor a stop id (the cluster bans it).
    whole = client.completions.create(
        model=MODEL,
        prompt=TEXT_PROMPT,
        max_tokens=24,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True, "min_tokens": 24},
    )
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (full.text, "length")
    held = {"stop_token_ids": [full.token_ids[index]], "min_tokens": index + 3, "ignore_eos": True}
    late = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=24, temperature=0, extra_body=held)
    same = zmq_greedy(served, TEXT_PROMPT, chat=False, max_tokens=24, **held)
    assert late.choices[0].text == same.text and late.usage is not None
    assert late.usage.completion_tokens == len(same.token_ids) > index + 3

    # Sampling reaches the cluster: a seed repeats, top_k=1 (and a tiny top_p) is greedy at any temperature.
    seeded = [
        client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=12, temperature=1.0, seed=7)
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert (
        seeded[0]
        == seeded[1]
        == served.zmq.generate(TEXT_PROMPT, chat=False, max_tokens=12, temperature=1.0, seed=7).text
    )
    for extra in ({"top_k": 1}, {"top_p": 1e-6}):
        kwargs: dict[str, Any] = {"extra_body": extra} if "top_k" in extra else extra
        sampled = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=24, temperature=1.5, **kwargs)
        assert full.text.startswith(sampled.choices[0].text), extra

    # Penalties and min_p reach the cluster: as the ZMQ client's request with them, not as without.
    penalized = client.completions.create(
        model=MODEL,
        prompt=TEXT_PROMPT,
        max_tokens=24,
        temperature=0,
        frequency_penalty=2.0,
        presence_penalty=0.5,
        extra_body={"repetition_penalty": 1.5, "min_p": 0.5, "ignore_eos": True},
    )
    same = zmq_greedy(
        served,
        TEXT_PROMPT,
        chat=False,
        max_tokens=24,
        frequency_penalty=2.0,
        presence_penalty=0.5,
        repetition_penalty=1.5,
        min_p=0.5,
        ignore_eos=True,
    )
    assert penalized.choices[0].text == same.text != full.text

    # A logit bias reaches the cluster: banning the greedy answer's first token changes it.
    banned = {str(full.token_ids[0]): -100}
    biased = client.completions.create(
        model=MODEL,
        prompt=TEXT_PROMPT,
        max_tokens=8,
        temperature=0,
        logit_bias=banned,  # type: ignore[arg-type]
    )
    same = zmq_greedy(served, TEXT_PROMPT, chat=False, max_tokens=8, logit_bias=banned)
    assert biased.choices[0].text == same.text and same.token_ids[0] != full.token_ids[0]

    # ignore_eos: a chat answer runs to max_completion_tokens instead of stopping at <|im_end|>.
    short = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_completion_tokens=40, temperature=0
    )
    assert short.choices[0].finish_reason == "stop" and short.usage is not None
    long = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_completion_tokens=short.usage.completion_tokens + 3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert long.choices[0].finish_reason == "length" and long.usage is not None
    assert long.usage.completion_tokens == short.usage.completion_tokens + 3


def test_logprobs_in_both_endpoints_whole_and_streamed(served: Served) -> None:
    """The cluster's log-probabilities (the ZMQ final's, for the same greedy request) in OpenAI's
    shapes, as the official client parses them: a completion's legacy lists, a chat's entries."""
    client = served.client
    zmq = zmq_greedy(served, TEXT_PROMPT, chat=False, max_tokens=12, ignore_eos=True, logprobs=3)
    assert zmq.logprobs is not None and len(zmq.logprobs.token_logprobs) == 12
    whole = client.completions.create(
        model=MODEL, prompt=TEXT_PROMPT, max_tokens=12, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert logprobs.token_logprobs == pytest.approx(zmq.logprobs.token_logprobs, abs=1e-5)
    assert "".join(logprobs.tokens) == whole.choices[0].text == zmq.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(12)]
    for token, value, top, top_values in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, zmq.logprobs.top_logprobs
    ):
        assert top[token] == value  # the chosen token beside the three likeliest, as vLLM shows it
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(top_values, abs=1e-5)

    streamed = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_completion_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    entries, text, usage = [], "", None
    for chunk in streamed:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                entries += choice.logprobs.content
    assert usage is not None and len(entries) == usage.completion_tokens
    assert "".join(e.token for e in entries) == text
    for entry in entries:
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy: a likeliest token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob

    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_completion_tokens=4, temperature=0
    )
    assert plain.choices[0].logprobs is None


TOO_LONG = list(range(1, MAX_MODEL_LEN - 10))
BAD_REQUESTS = {
    # name: (path, body (dict, or raw bytes), status, code, param)
    "malformed json": ("/v1/completions", b'{"model": "x", "prompt": ', 400, "malformed_json", None),
    "not an object": ("/v1/chat/completions", b"[1, 2]", 400, "malformed_json", None),
    "unknown model": ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found", "model"),
    "negative temperature": (
        "/v1/completions",
        {"prompt": "hi", "temperature": -0.5},
        400,
        "invalid_value",
        "temperature",
    ),
    "top_p 0": ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "invalid_value", "top_p"),
    "top_p above 1": ("/v1/chat/completions", {"top_p": 1.5}, 400, "invalid_value", "top_p"),
    "max_tokens 0 without echo": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 0},
        400,
        "invalid_request",
        "max_tokens",
    ),
    "min_tokens over an echo's max_tokens 0": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 0, "echo": True, "min_tokens": 1},
        400,
        "invalid_request",
        "min_tokens",
    ),
    "max_tokens -1": ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "invalid_value", "max_tokens"),
    "a chat's max_tokens 0": (
        "/v1/chat/completions",
        {"max_tokens": 0, "echo": True},
        400,
        "invalid_value",
        "max_tokens",
    ),
    "top_k -2": ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "invalid_value", "top_k"),
    "seed below int64": ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, 400, "invalid_value", "seed"),
    "presence_penalty above 2": (
        "/v1/chat/completions",
        {"presence_penalty": 2.5},
        400,
        "invalid_value",
        "presence_penalty",
    ),
    "boolean frequency_penalty": (
        "/v1/completions",
        {"prompt": "hi", "frequency_penalty": True},
        400,
        "invalid_value",
        "frequency_penalty",
    ),
    "repetition_penalty 0": (
        "/v1/completions",
        {"prompt": "hi", "repetition_penalty": 0},
        400,
        "invalid_value",
        "repetition_penalty",
    ),
    "min_p above 1": ("/v1/chat/completions", {"min_p": 1.5}, 400, "invalid_value", "min_p"),
    "negative min_tokens": ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, 400, "invalid_value", "min_tokens"),
    "min_tokens above max_tokens": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 4, "min_tokens": 5},
        400,
        "invalid_request",
        "min_tokens",
    ),
    "logprobs above 20": ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "invalid_value", "logprobs"),
    "top_logprobs without logprobs": (
        "/v1/chat/completions",
        {"top_logprobs": 3},
        400,
        "invalid_request",
        "top_logprobs",
    ),
    "string max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "invalid_value", "max_tokens"),
    "missing prompt": ("/v1/completions", {"max_tokens": 5}, 400, "missing_required_parameter", "prompt"),
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, "invalid_request", "prompt"),
    "prompt too long": (
        "/v1/completions",
        {"prompt": TOO_LONG, "max_tokens": 16},
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    "chat too long": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi " * MAX_MODEL_LEN}]},
        400,
        "context_length_exceeded",
        "messages",
    ),
    "prompt over max-prompt-chars": (
        "/v1/completions",
        {"prompt": "x" * 100_001},
        400,
        "prompt_too_long",
        "prompt",
    ),
    "chat over max-prompt-chars": (
        "/v1/chat/completions",
        {"messages": [{"role": "system", "content": "x" * 50_000}, {"role": "user", "content": "y" * 50_001}]},
        400,
        "prompt_too_long",
        "messages",
    ),
    "chat of many empty messages over max-prompt-chars": (  # their roles count: rendered, they are text
        "/v1/chat/completions",
        {"messages": [{"role": "assistant"}] * 12_000},
        400,
        "prompt_too_long",
        "messages",
    ),
    "body over max-message-mib": ("/v1/completions", b" " * (4 * 2**20 + 1), 413, "request_too_large", None),
    "token outside the vocabulary": ("/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "invalid_request", "prompt"),
    "token outside the vocabulary, streamed": (
        "/v1/completions",
        {"prompt": [1, 2, 10**6], "stream": True},
        400,
        "invalid_request",
        "prompt",
    ),
    "n past 128": ("/v1/completions", {"prompt": "hi", "n": 129}, 400, "invalid_value", "n"),
    "echo not a boolean": ("/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "invalid_value", "echo"),
    "suffix": ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "unsupported_parameter", "suffix"),
    "logit_bias past 100": (
        "/v1/chat/completions",
        {"logit_bias": {"5": 101}},
        400,
        "invalid_request",
        "logit_bias",
    ),
    "logit_bias on no token id": (
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"five": 1}},
        400,
        "invalid_request",
        "logit_bias",
    ),
    "logit_bias outside the vocabulary": (
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"10000000": 1}},
        400,
        "invalid_request",
        "logit_bias",
    ),
    "best_of": ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "unsupported_parameter", "best_of"),
    "tools": (
        "/v1/chat/completions",
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "unsupported_parameter",
        "tools",
    ),
    "a batch with an empty prompt": ("/v1/completions", {"prompt": ["a", ""]}, 400, "invalid_request", "prompt"),
    "a batch of too many requests": (
        "/v1/completions",
        {"prompt": [[1]] * 1025, "n": 2},
        400,
        "invalid_request",
        "prompt",
    ),
    "unknown field": ("/v1/completions", {"prompt": "hi", "colour": "red"}, 400, "unrecognized_argument", "colour"),
    "stream_options without stream": (
        "/v1/completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "invalid_request",
        "stream_options",
    ),
    "image content": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
        400,
        "invalid_value",
        "messages",
    ),
    "chat message without content": (
        "/v1/chat/completions",
        {"messages": [{"role": "user"}]},
        400,
        "missing_required_parameter",
        "messages",
    ),
    "no such route": ("/v1/embeddings", {"input": "hi"}, 404, "not_found", None),
}


@pytest.mark.slow
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served: Served) -> None:
    before = metric_samples(served)
    for name, (path, body, status, code, param) in BAD_REQUESTS.items():
        if isinstance(body, dict):
            body = {"model": MODEL, **body}
            if path.endswith("chat/completions"):
                body.setdefault("messages", [{"role": "user", "content": "hi"}])
            content = json.dumps(body).encode()
        else:
            content = body
        response = served.http.post(path, content=content, headers={"Content-Type": "application/json"})
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], name
        assert (error["code"], error["param"]) == (code, param), (name, error)
        assert error["type"] == ("invalid_request_error" if status < 500 else "server_error"), name

    # A body without a length (chunked) is counted as it arrives and refused at the limit.
    chunks = iter([b" " * 2**20] * 5)
    response = served.http.post("/v1/completions", content=chunks, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    with pytest.raises(openai.BadRequestError) as info:  # what the official client makes of one
        served.client.completions.create(model=MODEL, prompt="hi", suffix="!")
    assert info.value.status_code == 400 and info.value.code == "unsupported_parameter" and info.value.param == "suffix"

    after = metric_samples(served)
    for code in (
        "malformed_json",
        "model_not_found",
        "invalid_value",
        "unsupported_parameter",
        "context_length_exceeded",
    ):
        expected = sum(1 for *_, c, _ in BAD_REQUESTS.values() if c == code) + (code == "unsupported_parameter")
        got = sample(after, "pdserve:request_error_total", reason=code) - sample(
            before, "pdserve:request_error_total", reason=code
        )
        assert got == expected, code
    ok = served.client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"


@pytest.mark.slow
def test_metrics_parse_and_move_with_a_request(served: Served) -> None:
    before = metric_samples(served)
    with served.http.stream(
        "POST",
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": TEXT_PROMPT,
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as response:
        events = sse_events(response)
    usage = events[-1]["usage"]
    chunks = len(events) - 2  # less the finish and usage chunks
    after = metric_samples(served)

    def moved(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert moved("pdserve:request_success_total", finished_reason="length") == 1
    assert moved("pdserve:generation_tokens_total") == 5
    assert moved("pdserve:prompt_tokens_total") == usage["prompt_tokens"]
    assert moved("pdserve:time_to_first_token_seconds_count") == 1
    assert moved("pdserve:inter_token_latency_seconds_count") == chunks - 1
    assert moved("pdserve:e2e_request_latency_seconds_count") == 1
    for phase in ("request_queue_time", "request_prefill_time", "kv_transfer_time", "request_decode_time"):
        assert moved(f"pdserve:{phase}_seconds_count") == 1, phase
    assert moved("pdserve:kv_transfer_bytes_total") > 0
    assert sample(after, "pdserve:cluster_ready") == 1
    assert not [name for name, _ in after if name.endswith("_created")]  # as vLLM, none
    wait_for(lambda: idle(served.zmq.stats()), 30, "the cluster did not become idle")  # groups report every 0.2 s
    idle_samples = metric_samples(served)
    for group in ("prefill0", "decode0"):
        for gauge in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "kv_transfers_pending"):
            assert (f"pdserve:{gauge}", (("group", group), ("model_name", MODEL))) in idle_samples, (gauge, group)
            assert sample(idle_samples, f"pdserve:{gauge}", group=group) == 0, (gauge, group)
        assert sample(idle_samples, "pdserve:kv_transfer_refused_total", group=group) == 0


def collected(stats: Stats) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples a scrape exposes of the cluster's ``stats`` (``ClusterCollector``)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.router.metrics import ClusterCollector

    collector = ClusterCollector(MODEL)
    collector.stats = stats
    registry = CollectorRegistry()
    registry.register(collector)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }


def test_metrics_carry_each_groups_prefix_cache_counters() -> None:
    samples = collected(
        Stats(
            1,
            {
                "prefill0": {
                    "prefix_queried_tokens": 300,
                    "prefix_hit_tokens": 240,
                    "prefix_evicted_blocks": 7,
                    "prefix_cached_blocks": 12,
                },
                "decode0": {"num_blocks": 64, "free_blocks": 64},
            },
        )
    )
    assert sample(samples, "pdserve:prefix_cache_blocks", group="prefill0") == 12
    assert sample(samples, "pdserve:prefix_cache_blocks", group="decode0") == 0
    assert sample(samples, "pdserve:prefix_cache_queries_total", group="prefill0") == 300
    assert sample(samples, "pdserve:prefix_cache_hits_total", group="prefill0") == 240
    assert sample(samples, "pdserve:prefix_cache_evicted_blocks_total", group="prefill0") == 7
    assert ("pdserve:prefix_cache_hits_total", (("group", "decode0"), ("model_name", MODEL))) in samples


def test_metrics_carry_each_groups_kv_transfer_failures() -> None:
    """A leader's failure count travels in its worker_stats, through the router's stats reply, to
    a per-group counter beside the refusals."""
    from pdserve.cluster.protocol import WorkerStats, decode, encode

    report = decode(encode(WorkerStats("decode", 0, 64, 60, 1, 0, 0, 0, kv_transfer_failures=3)))
    assert isinstance(report, WorkerStats) and report.kv_transfer_failures == 3
    samples = collected(Stats(1, {"decode0": {"kv_transfer_failures": 3, "kv_refused": 5}, "prefill0": {}}))
    assert sample(samples, "pdserve:kv_transfer_failures_total", group="decode0") == 3
    assert sample(samples, "pdserve:kv_transfer_refused_total", group="decode0") == 5
    assert ("pdserve:kv_transfer_failures_total", (("group", "prefill0"), ("model_name", MODEL))) in samples


def test_metrics_carry_each_groups_preemptions() -> None:
    """vLLM's ``num_preemptions`` counter, per group, from the leaders' worker_stats."""
    from pdserve.cluster.protocol import WorkerStats, decode, encode

    report = decode(encode(WorkerStats("decode", 0, 64, 60, 1, 0, 0, 0, preemptions=4)))
    assert isinstance(report, WorkerStats) and report.preemptions == 4
    samples = collected(Stats(1, {"decode0": {"preemptions": 4}, "prefill0": {}}))
    assert sample(samples, "pdserve:num_preemptions_total", group="decode0") == 4
    assert sample(samples, "pdserve:num_preemptions_total", group="prefill0") == 0


def test_metrics_carry_the_routers_faults_and_each_groups_readiness() -> None:
    """What an operator alerts on: group failures, restarts and moved requests (the counts
    ``--status`` prints), and a group that is down, which reports no stats of its own."""
    faults = {"group_failures": 2, "restarts": 1, "migrated": 8, "worker_failed": 3}
    members = [
        GroupInfo(role, 0, 1, state, f"ipc://{role}", ["cpu"], False, 0, 0, 0)
        for role, state in (("prefill", "ready"), ("decode", "down"))
    ]
    samples = collected(Stats(1, {"prefill0": {}}, faults=faults, members=members))
    assert sample(samples, "pdserve:group_failures_total") == 2
    assert sample(samples, "pdserve:group_restarts_total") == 1
    assert sample(samples, "pdserve:requests_migrated_total") == 8
    assert sample(samples, "pdserve:requests_worker_failed_total") == 3
    assert sample(samples, "pdserve:group_ready", group="prefill0") == 1
    assert sample(samples, "pdserve:group_ready", group="decode0") == 0


def test_metrics_of_several_processes_are_summed_whichever_one_exposes_them(tmp_path: Path) -> None:
    """With PROMETHEUS_MULTIPROC_DIR (what launch.py --api-servers N sets) each process's counters
    and histograms go to its files there, and any process's /metrics body sums every process's,
    one that has exited included, each family once; without it, a process counts its own."""
    script = (
        "import sys\n"
        "from pdserve.router.metrics import FrontendMetrics\n"
        f"m = FrontendMetrics({MODEL!r})\n"
        "m.observe_final('stop', {'prompt_tokens': int(sys.argv[1]), 'completion_tokens': 3}, {'queue': 0.01})\n"
        "m.ttft.observe(0.003)\n"
        "m.observe_error('invalid_request')\n"
        "sys.stdout.write(m.exposition().decode())\n"
    )
    shared = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    alone = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}

    def exposition(prompt_tokens: int, env: dict[str, str]) -> str:
        command = [sys.executable, "-c", script, str(prompt_tokens)]
        return subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout

    exposition(5, shared)
    exposition(7, shared)
    text = exposition(11, shared)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert sample(samples, "pdserve:request_success_total", finished_reason="stop") == 3
    assert sample(samples, "pdserve:prompt_tokens_total") == 5 + 7 + 11
    assert sample(samples, "pdserve:generation_tokens_total") == 9
    assert sample(samples, "pdserve:time_to_first_token_seconds_count") == 3
    assert sample(samples, "pdserve:time_to_first_token_seconds_bucket", le="0.005") == 3
    assert sample(samples, "pdserve:time_to_first_token_seconds_bucket", le="0.002") == 0
    assert sample(samples, "pdserve:request_queue_time_seconds_count") == 3
    assert sample(samples, "pdserve:request_error_total", reason="invalid_request") == 3
    lines = text.splitlines()
    for name in ("pdserve:prompt_tokens_total", "pdserve:cluster_ready"):  # no sample twice
        assert sum(line.startswith(f"{name}{{") for line in lines) == 1, name
    assert f'pdserve:prompt_tokens_total{{model_name="{MODEL}"}} 13.0' in exposition(13, alone)


@pytest.mark.slow
def test_n_choices_whole_and_streamed(served: Served) -> None:
    """Each choice is the cluster's answer to its own request (seeds one apart); the usage counts
    the prompt once and every choice's tokens; a stream ends each choice with its own reason."""
    client = served.client
    whole = client.completions.create(
        model=MODEL, prompt=TEXT_PROMPT, max_tokens=10, temperature=1.0, seed=5, n=3, logprobs=1
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    expected = [
        served.zmq.generate(TEXT_PROMPT, chat=False, max_tokens=10, temperature=1.0, seed=5 + i) for i in range(3)
    ]
    assert [c.text for c in whole.choices] == [e.text for e in expected]
    assert len({c.text for c in whole.choices}) > 1
    assert all(
        c.logprobs is not None and len(c.logprobs.tokens or []) == len(e.token_ids)
        for c, e in zip(whole.choices, expected)
    )
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == expected[0].usage["prompt_tokens"]
    assert whole.usage.completion_tokens == sum(len(e.token_ids) for e in expected)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_completion_tokens=12,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, reasons, roles, usage = ["", ""], [None, None], [0, 0], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
            if choice.finish_reason is not None:
                assert reasons[choice.index] is None
                reasons[choice.index] = choice.finish_reason
    greedy = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_completion_tokens=12, temperature=0
    )
    assert texts == [greedy.choices[0].message.content] * 2
    assert reasons == [greedy.choices[0].finish_reason] * 2 and roles == [1, 1]
    assert usage is not None and greedy.usage is not None
    assert usage.completion_tokens == 2 * greedy.usage.completion_tokens
    wait_for(lambda: idle(served.zmq.stats()), 30, "the choices' requests did not end")

    # A request the cluster would refuse is refused as one request would be.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=TEXT_PROMPT, n=3, logit_bias={"49152": 1})  # type: ignore[dict-item]
    assert info.value.param == "logit_bias" and "outside the vocabulary" in info.value.message


@pytest.mark.slow
def test_a_batch_of_prompts_answers_each_as_its_own_request(served: Served, demo_tokenizer: Any) -> None:
    """A list of prompts, as lm-evaluation-harness's ``local-completions`` sends a batch: each
    choice is what the cluster gives its prompt alone (greedy: the ZMQ client's text, echo and
    log-probabilities), in the batch's order; the usage counts every prompt and choice."""
    prompts = [TEXT_PROMPT, "Paris is the capital of", "1, 2, 3,"]
    request = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    whole = served.http.post("/v1/completions", json={**request, "n": 2}).json()
    alone = [served.http.post("/v1/completions", json={**request, "prompt": p}).json()["choices"][0] for p in prompts]
    assert [c["index"] for c in whole["choices"]] == list(range(6))
    for i, choice in enumerate(whole["choices"]):
        expected = alone[i // 2]
        assert choice["text"] == expected["text"] and choice["text"].startswith(prompts[i // 2])
        assert choice["logprobs"]["tokens"] == expected["logprobs"]["tokens"]
        # Run side by side, the prompts share steps: fp32 sums in another order, not other tokens.
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-4)
    for prompt, choice in zip(prompts, alone):
        zmq = zmq_greedy(served, prompt, chat=False, max_tokens=3)
        assert choice["text"] == prompt + zmq.text
    prompt_tokens = [len(encode_prompt(demo_tokenizer, p, chat=False)) for p in prompts]
    assert whole["usage"]["prompt_tokens"] == sum(prompt_tokens)
    assert whole["usage"]["completion_tokens"] == 6 * 3

    # Streamed, by the official client: each choice's chunks carry its index and its own end.
    stream = served.client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=3, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    texts, reasons, usage = [""] * 3, [None] * 3, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                assert reasons[c.index] is None
                reasons[c.index] = c.finish_reason
    assert [prompt + text for prompt, text in zip(prompts, texts)] == [c["text"] for c in alone]
    assert reasons == ["length"] * 3
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (sum(prompt_tokens), 9)
    wait_for(lambda: idle(served.zmq.stats()), 30, "the batch's requests did not end")


def test_a_client_that_goes_away_aborts_its_request_and_frees_the_kv(served: Served) -> None:
    before = metric_samples(served)
    body = {
        "model": MODEL,
        "prompt": TEXT_PROMPT,
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=served.base_url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        started = time.monotonic()
        events = 0
        for line in lines:
            events += line.startswith("data: ")
            if events == 4:
                break
        per_token = (time.monotonic() - started) / 3
        stats = served.zmq.stats()
        assert stats.requests_in_flight == 1 and not idle(stats)  # running, holding blocks

        def decoding() -> bool:  # the gauges of /metrics show it too
            samples = metric_samples(served)
            return (
                sample(samples, "pdserve:num_requests_running", group="decode0") == 1
                and sample(samples, "pdserve:kv_cache_usage_perc", group="decode0") > 0
            )

        wait_for(decoding, 10, "the metrics never showed the running request")
    gone = time.monotonic()  # the connection is closed: the front end must abort the request
    wait_for(lambda: idle(served.zmq.stats()), 60, "the KV was not freed")
    # Left alone it would run ~476 more tokens; the abort frees it in a fraction of that.
    assert time.monotonic() - gone < max(2.0, 476 * per_token / 4)

    # A non-streaming request whose client times out is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.base_url}/v1/completions", json={**body, "stream": False}, timeout=1.5)
    gone = time.monotonic()
    wait_for(lambda: idle(served.zmq.stats()), 60, "the KV was not freed")
    assert time.monotonic() - gone < max(2.0, 476 * per_token / 4)

    def counted() -> bool:  # each abort in every metric, with what it used, as a finished request
        after = metric_samples(served)

        def moved(name: str, **labels: str) -> float:
            return sample(after, name, **labels) - sample(before, name, **labels)

        return (
            moved("pdserve:request_success_total", finished_reason="abort") == 2
            and moved("pdserve:e2e_request_latency_seconds_count") == 2
            and moved("pdserve:request_prefill_time_seconds_count") == 2
            and moved("pdserve:prompt_tokens_total") > 0
            and moved("pdserve:generation_tokens_total") >= 3
        )

    wait_for(counted, 10, "the aborts are not counted in every metric")

    # A stream of several choices that its client leaves has every choice's request aborted.
    with (
        httpx.Client(base_url=served.base_url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json={**body, "n": 3}) as response,
    ):
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 6:  # still reading: leaving the loop closes the connection
                wait_for(lambda: served.zmq.stats().requests_in_flight == 3, 10, "the three choices never all ran")
                break
    gone = time.monotonic()
    wait_for(lambda: idle(served.zmq.stats()), 60, "the choices' KV was not freed")
    assert time.monotonic() - gone < max(2.0, 476 * per_token / 4)


def test_a_client_that_stops_reading_is_dropped_after_the_send_timeout(demo_model_dir: Path, tmp_path: Path) -> None:
    """A client that neither reads nor leaves would hold its stream, and its replies in the front
    end's memory, for good: once its buffers stay full for --send-timeout, the request is aborted
    and the connection closed (the stream ends without [DONE]), and the front end drains at once."""
    from pdserve.bench.frontend import stand_in_cluster

    with stand_in_cluster(60_000, 0.0, str(demo_model_dir)) as cluster:  # 60000 tokens, unpaced
        frontend = FrontendProcess(cluster.endpoint, tmp_path / "frontend.log", "--send-timeout", "1")
        try:
            body = json.dumps(
                {"model": MODEL, "prompt": [1000, 1001], "max_tokens": 59_990, "ignore_eos": True, "stream": True}
            ).encode()
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", frontend.port))
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            time.sleep(6.0)  # reading nothing: the stand-in is done in about a second, the front end stalls
            sock.settimeout(20)
            received = bytearray()
            while chunk := sock.recv(1 << 16):
                received += chunk
            sock.close()
            assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
            assert received.count(b"data: ") < 59_990  # cut off, not streamed to the end
            started = time.monotonic()
            assert frontend.stop(timeout=20) == 0 and time.monotonic() - started < 10  # nothing left to drain
            assert "read nothing of its stream for 1s" in frontend.log_path.read_text()
        finally:
            frontend.kill()


@pytest.mark.slow
def test_sigterm_drains_refuses_new_requests_with_503_and_exits_zero(served: Served, tmp_path: Path) -> None:
    frontend = FrontendProcess(served.cluster.endpoint, tmp_path / "frontend.log")
    try:
        first_token = threading.Event()
        outcome: dict[str, Any] = {}

        def long_request() -> None:
            body = {
                "model": MODEL,
                "prompt": TEXT_PROMPT,
                "max_tokens": 60,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with httpx.stream("POST", f"{frontend.base_url}/v1/completions", json=body, timeout=60) as response:
                lines = []
                for line in response.iter_lines():
                    lines.append(line)
                    first_token.set()
                outcome["lines"] = lines

        thread = threading.Thread(target=long_request)
        thread.start()
        assert first_token.wait(60)
        frontend.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{frontend.base_url}/health").status_code == 503, 10, "no 503 after SIGTERM")
        for method, path in (("GET", "/health"), ("POST", "/v1/completions")):
            response = httpx.request(method, f"{frontend.base_url}{path}", json={"model": MODEL, "prompt": "hi"})
            assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down", path
        thread.join(60)
        data = [line for line in outcome["lines"] if line]
        assert data[-1] == "data: [DONE]" and json.loads(data[-2][6:])["usage"]["completion_tokens"] == 60
        assert frontend.proc.wait(timeout=60) == 0, (tmp_path / "frontend.log").read_text()[-2000:]
    finally:
        frontend.kill()


@pytest.mark.slow
def test_ctrl_c_drains_the_http_front_end_too(tmp_path: Path, demo_model_dir: Path) -> None:
    """Ctrl-C in a terminal signals the whole foreground process group: the front end must still
    drain its streams (one signal, the launcher's), and the launcher exit 0 without a traceback.
    The launcher hands the front end its --allowed-origins and --access-log, and its --api-key in
    its environment, not on its command line."""
    http_port = free_port()
    log_path = tmp_path / "launch.log"
    key = "sk-launched"
    command = [
        sys.executable,
        "launch.py",
        "--model",
        "demo",
        "--port",
        str(free_port()),
        "--http-port",
        str(http_port),
        "--api-key",
        key,
        "--allowed-origins",
        "https://ui.example",
        "--access-log",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(
            lambda: "endpoint " in log_path.read_text() or proc.poll() is not None, 300, "the cluster never started"
        )
        assert proc.poll() is None, log_path.read_text()
        front_ends = [
            cmdline
            for cmdline in (p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline") if p.exists())
            if b"pdserve.router.openai_server" in cmdline and str(http_port).encode() in cmdline
        ]
        assert len(front_ends) == 1 and key.encode() not in front_ends[0], front_ends
        url = f"http://127.0.0.1:{http_port}/v1/completions"
        # No --served-model-name: the model is named as --model was given.
        body = {"model": "demo", "prompt": TEXT_PROMPT, "max_tokens": 40, "ignore_eos": True, "stream": True}
        refused = httpx.post(url, json=body, headers={"Origin": "https://ui.example"}, timeout=30)
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://ui.example"
        with httpx.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            os.killpg(proc.pid, signal.SIGINT)
            events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-4000:]
        log = log_path.read_text()
        assert "Traceback" not in log, log[-4000:]
        assert "stopping: 1 request(s) in flight finish first, for up to 30 s (--drain-timeout;" in log, log[-4000:]
        for status in ("401 Unauthorized", "200 OK"):  # each request's access line
            assert f'"POST /v1/completions HTTP/1.1" {status}' in log, log[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_port_taken_without_reuse_port_is_one_clear_line() -> None:
    """--reuse-port shares the port only with servers that ask for it too: one bound without it
    (here a plain socket) leaves it taken, said in one line, exit 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "pdserve.router.openai_server", "--reuse-port", "--port", str(port)]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"Error: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(another server there? choose another --port)"
    )


@pytest.mark.slow
def test_without_a_cluster_health_and_requests_are_503(tmp_path: Path) -> None:
    frontend = FrontendProcess(f"tcp://127.0.0.1:{free_port()}", tmp_path / "frontend.log")
    try:
        health = httpx.get(f"{frontend.base_url}/health", timeout=30)
        assert health.status_code == 503 and health.json()["error"]["code"] == "cluster_unavailable"
        response = httpx.post(f"{frontend.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
        assert response.status_code == 503 and response.json()["error"]["code"] == "cluster_unavailable"
        metrics = httpx.get(f"{frontend.base_url}/metrics", timeout=30).text
        assert f'pdserve:cluster_ready{{model_name="{MODEL}"}} 0.0' in metrics
        assert frontend.stop() == 0
        log = frontend.log_path.read_text()
        assert "GET /health" not in log  # no access log unless asked
        # Where to send requests: uvicorn says nothing of a socket bound for it.
        assert f"the OpenAI API is on http://127.0.0.1:{frontend.port}/v1 (model {MODEL})" in log
    finally:
        frontend.kill()


@pytest.mark.slow
def test_bench_serve_openai_backend_measures_the_front_end(served: Served, demo_model_dir: Path) -> None:
    """bench.serve's load generator over HTTP: every request completes with the token counts the
    ZMQ backend gets for the same requests, and the document carries vLLM's flat keys."""
    from pdserve.bench.serve import BenchConfig, run_benchmark, vocab_size_of

    vocab = vocab_size_of(demo_model_dir)
    for workload in ("random", "text"):
        config = BenchConfig(
            workload=workload,
            num_requests=3,
            warmup=0,
            input_len=8,
            output_len=4,
            concurrency=2,
            vocab_size=vocab,
            timeout=60,
        )
        # The base URL an OpenAI client takes (ending /v1) serves as well as the server's root.
        base_url = served.base_url if workload == "random" else f"{served.base_url}/v1/"
        over_http = asyncio.run(run_benchmark(config, "", backend="openai", base_url=base_url))
        over_zmq = asyncio.run(run_benchmark(config, served.cluster.endpoint))
        assert over_http["meta"]["backend"] == "openai" and over_http["meta"]["model_id"] == MODEL
        for key in ("completed", "total_input_tokens", "total_output_tokens"):
            assert over_http[key] == over_zmq[key], (workload, key)
        assert over_http["completed"] == 3 and over_http["failed"] == 0
        if workload == "random":  # ignore_eos: exactly output_len each
            assert over_http["total_output_tokens"] == 12
        for key in ("request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_itl_ms", "std_e2el_ms"):
            assert isinstance(over_http[key], float) and over_http[key] >= 0, key


@pytest.mark.slow
def test_a_draining_cluster_answers_503(served: Served) -> None:
    """Last in the module: SIGTERM to the cluster. Its running request finishes; health and new
    requests are 503 while it drains; it exits 0."""
    outcome: dict[str, Any] = {}
    started = threading.Event()

    def long_request() -> None:
        body = {
            "model": MODEL,
            "prompt": TEXT_PROMPT,
            "max_tokens": 100,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=60) as response:
            started.set()
            outcome["events"] = sse_events(response)

    thread = threading.Thread(target=long_request)
    thread.start()
    assert started.wait(60)
    served.cluster.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: served.http.get("/health").status_code == 503, 30, "health stayed 200 while draining")
    response = served.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
    thread.join(60)
    assert outcome["events"][-1]["choices"][0]["finish_reason"] == "length"
    assert served.cluster.proc.wait(timeout=120) == 0
