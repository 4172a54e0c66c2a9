"""Loading a Hugging Face checkpoint directory into a model built on the meta device.

Each parameter's ``weight_loader`` takes a lazy safetensors slice and copies only this rank's
piece, so a rank reads only the bytes it keeps.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers import RotaryEmbedding
from pdserve.engine.model import CausalLM
from pdserve.engine.parallel import TensorParallel


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else all in the dir."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def check_checkpoint(model_dir: Path, config: ModelConfig) -> None:
    """Refuse a checkpoint whose files are missing, whose headers do not parse or do not match the
    file's length (a truncated download), or whose tensors are not the model's (one missing, one
    of another model, one of another shape than the config makes it): in the launcher, one line,
    instead of a traceback from every rank. Reads only the headers, and builds the model on the
    meta device for its parameters' names and shapes."""
    shapes: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in checkpoint_files(model_dir):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (named in the checkpoint's index)")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                shapes.update((name, (path, tuple(f.get_slice(name).get_shape()))) for name in f.keys())  # noqa: SIM118 (a safetensors file, not a dict)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
    # On one rank every parameter's piece of a checkpoint tensor is the whole tensor.
    with torch.device("meta"):
        model = CausalLM(config, TensorParallel(), torch.float32, max_position=1)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, (path, shape) in shapes.items():
        if (target := _target(model, params, name, path)) is None:
            continue
        expected = params[target[0]].shard_shapes[target[1]]  # type: ignore[attr-defined]
        if shape != expected:
            raise ValueError(
                f"checkpoint tensor {name!r} in {path} has shape {list(shape)}, but {model_dir / 'config.json'} "
                f"makes it {list(expected)}: the config is not this checkpoint's"
            )
        loaded.add(_loaded_key(*target))
    _check_complete(params, loaded, model_dir)


def load_weights(model: CausalLM, model_dir: Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint; errors on missing or extra tensors."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors file, not a dict)
                if (target := _target(model, params, name, path)) is None:
                    continue
                param = params[target[0]]
                param.weight_loader(param, f.get_slice(name), target[1])  # type: ignore[attr-defined]
                loaded.add(_loaded_key(*target))
    _check_complete(params, loaded, model_dir)


def _target(
    model: CausalLM, params: dict[str, torch.nn.Parameter], name: str, path: Path
) -> tuple[str, str | None] | None:
    """The parameter checkpoint tensor ``name`` (of file ``path``) loads into, and its shard of a
    packed one (q of qkv); None for a tensor that is not loaded; ValueError for one that matches
    no parameter."""
    if "rotary_emb.inv_freq" in name:
        return None  # derived from the config, never loaded
    if name == "lm_head.weight" and model.lm_head is None:
        return None  # tied embeddings: some checkpoints still store the copy
    target: tuple[str, str | None] = (name, None)
    for fragment, (packed, shard) in CausalLM.packed_modules.items():
        if f".{fragment}." in name:
            target = (name.replace(f".{fragment}.", f".{packed}."), shard)
            break
    if target[0] not in params:
        raise ValueError(f"checkpoint tensor {name!r} in {path} matches no parameter of this model")
    return target


def _loaded_key(target: str, shard_id: str | None) -> str:
    return target if shard_id is None else f"{target}:{shard_id}"


def _check_complete(params: dict[str, torch.nn.Parameter], loaded: set[str], model_dir: Path) -> None:
    expected = {
        _loaded_key(name, shard)
        for name, param in params.items()
        for shard in param.shard_shapes  # type: ignore[attr-defined]
    }
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:4]}")


def build_model(
    config: ModelConfig,
    model_dir: Path,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
) -> CausalLM:
    """Build on the meta device (no memory), materialise on ``device``, load this rank's shard."""
    with torch.device("meta"):
        model = CausalLM(config, tp, dtype, max_position)
    # to_empty makes new Parameter objects: carry the loaders across.
    loaders = {name: (p.weight_loader, p.shard_shapes) for name, p in model.named_parameters()}  # type: ignore[attr-defined]
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        param.weight_loader, param.shard_shapes = loaders[name]  # type: ignore[attr-defined]
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_cache()
    load_weights(model, model_dir)
    return model.eval()
