"""bench.step_profile on the CPU: rows that add up to the step, in the JSON it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.step_profile import main


def test_cpu_profile_of_a_decode_step(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    result = main(["--model", str(tiny_model_dirs["tiny-llama"]), "--device", "cpu", "--batch", "2",
                   "--context", "32", "--steps", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["step_us"] > 0 and result["rows"]
    assert sum(r["share"] for r in result["rows"]) == pytest.approx(1.0)
    assert any("index" in r["name"] or "mm" in r["name"] or "linear" in r["name"] for r in result["rows"])
