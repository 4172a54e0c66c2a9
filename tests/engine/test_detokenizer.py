"""The incremental detokenizer asks for the decoded text as it is, so transformers has nothing to warn about."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
from transformers import AutoTokenizer

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
