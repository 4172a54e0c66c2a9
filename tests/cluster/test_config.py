"""The cluster spec: YAML presets, validation, and the engine settings it hands every rank."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from pdserve.cluster.config import MIN_PROMPT_CHARS, ClusterConfig, cluster_settings, origins, prompt_chars_limit
from pdserve.cluster.launcher import ClusterError, resolve_transfer
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, flatten_config
from pdserve.engine.parallel import head_shard
from pdserve.engine.presets import load_preset
from pdserve.kvtransfer.base import TransferConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


MODEL = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=4096)


def test_engine_config_carries_the_engine_settings() -> None:
    config = ClusterConfig.from_settings(
        dict(
            overlap_scheduling=False,
            cuda_graph_max_batch=24,
            cuda_graph_max_prefill_tokens=512,
            cuda_graph_max_prefill_seqs=8,
            enforce_eager=True,
            max_model_len=1024,
            block_size=32,
            num_blocks=99,
            max_num_seqs=12,
            max_num_batched_tokens=2048,
        )
    )
    engine = config.engine_config("model-dir", MODEL)
    assert not engine.overlap_scheduling and engine.enforce_eager
    assert (engine.cuda_graph_max_batch, engine.cuda_graph_max_prefill_tokens, engine.cuda_graph_max_prefill_seqs) == (
        24,
        512,
        8,
    )
    assert (engine.model, engine.max_model_len, engine.cache.block_size, engine.cache.num_blocks) == (
        "model-dir",
        1024,
        32,
        99,
    )
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (12, 2048)
    defaults = ClusterConfig().engine_config("m", MODEL)
    assert defaults.overlap_scheduling
    # The graphs cover every decode batch and mixed step that the default scheduler forms.
    assert defaults.cuda_graph_max_batch == defaults.cuda_graph_max_prefill_seqs == defaults.scheduler.max_num_seqs


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_presets_load(path: Path) -> None:
    assert ClusterConfig.from_yaml(path).world_size >= 1


def test_a_preset_is_named_by_its_path_or_by_the_name_of_one_shipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # away from the repo: "2p1d" is no file here
    shipped = ClusterConfig.from_yaml(CONFIGS / "2p1d.yaml", port=6001)
    assert ClusterConfig.from_preset("2p1d", port=6001) == shipped == ClusterConfig.from_preset("2p1d.yaml", port=6001)
    own = tmp_path / "2p1d"  # a file of that name is the file, not the preset
    own.write_text("mode: colocated\n")
    assert ClusterConfig.from_preset("2p1d").mode == "colocated"
    with pytest.raises(ValueError, match=r"--config nope: no such file, nor a preset of that name \(1p1d, 2p1d"):
        ClusterConfig.from_preset("nope")
    with pytest.raises(ValueError, match="no such file"):
        ClusterConfig.from_preset("elsewhere/2p1d")  # a path that does not exist is not a preset name


def test_unknown_preset_setting_is_named(tmp_path: Path) -> None:
    preset = tmp_path / "bad.yaml"
    preset.write_text("prefill-tp: 2\noverlap: false\n")
    with pytest.raises(ValueError, match="unknown setting 'overlap'"):
        ClusterConfig.from_yaml(preset)


def test_without_chunked_prefill_a_step_holds_a_whole_prompt() -> None:
    config = ClusterConfig.from_settings({"enable_chunked_prefill": False, "max_num_batched_tokens": 512})
    assert config.engine_config("m", MODEL).scheduler.max_num_batched_tokens == MODEL.max_position_embeddings


def test_one_name_and_one_default_per_setting() -> None:
    # Each setting's default is the one its owner's dataclass declares; the spec adds none.
    owners = {
        (): ClusterConfig(),
        ("engine",): EngineConfig(),
        ("engine", "cache"): CacheConfig(),
        ("engine", "scheduler"): SchedulerConfig(),
        ("transfer",): TransferConfig(),
    }
    for spec in cluster_settings():
        assert getattr(owners[spec.path[:-1]], spec.path[-1]) == spec.default, spec.key
        assert spec.help.endswith(".") and spec.flag == "--" + spec.key.replace("_", "-")
    assert flatten_config(ClusterConfig()) == {spec.key: spec.default for spec in cluster_settings()}


def test_settings_round_trip_through_flat_keys() -> None:
    config = ClusterConfig.from_settings(
        {"prefill-tp": 2, "transfer": "gloo-async", "gpu_memory_utilization": 0.5, "devices": [0, 1, 2]}
    )
    assert config.prefill_tp == 2 and config.transfer.backend == "gloo-async" and config.devices == (0, 1, 2)
    assert config.engine.cache.gpu_memory_utilization == 0.5
    assert ClusterConfig.from_settings(flatten_config(config)) == config
    assert dataclasses.replace(config, prefill_tp=1) != config


def test_a_misspelt_setting_names_the_closest_one() -> None:
    with pytest.raises(ValueError, match="unknown setting 'max_model_length' \\(did you mean 'max_model_len'\\?\\)"):
        ClusterConfig.from_settings({"max_model_length": 5})


def test_a_prefill_and_a_decode_rank_may_share_a_gpu_with_budgets_of_their_own() -> None:
    config = ClusterConfig(devices=(0, 0))
    placement = config.placement(visible_gpus=1)
    assert placement == [(0,), (0,)]
    assert config.groups_on(placement, 0) == 2
    engine = EngineConfig()
    shared = config.rank_engine(engine, "decode", 2).cache
    assert shared.gpu_shared and shared.gpu_memory_utilization == pytest.approx(0.45)
    alone = config.rank_engine(engine, "decode", 1).cache
    assert not alone.gpu_shared and alone.gpu_memory_utilization == 0.9
    split = ClusterConfig(devices=(0, 0), prefill_gpu_memory_utilization=0.3, decode_gpu_memory_utilization=0.6)
    split.placement(visible_gpus=1)
    assert split.rank_engine(engine, "prefill", 2).cache.gpu_memory_utilization == 0.3


def test_gpu_sharing_that_cannot_work_is_refused_before_any_rank_starts() -> None:
    for backend in ("nccl", "nccl-async"):  # NCCL refuses two ranks of one communicator on one GPU
        with pytest.raises(ValueError, match=f"--transfer {backend} cannot connect two ranks on one GPU: use "):
            ClusterConfig(devices=(0, 0)).check_shared_gpus([(0,), (0,)], backend)
    ClusterConfig(devices=(0, 0)).check_shared_gpus([(0,), (0,)], "cuda-ipc")
    ClusterConfig(devices=(0, 1)).check_shared_gpus([(0,), (1,)], "nccl")
    with pytest.raises(ValueError, match="need a GPU each"):
        ClusterConfig(prefill_tp=2, devices=(0, 0, 1)).placement(visible_gpus=2)
    overcommitted = ClusterConfig(devices=(0, 0), prefill_gpu_memory_utilization=0.6, decode_gpu_memory_utilization=0.6)
    with pytest.raises(ValueError, match="1.20 of its memory"):
        overcommitted.placement(visible_gpus=1)
    with pytest.raises(ValueError, match="1..100"):
        ClusterConfig(decode_sm_percent=0)
    with pytest.raises(ValueError, match="applies to --mode disagg"):
        ClusterConfig(mode="colocated", prefill_sm_percent=50)


def test_kv_transfer_settings_are_refused_where_no_kv_moves() -> None:
    """A colocated group moves no KV: a transfer setting there would be silently ignored."""
    for settings, flag in (
        ({"transfer": "shm"}, "--transfer"),
        ({"transfer_staging_mib": 64}, "--transfer-staging-mib"),
        ({"transfer_layer_groups": 2}, "--transfer-layer-groups"),
    ):
        with pytest.raises(ValueError, match=f"^{flag} applies to --mode disagg"):
            ClusterConfig.from_settings({"mode": "colocated", **settings})
    assert ClusterConfig.from_settings({"mode": "colocated"}).transfer == TransferConfig()


def test_multi_node_settings_are_checked_before_anything_starts() -> None:
    router_node = ClusterConfig.from_settings({"master_addr": "10.0.0.1", "decode_groups": 0})
    assert router_node.joinable and router_node.decode_groups == 0 and router_node.groups() == [("prefill", 0, 1)]
    group_node = ClusterConfig.from_settings({"join": "10.0.0.1:29500", "role": "decode", "tp": 2})
    assert (group_node.join_role, group_node.join_tp, group_node.joinable) == ("decode", 2, True)
    refused = {
        "decode_groups must be >= 1": {"decode_groups": 0},  # no group could ever join
        "--tp applies to a group node": {"tp": 2},
        "--role applies to a group node": {"role": "decode"},
        "--advertise-addr applies to a group node": {"advertise_addr": "10.0.0.2"},
        "exclude each other": {"master_addr": "10.0.0.1", "join": "10.0.0.1:29500", "role": "decode"},
        "--join 'nowhere': expected HOST:PORT": {"join": "nowhere", "role": "decode"},
        "--join 'h:99999': expected HOST:PORT": {"join": "h:99999", "role": "decode"},
        "--join needs --role": {"join": "10.0.0.1:29500"},
        "--tp must be >= 1": {"join": "10.0.0.1:29500", "role": "decode", "tp": 0},
        "--join-timeout must be positive": {"join": "10.0.0.1:29500", "role": "decode", "join_timeout": 0},
        "--join-timeout applies to a group node": {"join_timeout": 5},
        "master_port must be in 1..65535": {"master_addr": "10.0.0.1", "master_port": 0},
        "--master-port applies to a router node (--master-addr)": {"master_port": 30000},
        "master_addr must be an IPv4 address or name": {"master_addr": "::1"},
        "advertise_addr must be an IPv4 address or name": {
            "join": "10.0.0.1:29500",
            "role": "decode",
            "advertise_addr": "fe80::1",
        },
    }
    for message, settings in refused.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            ClusterConfig.from_settings(settings)


def test_the_default_prompt_limit_holds_a_prompt_of_the_maximum_model_length() -> None:
    """A long-context model's text prompt of up to 8 characters a token is not refused before it is
    tokenized; a small model keeps the floor, and a limit that is set is the limit."""
    assert ClusterConfig().max_prompt_chars is None
    assert prompt_chars_limit(None, 131_072) == 8 * 131_072
    assert prompt_chars_limit(None, 2048) == MIN_PROMPT_CHARS
    assert prompt_chars_limit(ClusterConfig.from_settings({"max_prompt_chars": 500}).max_prompt_chars, 131_072) == 500
    with pytest.raises(ValueError, match="max_prompt_chars must be positive, got 0"):
        ClusterConfig.from_settings({"max_prompt_chars": 0})


def test_the_http_apis_key_and_origins_need_it_and_a_value() -> None:
    assert ClusterConfig.from_settings({"http_port": 8000, "api_key": "sk-1"}).api_key == "sk-1"
    assert origins(
        ClusterConfig.from_settings({"http_port": 8000, "allowed_origins": "https://a.b, *"}).allowed_origins
    ) == [
        "https://a.b",
        "*",
    ]
    for settings, message in (
        ({"api_key": "sk-1"}, "--api-key guards the HTTP API: give --http-port too"),
        ({"http_port": 8000, "api_key": " "}, "--api-key must not be empty"),
        ({"allowed_origins": "*"}, "--allowed-origins applies to the HTTP API: give --http-port too"),
        ({"http_port": 8000, "allowed_origins": " , "}, "--allowed-origins names none"),
        ({"send_timeout": 5.0}, "--send-timeout applies to the HTTP API: give --http-port too"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            ClusterConfig.from_settings(settings)


def test_several_http_front_ends_need_the_http_port(tmp_path: Path) -> None:
    assert ClusterConfig().api_servers == 1
    preset = tmp_path / "http.yaml"
    preset.write_text("http_port: 8000\napi_servers: 4\n")
    assert ClusterConfig.from_yaml(preset).api_servers == 4
    for settings, message in (
        ({"api_servers": 2}, "--api-servers 2 runs HTTP front ends: give --http-port too"),
        ({"http_port": 8000, "api_servers": 0}, "api_servers must be >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            ClusterConfig.from_settings(settings)


def test_across_machines_kv_moves_over_the_network() -> None:
    auto = TransferConfig()
    assert resolve_transfer(auto, on_gpu=True, peer_access=True, joinable=True).backend == "nccl-async"
    assert resolve_transfer(auto, on_gpu=False, peer_access=True, joinable=True).backend == "gloo"
    assert resolve_transfer(auto, on_gpu=True, peer_access=True, joinable=False).backend == "cuda-ipc"
    for backend in ("cuda-ipc", "shm"):
        with pytest.raises(ClusterError, match=f"--transfer {backend} moves KV within one host"):
            resolve_transfer(TransferConfig(backend), on_gpu=backend == "cuda-ipc", peer_access=True, joinable=True)


def test_auto_transfer_pulls_through_cuda_ipc_on_one_host_and_checks_the_device() -> None:
    auto = TransferConfig()
    assert auto.resolved(on_gpu=True).backend == "cuda-ipc"
    assert auto.resolved(on_gpu=True, peer_access=False).backend == "nccl-async"
    assert auto.resolved(on_gpu=False).backend == "gloo"
    with pytest.raises(ValueError, match="needs GPUs"):
        TransferConfig("cuda-ipc").resolved(on_gpu=False)
    with pytest.raises(ValueError, match="moves CPU tensors"):
        TransferConfig("shm").resolved(on_gpu=True)
    with pytest.raises(ValueError, match="peer access"):
        TransferConfig("cuda-ipc").resolved(on_gpu=True, peer_access=False)


def test_a_preset_value_of_the_wrong_type_names_its_setting(tmp_path: Path) -> None:
    refused = {
        "max_model_len: abc\n": "max_model_len must be an integer, got 'abc'",
        'prefill_tp: "2"\n': "prefill_tp must be an integer, got '2'",
        "prefix_cache: 1\n": "prefix_cache must be true or false, got 1",
        "dtype: 5\n": "dtype must be a string, got 5",
        "drain_timeout: [1]\n": "drain_timeout must be a number, got [1]",
        "devices: a,b\n": "devices: expected comma-separated GPU ids such as 0,1, or cpu, got 'a,b'",
        "max_model_len: [\n": "not valid YAML: expected the node content, but found '<stream end>' (line 2, column 1)",
        "1: 2\n": "setting names are strings, got 1",
        "on: true\n": "setting names are strings, got True",
    }
    for text, message in refused.items():
        path = tmp_path / "preset.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            ClusterConfig.from_yaml(path)


def test_devices_cpu_runs_every_rank_on_the_cpu_beside_gpus() -> None:
    """A machine with fewer GPUs than ranks is told both ways out: sharing one, or the CPU."""
    assert ClusterConfig(prefill_tp=2, devices=()).placement(visible_gpus=1) == [None, None]
    assert ClusterConfig.from_settings({"devices": "cpu"}).placement(visible_gpus=8) == [None, None]
    with pytest.raises(ValueError, match=r"3 ranks need 3 GPUs, 1 available.*--devices 0,0.*--devices cpu"):
        ClusterConfig(prefill_tp=2).placement(visible_gpus=1)


def test_a_preset_spells_devices_as_the_flag_does_or_as_a_list(tmp_path: Path) -> None:
    path = tmp_path / "preset.yaml"
    spellings = {"devices: 0,1\n": (0, 1), "devices: [0, 1]\n": (0, 1), "devices: 3\n": (3,), "devices: cpu\n": ()}
    for text, devices in spellings.items():
        path.write_text(text)
        assert ClusterConfig.from_yaml(path).devices == devices
    path.write_text("drain_timeout: 5\nmax_model_len:\n")
    config = ClusterConfig.from_yaml(path)
    assert config.drain_timeout == 5.0 and isinstance(config.drain_timeout, float)
    assert config.engine.max_model_len is None


def test_a_watchdog_must_outwait_a_blocking_transfers_lease() -> None:
    """A blocking KV transfer holds its leader's loop up to --kv-lease-timeout: a watchdog that
    ends the loop sooner is refused for those backends, and allowed for the others."""
    config = ClusterConfig.from_settings({"watchdog_timeout": 10.0, "kv_lease_timeout": 30.0})
    for backend in ("gloo", "nccl"):
        with pytest.raises(ValueError, match="--watchdog-timeout 10 must exceed --kv-lease-timeout 30"):
            config.check_watchdog(TransferConfig(backend))
    for backend in ("gloo-async", "nccl-async", "shm", "cuda-ipc"):
        config.check_watchdog(TransferConfig(backend))
    ClusterConfig().check_watchdog(TransferConfig("gloo"))  # the defaults: 300 s against 30 s


def test_a_registered_backend_is_checked_by_the_traits_it_declares(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend from outside (an RDMA one, say) registers its traits with its factory: the
    launcher's checks read them, not a list of the built-in names."""
    from pdserve.kvtransfer import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._registry()))  # the registration ends with the test
    traits = base.BackendTraits("cuda", blocking=True, same_host=True, shares_gpu=False)
    base.register_backend("test-rdma", traits)(lambda config, topology, kv_cache: None)
    rdma = TransferConfig("test-rdma")
    assert rdma.traits == traits and "test-rdma" in base.backends_for("cuda", blocking=True)
    with pytest.raises(ValueError, match="--transfer test-rdma needs GPUs; on CPU use gloo or gloo-async or shm"):
        rdma.resolved(on_gpu=False)
    with pytest.raises(ValueError, match="needs peer access"):
        rdma.resolved(on_gpu=True, peer_access=False)
    with pytest.raises(ClusterError, match="--transfer test-rdma moves KV within one host"):
        resolve_transfer(rdma, on_gpu=True, peer_access=True, joinable=True)
    with pytest.raises(ValueError, match="--transfer test-rdma cannot connect two ranks on one GPU"):
        ClusterConfig(devices=(0, 0)).check_shared_gpus([(0,), (0,)], "test-rdma")
    config = ClusterConfig.from_settings({"watchdog_timeout": 10.0, "kv_lease_timeout": 30.0})
    with pytest.raises(ValueError, match="does not block: cuda-ipc or nccl-async"):
        config.check_watchdog(rdma)


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"max_message_mib": float("inf")}, "max_message_mib"),  # int(inf) in the router: a traceback
        ({"max_message_mib": float("nan")}, "max_message_mib"),
        ({"client_heartbeat_timeout": float("inf")}, "client_heartbeat_timeout"),
        ({"client_heartbeat_timeout": 7000.0}, "client_heartbeat_timeout"),  # past ZMQ's TTL: "cannot listen"
        ({"transfer_staging_mib": float("inf")}, "staging_mib"),  # ranks abort at start
        ({"start_timeout": float("inf")}, "start_timeout"),  # KV pair groups' threads die after "ready"
        ({"http_port": 8000, "send_timeout": float("nan")}, "send_timeout"),
        ({"drain_timeout": float("nan")}, "drain_timeout"),
        ({"join": "127.0.0.1:29500", "role": "decode", "join_timeout": float("inf")}, "join_timeout"),
    ],
)
def test_a_number_no_part_of_the_cluster_can_use_is_refused_up_front(settings: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ClusterConfig.from_settings(settings)


def test_a_watchdog_may_still_be_infinite() -> None:
    """--watchdog-timeout documents inf as "never"."""
    assert ClusterConfig.from_settings({"watchdog_timeout": float("inf")}).watchdog_timeout == float("inf")


def test_dtypes_take_vllms_names_and_a_wrong_one_lists_auto() -> None:
    import torch

    assert ClusterConfig.from_settings({"dtype": "half"}).engine.resolved_dtype() == torch.float16
    assert ClusterConfig.from_settings({"dtype": "float"}).engine.resolved_dtype() == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'halff'; expected auto or one of bf16, "):
        ClusterConfig.from_settings({"dtype": "halff"})


def test_the_cache_aware_margin_is_refused_with_another_dispatch() -> None:
    """It weighs nothing under round-robin or least-tokens: a value given there would be ignored."""
    assert ClusterConfig.from_settings({"dispatch": "cache-aware", "cache_aware_margin": 10}).cache_aware_margin == 10
    assert ClusterConfig.from_settings({"dispatch": "round-robin"}).dispatch == "round-robin"  # the default margin
    with pytest.raises(
        ValueError, match="^--cache-aware-margin applies to --dispatch cache-aware, not --dispatch round"
    ):
        ClusterConfig.from_settings({"dispatch": "round-robin", "cache_aware_margin": 10})


def test_the_cpu_pool_check_counts_the_rank_with_the_most_kv_heads() -> None:
    """Where TP does not divide the KV heads rank 0 holds the fewest, and the group's pool is the
    one its fullest rank can hold: checked on rank 0, a pool too small passed, and the leader
    failed at start with a traceback instead of one line before any rank started (review)."""
    model = ModelConfig.from_hf_dict(load_preset("tiny-llama-odd"))  # 9 query heads, 3 KV heads
    assert [head_shard(9, 3, 2, r).num_kv_heads for r in range(2)] == [1, 2]
    # 196608 bytes: 512 tokens of one head, 256 of two.
    settings = {"mode": "colocated", "colocated_tp": 2, "cpu_kv_cache_bytes": 196608, "max_model_len": 512}
    with pytest.raises(ValueError, match="--cpu-kv-cache-bytes 196608 holds 256 tokens on a colocated rank"):
        ClusterConfig.from_settings(settings).check_model(model)
