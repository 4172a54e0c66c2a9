"""The launcher's periodic stats line (``router.stats_log``)."""

from __future__ import annotations

from pdserve.router.stats_log import StatsLog

GROUPS = {
    "prefill0": {"num_blocks": 100, "free_blocks": 75, "running": 1, "waiting": 2},
    "decode0": {"num_blocks": 200, "free_blocks": 40, "running": 7, "waiting": 0},
}


def prefix(queried: int, hit: int) -> dict[str, dict[str, int]]:
    return {**GROUPS, "prefill0": {**GROUPS["prefill0"], "prefix_queried_tokens": queried, "prefix_hit_tokens": hit}}


def test_a_line_gives_the_rates_since_the_last_one_and_each_groups_load() -> None:
    log = StatsLog(10.0, now=0.0)
    tokens = {"prompt": 2000, "generated": 500}
    assert not log.due(9.9) and log.line(9.9, tokens, 3, GROUPS, "prefill") is None  # not yet
    assert log.due(10.0)
    line = log.line(10.0, tokens, 3, GROUPS, "prefill")
    assert line == (
        "prompt 200.0 tok/s, generation 50.0 tok/s | 3 request(s) in flight"
        " | prefill0: 1 running, 2 waiting, KV 25.0% | decode0: 7 running, 0 waiting, KV 80.0%"
    )
    line = log.line(30.0, {"prompt": 2000, "generated": 900}, 1, GROUPS, "prefill")
    assert line is not None and line.startswith("prompt 0.0 tok/s, generation 20.0 tok/s | 1 request(s)")
    line = log.line(40.0, {"prompt": 2000, "generated": 900}, 3, {"prefill0": GROUPS["prefill0"]}, "prefill", 2)
    assert line is not None and "| 3 request(s) in flight (2 waiting for a group to serve them) | prefill0:" in line


def test_an_idle_cluster_stays_quiet_and_zero_turns_the_line_off() -> None:
    log = StatsLog(10.0, now=0.0)
    assert log.line(10.0, {"prompt": 0, "generated": 0}, 0, GROUPS, "prefill") is None
    assert log.line(20.0, {"prompt": 0, "generated": 0}, 1, GROUPS, "prefill") is not None  # one waits
    off = StatsLog(0.0, now=0.0)
    assert off.line(100.0, {"prompt": 10, "generated": 10}, 1, GROUPS, "prefill") is None


def test_the_prefix_cache_hit_rate_is_the_entry_groups_over_the_interval() -> None:
    log = StatsLog(1.0, now=0.0)
    tokens = {"prompt": 1, "generated": 1}
    assert "prefix cache" not in (log.line(1.0, tokens, 1, GROUPS, "prefill") or "")  # nothing looked up
    line = log.line(2.0, tokens, 1, prefix(1000, 600), "prefill")
    assert line is not None and line.endswith(" | prefix cache hit 60% of 1000 prompt tokens")
    line = log.line(3.0, tokens, 1, prefix(1500, 1100), "prefill")  # 500 more, all hits
    assert line is not None and line.endswith(" | prefix cache hit 100% of 500 prompt tokens")
    line = log.line(4.0, tokens, 1, prefix(200, 50), "prefill")  # restarted: counts from zero
    assert line is not None and line.endswith(" | prefix cache hit 25% of 200 prompt tokens")
    decode_only = {"decode0": {**GROUPS["decode0"], "prefix_queried_tokens": 999, "prefix_hit_tokens": 999}}
    assert "prefix cache" not in (log.line(5.0, tokens, 1, decode_only, "prefill") or "")


def test_a_group_that_is_not_ready_is_named_with_its_state() -> None:
    log = StatsLog(1.0, now=0.0)
    tokens = {"prompt": 10, "generated": 10}
    states = {"prefill0": "draining", "prefill1": "down", "decode0": "ready", "decode1": "starting"}
    line = log.line(1.0, tokens, 4, GROUPS, "prefill", 0, states)
    assert line is not None and line.endswith(
        " | prefill0 (draining): 1 running, 2 waiting, KV 25.0% | prefill1: down"
        " | decode0: 7 running, 0 waiting, KV 80.0% | decode1: starting"
    )


def test_a_report_from_before_a_long_step_is_said_to_be_old() -> None:
    """A leader reports between steps: during a long prefill its queues are those before it, and
    a group just restarted has none yet; the line says so instead of showing it idle or blank."""
    log = StatsLog(1.0, now=0.0)
    tokens = {"prompt": 10, "generated": 10}
    states = {"prefill0": "ready", "prefill1": "ready", "decode0": "ready"}
    ages = {"prefill0": 12.4, "decode0": 0.1}
    line = log.line(
        1.0, tokens, 7, {"prefill0": GROUPS["prefill0"], "decode0": GROUPS["decode0"]}, "prefill", 0, states, ages
    )
    assert line is not None and line.endswith(
        " | prefill0: 1 running, 2 waiting, KV 25.0% (12 s ago: in a long step) | prefill1: ready, no report yet"
        " | decode0: 7 running, 0 waiting, KV 80.0%"
    )
