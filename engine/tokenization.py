"""Prompt text to token ids, the same way for every entry point."""

from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids of ``text``; as one user turn of the chat template when the tokenizer has one.

    The template is rendered to text and then encoded without extra special tokens, which gives
    the same ids on transformers 4 and 5 (their ``tokenize=True`` return types differ).
    """
    if chat and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text))
