"""bench.step_inputs: one row per batch size, in the JSON it writes."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench.step_inputs import main


def test_step_inputs_rows(tmp_path: Path) -> None:
    out = tmp_path / "inputs.json"
    result = main(["--batch-sizes", "2,4", "--context", "64", "--iters", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [r["batch"] for r in result["rows"]] == [2, 4] and result["rows"][1]["table_entries"] == 16
    assert all(r[key] > 0 for r in result["rows"] for key in r if key.endswith("_us"))
