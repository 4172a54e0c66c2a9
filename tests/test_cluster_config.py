"""The cluster spec: YAML presets, validation, and the engine settings it hands every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cluster.config import ClusterConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_engine_config_carries_the_engine_settings() -> None:
    config = ClusterConfig(overlap_scheduling=False, cuda_graph_max_batch=24, cuda_graph_max_prefill_tokens=512,
                           cuda_graph_max_prefill_seqs=8, enforce_eager=True, max_model_len=1024, block_size=32,
                           num_blocks=99, max_num_seqs=12, max_num_batched_tokens=2048)
    engine = config.engine_config("model-dir")
    assert not engine.overlap_scheduling and engine.enforce_eager
    assert (engine.cuda_graph_max_batch, engine.cuda_graph_max_prefill_tokens, engine.cuda_graph_max_prefill_seqs) \
        == (24, 512, 8)
    assert (engine.model, engine.max_model_len, engine.cache.block_size, engine.cache.num_blocks) \
        == ("model-dir", 1024, 32, 99)
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (12, 2048)
    defaults = ClusterConfig().engine_config("m")
    assert defaults.overlap_scheduling
    # The graphs cover every decode batch and mixed step that the default scheduler forms.
    assert defaults.cuda_graph_max_batch == defaults.cuda_graph_max_prefill_seqs == defaults.scheduler.max_num_seqs


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_presets_load(path: Path) -> None:
    assert ClusterConfig.from_yaml(path).world_size >= 1


def test_unknown_preset_setting_is_named(tmp_path: Path) -> None:
    preset = tmp_path / "bad.yaml"
    preset.write_text("prefill-tp: 2\noverlap: false\n")
    with pytest.raises(ValueError, match="unknown setting 'overlap'"):
        ClusterConfig.from_yaml(preset)
