"""The incremental detokenizer asks for the decoded text as it is, so transformers has nothing to warn about."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pdserve.engine.detokenizer import IncrementalDetokenizer

TEXT = "Hello , world . It ' s fine ! Grüße ☃"


def test_decoding_emits_no_clean_up_warning(demo_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Ask for the clean-up as many checkpoints' tokenizer_config.json do (and as transformers 5.17's
    # own GGUF conversion of this model did): transformers 5 warns about it on byte-level BPE.
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir, clean_up_tokenization_spaces=True)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # transformers logs each such warning once per process (an lru_cache): forget it, so the control can see it.
    logging.Logger.warning_once.cache_clear()
    library_logger = logging.getLogger("transformers")  # it does not propagate to the root logger caplog hooks
    library_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="transformers"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            detok = IncrementalDetokenizer(tokenizer)
            text = "".join(detok.add([t]) for t in ids) + detok.flush()
            ours = [r.getMessage() for r in caplog.records] + [str(w.message) for w in caught]
            caplog.clear()
            # Control: a plain decode of the same tokenizer is what warns (transformers 5) or cleans (4).
            plain = tokenizer.decode(ids)
            control = [r.getMessage() for r in caplog.records]
    finally:
        library_logger.removeHandler(caplog.handler)
    assert ours == []
    assert text == TEXT
    assert any("clean_up_tokenization_spaces" in m for m in control) or plain != TEXT


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama 2's "▁" word starts) whose decode drops the
    leading space of its first token, as theirs does."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁The": 3, "▁capital": 4, "▁is": 5, "▁Paris": 6, ".": 7}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    model.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_the_first_output_token_keeps_its_leading_space() -> None:
    """The output's first token is decoded after the prompt's last tokens, as vLLM does: decoded
    alone, a SentencePiece tokenizer's "▁Paris" lost its space, and every completion of a Llama 2
    style model ran into its prompt ("...isParis." with echo; review)."""
    tokenizer = metaspace_tokenizer()
    prompt, output = [1, 3, 4, 5], [6, 7, 2]
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    text = "".join(detok.add([t]) for t in output) + detok.flush()
    assert text == " Paris."
    assert tokenizer.decode(prompt, skip_special_tokens=True) + text == "The capital is Paris."


def test_prompt_context_leaves_byte_level_text_as_decoded_alone(demo_model_dir: Path) -> None:
    """With a byte-level tokenizer (no space to lose) the prompt's context changes nothing: the
    deltas still add up to the output decoded alone, multi-byte characters included."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    prompt = tokenizer.encode("Say hello in German:", add_special_tokens=False)
    output = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    assert "".join(detok.add([t]) for t in output) + detok.flush() == TEXT
