"""Configuration dataclasses, one per concern, each validated once in ``__post_init__``.

A rank gets its own copy with ``dataclasses.replace``; derived values are computed by methods
and returned, never written back into a config.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters as the Llama / Qwen2 checkpoints spell them."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "llama3"):
            raise ValueError(
                f"rope_scaling type {self.rope_type!r} is not supported "
                "(supported: default, linear, llama3)"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope theta and factor must be positive")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        # transformers < 5 writes `rope_theta` + `rope_scaling`; 5.x writes `rope_parameters`.
        params = dict(hf.get("rope_parameters") or {})
        scaling = dict(hf.get("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = float(merged.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
        kwargs: dict[str, Any] = {"theta": theta, "rope_type": rope_type}
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if key in merged and merged[key] is not None:
                kwargs[key] = float(merged[key])
        if merged.get("original_max_position_embeddings") is not None:
            kwargs["original_max_position_embeddings"] = int(merged["original_max_position_embeddings"])
        return cls(**kwargs)

    def inv_freq(self, rotary_dim: int) -> torch.Tensor:
        """Inverse frequencies (fp32, ``rotary_dim // 2`` of them) after the configured scaling."""
        # fp32 throughout, as transformers computes it, so that cos/sin agree bit for bit.
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.factor
        elif self.rope_type == "llama3":
            # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, blend between.
            low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
            inv_freq = torch.where(is_medium, smoothed, scaled)
        return inv_freq


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama- or Qwen2-family decoder, read from a Hugging Face config.json."""

    architecture: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"  # the checkpoint's own dtype

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"unsupported architecture {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = {"llama": "llama", "qwen2": "qwen2"}.get(hf.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"unsupported model: architectures={archs}, model_type={hf.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(hf["num_attention_heads"])
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and none on o_proj; Llama has `attention_bias` for all four.
            qkv_bias=True if arch == "qwen2" else attention_bias,
            o_bias=False if arch == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            eos_token_ids=eos_ids,
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory")
        hf = json.loads(path.read_text())
        # Chat checkpoints often list extra end-of-turn ids in generation_config.json only.
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            if gen_eos is not None:
                own = hf.get("eos_token_id")
                own = own if isinstance(own, list) else ([] if own is None else [own])
                extra = gen_eos if isinstance(gen_eos, list) else [gen_eos]
                hf["eos_token_id"] = list(dict.fromkeys([*own, *extra]))
        return cls.from_hf_dict(hf)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V per token over all layers and all KV heads (whole model, one copy)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool of one rank."""

    block_size: int = 16
    # Fixed number of blocks; when None it is derived from memory (see ``engine.model_runner``).
    num_blocks: int | None = None
    # GPU: fraction of total device memory this engine may use, weights and KV together (other
    # engines in the same process, like other processes, come out of the rest).
    gpu_memory_utilization: float = 0.90
    # CPU: bytes of KV pool when num_blocks is not given.
    cpu_kv_cache_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_bytes < 1:
            raise ValueError("cpu_kv_cache_bytes must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits of one engine."""

    max_num_seqs: int = 256
    # Tokens (prompt chunks + one per decode) that one step may process.
    max_num_batched_tokens: int = 8192
    # Split long prompts into chunks that fit the step budget, mixed with running decodes.
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so that every running sequence can decode in one step"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """This rank's place in its tensor-parallel group.

    ``step_address`` is the ZMQ base address the leader sends step plans to (peers listen on
    ``<step_address>-<rank>``); needed when ``tp_size > 1``.
    """

    tp_size: int = 1
    tp_rank: int = 0
    step_address: str | None = None

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside a group of {self.tp_size}")
        if self.tp_size > 1 and not self.step_address:
            raise ValueError("a TP group of size > 1 needs a step_address for its step plans")

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (one rank of one group) needs to start."""

    model: str  # a Hugging Face directory
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda if available else cpu
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0
    kernels: str = "auto"  # auto: triton on CUDA, torch on CPU
    enforce_eager: bool = False  # no CUDA graphs at all
    # Largest captured decode batch (capped at scheduler.max_num_seqs); larger steps run eagerly.
    # An eager step costs the host 12-19 ms of launches whatever its size, against 1-4 ms for a
    # replay (H200 host, Qwen2.5-1.5B: docs/benchmarks.md), so the default covers the default
    # max_num_seqs: every graph writes one shared logits buffer, and a bucket costs its capture.
    cuda_graph_max_batch: int = 256
    # Largest captured prefill (or mixed) step in tokens, 0 for none, and the most sequences it
    # may hold (capped at scheduler.max_num_seqs); larger steps run eagerly.
    cuda_graph_max_prefill_tokens: int = 2048
    # A mixed step holds every running decode beside its prompt chunks, so this bounds the
    # decode batch that a prompt's arrival keeps in graphs. A bucket of T tokens samples
    # min(T, this) rows (the LM head's cost). Colocated serving on an H200 (docs/benchmarks.md):
    # 64 against 16, TTFT p99 394 -> 15 ms at 80 req/s of 128-token outputs; 256 (decode graphs
    # to 256) against 64 (to 128), 21.7 -> 58.3 req/s served at 80 req/s of 512-token outputs.
    cuda_graph_max_prefill_seqs: int = 256
    # Plan and launch each step before reading back the previous one's sampled tokens, so the
    # GPU does not wait for the host between steps (docs/design.md, "Overlapped steps"); TP
    # peers get those tokens from the leader by a broadcast on the device.
    overlap_scheduling: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels must be auto, torch or triton, got {self.kernels!r}")
        if self.cuda_graph_max_batch < 1:
            raise ValueError(f"cuda_graph_max_batch must be >= 1, got {self.cuda_graph_max_batch}")
        if self.cuda_graph_max_prefill_tokens < 0:
            raise ValueError(f"cuda_graph_max_prefill_tokens must be >= 0, got {self.cuda_graph_max_prefill_tokens}")
        if self.cuda_graph_max_prefill_seqs < 1:
            raise ValueError(f"cuda_graph_max_prefill_seqs must be >= 1, got {self.cuda_graph_max_prefill_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:  # set_device and graphs need an index
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return parse_dtype(self.dtype)

    def resolved_kernels(self) -> str:
        if self.kernels == "auto":
            return "triton" if self.resolved_device().type == "cuda" else "torch"
        return self.kernels

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        if self.max_model_len is None:
            return model.max_position_embeddings
        if self.max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {model.max_position_embeddings}"
            )
        return self.max_model_len
