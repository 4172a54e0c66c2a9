"""What the engine's GPU test files share."""

from __future__ import annotations

import torch


def free_cuda() -> None:
    """Give the caching allocator's free blocks back to the device once its work is done, so that
    the next model a test loads finds the memory the last one held."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
