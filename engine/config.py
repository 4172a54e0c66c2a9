"""Configuration dataclasses, one per concern, each validated once in ``__post_init__``.

A rank gets its own copy with ``dataclasses.replace``; derived values are computed by methods
and returned, never written back into a config.

User-facing fields are declared with :func:`setting` (a default and a help text). The cluster
spec nests these dataclasses into one tree, and :func:`settings_of` lists its settings under
one flat key each: the YAML key, and with dashes the command-line flag. A setting therefore has
one name, one default and one help text, declared once, here or beside its owner.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.tokenization import eos_token_ids

# -- settings tree --------------------------------------------------------------------------


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    section: str = "Engine",
    choices: tuple[str, ...] | None = None,
    default_text: str | None = None,
    key: str | None = None,
) -> Any:
    """A user-facing field: its help text, the ``--help`` section it shows in, its choices, how
    to show a default that is not a plain value (``default_text``), and its flat key when that
    is not the subtree's prefix + the field's name."""
    metadata = {"help": help, "section": section, "choices": choices, "default_text": default_text, "key": key}
    return field(default=default, metadata=metadata)


def subtree(factory: Any, prefix: str = "") -> Any:
    """A nested config whose settings join the parent's, their keys prefixed with ``prefix``."""
    return field(default_factory=factory, metadata={"subtree": prefix})


def internal(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A field set by the program, never by the user (no flag, no YAML key)."""
    return field(default=default, default_factory=default_factory, metadata={"internal": True})


@dataclass(frozen=True)
class SettingSpec:
    """One user-facing setting of a config tree."""

    key: str  # YAML key; the flag is ``--`` + key with dashes
    path: tuple[str, ...]  # attribute path from the root config
    type: Any  # the field's type hint
    default: Any
    help: str
    section: str
    choices: tuple[str, ...] | None
    default_text: str | None

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


def settings_of(cls: type, prefix: str = "", path: tuple[str, ...] = ()) -> list[SettingSpec]:
    """Every setting of the config tree rooted at ``cls``, in declaration order.

    Raises if a field is neither a setting, a subtree nor marked internal, or if two settings
    share a key: both would give one setting two names or two meanings.
    """
    hints = typing.get_type_hints(cls)
    specs: list[SettingSpec] = []
    for f in dataclasses.fields(cls):
        if "subtree" in f.metadata:
            specs += settings_of(hints[f.name], prefix + f.metadata["subtree"], (*path, f.name))
        elif "help" in f.metadata:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            key = f.metadata["key"] or prefix + f.name
            specs.append(
                SettingSpec(
                    key,
                    (*path, f.name),
                    hints[f.name],
                    default,
                    f.metadata["help"],
                    f.metadata["section"],
                    f.metadata["choices"],
                    f.metadata["default_text"],
                )
            )
        elif not f.metadata.get("internal"):
            raise TypeError(f"{cls.__name__}.{f.name} is neither a setting, a subtree nor internal")
    keys = [s.key for s in specs]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise TypeError(f"{cls.__name__}: settings share the keys {duplicates}")
    return specs


def build_config(cls: type, values: Mapping[str, Any], origin: str = "settings") -> Any:
    """``cls`` built from flat ``{key: value}`` settings (defaults for the rest).

    An unknown key is an error that names it and the closest known key.
    """
    specs = {s.key: s for s in settings_of(cls)}
    tree: dict[str, Any] = {}
    for key, value in values.items():
        spec = specs.get(key)
        if spec is None:
            close = difflib.get_close_matches(key, specs, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{origin}: unknown setting {key!r}{hint}")
        node = tree
        for name in spec.path[:-1]:
            node = node.setdefault(name, {})
        node[spec.path[-1]] = _typed(spec, value, origin)
    return _construct(cls, tree)


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _typed(spec: SettingSpec, value: Any, origin: str) -> Any:
    """``value`` as its setting's type (an integer where a number is expected becomes a float).
    A YAML preset's values arrive untyped: one of the wrong type is refused here, naming its
    setting, instead of failing later in a comparison that names neither."""
    args = typing.get_args(spec.type)
    kind = next(t for t in args or (spec.type,) if t is not type(None))
    if value is None and type(None) in args:
        return None
    if typing.get_origin(kind) is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(value)
        expected = "a list of integers"
    else:
        if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return value
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        expected = _TYPE_NAMES.get(kind, kind.__name__)
    raise ValueError(f"{origin}: {spec.key} must be {expected}, got {value!r}")


def _construct(cls: type, tree: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {
        name: _construct(hints[name], value) if isinstance(value, Mapping) else value for name, value in tree.items()
    }
    return cls(**kwargs)


def flatten_config(config: Any) -> dict[str, Any]:
    """``{key: value}`` of every setting of a built config tree (the inverse of ``build_config``)."""
    out = {}
    for spec in settings_of(type(config)):
        value = config
        for name in spec.path:
            value = getattr(value, name)
        out[spec.key] = value
    return out


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,  # vLLM's
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,  # vLLM's
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
                f"rope_scaling type {self.rope_type!r} is not supported (supported: default, linear, llama3)"
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


def _read_json(path: Path) -> dict[str, Any]:
    """A model directory's JSON file as a dict; ValueError naming the file when it is not one."""
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _integer(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    """``hf[key]`` (``default`` where absent or null), which must be a JSON integer: Hugging
    Face's own config classes refuse ``"30"`` or ``30.0`` too."""
    value = hf.get(key)
    if value is None:
        if default is None:
            raise KeyError(key)
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{key} must be an integer, got {value!r}")
    return value


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
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model config {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
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
        num_heads = _integer(hf, "num_attention_heads")
        hidden_size = _integer(hf, "hidden_size")
        if hf.get("head_dim") is None and num_heads > 0 and hidden_size % num_heads:
            raise ValueError(
                f"hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads}), "
                "and no head_dim is given"
            )
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=_integer(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_integer(hf, "intermediate_size"),
            num_layers=_integer(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_integer(hf, "num_key_value_heads", num_heads),
            head_dim=_integer(hf, "head_dim", hidden_size // max(num_heads, 1)),
            max_position_embeddings=_integer(hf, "max_position_embeddings", 2048),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and none on o_proj; Llama has `attention_bias` for all four.
            qkv_bias=True if arch == "qwen2" else attention_bias,
            o_bias=False if arch == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            eos_token_ids=eos_token_ids(hf),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory")
        hf = _read_json(path)
        # Chat checkpoints often list extra end-of-turn ids in generation_config.json only.
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file():
            gen_eos = _read_json(gen_path).get("eos_token_id")
            if gen_eos is not None:
                own = hf.get("eos_token_id")
                own = own if isinstance(own, list) else ([] if own is None else [own])
                extra = gen_eos if isinstance(gen_eos, list) else [gen_eos]
                hf["eos_token_id"] = list(dict.fromkeys([*own, *extra]))
        try:
            return cls.from_hf_dict(hf)
        except KeyError as e:
            raise ValueError(f"{path} has no {e.args[0]!r}, which the model's shape needs") from None
        except (TypeError, ValueError) as e:  # a value of the wrong type, or a shape that cannot be
            raise ValueError(f"{path}: {e}") from None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V per token over all layers and all KV heads (whole model, one copy)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool of one rank."""

    block_size: int = setting(16, help="Tokens per KV block (a power of two).")
    num_blocks: int | None = setting(
        None, help="KV blocks per rank.", default_text="sized from free memory (GPU) or cpu_kv_cache_bytes (CPU)"
    )
    # Weights and KV together: other engines in the same process, like other processes, come
    # out of the rest.
    gpu_memory_utilization: float = setting(
        0.90, help="Fraction of each GPU's memory a rank may use for weights and KV cache.", section="GPU"
    )
    cpu_kv_cache_bytes: int = setting(1 << 30, help="Bytes of KV pool per rank on CPU when num_blocks is unset.")
    # Set where ranks of several roles share a GPU, each with its own budget: the memory the
    # others hold is theirs, not to be taken out of this rank's gpu_memory_utilization again.
    gpu_shared: bool = internal(False)
    enable_prefix_caching: bool = setting(
        True,
        key="prefix_cache",
        help="Keep computed KV blocks after their requests end and reuse them for prompts that start alike.",
    )

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

    max_num_seqs: int = setting(256, help="Most sequences a group runs at once.")
    max_num_batched_tokens: int = setting(8192, help="Tokens (prompt chunks + one per decode) one step may process.")
    enable_chunked_prefill: bool = setting(
        True, help="Split long prompts into chunks that share each step's token budget with running decodes."
    )

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

    tp_size: int = internal(1)
    tp_rank: int = internal(0)
    step_address: str | None = internal(None)

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

    model: str = setting(
        "demo",
        help="'demo' (the embedded SmolLM2-135M-Instruct), a shape preset (random weights, see "
        "`python -m pdserve.engine.presets list`) or a Hugging Face model directory.",
        section="Model",
    )
    dtype: str = setting(
        "auto",
        help="Weights and activations: float32 (float), float16 (half) or bfloat16.",
        section="Model",
        default_text="auto: bfloat16 on GPUs, float32 on CPU",
    )
    max_model_len: int | None = setting(
        None, help="Longest prompt + output in tokens.", section="Model", default_text="the model's own limit"
    )
    device: str = internal("auto")  # auto: cuda if available else cpu; the launcher places ranks
    seed: int = internal(0)
    kernels: str = setting(
        "auto",
        help="Kernel implementation: triton or torch (the references).",
        choices=("auto", "triton", "torch"),
        default_text="auto: triton on GPUs, torch on CPU",
    )
    enforce_eager: bool = setting(False, help="Run every step eagerly: no CUDA graphs.", section="GPU")
    # Every graph shares one logits buffer and each bucket costs its capture, while an eager step
    # costs the host its launches whatever its size: the default covers the default max_num_seqs.
    cuda_graph_max_batch: int = setting(
        256, help="Largest decode batch captured in a CUDA graph; larger steps run eagerly.", section="GPU"
    )
    cuda_graph_max_prefill_tokens: int = setting(
        2048, help="Largest prefill (or mixed) step captured in a CUDA graph, in tokens; 0 for none.", section="GPU"
    )
    # A mixed step holds every running decode beside its prompt chunks, so this bounds the decode
    # batch that a prompt's arrival keeps in graphs.
    cuda_graph_max_prefill_seqs: int = setting(
        256, help="Most sequences (decodes included) in a captured prefill or mixed step.", section="GPU"
    )
    # TP peers get the sampled tokens from the leader by a broadcast on the device.
    overlap_scheduling: bool = setting(
        True, help="Plan and launch each step before reading back the last one's tokens (docs/design.md)."
    )
    cache: CacheConfig = subtree(CacheConfig)
    scheduler: SchedulerConfig = subtree(SchedulerConfig)
    parallel: ParallelConfig = internal(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected auto or one of {', '.join(sorted(_DTYPES))}")
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
                f"max_position_embeddings {model.max_position_embeddings} (leave it out to take the model's)"
            )
        return self.max_model_len
