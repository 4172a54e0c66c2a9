"""Programmatic dependent launch (PDL): a kernel starts while the one before it finishes.

On Hopper (sm90) and later, a kernel launched with PDL may start as soon as every program of
the kernel before it on the stream has called ``gdc_launch_dependents``; it calls ``gdc_wait``
before it reads anything an earlier kernel wrote, and ``gdc_wait`` returns once that kernel has
completed and its writes are visible. A decode step of a 1.5B model is about 170 kernels of a
few microseconds each, so the gap between one kernel's end and the next one's start is a large
share of the step; PDL overlaps it, and the linear kernel uses it to load its first weight tile
(weights are never written by an earlier kernel) before it waits.

Invariants every kernel here keeps with ``USE_PDL``: it calls ``gdc_wait`` unconditionally and
before its first read of data an earlier kernel may have written, so its completion implies its
predecessor's, and completion stays transitive along the stream. Kernels launched without PDL
(cuBLAS, NCCL, torch ops) wait for their predecessor's completion as always, so mixing them in
one stream or one CUDA graph is safe.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: CUDA compute capability 9.0 or newer,
    unless the environment sets ``PDSERVE_PDL=0``."""
    if device.type != "cuda" or os.environ.get("PDSERVE_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_args(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for launching a kernel that takes ``USE_PDL`` on ``device``."""
    use = enabled(device)
    return {"USE_PDL": use, "launch_pdl": use}
