"""Serving metrics from per-request timelines: pure functions, no I/O, no cluster.

Definitions (times are client-side, seconds from the start of a run; reported in ms):

* TTFT: first chunk's arrival - the request's send.
* E2E: the terminal (``final``) message's arrival - the send.
* TPOT: (E2E - TTFT) / (output tokens - 1), for requests of two or more output tokens.
* ITL: one sample per output token after the first chunk. The gap between a chunk and the one
  before it is divided evenly over the later chunk's tokens (a chunk of k tokens after a gap g
  gives k samples of g / k), as SGLang's ``bench_serving`` does; vLLM's ``benchmark_serving``
  records one undivided gap per chunk. The two agree when every chunk carries one token, which
  is what this cluster sends (one chunk per decode step).
* Duration: first send -> last terminal message of the measured requests. Request and output
  token throughput are completed requests and their output tokens over it.
* Goodput (DistServe): completed requests per second whose TTFT <= ``slo_ttft_ms`` and
  TPOT <= ``slo_tpot_ms``; a request of one output token has no TPOT and meets that SLO. An SLO
  left as None is not checked. Failed requests never count.
* Transfer: the server's ``timings["transfer"]`` of the final message (disaggregated requests
  that reached a decode group); its KV bytes, ``timings["transfer_bytes"]``, averaged over the
  same requests.
* Prefix hit rates: the share of the prompt tokens whose KV a prefix cache held, over the
  requests whose final reports it: the prefill (or colocated) group's ``cached_tokens``, the
  decode group's ``decode_cached_tokens`` (KV that did not move).

Percentiles interpolate linearly between order statistics (numpy's default, as vLLM reports).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

STATS = ("mean", "p50", "p90", "p99", "max")


@dataclass
class RequestRecord:
    """What the client saw of one request; every time in seconds from the start of its run."""

    request_id: str
    kind: str  # workload class ("random", "short", "long", ...)
    max_tokens: int
    scheduled: float  # when the arrival process meant to send it
    sent: float  # when it was sent
    prompt_len: int | None = None  # tokens sent (None for text prompts: see prompt_tokens)
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each chunk
    finished: float | None = None  # arrival of the terminal message (final or error)
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # the server's count (after tokenization and chat template)
    output_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # the final message's server timings
    error: str | None = None  # "code: message" of an error reply, or the client's failure
    warmup: bool = False

    @property
    def ok(self) -> bool:
        """Completed normally: a final that is not an abort, and at least one token."""
        return self.error is None and self.finish_reason in ("stop", "length") and bool(self.chunk_times)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50, p90, p99 and max in ms of values in seconds (None for each if there are none)."""
    if not values_s:
        return dict.fromkeys(STATS)
    ms = [v * 1e3 for v in values_s]
    return {
        "mean": sum(ms) / len(ms),
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
        "max": max(ms),
    }


def ttft(record: RequestRecord) -> float:
    return record.chunk_times[0] - record.sent


def e2e(record: RequestRecord) -> float:
    assert record.finished is not None
    return record.finished - record.sent


def tpot(record: RequestRecord) -> float | None:
    """Mean time per output token after the first; None with fewer than two tokens."""
    if record.output_tokens < 2:
        return None
    return (e2e(record) - ttft(record)) / (record.output_tokens - 1)


def itls(record: RequestRecord) -> list[float]:
    """Inter-token latencies: each chunk's gap to the previous one, spread over its tokens."""
    out: list[float] = []
    for i in range(1, len(record.chunk_times)):
        tokens = record.chunk_tokens[i]
        out.extend([(record.chunk_times[i] - record.chunk_times[i - 1]) / tokens] * tokens)
    return out


def meets_slo(record: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not record.ok:
        return False
    if slo_ttft_ms is not None and ttft(record) * 1e3 > slo_ttft_ms:
        return False
    per_token = tpot(record)
    return slo_tpot_ms is None or per_token is None or per_token * 1e3 <= slo_tpot_ms


def duration(records: Sequence[RequestRecord]) -> float:
    """Wall time from the first send to the last terminal message."""
    ends = [r.finished for r in records if r.finished is not None]
    if not ends:
        return 0.0
    return max(ends) - min(r.sent for r in records)


def prefix_hit_rate(records: Sequence[RequestRecord], key: str = "cached_tokens") -> float | None:
    """The share of the records' prompt tokens that a prefix cache held (their final messages'
    ``key``: ``cached_tokens``, or ``decode_cached_tokens`` for the decode group's); None when
    no record reports it (the cache off, colocated for the decode group's, or HTTP)."""
    reported = [r for r in records if key in r.timings and r.prompt_tokens]
    if not reported:
        return None
    return sum(r.timings[key] for r in reported) / sum(r.prompt_tokens or 0 for r in reported)


def mean_transfer_bytes(records: Sequence[RequestRecord]) -> float | None:
    """KV bytes moved per request, over the records whose final reports it; None if none does."""
    moved = [r.timings["transfer_bytes"] for r in records if "transfer_bytes" in r.timings]
    return sum(moved) / len(moved) if moved else None


def compute_metrics(
    records: Sequence[RequestRecord],
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    wall: float | None = None,
) -> dict[str, Any]:
    """Every metric of one run (warm-up records are ignored). ``wall``: the seconds the rates
    are over (default: the records' own span); a subset of a run (one request kind) takes the
    run's, so that its rates add up to the run's."""
    measured = [r for r in records if not r.warmup]
    done = [r for r in measured if r.ok]
    wall = duration(measured) if wall is None else wall

    def per_second(count: int) -> float:
        return count / wall if wall > 0 else 0.0

    output_tokens = sum(r.output_tokens for r in done)
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in done)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    return {
        "num_requests": len(measured),
        "completed": len(done),
        "failed": len(measured) - len(done),
        "duration_s": wall,
        "input_tokens": sum(r.prompt_tokens or 0 for r in done),
        "output_tokens": output_tokens,
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(output_tokens),
        "ttft_ms": summarize([ttft(r) for r in done]),
        "tpot_ms": summarize([t for t in map(tpot, done) if t is not None]),
        "itl_ms": summarize([gap for r in done for gap in itls(r)]),
        "e2e_ms": summarize([e2e(r) for r in done]),
        "transfer_ms": summarize([r.timings["transfer"] for r in done if "transfer" in r.timings]),
        "transfer_bytes": mean_transfer_bytes(done),
        "prefix_hit_rate": prefix_hit_rate(done),
        "decode_prefix_hit_rate": prefix_hit_rate(done, "decode_cached_tokens"),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "goodput": per_second(good) if has_slo else None,
        "slo_attainment": good / len(measured) if has_slo and measured else None,
    }
