"""``bench.ipc_transfer`` on CPU (shm): the documented smoke run verifies what it pulled and
reports every case with its baseline."""

from __future__ import annotations

import json
import math
from pathlib import Path

from click.testing import CliRunner

from pdserve.bench import ipc_transfer


def test_smoke_run_pulls_verified_kv_and_reports_both_cases(tmp_path: Path) -> None:
    out = tmp_path / "ipc.json"
    args = ["--preset", "tiny-llama", "--devices", "cpu", "--tokens", "256", "--handoff-tokens", "64"]
    result = CliRunner().invoke(ipc_transfer.main, [*args, "--iters", "3", "--warmup", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    cases = json.loads(out.read_text())["cases"]
    move, handoff, hot = cases["move 256"], cases["handoff 64"], cases["handoff 64 hot"]
    assert move["bytes"] > 0 and handoff["bytes"] > 0
    for key in ("median_ms", "gbps", "copy_median_ms", "pct_of_copy"):
        assert math.isfinite(move[key]) and move[key] > 0, key
    assert len(move["samples_ms"]) == len(handoff["samples_ms"]) == len(hot["samples_ms"]) == 3
    for case in (handoff, hot):
        assert 0 < case["median_ms"] < 1000
        for phase in ("announce_ms", "issue_ms", "copy_ms"):  # each a part of every sample
            assert 0 <= case[phase] <= max(case["samples_ms"]), phase


def test_targets_are_judged_only_where_their_case_ran() -> None:
    checks = ipc_transfer.evaluate({"handoff 1024": {"median_ms": 0.2}})
    assert checks == [{"case": "handoff 1024", "key": "median_ms", "target": "<= 0.3", "value": 0.2, "met": True}]
