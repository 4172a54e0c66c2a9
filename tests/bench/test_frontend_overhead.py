"""The front-end overhead benchmark: its summary of alternating runs on known numbers, and a short
end-to-end run of ``python -m pdserve.bench.frontend_overhead`` against a real CPU cluster on the
demo model serving both ZMQ and HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.compare import LaunchedCluster
from pdserve.bench.frontend_overhead import backend_order, spread, summarize_runs, summary_table
from pdserve.cluster.group import free_port

REPO = Path(__file__).resolve().parent.parent


def run(
    backend: str, concurrency: int, repeat: int, ttft_p50: float, itl_p50: float, failed: int = 0
) -> dict[str, Any]:
    """A measured run whose p99s are ten times its p50s."""
    metrics = {
        "failed": failed,
        "ttft_ms": {"p50": ttft_p50, "p99": 10 * ttft_p50},
        "itl_ms": {"p50": itl_p50, "p99": 10 * itl_p50},
    }
    return {"backend": backend, "concurrency": concurrency, "repeat": repeat, "metrics": metrics}


def test_backends_alternate_which_goes_first() -> None:
    assert [backend_order(r) for r in range(3)] == [("zmq", "openai"), ("openai", "zmq"), ("zmq", "openai")]


def test_summary_pairs_the_runs_of_one_repetition() -> None:
    runs = [
        # concurrency 1: HTTP adds 1, 3 and -1 ms of TTFT p50 in the three repetitions, 0.1 ms of ITL p50
        run("zmq", 1, 0, 100.0, 50.0),
        run("openai", 1, 0, 101.0, 50.1),
        run("openai", 1, 1, 203.0, 60.1),
        run("zmq", 1, 1, 200.0, 60.0),
        run("zmq", 1, 2, 150.0, 55.0),
        run("openai", 1, 2, 149.0, 55.1),
        # concurrency 8: HTTP adds 5 ms of TTFT p50, and one HTTP request failed
        run("zmq", 8, 0, 300.0, 90.0),
        run("openai", 8, 0, 305.0, 90.0, failed=1),
    ]
    one, eight = summarize_runs(runs, max_ttft_ms=2.0, max_itl_ms=0.2)
    assert one["concurrency"] == 1 and one["repeats"] == 3
    assert one["backends"]["zmq"]["ttft_p50"] == {"median": 150.0, "min": 100.0, "max": 200.0}
    assert one["backends"]["openai"]["ttft_p99"] == {"median": 1490.0, "min": 1010.0, "max": 2030.0}
    # The median of the paired differences (1, 3, -1), not the difference of the medians (-1).
    assert one["openai_minus_zmq"]["ttft_p50"] == pytest.approx({"median": 1.0, "min": -1.0, "max": 3.0})
    assert one["openai_minus_zmq"]["itl_p50"]["median"] == pytest.approx(0.1)
    assert one["failed"] == {"zmq": 0, "openai": 0}
    assert one["ttft_target_met"] and one["itl_target_met"]
    assert summarize_runs(runs[:6], max_ttft_ms=0.5, max_itl_ms=0.05)[0]["ttft_target_met"] is False

    assert eight["repeats"] == 1 and eight["failed"] == {"zmq": 0, "openai": 1}
    assert eight["openai_minus_zmq"]["itl_p50"]["median"] == pytest.approx(0.0)
    assert not eight["ttft_target_met"] and not eight["itl_target_met"]  # 5 ms over, and a failure

    table = summary_table([one, eight]).splitlines()
    assert table[0].split() == ["concurrency", "ms", "ZMQ", "HTTP", "HTTP", "-", "ZMQ"]
    assert table[2].split()[:3] == ["1", "TTFT", "p50"] and "+1.00 [-1.00, +3.00]" in table[2]
    assert len(table) == 2 + 2 * 4
    assert spread([None, None]) == {"median": None, "min": None, "max": None}


@pytest.mark.slow
def test_alternating_and_side_by_side_backends_against_a_cpu_cluster(tmp_path: Path, demo_model_dir: Path) -> None:
    http_port = free_port()
    args = [
        "--model",
        "demo",
        "--prefill-tp",
        "1",
        "--decode-tp",
        "1",
        "--num-blocks",
        "300",
        "--max-model-len",
        "256",
        "--http-port",
        str(http_port),
    ]
    with LaunchedCluster(args, tmp_path / "launch.log", start_timeout=300) as cluster:
        out, paired_out = tmp_path / "overhead.json", tmp_path / "side_by_side.json"
        command = [
            sys.executable,
            "-m",
            "pdserve.bench.frontend_overhead",
            "--endpoint",
            cluster.endpoint,
            "--base-url",
            f"http://127.0.0.1:{http_port}",
            "--model-dir",
            str(demo_model_dir),
            "--concurrencies",
            "1,2",
            "--repeats",
            "2",
            "--num-requests",
            "2",
            "--warmup",
            "1",
            "--input-len",
            "8",
            "--output-len",
            "4",
        ]
        bench = subprocess.run([*command, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stderr[-4000:]
        paired = subprocess.run(
            [*command, "--side-by-side", "--out", str(paired_out)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert paired.returncode == 0, paired.stderr[-4000:]
        assert cluster.stop() == 0, cluster.output()[-4000:]

    results = json.loads(out.read_text())
    order = [(r["repeat"], r["concurrency"], r["backend"]) for r in results["runs"]]
    assert order == [
        (0, 1, "zmq"),
        (0, 1, "openai"),
        (0, 2, "zmq"),
        (0, 2, "openai"),
        (1, 1, "openai"),
        (1, 1, "zmq"),
        (1, 2, "openai"),
        (1, 2, "zmq"),
    ]
    for r in results["runs"]:
        m = r["metrics"]
        # Both backends saw every token of every request: 2 requests of 4 tokens, 3 gaps each.
        assert (m["completed"], m["failed"], m["output_tokens"]) == (2, 0, 8)
        assert m["ttft_ms"]["p50"] > 0 and m["itl_ms"]["p50"] > 0
    assert [s["concurrency"] for s in results["summary"]] == [1, 2]
    for s in results["summary"]:
        assert s["repeats"] == 2 and s["failed"] == {"zmq": 0, "openai": 0}
        diff = s["openai_minus_zmq"]["ttft_p50"]
        assert diff["min"] <= diff["median"] <= diff["max"]
    assert "concurrency 1: TTFT target" in bench.stdout

    # Side by side: the same runs, both backends at once, and every request through each complete.
    side_by_side = json.loads(paired_out.read_text())
    assert side_by_side["config"]["side_by_side"] is True
    assert sorted((r["repeat"], r["concurrency"], r["backend"]) for r in side_by_side["runs"]) == sorted(order)
    assert all(r["metrics"]["completed"] == 2 and r["metrics"]["failed"] == 0 for r in side_by_side["runs"])
    assert "the backends side by side" in paired.stdout
