"""What the OpenAI HTTP front end adds to latency: the same requests through the ZMQ client and
through HTTP against ONE running cluster, the two backends alternating, several repetitions.

    python launch.py --model demo --prefill-tp 1 --decode-tp 1 --port 5555 --http-port 8000
    python -m pdserve.bench.frontend_overhead --endpoint tcp://127.0.0.1:5555 --base-url http://127.0.0.1:8000 \\
        --concurrencies 1,8 --repeats 5 --num-requests 16 --input-len 32 --output-len 48 --out overhead.json

Several front-end processes are measured the same way: ``launch.py ... --api-servers N``, or N
``python -m pdserve.router.openai_server ... --reuse-port`` on one port (docs/benchmarks.md).

Each repetition runs, for every concurrency in turn, the measured requests once through each
backend (``bench.serve``'s ``zmq`` and ``openai``: a closed loop of that many clients, greedy,
``ignore_eos``), ZMQ first in even repetitions and HTTP first in odd ones, so that a drift in the
machine's load falls on both alike. With ``--side-by-side`` the two backends run at once instead,
each with its own closed loop of that many clients over the same requests: a request and its
twin through the other backend then share the cluster's steps, so that the difference between
them is what the path adds, not the cluster's step-to-step noise. Both backends warm up once
before the first repetition.

Reported per concurrency and backend: the median over repetitions of each run's p50 and p99 TTFT
and inter-token latency, with the smallest and largest; and the same statistics of the paired
difference HTTP - ZMQ (the two runs of one repetition and concurrency, back to back). The
front end meets its target at a concurrency when the median difference of p50 TTFT is at most
``--max-ttft-overhead-ms`` and that of p50 ITL at most ``--max-itl-overhead-ms``. The JSON
(``--out``) holds each run's full metrics (``bench.metrics.compute_metrics``) and the summary.
"""

from __future__ import annotations

import asyncio
import datetime
import platform
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from pdserve.bench.common import format_table, parse_ints, write_json
from pdserve.bench.metrics import compute_metrics
from pdserve.bench.serve import (
    DEFAULT_BASE_URL,
    BenchConfig,
    OpenAIBackend,
    build_requests,
    run_requests,
    vocab_size_of,
)
from pdserve.cluster.client import DEFAULT_ENDPOINT, AsyncClient

BACKENDS = ("zmq", "openai")
# (name in the summary, metric of compute_metrics, its statistic)
STATS = (
    ("ttft_p50", "ttft_ms", "p50"),
    ("ttft_p99", "ttft_ms", "p99"),
    ("itl_p50", "itl_ms", "p50"),
    ("itl_p99", "itl_ms", "p99"),
)
LABELS = {"ttft_p50": "TTFT p50", "ttft_p99": "TTFT p99", "itl_p50": "ITL p50", "itl_p99": "ITL p99"}


def backend_order(repeat: int) -> tuple[str, ...]:
    """ZMQ first in even repetitions, HTTP first in odd ones."""
    return BACKENDS if repeat % 2 == 0 else BACKENDS[::-1]


def spread(values: Sequence[float | None]) -> dict[str, float | None]:
    """Median, smallest and largest of the values that are not None (all None if none are)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


def summarize_runs(runs: Sequence[dict[str, Any]], max_ttft_ms: float, max_itl_ms: float) -> list[dict[str, Any]]:
    """Per concurrency: each backend's spread of every statistic over the repetitions, the spread
    of the paired differences HTTP - ZMQ, failures, and whether the targets are met."""
    out = []
    for concurrency in sorted({r["concurrency"] for r in runs}):
        by_repeat: dict[int, dict[str, dict[str, Any]]] = {}
        for run in runs:
            if run["concurrency"] == concurrency:
                by_repeat.setdefault(run["repeat"], {})[run["backend"]] = run["metrics"]

        backends = {
            name: {
                key: spread([m[name][metric][stat] for m in by_repeat.values() if name in m])
                for key, metric, stat in STATS
            }
            for name in BACKENDS
        }
        diffs = {}
        for key, metric, stat in STATS:
            pairs = [
                (m["openai"][metric][stat], m["zmq"][metric][stat])
                for m in by_repeat.values()
                if set(BACKENDS) <= set(m)
            ]
            diffs[key] = spread([h - z for h, z in pairs if h is not None and z is not None])
        failed = {name: sum(m[name]["failed"] for m in by_repeat.values() if name in m) for name in BACKENDS}
        ttft_diff, itl_diff = diffs["ttft_p50"]["median"], diffs["itl_p50"]["median"]
        out.append(
            {
                "concurrency": concurrency,
                "repeats": len(by_repeat),
                "backends": backends,
                "openai_minus_zmq": diffs,
                "failed": failed,
                "ttft_target_met": ttft_diff is not None and ttft_diff <= max_ttft_ms and not any(failed.values()),
                "itl_target_met": itl_diff is not None and itl_diff <= max_itl_ms and not any(failed.values()),
            }
        )
    return out


def _cell(s: dict[str, float | None], signed: bool = False) -> str:
    if s["median"] is None:
        return "-"
    form = "+.2f" if signed else ".2f"
    return f"{s['median']:{form}} [{s['min']:{form}}, {s['max']:{form}}]"


def summary_table(summary: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """A row per concurrency and statistic: ZMQ, HTTP, HTTP - ZMQ as median [min, max] in ms."""
    rows = [
        [
            str(s["concurrency"]),
            LABELS[key],
            _cell(s["backends"]["zmq"][key]),
            _cell(s["backends"]["openai"][key]),
            _cell(s["openai_minus_zmq"][key], signed=True),
        ]
        for s in summary
        for key, _, _ in STATS
    ]
    headers = ("concurrency", "ms", "ZMQ", "HTTP", "HTTP - ZMQ")
    return format_table(headers, rows, markdown=markdown, labels=2)


async def compare_backends(
    config: BenchConfig,
    endpoint: str,
    base_url: str,
    concurrencies: Sequence[int],
    repeats: int,
    model_name: str | None = None,
    side_by_side: bool = False,
) -> list[dict[str, Any]]:
    """Every measured run: a dict of backend, concurrency, repeat and its metrics."""
    specs = build_requests(config, config.warmup + config.num_requests)
    warmup, measured = specs[: config.warmup], specs[config.warmup :]
    http = OpenAIBackend(base_url, model_name, config.timeout)
    zmq = AsyncClient(endpoint, timeout=config.timeout)
    clients: dict[str, AsyncClient | OpenAIBackend] = {"zmq": zmq, "openai": http}
    runs = []
    try:
        await http.model_name()
        for name in BACKENDS:
            await run_requests(
                clients[name], warmup, None, max(concurrencies), config.seed, f"warmup {name}", warmup=True
            )
        for repeat in range(repeats):
            for concurrency in concurrencies:

                def run(name: str) -> Any:
                    label = f"#{repeat + 1} c={concurrency} {name}"
                    return run_requests(clients[name], measured, None, concurrency, config.seed, label)

                order = backend_order(repeat)
                if side_by_side:
                    results = await asyncio.gather(*(run(name) for name in order))
                else:
                    results = [await run(name) for name in order]
                for name, records in zip(order, results):
                    runs.append(
                        {
                            "backend": name,
                            "concurrency": concurrency,
                            "repeat": repeat,
                            "metrics": compute_metrics(records),
                        }
                    )
    finally:
        await http.close()
        zmq.close()
    return runs


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--endpoint", default=DEFAULT_ENDPOINT, help="The cluster's client endpoint.")
@click.option("--base-url", default=DEFAULT_BASE_URL, help="The same cluster's HTTP front end (with or without /v1).")
@click.option("--model-name", default=None, help="The 'model' of each HTTP request [default: the first of /v1/models].")
@click.option("--concurrencies", default="1,8", help="Closed-loop clients of each run, comma-separated.")
@click.option("--repeats", type=int, default=5, help="Repetitions of every (concurrency, backend) run.")
@click.option("--num-requests", type=int, default=16, help="Requests of each run.")
@click.option("--warmup", type=int, default=4, help="Requests sent once through each backend first, not measured.")
@click.option("--input-len", type=int, default=32, help="Prompt tokens (random ids).")
@click.option("--output-len", type=int, default=48, help="Output tokens (ignore_eos).")
@click.option("--seed", type=int, default=0)
@click.option(
    "--model-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="The served model's directory: its config.json gives the vocabulary size.",
)
@click.option(
    "--side-by-side", is_flag=True, help="Run both backends at once, each with --concurrencies clients, not in turn."
)
@click.option("--max-ttft-overhead-ms", type=float, default=2.0, help="Target: HTTP - ZMQ of p50 TTFT.")
@click.option("--max-itl-overhead-ms", type=float, default=0.2, help="Target: HTTP - ZMQ of p50 ITL.")
@click.option("--timeout", type=float, default=600.0, help="Seconds to wait for any one reply.")
@click.option("--markdown", is_flag=True, help="Print the table as Markdown.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the JSON here.")
def main(
    endpoint: str,
    base_url: str,
    model_name: str | None,
    concurrencies: str,
    repeats: int,
    num_requests: int,
    warmup: int,
    input_len: int,
    output_len: int,
    seed: int,
    model_dir: Path | None,
    side_by_side: bool,
    max_ttft_overhead_ms: float,
    max_itl_overhead_ms: float,
    timeout: float,
    markdown: bool,
    out: Path | None,
) -> None:
    """Alternate the ZMQ client and the HTTP front end against one cluster; report what HTTP adds."""
    try:
        levels = parse_ints(concurrencies)
        config = BenchConfig(
            workload="random",
            num_requests=num_requests,
            warmup=warmup,
            seed=seed,
            input_len=input_len,
            output_len=output_len,
            vocab_size=vocab_size_of(model_dir),
            timeout=timeout,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if repeats < 1:
        raise click.UsageError("--repeats must be >= 1")
    runs = asyncio.run(compare_backends(config, endpoint, base_url, levels, repeats, model_name, side_by_side))
    summary = summarize_runs(runs, max_ttft_overhead_ms, max_itl_overhead_ms)
    click.echo(
        f"{num_requests} requests of {input_len} tokens in, {output_len} out, per run; {repeats} repetitions"
        f"{', the backends side by side' if side_by_side else ''}; "
        "median [min, max] over repetitions of each run's percentile, ms"
    )
    click.echo(summary_table(summary, markdown=markdown))
    for s in summary:
        if any(s["failed"].values()):
            click.echo(f"warning: concurrency {s['concurrency']}: failed requests {s['failed']}", err=True)
        click.echo(
            f"concurrency {s['concurrency']}: TTFT target {'met' if s['ttft_target_met'] else 'NOT met'}, "
            f"ITL target {'met' if s['itl_target_met'] else 'NOT met'}"
        )
    if out is not None:
        write_json(
            {
                "meta": {
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "host": platform.node(),
                    "command": shlex.join(sys.orig_argv),
                    "endpoint": endpoint,
                    "base_url": base_url,
                },
                "config": {
                    "concurrencies": levels,
                    "repeats": repeats,
                    "side_by_side": side_by_side,
                    "num_requests": num_requests,
                    "warmup": warmup,
                    "input_len": input_len,
                    "output_len": output_len,
                    "seed": seed,
                    "vocab_size": config.vocab_size,
                    "max_ttft_overhead_ms": max_ttft_overhead_ms,
                    "max_itl_overhead_ms": max_itl_overhead_ms,
                },
                "summary": summary,
                "runs": runs,
            },
            out,
        )


if __name__ == "__main__":
    main()
