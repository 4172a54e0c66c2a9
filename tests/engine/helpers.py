"""What the engine's test files share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine


def free_cuda() -> None:
    """Give the caching allocator's free blocks back to the device once its work is done, so that
    the next model a test loads finds the memory the last one held."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def make_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, **processors: Any) -> list[int]:
    """transformers' greedy output, exactly ``max_new_tokens`` long, as an engine request with
    ``ignore_eos`` gives it: EOS may be chosen and does not end it (``min_new_tokens`` would
    mask EOS instead); ``processors``: generate's logits processors (``repetition_penalty=1.2``)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # else generate masks every id 0 as padding
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **processors,
        )
    assert out.shape[1] == len(prompt) + max_new_tokens
    return out[0, len(prompt) :].tolist()


def make_engine(
    model_dir: Path,
    num_blocks: int = 256,
    max_model_len: int = 256,
    overlap: bool = True,
    kernels: str = "auto",
    prefix_cache: bool = True,
    **sched: object,
) -> LLMEngine:
    """An fp32 engine on the CPU; ``sched``: ``SchedulerConfig`` fields."""
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            max_model_len=max_model_len,
            kernels=kernels,
            overlap_scheduling=overlap,
            cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=prefix_cache),
            scheduler=SchedulerConfig(**sched),  # type: ignore[arg-type]
        )
    )


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
