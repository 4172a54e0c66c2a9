"""Our import names collide with no installed distribution.

The code is one import package, ``pdserve``, mapped over the repository's top-level folders.
Those folders have no ``__init__.py``, so an interpreter started from the repository root (as
``python launch.py`` and ``python -m pytest`` are) still imports Hugging Face's ``kernels``,
which transformers 5.25+ requires and imports on every ``from_pretrained``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOP_LEVEL = (
    "cluster",
    "prefill_worker",
    "decode_worker",
    "router",
    "kvtransfer",
    "kernels",
    "configs",
    "engine",
    "bench",
)

PROBE = """
import importlib.metadata, os, tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import kernels
from pdserve.kernels.rmsnorm import rms_norm, rms_norm_ref
from triton.runtime.interpreter import InterpretedFunction
import pdserve.kernels.rmsnorm as ours

repo = Path({repo!r})
assert kernels.__file__ is not None and not Path(kernels.__file__).is_relative_to(repo), kernels.__path__
assert importlib.metadata.distribution("kernels").read_text("METADATA") is not None
assert Path(ours.__file__).is_relative_to(repo / "kernels"), ours.__file__

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2)
with tempfile.TemporaryDirectory() as tmp:
    LlamaForCausalLM(config).save_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp).eval()
with torch.no_grad():
    logits = model(torch.tensor([[1, 2, 3]])).logits
assert logits.shape == (1, 3, 64) and torch.isfinite(logits).all()

assert isinstance(ours._rms_norm_kernel, InterpretedFunction)  # the Triton kernel, interpreted
x, w = torch.randn(3, 32), torch.randn(32)
torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
print("ok", transformers.__version__, importlib.metadata.version("kernels"))
"""


def test_transformers_loads_models_beside_our_kernels_from_the_repo_root() -> None:
    # A fresh interpreter in the repository root: sys.path[0] is the root, as for launch.py.
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(repo=str(REPO))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stderr[-3000:]


def test_top_level_folders_are_namespace_portions() -> None:
    # An __init__.py in any of them would make it a regular package that shadows an installed
    # distribution of the same name whenever the repository root is on sys.path.
    assert (REPO / "__init__.py").is_file()
    for folder in TOP_LEVEL:
        assert not (REPO / folder / "__init__.py").exists(), folder


def test_every_import_of_our_code_goes_through_pdserve() -> None:
    offenders = []
    for path in REPO.rglob("*.py"):
        if ".git" in path.parts or "site-packages" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n.split(".")[0] in TOP_LEVEL]
    assert not offenders, offenders
