"""Shared fixtures. CPU by default; GPU tests are marked ``gpu`` and skip without CUDA."""

from __future__ import annotations

import os

# On a machine without CUDA, Triton kernels can only run in its interpreter. This must be set
# before anything imports triton, hence here, at the top of the first module pytest loads.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count()
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA devices"))


@pytest.fixture
def interpreter() -> None:
    """Require the Triton kernels to run under Triton's interpreter: TRITON_INTERPRET=1 from the
    top of this file, before triton's first import (tests/kernels/conftest.py's docstring says why)."""
    import numpy
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from pdserve.kernels import rmsnorm

    if not isinstance(rmsnorm._rms_norm_kernel, InterpretedFunction):
        if torch.cuda.is_available():
            pytest.skip("kernels are compiled for the GPU here; the gpu tests cover them")
        pytest.fail("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does it)")
    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        # Older interpreters loop to a loaded bound through int() of a 1-element array,
        # which NumPy 2.4 refuses; triton 3.7+ (the CI's) is fine with any NumPy.
        pytest.skip("the interpreter of triton < 3.7 needs numpy < 2.4")


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp32 random-weight checkpoints of the tiny presets, written once per test session."""
    from pdserve.engine.presets import list_presets, load_preset, write_random_checkpoint

    root = tmp_path_factory.mktemp("tiny-models")
    return {
        name: write_random_checkpoint(load_preset(name), root / name, seed=0, dtype="float32")
        for name in list_presets()
        if name.startswith("tiny-")
    }


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    from pdserve.engine.demo import ensure_demo_model

    return ensure_demo_model(quiet=True)
