"""Programmatic dependent launch (PDL): a kernel starts while the one before it finishes.

On Hopper and later, a PDL kernel may start once every program of the kernel before it has
called ``gdc_launch_dependents``; its ``gdc_wait`` returns once that kernel has completed. A
decode step is hundreds of few-microsecond kernels, so hiding launch gaps matters: every kernel
here calls ``gdc_launch_dependents`` first and loads what no kernel of the step writes (weights,
step inputs) before its wait, or prefetches it into L2 (:func:`prefetch_l2`).

Invariants every kernel keeps with ``USE_PDL``:

* ``gdc_wait`` is called unconditionally, before the first write and before the first read of
  anything a kernel of the current step may have written (activations, partial sums, the KV slots
  the step stores), so completion stays transitive along the stream;
* before the wait it reads only weights, constant tables and the step's inputs (positions, slots,
  block tables, context lengths, earlier steps' KV), all written before the step's first kernel.
  A prefetch may name any line: it reads nothing into the program.

Kernels without PDL (cuBLAS, NCCL, torch ops) wait for their predecessor as always, so mixing
them in one stream or CUDA graph is safe.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

L2_LINE_BYTES = 128  # what one prefetch_l2 brings into L2


@functools.cache
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


@triton.jit
def prefetch_l2(ptrs, mask):
    """``prefetch.global.L2`` of the line at each of ``ptrs`` where ``mask`` holds, for a kernel
    to issue before its wait: no register result, so the program goes on at once, and it may
    name lines the kernels ahead still write. PTX only: issue it under ``USE_PDL``."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        constraints="=r,l,r",
        args=[ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
