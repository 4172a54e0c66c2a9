"""bench.frontend: the router and the client library against its stand-in leader, every token
counted (tests/router/test_streaming.py uses the same stand-in to test the router itself)."""

from __future__ import annotations

import pytest

from pdserve.bench.frontend import main


def test_frontend_benchmark_counts_every_token() -> None:
    result = main(["--streams", "3", "--output-len", "20", "--step-ms", "0,1"])
    assert [(r["streams"], r["step_ms"], r["batch_chunks"]) for r in result["rows"]] == [
        (3, 0.0, False),
        (3, 0.0, True),
        (3, 1.0, False),
        (3, 1.0, True),
    ]
    for row in result["rows"]:
        assert row["delivered_tok_s"] == pytest.approx(3 * 20 / row["wall_s"])
        assert row["itl_p50_ms"] <= row["itl_p99_ms"]
    assert [r["emitted_tok_s"] for r in result["rows"]] == [None, None, pytest.approx(3000), pytest.approx(3000)]
