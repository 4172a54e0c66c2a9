"""The serving benchmark: metrics on synthetic timelines with known answers, workloads, and a
short end-to-end run of ``python -m pdserve.bench.serve`` against a real CPU cluster on the demo model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from pdserve.bench.common import to_json
from pdserve.bench.compare import LaunchedCluster, required_model_len, system_args, write_report
from pdserve.bench.metrics import (
    RequestRecord,
    compute_metrics,
    e2e,
    itls,
    mean_transfer_bytes,
    meets_slo,
    percentile,
    prefix_hit_rate,
    summarize,
    tpot,
    ttft,
)
from pdserve.bench.serve import (
    DEFAULT_VOCAB_SIZE,
    BenchConfig,
    OpenAIBackend,
    RequestSpec,
    arrival_times,
    build_requests,
    kinds_table,
    point_requests,
    point_result,
    results_table,
    run_requests,
    vllm_keys,
    vocab_size_of,
    workload_requests,
    write_plots,
)
from pdserve.bench.serve import main as serve_main
from pdserve.cluster.group import free_port
from pdserve.cluster.protocol import Chunk, Final

REPO = Path(__file__).resolve().parents[2]


def record(sent: float, chunks: list[tuple[float, int]], finished: float, **kwargs: object) -> RequestRecord:
    """A completed request: ``chunks`` are (arrival time, tokens)."""
    return RequestRecord(
        request_id=f"r{sent}",
        kind="random",
        max_tokens=sum(n for _, n in chunks),
        scheduled=sent,
        sent=sent,
        chunk_times=[t for t, _ in chunks],
        chunk_tokens=[n for _, n in chunks],
        finished=finished,
        finish_reason="length",
        output_tokens=sum(n for _, n in chunks),
        **kwargs,  # type: ignore[arg-type]
    )


def test_results_json_keeps_plain_lists_on_one_line() -> None:
    """What json.dumps(indent=2) would read back, with the per-token times on one line."""
    doc = {
        "points": [
            {"rate": 4.0, "records": [{"chunk_times": [0.1, 0.25], "error": None, "tags": ["a", "[b]"]}], "by_kind": {}}
        ],
        "warmup": [],
        "nested": [[1, 2], []],
        3: True,
        None: "x",
        "nan": float("nan"),
    }
    text = to_json(doc)
    assert text == to_json(json.loads(text)) and json.dumps(json.loads(text)) == json.dumps(json.loads(json.dumps(doc)))
    assert '"chunk_times": [0.1, 0.25],' in text and '"tags": ["a", "[b]"]' in text
    assert '\n      "records": [\n        {\n' in text  # containers still one item a line, indented


def test_percentile_interpolates_linearly_between_order_statistics() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile(list(range(11)), 90) == pytest.approx(9.0)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert percentile([7.0], 99) == 7.0
    stats = summarize([0.001, 0.002, 0.003, 0.010])  # seconds in, ms out
    assert stats == pytest.approx({"mean": 4.0, "p50": 2.5, "p90": 7.9, "p99": 9.79, "max": 10.0})
    assert summarize([]) == dict.fromkeys(("mean", "p50", "p90", "p99", "max"))


def test_ttft_tpot_e2e_and_itl_from_chunk_timestamps() -> None:
    # Sent at 1.0; first token at 1.5; one at 1.6; two together at 2.0; one at 2.05; final at 2.1.
    r = record(1.0, [(1.5, 1), (1.6, 1), (2.0, 2), (2.05, 1)], finished=2.1)
    assert ttft(r) == pytest.approx(0.5)
    assert e2e(r) == pytest.approx(1.1)
    assert tpot(r) == pytest.approx((1.1 - 0.5) / 4)
    # The 0.4 s gap before the two-token chunk counts as two tokens of 0.2 s each.
    assert itls(r) == pytest.approx([0.1, 0.2, 0.2, 0.05])
    assert len(itls(r)) == r.output_tokens - 1

    single = record(0.0, [(0.3, 1)], finished=0.31)
    assert tpot(single) is None and itls(single) == []
    assert meets_slo(single, slo_ttft_ms=400, slo_tpot_ms=1)  # no TPOT: only the TTFT SLO applies
    assert not meets_slo(single, slo_ttft_ms=200, slo_tpot_ms=None)


def test_compute_metrics_throughput_and_goodput_counting() -> None:
    records = [
        record(0.0, [(0.1, 1), (0.15, 1), (0.2, 1)], finished=0.2, timings={"transfer": 0.004}),  # TTFT 100, TPOT 50
        record(0.5, [(0.9, 1), (0.95, 1), (1.0, 1)], finished=1.0, timings={"transfer": 0.006}),  # TTFT 400: misses
        record(1.0, [(1.1, 1), (1.3, 1), (1.5, 1)], finished=1.5),  # TPOT 200: misses the TPOT SLO
        record(1.5, [(1.6, 1), (1.62, 1), (1.64, 1)], finished=2.0),  # TTFT 100, TPOT 200 (final late): misses
        record(2.0, [(2.1, 1)], finished=2.1),  # one token: TTFT 100, meets both
        RequestRecord("failed", "random", 3, 2.5, 2.5, finished=2.6, error="invalid_request: too long"),
        record(-5.0, [(-4.0, 1)], finished=9.0, warmup=True),  # ignored entirely
    ]
    m = compute_metrics(records, slo_ttft_ms=300, slo_tpot_ms=100)
    assert (m["num_requests"], m["completed"], m["failed"]) == (6, 5, 1)
    assert m["duration_s"] == pytest.approx(2.6)  # first send (0.0) -> last terminal message (2.6)
    assert m["output_tokens"] == 13
    assert m["request_throughput"] == pytest.approx(5 / 2.6)
    assert m["output_throughput"] == pytest.approx(13 / 2.6)
    assert m["goodput"] == pytest.approx(2 / 2.6)  # the first and the one-token request
    assert m["slo_attainment"] == pytest.approx(2 / 6)  # the failed request counts against it
    assert m["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert m["ttft_ms"]["max"] == pytest.approx(400.0)
    assert m["tpot_ms"]["mean"] == pytest.approx((50 + 50 + 200 + 200) / 4)
    assert m["itl_ms"]["max"] == pytest.approx(200.0)
    assert m["e2e_ms"]["max"] == pytest.approx(500.0)
    assert m["transfer_ms"]["mean"] == pytest.approx(5.0)

    no_slo = compute_metrics(records)
    assert no_slo["goodput"] is None and no_slo["slo_attainment"] is None
    only_ttft = compute_metrics(records, slo_ttft_ms=300)
    assert only_ttft["goodput"] == pytest.approx(4 / 2.6)


def test_vllm_flat_keys_on_known_timelines() -> None:
    records = [
        record(0.0, [(0.1, 1), (0.15, 1), (0.2, 1)], finished=0.2, prompt_tokens=10),  # TTFT 100, ITL 50 50
        record(0.5, [(0.9, 1), (1.0, 2)], finished=1.0, prompt_tokens=20),  # TTFT 400, ITL 50 50
        RequestRecord("failed", "random", 3, 1.0, 1.0, finished=1.25, error="invalid_request: too long"),
        record(-5.0, [(-4.0, 1)], finished=9.0, warmup=True),  # ignored entirely
    ]
    keys = vllm_keys(4.0, BenchConfig(concurrency=8, slo_ttft_ms=200), records)
    assert (keys["num_prompts"], keys["completed"], keys["failed"]) == (3, 2, 1)
    assert (keys["request_rate"], keys["max_concurrency"]) == (4.0, 8)
    assert keys["duration"] == pytest.approx(1.25)
    assert (keys["total_input_tokens"], keys["total_output_tokens"]) == (30, 6)
    assert keys["request_throughput"] == pytest.approx(2 / 1.25)
    assert keys["output_throughput"] == pytest.approx(6 / 1.25)
    assert keys["total_token_throughput"] == pytest.approx(36 / 1.25)
    assert keys["request_goodput"] == pytest.approx(1 / 1.25)  # only the first meets TTFT <= 200 ms
    assert keys["mean_ttft_ms"] == pytest.approx(250.0) and keys["median_ttft_ms"] == pytest.approx(250.0)
    assert keys["std_ttft_ms"] == pytest.approx(150.0)  # population std, as numpy's
    assert keys["p99_ttft_ms"] == pytest.approx(100 + 300 * 0.99)
    assert keys["mean_itl_ms"] == pytest.approx(50.0) and keys["std_itl_ms"] == pytest.approx(0.0)
    assert keys["mean_tpot_ms"] == pytest.approx(50.0)
    assert keys["p90_e2el_ms"] == pytest.approx(200 + 300 * 0.9)
    empty = vllm_keys(None, BenchConfig(), [records[2]])
    assert empty["request_rate"] == "inf" and empty["mean_ttft_ms"] is None and empty["request_goodput"] is None


def test_workloads_lengths_vocabulary_and_arrivals() -> None:
    config = BenchConfig(workload="random", input_len=40, output_len=10, len_dist="uniform", vocab_size=100, seed=3)
    specs = build_requests(config, 200)
    assert specs == build_requests(config, 200)  # same seed, same requests
    assert all(20 <= len(s.token_ids or []) <= 60 and 5 <= s.max_tokens <= 15 for s in specs)
    assert all(0 <= t < 100 for s in specs for t in s.token_ids or [])
    assert all(s.ignore_eos for s in specs)

    lognormal = build_requests(BenchConfig(input_len=40, len_dist="lognormal", num_requests=1), 2000)
    lengths = [len(s.token_ids or []) for s in lognormal]
    assert max(lengths) <= 160 and 34 < statistics.mean(lengths) < 44

    mixed = build_requests(
        BenchConfig(
            workload="mixed", input_len=8, output_len=4, long_fraction=0.25, long_len=(100, 200), max_model_len=150
        ),
        40,
    )
    long = [s for s in mixed if s.kind == "long"]
    assert len(long) == 10 and all(len(s.token_ids or []) + s.max_tokens <= 150 for s in long)
    assert all(len(s.token_ids or []) == 8 for s in mixed if s.kind == "short")

    shared = build_requests(BenchConfig(workload="shared-prefix", num_prefixes=3, prefix_len=16, input_len=4), 30)
    prefixes = {tuple((s.token_ids or [])[:16]) for s in shared}
    assert len(prefixes) == 3 and all(len(s.token_ids or []) == 20 for s in shared)

    text = build_requests(BenchConfig(workload="text", output_len=16), 45)
    lines = (REPO / "bench" / "prompts.txt").read_text().splitlines()
    assert len(lines) >= 40 and all(s.prompt in lines and not s.ignore_eos for s in text)
    assert len({s.prompt for s in text}) == len(set(lines))  # 45 requests cover every prompt

    assert arrival_times(3, None, 0) == [0.0, 0.0, 0.0]
    slow, fast = arrival_times(2000, 2.0, 1), arrival_times(2000, 8.0, 1)
    assert slow[0] == 0.0 and fast == pytest.approx([t / 4 for t in slow])  # one pattern, scaled
    assert statistics.mean(b - a for a, b in zip(slow, slow[1:])) == pytest.approx(0.5, rel=0.1)

    assert required_model_len([RequestSpec("x", 10, token_ids=[1] * 300)], 8192) == 512
    assert required_model_len([RequestSpec("x", 10, token_ids=[1] * 300)], 400) == 400


def test_each_rate_of_a_sweep_gets_requests_of_its_own() -> None:
    """A later rate replaying the first rate's prompts would find them in the prefix cache."""
    config = BenchConfig(workload="shared-prefix", num_prefixes=2, prefix_len=16, input_len=4, num_requests=10)
    _, measured = workload_requests(config)
    first, second = point_requests(config, measured, 0), point_requests(config, measured, 1)
    assert first is measured and len(second) == len(first) and second == point_requests(config, measured, 1)

    def prefixes(specs: list[RequestSpec]) -> set[tuple[int, ...]]:
        return {tuple(s.token_ids or [])[:16] for s in specs}

    assert len(prefixes(second)) == 2 and not prefixes(first) & prefixes(second)
    mixed = BenchConfig(workload="mixed", num_requests=50, long_fraction=0.2, long_len=(300, 400))
    _, measured = workload_requests(mixed)
    later = point_requests(mixed, measured, 2)
    assert [s.kind for s in later].count("long") == [s.kind for s in measured].count("long") == 10
    assert {tuple(s.token_ids or []) for s in later}.isdisjoint(tuple(s.token_ids or []) for s in measured)


def test_the_next_seed_replays_nothing_the_last_run_sent() -> None:
    """--seed 1 after --seed 0 (or --seed 1000 after a sweep) must find nothing the earlier run's
    warm-up or later rates left in the prefix cache: they drew from seed + 1 and seed + 1000 once."""
    config = BenchConfig(workload="shared-prefix", num_prefixes=2, prefix_len=16, input_len=4, num_requests=4)

    def prompts(specs: list[RequestSpec]) -> set[tuple[int, ...]]:
        return {tuple(s.token_ids or [])[:16] for s in specs}

    warmup, measured = workload_requests(config)
    later_rate = point_requests(config, measured, 1)
    for seed in (1, 1000):
        _, next_run = workload_requests(dataclasses.replace(config, seed=seed))
        assert prompts(next_run).isdisjoint(prompts(warmup) | prompts(later_rate)), seed


def test_a_bad_option_is_named_as_typed() -> None:
    for fields, option in [
        ({"timeout": 0.0}, "--timeout must be > 0"),
        ({"slo_ttft_ms": -5.0}, "--slo-ttft-ms must be > 0"),
        ({"vocab_size": 0}, "--vocab-size must be >= 1"),
        ({"rates": (0.0,)}, "--rate/--rates must be positive"),
        ({"long_len": (9, 3)}, "--long-len must be LOW-HIGH"),
        ({"max_model_len": 100, "output_len": 128}, "--max-model-len 100 leaves no room"),
    ]:
        with pytest.raises(ValueError, match=option):
            BenchConfig(**fields)  # type: ignore[arg-type]
    result = CliRunner().invoke(serve_main, ["--vocab-size", "0"])
    assert result.exit_code == 2 and "--vocab-size must be >= 1" in result.output, result.output
    result = CliRunner().invoke(serve_main, ["--goodput", "ttft:100"])  # vllm bench serve's, by habit
    assert result.exit_code == 2 and "is --slo-ttft-ms MS --slo-tpot-ms MS here" in result.output, result.output
    assert "Did you mean" not in result.output


def test_token_ids_are_drawn_from_the_clusters_vocabulary_by_default(tmp_path: Path) -> None:
    """Without --vocab-size or --model-dir the cluster's stats name its vocabulary: a small model's
    requests used to draw ids past it and every one failed."""
    from pdserve.tests.router.helpers import RouterRig, router_rig

    with router_rig(tmp_path, {}, RouterRig) as rig:
        pump = threading.Thread(target=rig.pump, args=(3.0,))
        pump.start()
        try:
            assert vocab_size_of(None, rig.router.addresses.client) == 1000
        finally:
            pump.join()
    assert vocab_size_of(None) == DEFAULT_VOCAB_SIZE


def test_openai_backend_reads_what_the_prefix_cache_served_from_the_usage() -> None:
    rec = RequestRecord("r", "random", 4, 0.0, 0.0)
    usage = {"prompt_tokens": 40, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 32}}
    OpenAIBackend._on_event({"choices": [], "usage": usage}, rec, 1.0)
    assert (rec.prompt_tokens, rec.output_tokens, rec.timings) == (40, 4, {"cached_tokens": 32.0})
    assert prefix_hit_rate([rec]) == pytest.approx(0.8)


def test_prefix_hit_rate_weighs_requests_by_prompt_tokens() -> None:
    records = [
        record(0.0, [(0.1, 1)], finished=0.1, prompt_tokens=100, timings={"cached_tokens": 96.0}),
        record(0.0, [(0.1, 1)], finished=0.1, prompt_tokens=300, timings={"cached_tokens": 0.0}),
        record(0.0, [(0.1, 1)], finished=0.1, prompt_tokens=50),  # the cache did not report: left out
    ]
    assert prefix_hit_rate(records) == pytest.approx(96 / 400)
    assert compute_metrics(records)["prefix_hit_rate"] == pytest.approx(96 / 400)
    assert prefix_hit_rate(records[2:]) is None


def test_decode_hit_rate_and_kv_bytes_per_request_reach_the_tables() -> None:
    """A chat's first turn moves its whole KV; a later one only what the decode group lacked:
    the mean bytes, and the decode cache's share of the prompt tokens, per kind and overall."""
    first = record(0.0, [(0.1, 1)], finished=0.2, prompt_tokens=64, timings={"transfer_bytes": 4096.0})
    later = {"transfer_bytes": 1024.0, "decode_cached_tokens": 96.0, "cached_tokens": 0.0}
    second = record(0.0, [(0.1, 1)], finished=0.2, prompt_tokens=128, timings=later)
    first.kind, second.kind = "first turn", "later turn"
    first.output_tokens = second.output_tokens = 1
    first.finish_reason = second.finish_reason = "length"
    assert mean_transfer_bytes([first, second]) == 2560.0 and mean_transfer_bytes([]) is None
    assert prefix_hit_rate([first, second], "decode_cached_tokens") == pytest.approx(96 / 128)
    point = point_result(None, BenchConfig(), [first, second])
    m = point["metrics"]
    assert m["transfer_bytes"] == 2560.0 and m["decode_prefix_hit_rate"] == pytest.approx(0.75)
    assert point["by_kind"]["later turn"]["transfer_bytes"] == 1024.0
    header, _, row = results_table([point]).splitlines()
    assert header.endswith("xfer KiB  hit %  dec hit %")
    assert row.split()[-3:] == ["2.5", "0.0", "75.0"]  # xfer KiB, hit %, dec hit %
    by_kind = kinds_table([point])
    assert by_kind is not None
    rows = by_kind.splitlines()[2:]
    assert [r.split()[1:3] for r in rows] == [["first", "turn"], ["later", "turn"]]
    assert rows[0].split()[-3:] == ["4.0", "-", "-"] and rows[1].split()[-3:] == ["1.0", "0.0", "75.0"]
    assert kinds_table([point_result(None, BenchConfig(), [first])]) is None


def test_each_kinds_rates_add_up_to_the_runs() -> None:
    """A kind's requests span less time than the run: their rates are over the run's time, so
    the rows of the per-kind table add up to the total (goodput too)."""
    short = [record(float(i), [(i + 0.1, 2)], finished=i + 0.2) for i in range(4)]  # 0 s to 3.2 s
    long = [record(0.5, [(1.0, 2)], finished=1.5)]
    long[0].kind = "long"
    point = point_result(2.0, BenchConfig(slo_ttft_ms=1000.0), short + long)
    total, kinds = point["metrics"], point["by_kind"]
    assert total["duration_s"] == pytest.approx(3.2)
    for key in ("request_throughput", "output_throughput", "goodput"):
        assert kinds["random"][key] + kinds["long"][key] == pytest.approx(total[key]), key
    assert kinds["long"]["request_throughput"] == pytest.approx(1 / 3.2)


class EchoCluster:
    """Stands in for ``AsyncClient``: answers a prompt of n tokens with ``max_tokens`` tokens
    from n on, and keeps each request's prompt."""

    def __init__(self) -> None:
        self.prompts: dict[str, list[int]] = {}

    @staticmethod
    def answer(prompt: list[int], max_tokens: int) -> list[int]:
        return [len(prompt) + i for i in range(max_tokens)]

    async def stream(self, prompt: None, *, token_ids: list[int], request_id: str, max_tokens: int, **_: object):
        self.prompts[request_id] = list(token_ids)
        answer = self.answer(token_ids, max_tokens)
        await asyncio.sleep(0.01)
        yield Chunk(request_id, answer, "")
        yield Final(request_id, "length", answer, "", {"prompt_tokens": len(token_ids)}, {})


def test_multi_turn_sessions_carry_their_history() -> None:
    config = BenchConfig(workload="multi-turn", num_turns=3, prefix_len=20, input_len=5, output_len=4, warmup=2)
    specs = build_requests(config, 12)  # 4 sessions of 3 turns, interleaved
    assert [s.session for s in specs] == [0, 1, 2, 3] * 3
    assert [len(s.token_ids or []) for s in specs] == [20] * 4 + [5] * 8
    assert [s.kind for s in specs] == ["first turn"] * 4 + ["later turn"] * 8
    warmup, measured = workload_requests(dataclasses.replace(config, num_requests=12))
    assert len(warmup) == 2 and measured == specs and warmup[0].token_ids != specs[0].token_ids

    cluster = EchoCluster()
    records = asyncio.run(run_requests(cluster, specs, None, None, 0, "t", max_model_len=40))  # type: ignore[arg-type]
    assert all(r.ok for r in records)
    last: dict[int, tuple[list[int], float]] = {}  # session -> its last turn's prompt and end
    for spec, rec in zip(specs, records):
        prompt = cluster.prompts[rec.request_id]
        assert rec.prompt_len == len(prompt)
        assert spec.session is not None
        if spec.session in last:
            before, finished = last[spec.session]
            history = before + EchoCluster.answer(before, spec.max_tokens)
            new = spec.token_ids or []
            # Cut to fit 40: the history's end goes, the turn's own tokens stay (cutting the end
            # of the whole prompt sent the previous prompt again once a session reached the limit).
            assert prompt == history[: 40 - spec.max_tokens - len(new)] + new
            assert prompt != before
            assert rec.sent >= finished  # a turn waits for the one before
        else:
            assert prompt == spec.token_ids
        last[spec.session] = (prompt, rec.finished or 0.0)
    assert max(len(p) for p in cluster.prompts.values()) == 36  # the third turns were cut


def test_a_multi_turn_session_at_the_length_limit_still_sends_each_turns_question() -> None:
    """Past the limit every turn keeps its own new tokens: it used to resend the previous prompt
    (the new tokens cut off), and the cache served the repeat."""
    config = BenchConfig(workload="multi-turn", num_turns=4, prefix_len=20, input_len=5, output_len=4)
    specs = build_requests(config, 4)  # one session
    cluster = EchoCluster()
    records = asyncio.run(run_requests(cluster, specs, None, None, 0, "t", max_model_len=30))  # type: ignore[arg-type]
    prompts = [cluster.prompts[r.request_id] for r in records]
    assert [len(p) for p in prompts] == [20, 26, 26, 26]
    assert all(p[-5:] == s.token_ids for p, s in zip(prompts[1:], specs[1:]))
    assert len({tuple(p) for p in prompts}) == 4


def test_plots_are_skipped_with_a_warning_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert write_plots({"run": []}, tmp_path) == []


@pytest.mark.parametrize("backend", ["zmq", "openai"])
def test_a_run_that_reaches_no_server_says_so_at_once(backend: str) -> None:
    """It waited the reply timeout (600 s by default) for each request, or printed aiohttp's
    traceback; the CLI client says so within seconds, and so does the benchmark now."""
    port = str(free_port())
    target = ["--endpoint", port] if backend == "zmq" else ["--base-url", f"http://127.0.0.1:{port}"]
    started = time.monotonic()
    result = CliRunner().invoke(serve_main, ["--backend", backend, *target, "--rate", "1", "--num-requests", "1"])
    assert result.exit_code == 1 and time.monotonic() - started < 60, result.output
    assert result.output.startswith("Error: no") and "Traceback" not in result.output, result.output
    for bad, why in (
        (["--endpoint", "foo"], "'--endpoint': expected tcp://HOST:PORT, HOST:PORT or PORT"),
        (["--endpoint", "/v1/chat/completions"], "the cluster's ZMQ endpoint, not an HTTP URL or route"),
        (["--rate", "abc"], "--rate/--rates abc: give requests a second"),
    ):
        usage = CliRunner().invoke(serve_main, bad)
        assert usage.exit_code == 2 and why in usage.output, usage.output


def test_the_openai_backend_without_aiohttp_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """aiohttp comes with the bench extra, not the plain install: a one-line answer, not a traceback."""
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    with pytest.raises(click.ClickException, match=r"pip install -e '\.\[bench\]'"):
        OpenAIBackend("http://127.0.0.1:8000", None, 1.0)


@pytest.mark.slow
def stopped_during_second_rate(endpoint: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """bench.serve on a sweep of two rates, sent SIGINT (Ctrl-C) once the second one's progress
    shows (its five requests take seconds at 0.5 req/s)."""
    stderr = tmp_path / "stopped.err"
    command = [sys.executable, "-m", "pdserve.bench.serve", "--endpoint", endpoint, "--input-len", "8"]
    command += ["--output-len", "2", "--num-requests", "5", "--warmup", "0", "--rates", "8,0.5"]
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [*command, "--out", str(tmp_path / "stopped.json")], cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True
        )
        deadline = time.monotonic() + 120
        while "rate 0.5" not in stderr.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, stderr.read_text()[-4000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr.read_text())


def test_load_generator_against_a_cpu_cluster(tmp_path: Path, demo_model_dir: Path) -> None:
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
        "1024",
    ]
    with LaunchedCluster(args, tmp_path / "launch.log", start_timeout=300) as cluster:
        out = tmp_path / "run.json"
        bench = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve.bench.serve",
                "--endpoint",
                cluster.endpoint,
                "--workload",
                "random",
                "--input-len",
                "24",
                "--output-len",
                "6",
                "--len-dist",
                "uniform",
                "--num-requests",
                "5",
                "--warmup",
                "1",
                "--rates",
                "8,inf",
                "--model-dir",
                str(demo_model_dir),
                "--slo-ttft-ms",
                "20000",
                "--slo-tpot-ms",
                "5000",
                "--out",
                str(out),
                "--plot-dir",
                str(tmp_path / "plots"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert bench.returncode == 0, bench.stderr[-4000:]
        text = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve.bench.serve",
                "--endpoint",
                cluster.endpoint,
                "--workload",
                "text",
                "--output-len",
                "8",
                "--num-requests",
                "3",
                "--warmup",
                "0",
                "--concurrency",
                "2",
                "--out",
                str(tmp_path / "text.json"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert text.returncode == 0, text.stderr[-4000:]
        # Prompts past the cluster's max_model_len: every request refused, which a script must see.
        refused = subprocess.run(
            [sys.executable, "-m", "pdserve.bench.serve", "--endpoint", cluster.endpoint, "--input-len", "2000"]
            + ["--len-dist", "fixed", "--output-len", "4", "--num-requests", "2", "--warmup", "1"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert refused.returncode == 1 and "every request failed" in refused.stderr, refused.stderr[-4000:]
        assert "warning: warm-up: 1 of 1 requests failed" in refused.stderr, refused.stderr[-4000:]
        stopped = stopped_during_second_rate(cluster.endpoint, tmp_path)
        assert cluster.stop() == 0, cluster.output()[-4000:]
    # Ctrl-C in a sweep's second rate: the first is still reported and written, and the run
    # exits as an interrupted command does.
    assert stopped.returncode == 130, stopped.stderr[-4000:]
    assert "stopped: 1 of 2 rates finished" in stopped.stderr, stopped.stderr[-4000:]
    assert [line.split()[0] for line in stopped.stdout.splitlines()[3:-1]] == ["8"], stopped.stdout  # then "wrote"
    partial = json.loads((tmp_path / "stopped.json").read_text())
    assert partial["meta"]["complete"] is False and [p["rate"] for p in partial["points"]] == [8.0]

    table = bench.stdout.splitlines()
    assert table[1].split()[:5] == ["rate", "failed", "req/s", "out", "tok/s"]
    assert [line.split()[:2] for line in table[3:5]] == [["8", "0"], ["inf", "0"]]
    results = json.loads(out.read_text())
    assert results["config"]["rates"] == [8.0, None] and results["config"]["vocab_size"] == 49152
    assert len(results["warmup"]) == 1 and results["warmup"][0]["warmup"]
    for point in results["points"]:
        m = point["metrics"]
        assert (m["completed"], m["failed"]) == (5, 0)
        assert m["goodput"] == pytest.approx(m["request_throughput"])  # generous SLOs: every request meets them
        assert m["transfer_ms"]["mean"] > 0  # disaggregated: every request moved its KV
        # Each rate sends prompts of its own: the second finds nothing of the first's cached.
        assert m["prefix_hit_rate"] == 0.0
        for r in point["records"]:
            assert r["finish_reason"] == "length" and r["output_tokens"] == r["max_tokens"]  # ignore_eos
            assert sum(r["chunk_tokens"]) == r["output_tokens"] and r["prompt_tokens"] == r["prompt_len"]
            times = [r["sent"], *r["chunk_times"], r["finished"]]
            assert times == sorted(times)
            assert {"queue", "prefill", "transfer", "decode", "first_token", "total"} <= set(r["timings"])
    text_records = json.loads((tmp_path / "text.json").read_text())["points"][0]["records"]
    assert all(r["error"] is None and r["prompt_len"] is None and r["prompt_tokens"] > 10 for r in text_records)

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in bench.stderr
    else:
        assert {p.name for p in (tmp_path / "plots").iterdir()} == {
            "itl_cdf.png",
            "latency_vs_rate.png",
            "goodput_vs_rate.png",
        }

    # The comparison report over these results, as if from two systems.
    setup = compare_setup(["disagg", "colocated-chunked"])
    report = write_report(tmp_path, {"disagg": results, "colocated-chunked": results}, setup, plots=[])
    rows = [line for line in report.read_text().splitlines() if line.startswith("| 8 ") or line.startswith("| inf ")]
    assert [row.split(" | ")[1] for row in rows] == ["disagg", "colocated-chunked"] * 2


def test_compared_systems_get_the_same_devices() -> None:
    """2p1d against colocated: the disaggregated groups' three ranks become three colocated groups;
    1p1d sharing one GPU (with an SM split) against one colocated group on it."""
    systems = system_args(devices=3, prefill_tp=2, decode_tp=1)
    disagg = systems["disagg"]
    assert disagg[disagg.index("--prefill-tp") + 1] == "2" and disagg[disagg.index("--decode-tp") + 1] == "1"
    assert disagg[disagg.index("--transfer") + 1] == "auto"
    for name in ("colocated-chunked", "colocated-no-chunk"):
        args = systems[name]
        assert args[args.index("--colocated-groups") + 1] == "3" and args[args.index("--colocated-tp") + 1] == "1"
    assert "--no-enable-chunked-prefill" in systems["colocated-no-chunk"]
    shared = system_args(devices=1, transfer="cuda-ipc", sm_args=("--prefill-sm-percent", "60"))
    assert shared["disagg"][-3:] == ["cuda-ipc", "--prefill-sm-percent", "60"]
    args = shared["colocated-chunked"]
    assert args[args.index("--colocated-groups") + 1] == "1"


@pytest.mark.slow
def test_cluster_check_2p1d_on_cpu(tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> None:
    """The headline topology through bench.cluster_check (as the three-GPU check runs it): fp32
    on CPU, every output identical to the single-process engine, no divergence recorded."""
    out = tmp_path / "check.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.bench.cluster_check",
            "--model",
            str(tiny_model_dirs["tiny-qwen2"]),
            "--devices",
            "",
            "--prefill-tp",
            "2",
            "--num-requests",
            "6",
            "--max-tokens",
            "6",
            "--max-model-len",
            "256",
            "--topologies",
            "disagg-gloo",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())["results"]["disagg-gloo"]
    assert result["exit_code"] == 0 and result["exact"] == 1.0
    assert result["divergences"] == [] and result["divergences_not_near_ties"] == []


def test_compare_model_length_fits_a_multi_turn_sessions_last_turn() -> None:
    """bench.compare sizes --max-model-len from the specs; a later turn's prompt is the session's
    history (earlier prompts and answers) plus its new tokens, not just the new tokens."""
    config = BenchConfig(workload="multi-turn", prefix_len=1024, input_len=128, output_len=128, num_turns=4)
    specs = build_requests(config, 8)  # 2 sessions of 4 turns
    last_turn = 1024 + 3 * (128 + 128) + 128  # first prompt, 3 x (answer + new tokens), its output
    assert required_model_len(specs, 32768) >= last_turn


def compare_launches(monkeypatch: pytest.MonkeyPatch, demo_model_dir: Path, argv: list[str]) -> list[list[str]]:
    """Run bench.compare's command line on the demo model with no cluster started: the launch.py
    arguments of the first system it tried to start."""
    from click.testing import CliRunner

    from pdserve.bench import compare

    launched: list[list[str]] = []

    class NoCluster:
        def __init__(self, args: list[str], *rest: object) -> None:
            launched.append(args)
            raise compare.LaunchError("not started")

    monkeypatch.setattr(compare, "LaunchedCluster", NoCluster)
    monkeypatch.setattr(compare, "resolve_model", lambda model: demo_model_dir)
    CliRunner().invoke(compare.main, argv)
    return launched


def test_compare_model_length_fits_every_rate_of_the_sweep(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_model_dir: Path
) -> None:
    """Each rate draws requests of its own (point_requests); the cluster's max model length must
    fit all of them, or a later rate's long prompts are silently cut to it."""
    argv = ["--workload", "mixed", "--input-len", "16", "--output-len", "16", "--long-len", "100-1000"]
    argv += ["--long-fraction", "0.5", "--num-requests", "6", "--warmup", "0", "--rates", "1,2,4,8", "--seed", "2"]
    launched = compare_launches(monkeypatch, demo_model_dir, [*argv, "--systems", "disagg", "--out-dir", str(tmp_path)])
    max_model_len = int(launched[0][launched[0].index("--max-model-len") + 1])
    vocab = json.loads((demo_model_dir / "config.json").read_text())["vocab_size"]
    config = BenchConfig(
        workload="mixed",
        input_len=16,
        output_len=16,
        long_len=(100, 1000),
        long_fraction=0.5,
        num_requests=6,
        warmup=0,
        rates=(1, 2, 4, 8),
        vocab_size=vocab,
        seed=2,
    )
    _, measured = workload_requests(config)
    longest = max(len(s.token_ids or []) + s.max_tokens for i in range(4) for s in point_requests(config, measured, i))
    assert longest <= max_model_len


@pytest.mark.parametrize("system", ["disagg", "colocated-chunked"])
def test_compare_passes_launch_args_to_every_system(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_model_dir: Path, system: str
) -> None:
    argv = ["--num-requests", "2", "--warmup", "0", "--rate", "1", "--out-dir", str(tmp_path), "--systems", system]
    argv += ["--launch-args", "--leader-spin-ms 0  --migration-limit '2'"]
    (args,) = compare_launches(monkeypatch, demo_model_dir, argv)
    assert ("colocated" in args) == (system == "colocated-chunked")
    at = args.index("--leader-spin-ms")
    assert args[at : at + 4] == ["--leader-spin-ms", "0", "--migration-limit", "2"]


@pytest.mark.parametrize(
    ("launch_args", "message"),
    [
        ("--mode colocated", "--mode is bench.compare's to set: the system (--systems) does"),
        ("--leader-spin-ms 0 --prefill-tp=2", "--prefill-tp is bench.compare's to set: its --prefill-tp does"),
        ("--port 5000", "a free port it picks"),
        ("--leader-spin-ms '0", "No closing quotation"),
    ],
)
def test_compare_refuses_launch_args_it_sets_itself(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_model_dir: Path, launch_args: str, message: str
) -> None:
    """A system would run otherwise than its name says (a "disagg" run colocated), or compare's own
    setting would silently win."""
    from click.testing import CliRunner

    from pdserve.bench import compare

    monkeypatch.setattr(compare, "resolve_model", lambda model: demo_model_dir)
    argv = ["--num-requests", "2", "--rate", "1", "--out-dir", str(tmp_path), "--launch-args", launch_args]
    result = CliRunner().invoke(compare.main, argv)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not list(tmp_path.iterdir())


def _isolated_specs(monkeypatch: pytest.MonkeyPatch, config: BenchConfig) -> list[RequestSpec]:
    """The requests bench.compare's isolated-decode measurement sends (no cluster)."""
    import types

    from pdserve.bench import compare

    sent: list[RequestSpec] = []

    async def fake_run_requests(client: object, specs: list[RequestSpec], *args: object) -> list[RequestRecord]:
        sent.extend(specs)
        return [record(0.0, [(0.1, 1), (0.2, 1)], finished=0.2) for _ in specs]

    monkeypatch.setattr(compare, "run_requests", fake_run_requests)
    monkeypatch.setattr(compare, "AsyncClient", lambda *a, **k: types.SimpleNamespace(close=lambda: None))
    asyncio.run(compare.measure_isolated_tpot("tcp://127.0.0.1:1", config))
    return sent


def test_isolated_decode_prompts_are_not_the_workloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the first compared system serves the isolated requests: a measured request starting
    with their prompt finds it in that system's prefix cache alone."""
    for workload in ("random", "multi-turn"):
        config = BenchConfig(workload=workload, input_len=128, prefix_len=1024, warmup=2, num_requests=8)
        isolated = {tuple((s.token_ids or [])[:16]) for s in _isolated_specs(monkeypatch, config)}
        _, measured = workload_requests(config)
        assert not isolated & {tuple((s.token_ids or [])[:16]) for s in measured}, workload


def test_isolated_decode_requests_are_each_a_fresh_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch-1 decode of an uncached request: the three measured isolated requests must not
    find the warm-up's prompt cached (a prefix hit; disaggregated, no KV transfer at all)."""
    sent = _isolated_specs(monkeypatch, BenchConfig(input_len=128))
    firsts = [tuple((s.token_ids or [])[:16]) for s in sent]
    assert len(set(firsts)) == len(firsts)


def compare_setup(systems: list[str]) -> dict[str, Any]:
    """A comparison run's ``setup`` as bench.compare records it, ``systems`` in the order they ran."""
    return {
        "date": "today",
        "host": "here",
        "command": "bench",
        "model": "demo",
        "devices": "CPU",
        "max_model_len": 1024,
        "workload": "random",
        "systems": {name: [] for name in systems},
    }


def test_replot_names_the_system_the_isolated_tpot_was_measured_on(tmp_path: Path) -> None:
    """--replot rebuilds report.md from the JSON files; the isolated TPOT was measured on the
    first system run (here colocated-chunked, as in docs/results/pd_one_gpu.json)."""
    from click.testing import CliRunner

    from pdserve.bench import compare
    from pdserve.bench.common import write_json

    config = BenchConfig(rates=(1.0,), slo_ttft_ms=1000, slo_tpot_ms=3.0)
    point = point_result(1.0, config, [record(0.0, [(0.1, 1), (0.2, 1)], finished=0.2)])
    setup = compare_setup(["colocated-chunked", "disagg"])  # the order they ran in
    setup |= {"isolated_tpot_ms": 1.0, "isolated_tpot_samples_ms": [1.0, 1.0, 1.0]}
    for name in setup["systems"]:
        write_json({"config": dataclasses.asdict(config), "points": [point], "setup": setup}, tmp_path / f"{name}.json")
    result = CliRunner().invoke(compare.main, ["--replot", "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = (tmp_path / "report.md").read_text()
    assert "isolated batch-1 decode TPOT (on colocated-chunked)" in report


def test_the_first_rate_is_drawn_as_every_later_one() -> None:
    """The first rate's requests must not differ from a later rate's by where the warm-up cut a
    longer draw: mixed's share of long prompts (300 requests at 10%: 30 each), and nothing the
    warm-up sent may be in the prefix cache for them (shared-prefix's system prompts)."""
    mixed = BenchConfig(workload="mixed", num_requests=300, warmup=8, long_fraction=0.1, rates=(16, 32))
    _, measured = workload_requests(mixed)
    assert [[s.kind for s in point_requests(mixed, measured, i)].count("long") for i in range(2)] == [30, 30]

    shared = BenchConfig(
        workload="shared-prefix", num_requests=20, warmup=2, num_prefixes=4, prefix_len=32, input_len=8
    )
    warmup, measured = workload_requests(shared)
    assert not {tuple((s.token_ids or [])[:32]) for s in warmup} & {tuple((s.token_ids or [])[:32]) for s in measured}


def test_the_text_workloads_report_names_the_most_a_request_asks_for() -> None:
    """bench.compare's report said "at most 64 tokens out" while uniform draws asked up to 96."""
    from pdserve.bench.compare import describe_workload

    config = BenchConfig(workload="text", len_dist="uniform", output_len=64)
    most = max(s.max_tokens for s in build_requests(config, 200))
    assert 64 < most <= 96
    assert "a uniform draw of mean 64 tokens (at most 96)" in describe_workload(config)
    assert "out until EOS or 64 tokens;" in describe_workload(BenchConfig(workload="text", output_len=64))
