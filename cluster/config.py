"""The cluster spec: what launch.py builds from flags and YAML presets, validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.kvtransfer.base import TransferConfig

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class ClusterConfig:
    """How many groups of which role, their TP degrees, devices and the client endpoint."""

    model: str = "demo"
    mode: str = "disagg"  # disagg | colocated
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_groups: int = 1
    decode_groups: int = 1
    colocated_groups: int = 1
    colocated_tp: int = 1
    transfer: str = "auto"  # auto: nccl-async on CUDA, gloo on CPU
    transfer_layer_groups: int = 1  # KV messages per request per destination rank (layer ranges)
    transfer_staging_mib: float = 4096.0  # KV buffers a rank may hold for transfers in flight
    devices: tuple[int, ...] | None = None  # GPU ids; None: all visible GPUs, or CPU without any
    host: str = "127.0.0.1"
    port: int = 5555
    dtype: str = "auto"
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.85
    num_blocks: int | None = None  # fixed KV pool size per rank (tests); None sizes from memory
    block_size: int = 16
    cuda_graph_max_batch: int = 256
    cuda_graph_max_prefill_tokens: int = 2048  # largest captured prefill step; 0: prefill runs eagerly
    cuda_graph_max_prefill_seqs: int = 256  # most sequences (decodes included) a captured prefill step holds
    enforce_eager: bool = False
    overlap_scheduling: bool = True  # plan a step while the GPU runs the last
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    dispatch: str = "round-robin"
    drain_timeout: float = 30.0
    start_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.mode not in ("disagg", "colocated"):
            raise ValueError(f"mode must be disagg or colocated, got {self.mode!r}")
        for name in ("prefill_tp", "decode_tp", "prefill_groups", "decode_groups", "colocated_groups",
                     "colocated_tp", "transfer_layer_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.transfer_staging_mib > 0:
            raise ValueError(f"transfer_staging_mib must be positive, got {self.transfer_staging_mib}")
        if self.transfer not in ("auto", "nccl", "nccl-async", "gloo", "gloo-async"):
            raise ValueError(f"unknown transfer backend {self.transfer!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> ClusterConfig:
        """A YAML preset (keys = field names, dashes allowed), then the given overrides."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a cluster preset must be a mapping of settings")
        data = {k.replace("-", "_"): v for k, v in data.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown setting {unknown[0]!r}")
        if "devices" in data and data["devices"] is not None:
            data["devices"] = tuple(data["devices"])
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)

    def groups(self) -> list[tuple[str, int, int]]:
        """``(role, group index, tp)`` of every worker group, in global-rank order."""
        if self.mode == "colocated":
            return [("colocated", g, self.colocated_tp) for g in range(self.colocated_groups)]
        return [("prefill", g, self.prefill_tp) for g in range(self.prefill_groups)] + [
            ("decode", g, self.decode_tp) for g in range(self.decode_groups)
        ]

    @property
    def world_size(self) -> int:
        return sum(tp for _, _, tp in self.groups())

    def resolved_transfer(self, on_gpu: bool) -> TransferConfig:
        staging = max(1, int(self.transfer_staging_mib * 2**20))
        if self.transfer == "auto":
            return TransferConfig("nccl-async" if on_gpu else "gloo", max_staging_bytes=staging,
                                  layer_groups=self.transfer_layer_groups)
        if self.transfer.startswith("nccl") and not on_gpu:
            raise ValueError(f"--transfer {self.transfer} needs GPUs; use gloo on CPU")
        if self.transfer.startswith("gloo") and on_gpu:
            raise ValueError(f"--transfer {self.transfer} moves CPU tensors; use nccl on GPUs")
        return TransferConfig(self.transfer, max_staging_bytes=staging, layer_groups=self.transfer_layer_groups)

    def engine_config(self, model_dir: str) -> EngineConfig:
        chunked = self.enable_chunked_prefill
        return EngineConfig(
            model=model_dir,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
            cuda_graph_max_batch=self.cuda_graph_max_batch,
            cuda_graph_max_prefill_tokens=self.cuda_graph_max_prefill_tokens,
            cuda_graph_max_prefill_seqs=self.cuda_graph_max_prefill_seqs,
            overlap_scheduling=self.overlap_scheduling,
            cache=CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks,
                              gpu_memory_utilization=self.gpu_memory_utilization),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens if chunked
                else max(self.max_num_batched_tokens, self.max_model_len),
                enable_chunked_prefill=chunked,
            ),
        )

    def placement(self, visible_gpus: int) -> list[tuple[int, ...] | None]:
        """CUDA devices of each group's ranks (in ``groups()`` order); None entries run on CPU."""
        groups = self.groups()
        if visible_gpus == 0:
            if self.devices:
                raise ValueError(f"--devices {list(self.devices)} given but no GPU is visible")
            return [None] * len(groups)
        devices = list(self.devices) if self.devices is not None else list(range(visible_gpus))
        bad = [d for d in devices if not 0 <= d < visible_gpus]
        if bad:
            raise ValueError(f"GPU {bad[0]} does not exist ({visible_gpus} visible)")
        if len(devices) < self.world_size:
            raise ValueError(
                f"{self.world_size} ranks need {self.world_size} GPUs, {len(devices)} available: "
                f"{', '.join(f'{r}{g} x tp{t}' for r, g, t in groups)}"
            )
        out, next_device = [], 0
        for _, _, tp in groups:
            out.append(tuple(devices[next_device : next_device + tp]))
            next_device += tp
        return out


@dataclass(frozen=True)
class Addresses:
    """ZMQ endpoints of one cluster run: ipc sockets in the run directory, plus the client port."""

    run_dir: str
    client: str

    @property
    def router(self) -> str:
        return f"ipc://{self.run_dir}/router"

    def leader(self, role: str, group: int) -> str:
        return f"ipc://{self.run_dir}/{role}{group}"

    def steps(self, role: str, group: int) -> str:
        return f"ipc://{self.run_dir}/{role}{group}-steps"


@dataclass(frozen=True)
class GroupLayout:
    """Global ranks of every group, known to every rank (to build subgroups and transfers)."""

    ranks: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)  # role -> per group

    @classmethod
    def of(cls, config: ClusterConfig) -> GroupLayout:
        ranks: dict[str, list[tuple[int, ...]]] = {role: [] for role in ROLES}
        first = 0
        for role, _, tp in config.groups():
            ranks[role].append(tuple(range(first, first + tp)))
            first += tp
        return cls(ranks)

    def all_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(g for role in ROLES for g in self.ranks[role])
