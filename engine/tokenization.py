"""Prompt text to token ids, the same way for every entry point."""

from __future__ import annotations

from typing import Any

from pdserve.engine.sampling import RequestError

# Stands for the user's text while the chat template renders: the template's own special tokens
# are then encoded around it, and the user's text on its own.
_SLOT = "\ue000pdserve-user-text\ue000"


def encode_prompt(tokenizer: Any, text: str, chat: bool = True, parse_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text``; as one user turn of the chat template when the tokenizer has one.

    The template is rendered to text and then encoded without extra special tokens, which gives
    the same ids on transformers 4 and 5 (their ``tokenize=True`` return types differ). Special
    tokens written in ``text`` (``<|im_start|>``) are plain text unless ``parse_special_tokens``:
    otherwise user content could forge the template's turns.
    """
    literal = not parse_special_tokens and _has_special_text(tokenizer, text)
    if not (chat and getattr(tokenizer, "chat_template", None)):
        return list(tokenizer.encode(text, split_special_tokens=literal))
    if not literal:
        rendered = _render(tokenizer, text)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    before, slot, after = _render(tokenizer, _SLOT).partition(_SLOT)
    if not slot:
        raise RequestError("prompt", "holds special-token text and this model's chat template alters its user turn")
    return [
        *tokenizer.encode(before, add_special_tokens=False),
        *tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True),
        *tokenizer.encode(after, add_special_tokens=False),
    ]


def _render(tokenizer: Any, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


def _has_special_text(tokenizer: Any, text: str) -> bool:
    """Whether ``text`` spells one of the tokenizer's special tokens."""
    return any(token.special and token.content in text for token in tokenizer.added_tokens_decoder.values())
