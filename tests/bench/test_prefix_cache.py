"""bench.prefix_cache on the CPU: the second request of each pair is served its shared full blocks
from the cache and answers as an engine without the cache does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench import prefix_cache
from pdserve.bench.step_profile import KernelSpan


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


def test_time_breakdown_adds_up_to_the_request() -> None:
    """Host before, device busy (overlapping kernels counted once), gaps, host after; a kernel
    outside the request's span is not its own."""
    kernels = [
        KernelSpan(*k) for k in [("a", 10.0, 30.0), ("b", 20.0, 40.0), ("a", 50.0, 60.0), ("late", 150.0, 160.0)]
    ]
    result = prefix_cache.time_breakdown((0.0, 100.0), kernels)
    assert result["host_before_ms"] == 0.010
    assert result["device_busy_ms"] == 0.040
    assert result["device_gaps_ms"] == 0.010
    assert result["host_after_ms"] == 0.040
    assert result["wall_ms"] == 0.100
    assert [(k["name"], k["calls"]) for k in result["kernels"]] == [("a", 2), ("b", 1)]


def test_profile_of_a_cached_request_on_the_cpu(tiny_model_dirs: dict[str, Path]) -> None:
    """On a CPU the profile has the wall time and the top CPU ops, and no device phases."""
    document = prefix_cache.main(
        ["--model", str(tiny_model_dirs["tiny-llama"]), "--device", "cpu", "--prompt-len", "64"]
        + ["--cached-len", "48", "--reps", "1", "--warmup", "0", "--profile"]
    )
    profiled = document["result"]["profile"]
    assert profiled["wall_ms"] > 0 and profiled["device_busy_ms"] is None
    assert profiled["cpu_ops"] and all(op["calls"] >= 1 for op in profiled["cpu_ops"])
    assert profiled["graph_replay"] is None


@pytest.mark.gpu
def test_profile_replays_the_cached_requests_graph(tiny_model_dirs: dict[str, Path]) -> None:
    """On a GPU the profile also replays, unprofiled, the graph that ran the cached request's
    step (32 new tokens of one prompt: the 64-token graph for few sequences), whose device time
    is then a share of the request's kernels' span."""
    document = prefix_cache.main(
        ["--model", str(tiny_model_dirs["tiny-llama"]), "--device", "cuda", "--prompt-len", "128"]
        + ["--cached-len", "96", "--reps", "1", "--warmup", "1", "--profile"]
    )
    profiled = document["result"]["profile"]
    replay = profiled["graph_replay"]
    assert replay is not None and replay["bucket"] == [64, 4]
    assert 0 < replay["device_ms"] <= profiled["device_busy_ms"] + profiled["device_gaps_ms"]
    assert replay["launch_ms"] > 0
