"""bench.prefix_cache on the CPU: the second request of each pair is served its shared full blocks
from the cache and answers as an engine without the cache does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench import prefix_cache


@pytest.mark.parametrize(("cached_len", "expected_hits"), [(96, 96), (100, 96)])
def test_cached_pairs_hit_their_shared_blocks(
    tiny_model_dirs: dict[str, Path], tmp_path: Path, cached_len: int, expected_hits: int
) -> None:
    out = tmp_path / "prefix_cache.json"
    document = prefix_cache.main(
        [
            "--model",
            str(tiny_model_dirs["tiny-llama"]),
            "--device",
            "cpu",
            "--prompt-len",
            "128",
            "--cached-len",
            str(cached_len),
            "--reps",
            "2",
            "--warmup",
            "0",
            "--out",
            str(out),
        ]
    )
    result = document["result"]
    assert [r["cached_tokens"] for r in result["reps"]] == [expected_hits] * 2  # whole 16-token blocks only
    assert result["same_first_token"] == 2
    assert json.loads(out.read_text())["result"]["prompt_len"] == 128
