"""Model-shape presets and their random-weight checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pdserve.engine import presets
from pdserve.engine.config import ModelConfig
from pdserve.engine.presets import (
    checkpoint_tensor_shapes,
    ensure_preset_model,
    list_presets,
    load_preset,
    preset_model_dir,
    resolve_model,
    resolve_model_configs,
    write_random_checkpoint,
)

TINY = ["tiny-qwen2", "tiny-llama", "tiny-llama-odd"]

# name -> (architecture, heads, kv heads, head_dim, layers, tied)
EXPECTED = {
    "qwen2.5-1.5b": ("qwen2", 12, 2, 128, 28, True),
    "qwen2.5-7b": ("qwen2", 28, 4, 128, 28, False),
    "llama-3-8b": ("llama", 32, 8, 128, 32, False),
    "llama-3.1-8b": ("llama", 32, 8, 128, 32, False),
    "tiny-qwen2": ("qwen2", 6, 3, 16, 3, True),
    "tiny-llama": ("llama", 8, 2, 16, 3, False),
    "tiny-llama-odd": ("llama", 9, 3, 16, 3, False),
}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private pdserve cache, so tests never touch the user's."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def test_preset_list_is_complete() -> None:
    assert set(list_presets()) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_parses(name: str) -> None:
    arch, heads, kv_heads, head_dim, layers, tied = EXPECTED[name]
    model = ModelConfig.from_hf_dict(load_preset(name))
    assert (model.architecture, model.num_heads, model.num_kv_heads) == (arch, heads, kv_heads)
    assert (model.head_dim, model.num_layers, model.tie_word_embeddings) == (head_dim, layers, tied)
    assert model.qkv_bias == (arch == "qwen2")


def test_real_shapes_match_the_published_models() -> None:
    qwen = ModelConfig.from_hf_dict(load_preset("qwen2.5-1.5b"))
    assert (qwen.hidden_size, qwen.intermediate_size, qwen.vocab_size) == (1536, 8960, 151936)
    assert qwen.rope.theta == 1e6 and qwen.rms_norm_eps == 1e-6
    llama3 = ModelConfig.from_hf_dict(load_preset("llama-3-8b"))
    assert llama3.rope.rope_type == "default" and llama3.rope.theta == 500000.0
    llama31 = ModelConfig.from_hf_dict(load_preset("llama-3.1-8b"))
    assert llama31.rope.rope_type == "llama3" and llama31.rope.factor == 8.0
    assert llama31.rope.original_max_position_embeddings == 8192
    odd = ModelConfig.from_hf_dict(load_preset("tiny-llama-odd"))
    assert odd.rope.rope_type == "llama3" and odd.rope.original_max_position_embeddings == 64
    assert odd.vocab_size == 500


def test_parameter_counts() -> None:
    def count(name: str) -> int:
        return sum(torch.Size(shape).numel() for _, shape in checkpoint_tensor_shapes(load_preset(name)))

    assert round(count("qwen2.5-1.5b") / 1e9, 2) == 1.54
    assert round(count("qwen2.5-7b") / 1e9, 2) == 7.62
    assert round(count("llama-3.1-8b") / 1e9, 2) == 8.03


def test_unknown_preset_lists_the_names() -> None:
    with pytest.raises(ValueError, match="tiny-llama-odd"):
        load_preset("no-such-model")


@pytest.mark.parametrize("name", TINY)
def test_transformers_loads_the_checkpoint_exactly(name: str, tmp_path: Path) -> None:
    out = write_random_checkpoint(load_preset(name), tmp_path / name, dtype="float32")
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    files = read_checkpoint(out)
    assert set(files) == {tensor_name for tensor_name, _ in checkpoint_tensor_shapes(load_preset(name))}
    # transformers reads the rope block as the engine does (for tiny-llama-odd: llama3 scaling).
    engine_config = ModelConfig.from_pretrained(out)
    assert torch.equal(model.model.rotary_emb.inv_freq, engine_config.rope.inv_freq(engine_config.head_dim))
    state = model.state_dict()
    for tensor_name, tensor in files.items():
        assert torch.equal(state[tensor_name], tensor), tensor_name
    if load_preset(name)["tie_word_embeddings"]:
        assert "lm_head.weight" not in files
        assert torch.equal(state["lm_head.weight"], files["model.embed_tokens.weight"])
    else:
        assert not torch.equal(files["lm_head.weight"], files["model.embed_tokens.weight"])


def test_weight_statistics(tmp_path: Path) -> None:
    config = load_preset("tiny-llama")
    files = read_checkpoint(write_random_checkpoint(config, tmp_path / "ckpt", dtype="float32"))
    embed = files["model.embed_tokens.weight"]
    assert abs(embed.std().item() - config["initializer_range"]) < 0.01
    norm = files["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.05 and 0.05 < norm.std().item() < 0.15


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    config = load_preset("tiny-qwen2")
    first = write_random_checkpoint(config, tmp_path / "a", seed=3)
    again = write_random_checkpoint(config, tmp_path / "b", seed=3)
    other = write_random_checkpoint(config, tmp_path / "c", seed=4)
    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    a, c = read_checkpoint(first), read_checkpoint(other)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[q_proj], c[q_proj])


def test_bf16_checkpoint_is_the_fp32_one_rounded(tmp_path: Path) -> None:
    config = load_preset("tiny-llama-odd")
    fp32 = read_checkpoint(write_random_checkpoint(config, tmp_path / "fp32", dtype="float32"))
    bf16_dir = write_random_checkpoint(config, tmp_path / "bf16")  # default dtype
    bf16 = read_checkpoint(bf16_dir)
    assert json.loads((bf16_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert ModelConfig.from_pretrained(bf16_dir).torch_dtype == "bfloat16"
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, fp32[name].to(torch.bfloat16)), name


def test_sharded_write_loads_identically(tmp_path: Path) -> None:
    config = load_preset("tiny-llama")
    single = write_random_checkpoint(config, tmp_path / "single", dtype="float32")
    sharded = write_random_checkpoint(config, tmp_path / "sharded", dtype="float32", max_shard_bytes=200_000)
    shard_files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shard_files) > 2 and shard_files[0] == f"model-00001-of-{len(shard_files):05d}.safetensors"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shard_files)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in read_checkpoint(single).values())
    assert not (single / "model.safetensors.index.json").exists()

    model_single = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    model_sharded, info = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    expected = model_single.state_dict()
    for name, tensor in model_sharded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_save(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(presets, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        write_random_checkpoint(load_preset("tiny-llama"), tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_write_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        write_random_checkpoint(load_preset("tiny-llama"), tmp_path)
    # An existing empty directory is fine (pytest's tmp_path, a prepared mount point).
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (write_random_checkpoint(load_preset("tiny-llama"), empty) / "config.json").is_file()


def test_ensure_preset_model_caches(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ensure_preset_model("tiny-qwen2", seed=1, dtype="fp32")
    assert path == cache / "models" / "tiny-qwen2-seed1-float32"
    assert ModelConfig.from_pretrained(path).num_kv_heads == 3

    def must_not_write(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached checkpoint was written again")

    monkeypatch.setattr(presets, "write_random_checkpoint", must_not_write)
    assert ensure_preset_model("tiny-qwen2", seed=1, dtype="float32") == path


def test_ensure_preset_model_removes_stale_temp_dirs(cache: Path) -> None:
    stale = cache / "models" / ".tiny-llama-seed0-bfloat16.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    path = ensure_preset_model("tiny-llama")
    assert path.is_dir() and not stale.exists()


def test_resolve_model(cache: Path, tmp_path: Path) -> None:
    assert resolve_model("tiny-llama") == cache / "models" / "tiny-llama-seed0-bfloat16"
    assert resolve_model(str(cache / "models" / "tiny-llama-seed0-bfloat16")).is_dir()
    with pytest.raises(FileNotFoundError, match="neither 'demo', a preset") as info:
        resolve_model(str(tmp_path / "missing"))
    assert "Hub" not in str(info.value)
    with pytest.raises(FileNotFoundError, match=r"Hub; fetch it first \(huggingface-cli download Qwen/Qwen2.5-0.5B "):
        resolve_model("Qwen/Qwen2.5-0.5B")  # vLLM's habit: a Hub id
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_a_front_end_resolves_a_preset_to_its_configs_without_writing_weights(cache: Path) -> None:
    """An HTTP front end reads a model's configs and tokenizer alone: a preset not yet in the
    cache resolves to its configs, where it used to write the whole random checkpoint (a 16 GB
    one for llama-3-8b, on a machine that serves no weights); one in the cache is used as is."""
    configs = resolve_model_configs("llama-3-8b")
    assert sorted(p.name for p in configs.iterdir()) == ["config.json", "generation_config.json"]
    assert json.loads((configs / "config.json").read_text())["num_hidden_layers"] == 32
    assert not preset_model_dir("llama-3-8b").exists()
    assert resolve_model_configs("tiny-llama") == cache / "models" / "tiny-llama-configs"
    assert resolve_model_configs("tiny-llama") != (checkpoint := resolve_model("tiny-llama"))
    assert resolve_model_configs("tiny-llama") == checkpoint


def test_cli(tmp_path: Path) -> None:
    runner = CliRunner()
    listed = runner.invoke(presets.cli, ["list"])
    assert listed.exit_code == 0, listed.output
    assert "qwen2.5-7b" in listed.output and "7.62 B" in listed.output
    written = runner.invoke(presets.cli, ["write", "tiny-llama", "--out", str(tmp_path / "w"), "--seed", "5"])
    assert written.exit_code == 0, written.output
    assert (tmp_path / "w" / "model.safetensors").is_file()
    unknown = runner.invoke(presets.cli, ["write", "nope", "--out", str(tmp_path / "x")])
    assert unknown.exit_code != 0 and "tiny-qwen2" in unknown.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--dtype", "foo"], "foo"),
        (["--device", "nonsense"], "nonsense"),
    ],
)
def test_cli_mistakes_are_one_line_errors(args: list[str], needle: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(presets.cli, ["write", "tiny-llama", "--out", str(tmp_path / "w"), *args])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert needle in result.output


def test_cli_writing_twice_is_a_one_line_error(tmp_path: Path) -> None:
    """The README's `presets write ... --out DIR`, run a second time."""
    runner = CliRunner()
    assert runner.invoke(presets.cli, ["write", "tiny-llama", "--out", str(tmp_path / "w")]).exit_code == 0
    again = runner.invoke(presets.cli, ["write", "tiny-llama", "--out", str(tmp_path / "w")])
    assert again.exit_code == 1 and isinstance(again.exception, SystemExit), repr(again.exception)
    assert "already exists" in again.output
