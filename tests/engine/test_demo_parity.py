"""The engine on the embedded demo model against transformers on the same converted weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.tokenization import encode_prompt


@pytest.mark.slow
def test_greedy_chat_answer_is_identical_to_transformers(demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    prompt = encode_prompt(tokenizer, "What is the capital of France?")
    engine = LLMEngine(
        EngineConfig(
            model=str(demo_model_dir),
            device="cpu",
            dtype="float32",
            max_model_len=256,
            cache=CacheConfig(num_blocks=64),
        )
    )
    ours = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
    assert ours == theirs
    assert "The capital of France is Paris" in tokenizer.decode(ours, skip_special_tokens=True)


@pytest.mark.parametrize("text", ["Grüße aus Köln ☃", "日本語のテキスト 🚀🚀 and ascii", "naïve café — ½ ∑"])
def test_incremental_detokenizer_never_splits_a_character(demo_model_dir: Path, text: str) -> None:
    """Byte-level BPE splits multi-byte characters over tokens; the deltas must never show a
    half character, and together must equal the whole decode."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert len(ids) > len([d for d in deltas if d])  # some tokens really were held back
