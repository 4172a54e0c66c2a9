"""bench.engine_step on the CPU: one row per batch size and overlap mode, step = forward + host,
in its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench.engine_step import main


def test_cpu_engine_step_split(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "engine_step.json"
    result = main(
        [
            "--model",
            str(tiny_model_dirs["tiny-llama"]),
            "--device",
            "cpu",
            "--batch-sizes",
            "1,4",
            "--context",
            "24",
            "--iters",
            "4",
            "--warmup",
            "1",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == result
    assert [(r["batch"], r["overlap"]) for r in result["rows"]] == [(1, False), (1, True), (4, False), (4, True)]
    for row in result["rows"]:
        step, forward = row["step"]["median_ms"], row["forward"]["median_ms"]
        assert step > 0 and forward > 0
        assert row["host_ms"] == pytest.approx(step - forward)
        assert row["forward_share"] == pytest.approx(forward / step)


def test_one_overlap_mode(tiny_model_dirs: dict[str, Path]) -> None:
    result = main(
        [
            "--model",
            str(tiny_model_dirs["tiny-llama"]),
            "--device",
            "cpu",
            "--batch-sizes",
            "2",
            "--context",
            "8",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--overlap",
            "on",
        ]
    )
    assert [(r["batch"], r["overlap"]) for r in result["rows"]] == [(2, True)]
