"""The kernel implementations the model calls, chosen once at start-up.

``use_kernels("torch")`` routes every op to its plain-torch reference (the CPU path and the
oracle); ``use_kernels("triton")`` routes them to the Triton kernels. The model calls
``ops.<name>`` and never knows which one runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_OPS = {
    "embedding": "pdserve.kernels.embedding",
    "linear": "pdserve.kernels.linear",
    "linear_partial_sums": "pdserve.kernels.linear",
    "linear_silu_and_mul": "pdserve.kernels.linear",
    "rms_norm": "pdserve.kernels.rmsnorm",
    "fused_add_rms_norm": "pdserve.kernels.rmsnorm",
    "rope_and_store_kv": "pdserve.kernels.rope",
    "paged_decode_attention": "pdserve.kernels.decode_attention",
    "paged_prefill_attention": "pdserve.kernels.prefill_attention",
}

_impl: dict[str, Callable[..., Any]] = {}


def use_kernels(backend: str) -> None:
    """Bind every op to ``backend`` ("torch" or "triton")."""
    if backend not in ("torch", "triton"):
        raise ValueError(f"kernel backend must be torch or triton, got {backend!r}")
    suffix = "_ref" if backend == "torch" else ""
    for name, module in _OPS.items():
        _impl[name] = getattr(importlib.import_module(module), name + suffix)


def _op(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return _impl[name](*args, **kwargs)

    call.__name__ = name
    return call


embedding = _op("embedding")
linear = _op("linear")
linear_partial_sums = _op("linear_partial_sums")
linear_silu_and_mul = _op("linear_silu_and_mul")
rms_norm = _op("rms_norm")
fused_add_rms_norm = _op("fused_add_rms_norm")
rope_and_store_kv = _op("rope_and_store_kv")
paged_decode_attention = _op("paged_decode_attention")
paged_prefill_attention = _op("paged_prefill_attention")

use_kernels("torch")
