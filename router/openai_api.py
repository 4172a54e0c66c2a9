"""The OpenAI API's shapes: request bodies checked into a ``GenerationRequest`` for the cluster,
response and stream-chunk bodies, and errors in OpenAI's form.

Requests are decoded strictly (no "5" for 5, no ``true`` for 1): a field of the wrong type or
out of range, a field of OpenAI's or vLLM's that this server does not support (``suffix``,
tools, guided decoding, ...) and a field neither has are each a 400 naming the field; an
unsupported field with its "not used" value (``tools: []``, ``best_of: 1``) passes, and fields
that change nothing of the output (``user``, ``store``, ``metadata``, ``parallel_tool_calls``,
``service_tier``, ...) are accepted and ignored. vLLM's extensions ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``min_tokens``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``return_tokens_as_token_ids``,
``request_id``, a completion's ``add_special_tokens`` and a chat's ``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message`` and ``echo`` are accepted, and each choice
carries its ``stop_reason``. Sampling fields a request
leaves out take the model's ``generation_config.json`` values (``generation_defaults``).
Prompts are tokenized here, the same way the ZMQ client's are
(``engine.tokenization.encode_prompt``), so the cluster gets token ids.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from pdserve.cluster.protocol import MAX_REQUEST_ID_CHARS
from pdserve.engine.sampling import MAX_LOGPROBS, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, RequestError
from pdserve.engine.tokenization import encode_chat, encode_prompt, has_special_text

MAX_INT32 = 2**31 - 1
# OpenAI's bound on ``n``: each choice is a request of its own in the cluster.
MAX_CHOICES = 128
# A completion's prompts times ``n``: the cluster requests one HTTP request may start.
MAX_BATCH = 2048
# Stop strings of one request (OpenAI takes 4, vLLM any number): the front end matches each.
MAX_STOP_STRINGS = 128
# A request's own id (vLLM's request_id) within the cluster's limit once it is a response id
# ("chatcmpl-" before it) and, of several choices, a choice's ("-2047" after it).
MAX_CLIENT_REQUEST_ID_CHARS = MAX_REQUEST_ID_CHARS - len("chatcmpl-") - len(f"-{MAX_BATCH - 1}")
MAX_INT64 = 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(400, message, code, param)


# -- request bodies -------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, every chunk's usage so far
    include_obfuscation: bool | None = None  # OpenAI's padding against length side channels: ignored


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str | None = None  # absent, null or "": the served model (vLLM's; OpenAI requires it)
    stream: bool | None = False  # null: OpenAI's default, false
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)  # vLLM: -1 and 0 both turn it off
    seed: int | None = Field(None, ge=-MAX_INT64 - 1, le=MAX_INT64)  # any int64, as vLLM's: -1 is a seed too
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False  # vLLM's
    skip_special_tokens: bool = True  # vLLM's
    return_tokens_as_token_ids: bool | None = None  # vLLM's: log-probabilities' tokens as "token_id:<id>"
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = Field(None, ge=0, le=MAX_INT32)  # vLLM's
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)  # vLLM's
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    user: str | None = None  # accepted and ignored, as it only identifies the caller to OpenAI
    logit_bias: dict[str, float] | None = None  # token id -> bias in [-100, 100], checked with the sampling
    # vLLM's: the response's id (after "cmpl-" or "chatcmpl-") and the cluster's, in its logs.
    request_id: str | None = Field(None, min_length=1, max_length=MAX_CLIENT_REQUEST_ID_CHARS)
    # vLLM's, accepted and ignored: they tune only what this server does not do (guided decoding's
    # backend, multimodal inputs, logits processors, vLLM's own KV connectors).
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    # vLLM's extensions that this server does not implement: with their "not used" values only
    # (UNSUPPORTED), so that a client that sends its defaults works and one that needs them is told.
    prompt_logprobs: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    priority: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    spaces_between_special_tokens: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    cache_salt: Any = None
    structural_tag: Any = None
    return_token_ids: Any = None
    kv_transfer_params: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, stop: Any) -> Any:
        """As ``CompletionRequest.prompt``: not "stop.str: Input should be a valid string". An
        empty stop string is refused, as vLLM does: it would end every output at once."""
        if stop is None:
            return stop
        if isinstance(stop, str):
            if not stop:
                raise ValueError("a stop string must not be empty")
            return stop
        if not isinstance(stop, list):
            raise ValueError(f"expected a string or a list of strings, got {_json_type(stop)}")
        if len(stop) > MAX_STOP_STRINGS:  # each one costs every streamed delta some matching
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        for i, item in enumerate(stop):
            if not isinstance(item, str):
                raise ValueError(f"item {i} must be a string, got {_json_type(item)}")
            if not item:
                raise ValueError(f"item {i} must not be empty")
        return stop


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT32)  # 0: only with echo, to score the prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    add_special_tokens: bool = True  # vLLM's: false tokenizes the text alone (no BOS)
    best_of: Any = None
    suffix: Any = None
    response_format: Any = None
    prompt_embeds: Any = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _no_logprobs(cls, logprobs: Any) -> Any:
        """``false``, which SDKs may send for "none", is null here; ``0`` asks for the tokens' own."""
        return None if logprobs is False else logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        """Checked here, as a chat's content is, so that an error says what is wrong instead of
        naming the union's first branch ("prompt.str: Input should be a valid string")."""
        if isinstance(prompt, str):
            return prompt
        if not isinstance(prompt, list):
            raise ValueError(f"expected a string or a list of token ids, got {_json_type(prompt)}")
        for i, item in enumerate(prompt):
            if isinstance(prompt[0], str):
                if not isinstance(item, str):
                    raise ValueError(f"item {i} must be a string, as item 0 is, got {_json_type(item)}")
            elif isinstance(prompt[0], list):
                if not isinstance(item, list):
                    raise ValueError(f"item {i} must be a list of token ids, as item 0 is, got {_json_type(item)}")
                for j, token in enumerate(item):
                    _check_token_id(token, f"item {i}.{j}")
            else:
                _check_token_id(item, f"item {i}")
        return prompt


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    # Caching hints (LiteLLM's, OpenAI's): the prefix cache needs none.
    cache_control: Any = None
    prompt_cache_breakpoint: Any = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    # Validated even when absent: only an assistant message (one with tool calls) may lack it.
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None
    # What the official client's ChatCompletionMessage.model_dump() holds besides role and content,
    # so that a reply can be sent back as the next turn: only empty values (MESSAGE_UNSUPPORTED).
    refusal: Any = None
    tool_calls: Any = None
    function_call: Any = None
    audio: Any = None
    annotations: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, content: Any, info: ValidationInfo) -> Any:
        """Content is checked here, whole, so that an error says what is accepted instead of
        naming the union's branches ("messages.0.content.str: Input should be a valid string")."""
        if content is None:
            role = info.data.get("role")
            if role is not None and role != "assistant":  # an invalid role is reported as such
                # Pydantic's own "missing" type: answered as OpenAI's missing_required_parameter.
                raise PydanticCustomError("missing", "Field required")
            return content
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError(f"expected a string or a list of text parts, got {_json_type(content)}")
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise ValueError(f"part {i} must be an object (a text part), got {_json_type(part)}")
            if part.get("type") != "text":  # chat UIs send images as content parts: refused by name
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            if "text" not in part:
                raise ValueError(f"part {i} has no text")
            if not isinstance(part["text"], str):
                raise ValueError(f"part {i} needs its text as a string, got {_json_type(part['text'])}")
            extra = sorted(set(part) - set(TextPart.model_fields))
            if extra:
                raise ValueError(f"part {i} has the unrecognized key {extra[0]!r} (a text part has type and text)")
        return content


def _check_token_id(token: Any, where: str) -> None:
    if isinstance(token, bool) or not isinstance(token, int):
        raise ValueError(f"{where} must be a token id (an integer), got {_json_type(token)}")
    if not 0 <= token <= MAX_INT32:
        raise ValueError(f"{where} must be a token id in [0, {MAX_INT32}], got {token}")


def _json_type(value: Any) -> str:
    """A JSON value's kind, as an error message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    # vLLM's: the chat template's generation prompt, or the last message left open to go on with.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the reply starts with the last message's content, if the assistant's
    # Accepted and ignored: they change nothing of the output (no tools run here; nothing is
    # stored; OpenAI's tiers, cache keys and end-user ids mean nothing to this server).
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    include_reasoning: bool | None = None  # vLLM's, for its reasoning parsers: no output here has a reasoning part
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    prediction: Any = None
    web_search_options: Any = None
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    moderation: Any = None
    # vLLM's
    add_special_tokens: Any = None
    chat_template: Any = None
    documents: Any = None


# Each unsupported field and the values that mean "not used" (what SDKs send by default).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "audio": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    # vLLM's
    "prompt_logprobs": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "priority": (None, 0),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "spaces_between_special_tokens": (None, True),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "cache_salt": (None,),
    "structural_tag": (None,),
    "return_token_ids": (None, False),
    "kv_transfer_params": (None,),
    "prompt_embeds": (None,),
    "moderation": (None,),
}
# A chat's alone.
CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "add_special_tokens": (None, False),  # vLLM's default for a chat: the template has its own
    "chat_template": (None,),  # the template is the server's: vLLM too refuses one by default
    "documents": (None, []),
}
# A chat message's fields of the same kind.
MESSAGE_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "refusal": (None,),
    "tool_calls": (None, []),
    "function_call": (None,),
    "audio": (None,),
    "annotations": (None, []),
}


def _neutral(value: Any, neutrals: tuple[Any, ...]) -> bool:
    """``value`` is one of ``neutrals`` as JSON sees it: 0 is 0.0, but false is not 0 (nor
    true 1: ``best_of: true`` is refused)."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutrals)


# The sampling fields a model's generation_config.json may recommend, taken as the defaults of
# the fields a request leaves out (vLLM's --generation-config auto, its max_new_tokens aside), with
# OpenAI's (and vLLM's) defaults where it names none.
OPENAI_SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling defaults a model directory's ``generation_config.json`` recommends (none
    without one); ValueError naming the file for one that is not JSON or holds a value a
    request could not."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    defaults = {name: config[name] for name in OPENAI_SAMPLING_DEFAULTS if config.get(name) is not None}
    try:
        _Sampling.model_validate(defaults)  # the bounds a request's own values meet
    except ValidationError as e:
        raise ValueError(f"{path}: {_validation_error(e).message}") from None
    return defaults


# The body field that holds the prompt, by route: where an error in the prompt is reported.
PROMPT_PARAMS: dict[str, str] = {"completion": "prompt", "chat": "messages"}
# A response's id, by route: this, a dash, and the request's own id or a random one.
ID_PREFIXES: dict[str, str] = {"completion": "cmpl", "chat": "chatcmpl"}


@dataclass
class Prompt:
    """One prompt of a request, as token ids."""

    token_ids: list[int]
    # What an echo shows before the output: a completion's prompt, a chat's begun assistant message.
    echo: str | None = None


@dataclass
class GenerationRequest:
    """A checked request: its prompts (a chat's one, a completion's one or a batch), the
    cluster's sampling fields, and what the front end does itself (stop strings, streaming, the
    response's shape)."""

    kind: Literal["completion", "chat"]
    model: str
    prompts: list[Prompt]
    sampling: dict[str, Any]  # cluster.protocol.Sampling fields
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False  # the output keeps the stop string that ended it
    skip_special_tokens: bool = True  # the text (and log-probabilities' tokens) leave them out
    echo_only: bool = False  # completions' echo with max_tokens 0: the prompt alone, no output
    tokens_as_ids: bool = False  # log-probabilities show each token as "token_id:<id>"
    # A completion's text prompt spelled special tokens, read as plain text (not as vLLM reads them).
    special_text_as_text: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # every chunk carries the usage so far (vLLM's continuous_usage_stats)
    n: int = 1  # choices: each a request of its own, a seed (if any) plus its index
    id: str = ""
    request_id: str | None = None  # the client's own, which ``id`` is made of (errors name it)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{ID_PREFIXES[self.kind]}-{uuid.uuid4().hex}"

    @property
    def prompt_param(self) -> str:
        return PROMPT_PARAMS[self.kind]

    @property
    def choices(self) -> int:
        """The response's choices: ``n`` of each prompt, each a request of its own."""
        return len(self.prompts) * self.n

    def prompt_of(self, index: int) -> Prompt:
        """The prompt of choice ``index``: choices ``i * n`` to ``i * n + n - 1`` are prompt i's
        (vLLM's order)."""
        return self.prompts[index // self.n]

    @property
    def chunk_object(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion.chunk"

    def sampling_of(self, index: int) -> dict[str, Any]:
        """The cluster's sampling fields of choice ``index``: a seeded request's choices of one
        prompt draw from seeds one apart, so that they differ and each repeats; each prompt's
        first choice is what a request of that prompt alone would get."""
        seed, offset = self.sampling.get("seed"), index % self.n
        if offset == 0 or seed is None:
            return self.sampling
        return {**self.sampling, "seed": (seed + offset) % (MAX_INT64 + 1)}

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
        index: int = 0,
        stop_reason: str | int | None = None,
        usage: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """A stream chunk of choice ``index``: ``text`` (None: none, as in chat's last chunk)
        and/or the finish reason, with its ``stop_reason``; ``logprobs``: its tokens'
        (``LogprobsFormat``); ``usage``: the choice's so far, where continuous usage was asked."""
        if self.kind == "completion":
            choice: dict[str, Any] = {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        else:
            # The first always has content ("" before any text), as OpenAI's and vLLM's role chunk.
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        body = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,  # OpenAI's field; null: this server reports no fingerprint
            "choices": [choice],
        }
        if usage is not None:
            body["usage"] = usage_body(usage)
        elif self.include_usage:  # OpenAI's: every chunk before the usage chunk says it has none
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict[str, int], cached_tokens: int | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [],
            "usage": usage_body(usage, cached_tokens),
        }

    def response(
        self,
        text: str,
        finish_reason: str,
        usage: dict[str, int],
        cached_tokens: int | None = None,
        logprobs: dict[str, Any] | None = None,
        stop_reason: str | int | None = None,
    ) -> dict[str, Any]:
        """The whole (non-streaming) response of one choice; ``logprobs``: every token's
        (``LogprobsFormat``)."""
        return self.responses([self.choice(0, text, finish_reason, logprobs, stop_reason)], usage, cached_tokens)

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str,
        logprobs: dict[str, Any] | None = None,
        stop_reason: str | int | None = None,
    ) -> dict[str, Any]:
        """Choice ``index`` of a whole response. ``stop_reason`` (vLLM's): the stop string or
        ``stop_token_ids`` member that ended it; null for the model's EOS, a length or an abort."""
        if self.kind == "completion":
            return {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def responses(
        self, choices: list[dict[str, Any]], usage: dict[str, int], cached_tokens: int | None = None
    ) -> dict[str, Any]:
        """The whole (non-streaming) response of ``choices`` (``choice``); ``usage`` counts the
        prompt once and every choice's tokens."""
        return {
            "id": self.id,
            "object": "text_completion" if self.kind == "completion" else "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage_body(usage, cached_tokens),
        }


# JSON has no -inf: what vLLM reports for a token of probability 0.
LOWEST_LOGPROB = -9999.0


class LogprobsFormat:
    """The cluster's log-probabilities (``protocol.Logprobs``) as a choice's ``logprobs``, a
    stream's pieces one after another. A token is shown as its own decoded text, as the
    response's text has it (a special token as "" unless ``skip_special_tokens`` is false, a
    piece of a multi-byte character as U+FFFD). Completions: OpenAI's legacy lists, each
    ``top_logprobs`` map holding the chosen token beside the likeliest (vLLM's); chat:
    ``content`` entries with ``bytes``, and exactly ``top_logprobs`` alternatives. ``as_ids``
    (vLLM's ``return_tokens_as_token_ids``): each token shown as ``token_id:<id>`` instead, which
    tells apart tokens that decode alike."""

    def __init__(
        self,
        kind: Literal["completion", "chat"],
        tokenizer: Any,
        skip_special_tokens: bool = True,
        as_ids: bool = False,
    ) -> None:
        self.kind = kind
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.as_ids = as_ids or tokenizer is None  # a model with no tokenizer has no token text
        self.text_offset = 0  # completions: characters of the tokens shown so far

    def prompt(self, token_ids: list[int], logprobs: Any) -> dict[str, Any]:
        """Completions' echo: the prompt's tokens, ``logprobs`` those of all but the first,
        which has none (nothing comes before it), as vLLM lists them."""
        first = self._text(token_ids[0])
        offset = self.text_offset
        self.text_offset += len(first)
        rest = self(token_ids[1:], logprobs)
        return {
            "text_offset": [offset, *rest["text_offset"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "tokens": [first, *rest["tokens"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
        }

    @staticmethod
    def join(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
        """Two completions bodies as one, ``first``'s tokens before ``then``'s."""
        return {key: first[key] + then[key] for key in first}

    def __call__(self, token_ids: list[int], logprobs: Any) -> dict[str, Any]:
        """``logprobs``: a ``protocol.Logprobs`` of ``token_ids``."""
        texts = [self._text(t) for t in token_ids]
        values = [max(v, LOWEST_LOGPROB) for v in logprobs.token_logprobs]
        tops = [
            [(self._text(t), max(v, LOWEST_LOGPROB)) for t, v in zip(ids, lps)]
            for ids, lps in zip(logprobs.top_token_ids, logprobs.top_logprobs)
        ]
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": text,
                        "logprob": value,
                        "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top],
                    }
                    for text, value, top in zip(texts, values, tops)
                ],
                "refusal": None,
            }
        offsets = []
        for text in texts:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {
            "text_offset": offsets,
            "token_logprobs": values,
            "tokens": texts,
            "top_logprobs": [{**dict(top), text: value} for text, value, top in zip(texts, values, tops)],
        }

    def _text(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        # As the response's text shows it: by default a special token (the end of a chat turn) reads as "".
        return self.tokenizer.decode(
            [token_id], skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )


def usage_body(usage: dict[str, int], cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` where the cluster reported
    the prompt tokens its prefix cache served (absent with the cache off)."""
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def parse_request(
    kind: Literal["completion", "chat"],
    body: bytes,
    served_models: list[str],
    tokenizer: Any,
    max_model_len: int,
    max_prompt_chars: int,
    parse_special_tokens: bool = False,
    defaults: Mapping[str, Any] | None = None,
    look_for_special_text: bool = True,
) -> GenerationRequest:
    """Check a request body (raw JSON) and tokenize its prompts; raises APIError (400). Text over
    ``max_prompt_chars`` (a prompt; a chat's messages with their roles, or a batch's prompts, together) is refused
    before tokenizing; special-token text in it is plain text unless ``parse_special_tokens``
    (the cluster's setting). ``defaults``: sampling fields (``generation_defaults``) for those
    the request leaves out, in place of OpenAI's. ``look_for_special_text``: whether to find
    out if a completion's text spells special tokens (``special_text_as_text``)."""
    try:
        request = (CompletionRequest if kind == "completion" else ChatRequest).model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    check_model(request.model, served_models)
    for name, neutral in (UNSUPPORTED | CHAT_UNSUPPORTED if kind == "chat" else UNSUPPORTED).items():
        if name == "tools" and getattr(request, "tool_choice", None) == "none":
            # Tools the model may not call stay out of the prompt (vLLM's --exclude-tools-when-
            # tool-choice-none; its default renders them): this server renders no tools at all.
            continue
        if name in request.model_fields_set and not _neutral(getattr(request, name), neutral):
            raise bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")
    _check_messages(getattr(request, "messages", []))
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    echo_only = special_text_as_text = False
    if isinstance(request, ChatRequest):
        if request.top_logprobs and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        ids = _chat_prompt(request, tokenizer, max_prompt_chars, parse_special_tokens)
        prompts = [Prompt(ids, _chat_echo(request))]
        max_tokens = request.max_completion_tokens or request.max_tokens or max_model_len - len(ids)
    else:
        logprobs = request.logprobs
        prompts = _completion_prompts(request, tokenizer, max_prompt_chars, parse_special_tokens)
        texts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        # A second scan of the text for the operator's hint: only while the caller still wants it.
        special_text_as_text = (
            look_for_special_text
            and not parse_special_tokens
            and any(isinstance(text, str) and has_special_text(tokenizer, text) for text in texts)
        )
        max_tokens = request.max_tokens if request.max_tokens is not None else 16  # OpenAI's default
        if max_tokens == 0:
            if not request.echo:
                raise bad_request("max_tokens 0 needs echo: true (the prompt alone, to score it)", "max_tokens")
            if request.min_tokens:
                raise bad_request("min_tokens must be at most max_tokens (0)", "min_tokens")
            # The cluster runs the prompt and one token (its log-probabilities come with the first),
            # which the response leaves out.
            max_tokens, echo_only = 1, True
    for i, prompt in enumerate(prompts):
        _check_length(
            kind, len(prompt.token_ids), max_tokens, max_model_len, i if len(prompts) > 1 else None, echo_only
        )

    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if stop and tokenizer is None:  # they match text, which this server cannot make
        raise bad_request("stop strings need the model's tokenizer, which it has none of: use stop_token_ids", "stop")
    chosen = {**OPENAI_SAMPLING_DEFAULTS, **(defaults or {})}
    chosen.update({name: getattr(request, name) for name in chosen if getattr(request, name) is not None})
    sampling = {
        "max_tokens": max_tokens,
        "temperature": chosen["temperature"],
        "top_p": chosen["top_p"],
        "top_k": -1 if chosen["top_k"] == 0 else chosen["top_k"],
        "seed": None if request.seed is None else request.seed % (MAX_INT64 + 1),  # the cluster's [0, 2^63)
        "stop_token_ids": list(request.stop_token_ids or []),
        "ignore_eos": request.ignore_eos,
        "min_tokens": request.min_tokens or 0,
        "min_p": chosen["min_p"],
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        "repetition_penalty": chosen["repetition_penalty"],
        "logprobs": logprobs,
        # A completion's echo shows the prompt's tokens with their log-probabilities too (vLLM's).
        "prompt_logprobs": logprobs if isinstance(request, CompletionRequest) and request.echo else None,
        "logit_bias": request.logit_bias or {},
    }
    options = request.stream_options
    include_usage = options is not None and bool(options.include_usage)
    continuous_usage = include_usage and options is not None and bool(options.continuous_usage_stats)
    return GenerationRequest(
        kind,
        served_models[0],
        prompts,
        sampling,
        stop=stop,
        include_stop=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        echo_only=echo_only,
        tokens_as_ids=bool(request.return_tokens_as_token_ids),
        stream=bool(request.stream),
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        n=request.n or 1,
        id="" if request.request_id is None else f"{ID_PREFIXES[kind]}-{request.request_id}",
        request_id=request.request_id,
        special_text_as_text=special_text_as_text,
    )


class TokenizeRequest(_Strict):
    """vLLM's ``POST /tokenize`` of a prompt: its ids as ``/v1/completions`` would send them."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # what a completion's prompt gets; false: the text's alone
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """vLLM's ``POST /tokenize`` of a chat: its ids as ``/v1/chat/completions`` would send them."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[TokenId]


def parse_tokenize(
    body: bytes, served_models: list[str], tokenizer: Any, max_prompt_chars: int, parse_special_tokens: bool = False
) -> tuple[list[int], bool]:
    """The ids of a ``/tokenize`` body's prompt or messages, tokenized as the generation routes
    tokenize them, and whether it asked for each id's token string; raises APIError."""
    try:
        shape = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the stack
        shape = None  # the model's own decode names the fault
    if isinstance(shape, dict) and "messages" in shape and "prompt" in shape:
        raise bad_request("give either prompt or messages, not both", "messages")
    model = TokenizeChatRequest if isinstance(shape, dict) and "messages" in shape else TokenizeRequest
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    check_model(request.model, served_models)
    if isinstance(request, TokenizeChatRequest):
        _check_messages(request.messages)
        ids = _chat_prompt(request, tokenizer, max_prompt_chars, parse_special_tokens)
    else:
        ids = _text_prompt(
            request.prompt, tokenizer, max_prompt_chars, parse_special_tokens, request.add_special_tokens
        )
    return ids, request.return_token_strs


def parse_detokenize(body: bytes, served_models: list[str], tokenizer: Any) -> list[int]:
    """The token ids of a ``/detokenize`` body, each within the tokenizer's; raises APIError."""
    try:
        request = DetokenizeRequest.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    check_model(request.model, served_models)
    if tokenizer is None:
        raise bad_request("this model has no tokenizer", "tokens")
    vocab = len(tokenizer)
    for i, token in enumerate(request.tokens):
        if token >= vocab:
            raise bad_request(f"tokens.{i}: token id {token} is outside the vocabulary [0, {vocab})", "tokens")
    return request.tokens


def _prompt_too_long(chars: int, max_prompt_chars: int, param: str, where: str | None = None) -> APIError:
    return bad_request(
        f"{chars} characters in {where or param}, more than this server accepts ({max_prompt_chars})",
        param,
        "prompt_too_long",
    )


def _completion_prompts(
    request: CompletionRequest, tokenizer: Any, max_prompt_chars: int, parse_special_tokens: bool
) -> list[Prompt]:
    """A completion's prompts: one (a string, or a list of token ids) or a batch (a list of
    either), each with its echo where asked."""
    batch = request.prompt if isinstance(request.prompt, list) and request.prompt else [request.prompt]
    if not isinstance(batch[0], (str, list)):  # one prompt of token ids
        batch = [request.prompt]
    runs = len(batch) * (request.n or 1)
    if runs > MAX_BATCH:
        raise bad_request(
            f"{len(batch)} prompts of {request.n or 1} choices each are {runs} requests, more than this "
            f"server starts for one ({MAX_BATCH}): send fewer at a time",
            "prompt",
        )
    # A batch's texts together, as a chat's messages: tokenizing them holds up every other client.
    chars = sum(len(prompt) for prompt in batch if isinstance(prompt, str))
    if len(batch) > 1 and chars > max_prompt_chars:
        raise _prompt_too_long(chars, max_prompt_chars, "prompt", "the prompts together")
    prompts = []
    for i, prompt in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt.{i}"
        if not prompt:
            raise bad_request(f"{where} is empty", "prompt")
        if isinstance(prompt, str):
            token_ids = _text_prompt(
                prompt, tokenizer, max_prompt_chars, parse_special_tokens, request.add_special_tokens, where
            )
        else:
            token_ids = list(prompt)
        echo = _echo_text(prompt, token_ids, tokenizer, request.skip_special_tokens) if request.echo else None
        prompts.append(Prompt(token_ids, echo))
    return prompts


def _check_length(
    kind: Literal["completion", "chat"],
    prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    index: int | None,
    echo_only: bool = False,
) -> None:
    """A prompt of ``prompt_tokens`` leaves room for ``max_tokens`` (at least one) in the context;
    ``index``: the prompt's place in a batch; ``echo_only``: a prompt to score (max_tokens 0)."""
    param = PROMPT_PARAMS[kind]
    where = param if index is None else f"{param}.{index}"
    if echo_only and prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens; the {where} holds {prompt_tokens}, "
            f"and a prompt scored with max_tokens 0 may hold at most {max_model_len - 1} (the model runs one "
            f"position past it, left out of the response). Shorten the {where}.",
            param,
            "context_length_exceeded",
        )
    if max_tokens < 1:  # a chat without max_tokens whose messages fill the context alone
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens; the {where} hold "
            f"{prompt_tokens}, which leaves none to generate. Shorten the {where}.",
            param,
            "context_length_exceeded",
        )
    total = prompt_tokens + max_tokens
    if total > max_model_len:
        fits = prompt_tokens < max_model_len
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens; this request asks for {total} "
            f"({prompt_tokens} in the {where}, {max_tokens} to generate). Shorten the {where} "
            "or ask for fewer tokens.",
            "max_tokens" if fits else param,
            "context_length_exceeded",
        )


def _echo_text(prompt: str | list[int], token_ids: list[int], tokenizer: Any, skip_special_tokens: bool) -> str:
    """What an echo shows of a prompt: its text as sent, or its ids' decoded (vLLM's), as
    the output's text and the log-probabilities' tokens show special tokens."""
    if isinstance(prompt, str):
        return prompt
    if tokenizer is None:
        raise bad_request("echo needs the model's tokenizer to show a prompt of token ids", "echo")
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def check_model(model: str | None, served_models: list[str]) -> None:
    """A request that names a model names a served one (none, or "", means the first)."""
    if model and model not in served_models:
        served = " or ".join(repr(name) for name in served_models)
        raise APIError(
            404,  # as OpenAI and vLLM answer: the official client raises NotFoundError
            f"The model {model!r} does not exist: this server serves {served}",
            "model_not_found",
            "model",
        )


def _check_messages(messages: list[ChatMessage]) -> None:
    for i, message in enumerate(messages):
        for name, neutral in MESSAGE_UNSUPPORTED.items():
            if not _neutral(getattr(message, name), neutral):
                raise bad_request(
                    f"messages.{i}.{name} is not supported by this server", "messages", "unsupported_parameter"
                )


def _text_prompt(
    prompt: str,
    tokenizer: Any,
    max_prompt_chars: int,
    parse_special_tokens: bool,
    add_special_tokens: bool = True,
    where: str = "prompt",
) -> list[int]:
    if len(prompt) > max_prompt_chars:
        raise _prompt_too_long(len(prompt), max_prompt_chars, "prompt", where)
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
    return encode_prompt(tokenizer, prompt, False, parse_special_tokens, add_special_tokens)


def _chat_echo(request: ChatRequest) -> str | None:
    """What a chat's ``echo`` puts before the reply: the last message's text, if the assistant's
    (vLLM's; with ``continue_final_message``, the whole reply so)."""
    last = request.messages[-1]
    if not request.echo or last.role != "assistant":
        return None
    return _content(last) or None


def _content(message: ChatMessage) -> str:
    """A message's text: its content parts joined by newlines."""
    content = message.content
    return "\n".join(part.text for part in content) if isinstance(content, list) else content or ""


# apply_chat_template's own arguments and the variables it gives every template: a request's
# chat_template_kwargs adds variables, and may not replace these.
TEMPLATE_RESERVED = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "raise_exception",
        "strftime_now",
    }
)


def _chat_prompt(
    request: ChatRequest | TokenizeChatRequest, tokenizer: Any, max_prompt_chars: int, parse_special_tokens: bool
) -> list[int]:
    """The ids of a chat's messages, rendered as it asks: with the template's generation prompt,
    or the last message left open (``continue_final_message``)."""
    add_generation_prompt, continue_final_message = request.add_generation_prompt, request.continue_final_message
    if add_generation_prompt and continue_final_message:  # vLLM's rule: an open message or a new one
        raise bad_request(
            "continue_final_message needs add_generation_prompt: false (the last message is continued, "
            "no new one begun)",
            "continue_final_message",
        )
    if tokenizer is None:  # no text at all: a completion's prompt of ids is all it takes
        raise bad_request("this model has no tokenizer: use /v1/completions with a prompt of token ids", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template: use /v1/completions", "messages")
    messages = []
    for message in request.messages:
        entry = {"role": "system" if message.role == "developer" else message.role, "content": _content(message)}
        if message.name is not None:
            entry["name"] = message.name
        messages.append(entry)
    # Roles and names count too: the template renders them, and a chat of many empty messages
    # would otherwise be rendered and tokenized whole before any limit applied.
    chars = sum(len(m["role"]) + len(m.get("name", "")) + len(m["content"]) for m in messages)
    if chars > max_prompt_chars:
        raise _prompt_too_long(chars, max_prompt_chars, "messages")
    template_kwargs = request.chat_template_kwargs or {}
    if reserved := sorted(set(template_kwargs) & TEMPLATE_RESERVED):
        raise bad_request(
            f"chat_template_kwargs may not set {reserved[0]!r}, which the server's own rendering sets",
            "chat_template_kwargs",
        )
    try:
        # As engine.tokenization.encode_prompt does for one user turn: the same ids as the ZMQ client's.
        return encode_chat(
            tokenizer, messages, parse_special_tokens, add_generation_prompt, continue_final_message, template_kwargs
        )
    except RequestError as e:
        raise bad_request(str(e), "messages") from None
    except Exception as e:  # noqa: BLE001 (a template's own checks, e.g. alternating roles, raise anything)
        raise bad_request(f"the model's chat template refused these messages: {e}", "messages") from None


def _validation_error(error: ValidationError) -> APIError:
    first = error.errors(include_url=False)[0]
    loc = first["loc"]
    if first["type"] == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {first['msg']}", None, "malformed_json")
    if not loc:
        return bad_request(f"The request body must be a JSON object: {first['msg']}", None, "malformed_json")
    param = str(loc[0])
    if first["type"] == "extra_forbidden":  # named in full: "messages.0.tool_call_id", not "messages"
        return bad_request(
            f"Unrecognized request argument supplied: {'.'.join(map(str, loc))}", param, "unrecognized_argument"
        )
    if first["type"] == "missing":
        return bad_request(
            f"Missing required parameter: {'.'.join(map(str, loc))}", param, "missing_required_parameter"
        )
    # A validator's own message, without pydantic's "Value error, " before it.
    why = str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"]
    return bad_request(f"Invalid value for {'.'.join(map(str, loc))}: {why}", param, "invalid_value")
