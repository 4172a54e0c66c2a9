"""The project's top-level ``kernels`` package must not pass for the Hugging Face ``kernels`` hub
package, which transformers looks up by name (and would then try to load kernels from)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import kernels.rmsnorm  # ours, imported first, as the engine does
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import import_utils

assert kernels.__file__.startswith({repo!r}), kernels.__file__
assert not import_utils.is_kernels_available(), "transformers takes our kernels/ for the hub package"
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config).eval()
with torch.no_grad():
    logits = model(torch.tensor([[1, 2, 3]])).logits
assert logits.shape == (1, 3, 64) and torch.isfinite(logits).all()
print("ok")
"""


def test_importing_our_kernels_leaves_transformers_alone() -> None:
    # A fresh interpreter: transformers caches its availability checks per process.
    result = subprocess.run([sys.executable, "-c", PROBE.format(repo=str(REPO))], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
