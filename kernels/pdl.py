"""Programmatic dependent launch (PDL): a kernel starts while the one before it finishes.

On Hopper (sm90) and later, a kernel launched with PDL may start as soon as every program of
the kernel before it on the stream has called ``gdc_launch_dependents``; it calls ``gdc_wait``
before it reads anything an earlier kernel wrote, and ``gdc_wait`` returns once that kernel has
completed and its writes are visible. A decode step of a 1.5B model is about 280 kernels of a
few microseconds each, so the gap between one kernel's end and the next one's start is a large
share of the step. Every kernel here calls ``gdc_launch_dependents`` first thing, so the next
kernel's programs become resident while this one runs, and each kernel issues its reads of
data no kernel of the step writes before its wait: a linear kernel loads its first weight tile
(the down projection its first two, the narrow layers their whole weight slice) and decode
attention its context length and first block ids. That overlaps the weight stream with the
small kernels ahead (H200, Qwen2.5-1.5B, against the same kernels waiting first: batch-1 step
1.191 -> 1.177 ms, batch 32 at 2048 tokens 2.225 -> 2.178 ms; docs/benchmarks.md). Data whose
latency the step would still wait on after the wait is prefetched into L2 before it
(:func:`prefetch_l2`): decode attention's first K/V tile at small batches, the residual row of
the add + RMSNorm.

Invariants every kernel here keeps with ``USE_PDL``:

* it calls ``gdc_wait`` unconditionally, before its first write and before its first read of
  anything a kernel of the current step may have written (activations, partial sums, the KV
  slots the step stores), so its completion implies its predecessor's and completion stays
  transitive along the stream;
* before that wait it reads only weights (and constant tables such as RoPE's) and the step's
  inputs (token positions, slot mapping, block tables, context lengths, the KV cache of earlier
  steps), which are written before the step's first kernel: a kernel launched early starts
  after that first kernel did. A prefetch may name any line, the current step's writes
  included: it brings the line into L2 and reads nothing into the program.

Kernels launched without PDL (cuBLAS, NCCL, torch ops) wait for their predecessor's completion
as always, and a PDL kernel after one of them starts only when it completes, so mixing them in
one stream or one CUDA graph is safe.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

L2_LINE_BYTES = 128  # what one prefetch_l2 brings into L2


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


@triton.jit
def prefetch_l2(ptrs, mask):
    """``prefetch.global.L2`` of the line at each of ``ptrs`` where ``mask`` holds, for a kernel
    to issue before its wait. It has no register result, so the program goes on at once (a load
    would hold its registers until the data came), and it reads nothing into the program, so it
    may name lines the kernels ahead are still writing: their stores reach L2 as before. CUDA
    only (PTX); kernels issue it under ``USE_PDL``, which the interpreter never sets."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        constraints="=r,l,r", args=[ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )
