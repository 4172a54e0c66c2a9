"""Incremental detokenization that never emits half of a multi-byte character."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens decoded before the first output token (vLLM's offset): the tokenizers that strip
# the leading space of a decode's first token (SentencePiece's "▁", as Llama 2's) keep the
# output's, and the window stays short.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Decoding token by token breaks characters that span several byte-level tokens and drops
    the spaces some tokenizers attach to the following token. Instead, decode a short window
    ending at the new tokens, and emit only once the text no longer ends in U+FFFD (an
    incomplete UTF-8 sequence). Concatenated deltas equal ``tokenizer.decode(all_ids)`` without
    the clean-up of tokenization spaces, for valid UTF-8 output. (Byte-fallback tokenizers, as
    Llama 2's, decode an invalid byte run to U+FFFD per byte, ASCII ones included; here an ASCII
    byte before it is kept.) ``prompt_token_ids``: the request's prompt, whose last tokens are
    the first window's context, never emitted.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, prompt_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS) :])
        self.prefix_offset = 0  # start of the window that gives the context of the next token
        self.read_offset = len(self.token_ids)  # tokens before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        # Never the clean-up: it edits text across window boundaries (so deltas would not add up),
        # and transformers warns on every first decode of a byte-level BPE tokenizer that asks for it.
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (may be empty)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (e.g. a truncated character)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]
