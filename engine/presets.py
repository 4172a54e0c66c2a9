"""Model-shape presets (``configs/models/*.yaml``) and random-weight checkpoints built from them.

A preset is the config.json of a real model (or of a tiny test model); writing it with random
weights gives a Hugging Face directory with the real tensor names and shapes, so the engine,
the kernels and transformers all load it as they would the real checkpoint.

``python -m pdserve.engine.presets list`` and ``python -m pdserve.engine.presets write NAME --out DIR``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import torch
import yaml
from safetensors.torch import save_file
from tqdm import tqdm

from pdserve.engine.config import ModelConfig, parse_dtype
from pdserve.engine.demo import ensure_demo_model
from pdserve.engine.paths import atomic_directory, build_once, models_cache_dir

__all__ = [
    "PRESETS_DIR",
    "checkpoint_tensor_shapes",
    "ensure_preset_model",
    "list_presets",
    "load_preset",
    "preset_model_dir",
    "resolve_model",
    "resolve_model_configs",
    "write_random_checkpoint",
]

PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs" / "models"
_DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# Below this a progress bar is noise: the tiny presets write in milliseconds.
_PROGRESS_MIN_BYTES = 64 * 2**20
# Spread of the norm weights around 1, so that a forgotten or misapplied norm weight shows.
_NORM_WEIGHT_STD = 0.1


def list_presets() -> list[str]:
    """Names of the presets in ``configs/models``, sorted."""
    return sorted(path.stem for path in PRESETS_DIR.glob("*.yaml"))


def load_preset(name: str) -> dict[str, Any]:
    """The Hugging Face config dict of preset ``name``."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(list_presets())}")
    config = yaml.safe_load(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a mapping of config.json fields")
    return config


def checkpoint_tensor_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The Hugging Face tensor names and shapes of a Llama / Qwen2 checkpoint, in file order."""
    model = ModelConfig.from_hf_dict(config)
    hidden, inter = model.hidden_size, model.intermediate_size
    q_out, kv_out = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (model.vocab_size, hidden))]
    for i in range(model.num_layers):
        layer = f"model.layers.{i}"
        shapes.append((f"{layer}.input_layernorm.weight", (hidden,)))
        for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            shapes.append((f"{layer}.self_attn.{proj}.weight", (out, hidden)))
            if model.qkv_bias:
                shapes.append((f"{layer}.self_attn.{proj}.bias", (out,)))
        shapes.append((f"{layer}.self_attn.o_proj.weight", (hidden, q_out)))
        if model.o_bias:
            shapes.append((f"{layer}.self_attn.o_proj.bias", (hidden,)))
        shapes.append((f"{layer}.post_attention_layernorm.weight", (hidden,)))
        mlp = (("gate_proj", inter, hidden), ("up_proj", inter, hidden), ("down_proj", hidden, inter))
        for proj, out, inp in mlp:
            shapes.append((f"{layer}.mlp.{proj}.weight", (out, inp)))
            if model.mlp_bias:
                shapes.append((f"{layer}.mlp.{proj}.bias", (out,)))
    shapes.append(("model.norm.weight", (hidden,)))
    if not model.tie_word_embeddings:
        shapes.append(("lm_head.weight", (model.vocab_size, hidden)))
    return shapes


def _canonical_dtype(dtype: str) -> str:
    return str(parse_dtype(dtype)).removeprefix("torch.")


def _plan_shards(
    shapes: list[tuple[str, tuple[int, ...]]], elem_size: int, max_shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Group tensors, in order, into shards of at most ``max_shard_bytes`` (one tensor may exceed it)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = elem_size * _numel(shape)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _random_tensors(
    shard: list[tuple[str, tuple[int, ...]]],
    generator: torch.Generator,
    std: float,
    dtype: torch.dtype,
    device: str,
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape in shard:
        # Drawn in fp32 whatever the target dtype, so a bf16 checkpoint is the fp32 one rounded.
        tensor = torch.empty(shape, dtype=torch.float32, device=device)
        if name.endswith("norm.weight"):
            tensor.normal_(1.0, _NORM_WEIGHT_STD, generator=generator)
        else:
            tensor.normal_(0.0, std, generator=generator)
        yield name, tensor.to(dtype).cpu().contiguous()


def write_random_checkpoint(
    config: dict[str, Any],
    out_dir: str | Path,
    seed: int = 0,
    dtype: str = "bfloat16",
    device: str = "cpu",
    max_shard_bytes: int = _DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a Hugging Face checkpoint of ``config``'s shape with seeded random weights.

    Weights are normal(0, initializer_range), norm weights 1 + 0.1 * normal; the same seed and
    device give bitwise-identical files. Tensors are generated one at a time and written shard
    by shard, so memory holds at most one shard. ``out_dir`` appears atomically.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    dtype_name = _canonical_dtype(dtype)
    torch_dtype = parse_dtype(dtype_name)
    shapes = checkpoint_tensor_shapes(config)
    elem_size = torch.empty((), dtype=torch_dtype).element_size()
    shards = _plan_shards(shapes, elem_size, max_shard_bytes)
    total_bytes = elem_size * sum(_numel(shape) for _, shape in shapes)
    std = float(config.get("initializer_range", 0.02))
    generator = torch.Generator(device=device).manual_seed(seed)
    out_dir = Path(out_dir)

    with atomic_directory(out_dir) as tmp:
        _write_configs(config, tmp, dtype_name)
        weight_map: dict[str, str] = {}
        with tqdm(
            total=len(shapes), unit="tensor", desc=f"writing {out_dir.name}", disable=total_bytes < _PROGRESS_MIN_BYTES
        ) as progress:
            for number, shard in enumerate(shards, start=1):
                filename = (
                    "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
                )
                tensors: dict[str, torch.Tensor] = {}
                for name, tensor in _random_tensors(shard, generator, std, torch_dtype, device):
                    tensors[name] = tensor
                    weight_map[name] = filename
                    progress.update()
                save_file(tensors, tmp / filename, metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


def _write_configs(config: dict[str, Any], out_dir: Path, dtype_name: str) -> None:
    # transformers 5 spells it `dtype` and prefers that key; one key, the true one, is written.
    hf_config = {k: v for k, v in config.items() if k != "dtype"} | {"torch_dtype": dtype_name}
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def preset_model_dir(name: str, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Where :func:`ensure_preset_model` caches preset ``name`` (it may not exist yet)."""
    return models_cache_dir() / f"{name}-seed{seed}-{_canonical_dtype(dtype)}"


def ensure_preset_model(name: str, seed: int = 0, dtype: str = "bfloat16", device: str = "cpu") -> Path:
    """The random-weight checkpoint of preset ``name``, written into the cache on first use.

    ``device`` only says where the weights are drawn (a GPU draws a 7B quickly); the values
    depend on it, so the cache directory belongs to whichever device wrote it first.
    """
    config = load_preset(name)
    return build_once(
        preset_model_dir(name, seed, dtype),
        lambda final: write_random_checkpoint(config, final, seed=seed, dtype=dtype, device=device),
    )


def check_model_spec(spec: str) -> None:
    """Refuse a ``spec`` that ``resolve_model`` cannot resolve, at once: nothing is converted or
    written."""
    if spec == "demo" or spec in list_presets():
        return
    if not spec.strip():
        raise FileNotFoundError(f"model is empty: 'demo', a preset ({', '.join(list_presets())}) or a directory")
    path = Path(spec).expanduser()
    if not path.is_dir():
        # An "org/name" that is no directory here is most likely a Hub id, which vLLM would download.
        hub = re.fullmatch(r"[\w.-]+/[\w.-]+", spec) is not None and not spec.startswith(".")
        hint = (
            f": nothing is downloaded from the Hugging Face Hub; fetch it first "
            f"(huggingface-cli download {spec} --local-dir DIR) and pass DIR"
            if hub
            else ""
        )
        raise FileNotFoundError(
            f"model {spec!r} is neither 'demo', a preset ({', '.join(list_presets())}) nor a directory{hint}"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")


def resolve_model(spec: str) -> Path:
    """A model directory from ``spec``: "demo", a preset name, or a Hugging Face directory path."""
    check_model_spec(spec)
    if spec == "demo":
        return ensure_demo_model()
    if spec in list_presets():
        return ensure_preset_model(spec)
    return Path(spec).expanduser()


def resolve_model_configs(spec: str) -> Path:
    """What ``resolve_model`` gives, for a process that reads a model's configs and tokenizer
    alone (an HTTP front end): a preset whose checkpoint is not in the cache yet resolves to a
    directory of its configs, not gigabytes of random weights written for nothing."""
    if spec not in list_presets() or preset_model_dir(spec).is_dir():
        return resolve_model(spec)  # which checks the spec
    config = load_preset(spec)

    def write(final: Path) -> None:
        with atomic_directory(final) as tmp:
            _write_configs(config, tmp, _canonical_dtype("bfloat16"))

    return build_once(models_cache_dir() / f"{spec}-configs", write)


def _parameter_count(config: dict[str, Any]) -> int:
    return sum(_numel(shape) for _, shape in checkpoint_tensor_shapes(config))


@click.group()
def cli() -> None:
    """Model-shape presets with random weights."""


@cli.command("list")
def list_command() -> None:
    """List the presets with their architecture and size."""
    for name in list_presets():
        config = load_preset(name)
        params = _parameter_count(config)
        size = f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"
        click.echo(f"{name:<16} {config['architectures'][0]:<18} {size} params")


@cli.command("write")
@click.argument("name")
@click.option(
    "--out", "out_dir", required=True, type=click.Path(path_type=Path), help="new (or empty) directory to write"
)
@click.option("--seed", default=0, show_default=True, help="random seed of the weights")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default="bfloat16",
    show_default=True,
    help="float32, float16 or bfloat16",
)
@click.option("--device", default="cpu", show_default=True, help="where to draw the weights (cpu, cuda)")
def write_command(name: str, out_dir: Path, seed: int, dtype: str, device: str) -> None:
    """Write preset NAME with random weights into a new directory."""
    try:
        config = load_preset(name)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="NAME") from None
    try:
        where = torch.device(device)
    except RuntimeError:
        raise click.BadParameter(f"{device!r} is not a device (cpu, cuda)", param_hint="--device") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter(f"{device}: no GPU is visible", param_hint="--device")
    try:
        click.echo(write_random_checkpoint(config, out_dir, seed=seed, dtype=dtype, device=device))
    except FileExistsError as error:
        raise click.ClickException(str(error)) from None


if __name__ == "__main__":
    cli()
