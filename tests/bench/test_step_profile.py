"""bench.step_profile on the CPU: rows that add up to the step, in the JSON it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench.step_profile import KernelSpan, critical_path_rows, main


def test_cpu_profile_of_a_decode_step(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    result = main(
        [
            "--model",
            str(tiny_model_dirs["tiny-llama"]),
            "--device",
            "cpu",
            "--batch",
            "2",
            "--context",
            "32",
            "--steps",
            "2",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == result
    assert result["step_us"] > 0 and result["rows"]
    assert sum(r["share"] for r in result["rows"]) == pytest.approx(1.0)
    assert any("index" in r["name"] or "mm" in r["name"] or "linear" in r["name"] for r in result["rows"])


def test_critical_path_charges_what_each_kernel_adds() -> None:
    """Two steps of three kernels: norm runs alone, linear starts early (PDL) and ends 5 µs after
    it, a small kernel inside linear's span adds nothing, and the next step starts after 4 µs of
    idle device. The charges add up to the busy time; rows are keyed by the kernel before."""
    step = [KernelSpan("norm", 0, 10), KernelSpan("linear", 5, 15), KernelSpan("tiny", 6, 12)]
    second = [KernelSpan(k.name, k.start + 19, k.end + 19) for k in step]
    rows, busy, idle = critical_path_rows([*second, *step], steps=2)  # any order in
    by_key = {(r["name"], r["after"]): r for r in rows}
    assert by_key["linear", "norm"]["us_per_step"] == 5 and by_key["linear", "norm"]["span_us_per_call"] == 10
    assert by_key["tiny", "linear"]["us_per_step"] == 0
    # the first step's norm follows nothing, the second's follows tiny (after the idle gap)
    assert by_key["norm", ""]["us_per_step"] == 5 and by_key["norm", "tiny"]["us_per_step"] == 5
    assert by_key["norm", "tiny"]["calls_per_step"] == 0.5 and by_key["norm", "tiny"]["us_per_call"] == 10
    assert busy == 15 and idle == 2
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert rows[0]["us_per_step"] >= rows[-1]["us_per_step"]


def test_critical_path_needs_a_gpu(tiny_model_dirs: dict[str, Path]) -> None:
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_model_dirs["tiny-llama"]), "--device", "cpu", "--critical-path"])
