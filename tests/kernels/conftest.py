"""Each Triton kernel against its torch reference: one test file per module of kernels/.

CPU (CI): every kernel runs under Triton's interpreter at tiny shapes, in fp32 and fp16 (never
bf16: the interpreter's bf16 arithmetic is wrong). ``triton.jit`` picks interpreter or compiler
when a kernel module is imported, and ``triton.language``'s own jitted helpers (``tl.sum``,
``tl.max``...) are fixed when triton is imported, so TRITON_INTERPRET=1 must be in the
environment before the first ``import triton`` of the process: tests/conftest.py sets it at its
top on machines without CUDA, and pytest loads it before this file and any test module (the
engine's modules, which import ``pdserve.kernels.*`` for the references, come later). The
``interpreter`` fixture (tests/conftest.py) checks that this held instead of trusting it. The
interpreter runs every program instance in Python, slowly: each case keeps to a few dozen programs.

GPU (``-m gpu``; tests/conftest.py skips them without CUDA): real Qwen2.5-1.5B shapes (12 query
heads, 2 KV heads, head_dim 128, hidden 1536, intermediate 8960, block_size 16), bf16 and fp16,
random inputs, and a CUDA-graph capture of decode attention replayed with new lengths and tables.

Each kernel's case runner (``check_<kernel>``) is one body for its CPU and GPU tests;
helpers.py holds what several files share.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda")
