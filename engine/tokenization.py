"""Prompt text to token ids, the same way for every entry point."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdserve.engine.sampling import RequestError

# Stand for the messages' contents while the chat template renders: the template's own special
# tokens are then encoded around them, and each content on its own.
_SLOT = "\ue000pdserve-content-{}\ue000"
_SLOTS = re.compile("\ue000pdserve-content-(\\d+)\ue000")


def eos_token_ids(hf: Mapping[str, Any]) -> tuple[int, ...]:
    """The end-of-sequence ids a Hugging Face ``config.json`` names (one, a list, or none)."""
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The model's tokenizer, or None for checkpoints without one (random-weight presets);
    ValueError naming the directory for one that does not load."""
    if not any((Path(model_dir) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer  # heavy: only where a tokenizer exists

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # transformers' and huggingface_hub's errors share no base class but this
        raise ValueError(f"{model_dir}: its tokenizer does not load: {' '.join(str(e).split())}") from e


def encode_prompt(
    tokenizer: Any, text: str, chat: bool = True, parse_special_tokens: bool = False, add_special_tokens: bool = True
) -> list[int]:
    """Token ids of ``text``; as one user turn of the chat template when the tokenizer has one.

    Special tokens written in ``text`` (``<|im_start|>``) are plain text unless
    ``parse_special_tokens``: otherwise user content could forge the template's turns.
    ``add_special_tokens`` false: plain text without the tokenizer's own (e.g. BOS) around it.
    """
    if chat and getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [{"role": "user", "content": text}], parse_special_tokens)
    literal = not parse_special_tokens and has_special_text(tokenizer, text)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=literal))


def encode_chat(
    tokenizer: Any,
    messages: list[dict[str, str]],
    parse_special_tokens: bool = False,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template, with the generation prompt
    (unless not ``add_generation_prompt``), or ending in the last message, open, for the model
    to go on with (``continue_final_message``: an assistant's reply begun for it);
    ``template_kwargs``: more variables for the template (``enable_thinking``).

    The template is rendered to text and then encoded without extra special tokens, which gives
    the same ids on transformers 4 and 5 (their ``tokenize=True`` return types differ). A content
    that spells special tokens is encoded as plain text unless ``parse_special_tokens``.
    """
    contents = [message["content"] for message in messages]
    if parse_special_tokens or not any(has_special_text(tokenizer, c) for c in contents):
        rendered = _render(tokenizer, messages, add_generation_prompt, continue_final_message, template_kwargs)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    slotted = [{**message, "content": _SLOT.format(i)} for i, message in enumerate(messages)]
    rendered = _render(tokenizer, slotted, add_generation_prompt, continue_final_message, template_kwargs)
    parts = _SLOTS.split(rendered)  # template text, slot index, template text, ...
    if sorted(int(i) for i in parts[1::2]) != list(range(len(messages))):
        raise RequestError("prompt", "holds special-token text and this model's chat template alters its contents")
    ids: list[int] = []
    for n, part in enumerate(parts):
        if n % 2:
            ids += tokenizer.encode(contents[int(part)], add_special_tokens=False, split_special_tokens=True)
        elif part:
            ids += tokenizer.encode(part, add_special_tokens=False)
    return ids


def _render(
    tokenizer: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: Mapping[str, Any] | None,
) -> str:
    return tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **(template_kwargs or {}),
    )


def has_special_text(tokenizer: Any, text: str) -> bool:
    """Whether ``text`` spells one of the tokenizer's special tokens."""
    return any(token.special and token.content in text for token in tokenizer.added_tokens_decoder.values())
