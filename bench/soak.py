"""Soak: mixed load on a CPU demo cluster for a long while, a rank killed or stopped every few
minutes, clients aborting some requests; does every request end, and does nothing leak?

    python -m pdserve.bench.soak --minutes 20 --fault-every 180 --out docs/results/soak.json

Starts ``launch.py`` (the demo model, a prefill group of two ranks and two decode groups of one,
by default) and keeps ``--concurrency`` streams going: random prompts of 8-200 tokens, 8-64
output tokens, greedy or sampled, a ``--abort-fraction`` of them aborted after a few chunks.
Every ``--fault-every`` seconds the next rank in turn is killed (SIGKILL) or stopped (SIGSTOP).
At the end the load stops, the cluster must come back to idle, and it is stopped with SIGTERM.

Reported: requests served, aborted, failed (an ``error``), lost (no terminal message within
``--request-timeout``: must be 0), KV blocks still held once idle (must be 0), group failures,
restarts, request moves, and the RSS of the launcher and of all its processes at start and end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import click

from pdserve.bench.common import write_json
from pdserve.bench.compare import LaunchedCluster
from pdserve.cluster.client import AsyncClient, Chunk, Client, ClusterError, ClusterUnavailable, Final

FAULTS = (("SIGKILL", "decode0.0"), ("SIGKILL", "prefill0.1"), ("SIGSTOP", "decode1.0"), ("SIGKILL", "prefill0.0"))
CLUSTER_ARGS = (
    "--model demo --max-model-len 512 --prefill-tp 2 --decode-groups 2 --decode-tp 1 "
    "--transfer gloo-async --num-blocks 400 --heartbeat-timeout 5"
)


def rank_pids(log: str) -> dict[str, int]:
    """The newest pid of every rank, from the line each rank starts with."""
    return {name: int(pid) for name, pid in re.findall(r" (\w+\d+\.\d+) INFO rank up: pid (\d+)", log)}


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (children, their children, ...), from /proc."""
    found, stack = [], [root]
    while stack:
        for task in Path(f"/proc/{stack.pop()}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                below = [int(c) for c in task.read_text().split()]
                found += below
                stack += below
    return found


def rss_mib(root: int) -> tuple[float, float]:
    """(the process's RSS, the RSS of it and all its descendants), MiB, from /proc."""

    def rss(pid: int) -> int:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    return rss(root) / 1024, sum(rss(pid) for pid in (root, *descendants(root))) / 1024


async def one_request(client: AsyncClient, rng: random.Random, abort: bool, outcomes: Counter) -> None:
    prompt = [rng.randrange(10, 20000) for _ in range(rng.randrange(8, 200))]
    sampling = {"max_tokens": rng.randrange(8, 64), "ignore_eos": True}
    if rng.random() < 0.5:
        sampling.update(temperature=0.8, seed=rng.randrange(1000))
    else:
        sampling["temperature"] = 0.0
    request_id = f"soak-{rng.getrandbits(48):x}"
    abort_after = rng.randrange(1, 6) if abort else None
    chunks = 0
    try:
        async for message in client.stream(token_ids=prompt, request_id=request_id, **sampling):
            if isinstance(message, Chunk):
                chunks += 1
                if chunks == abort_after:
                    await client.abort(request_id)
            elif isinstance(message, Final):
                outcomes["aborted" if message.finish_reason == "abort" else "served"] += 1
    except ClusterError as e:
        outcomes[f"error {e.code}"] += 1
    except ClusterUnavailable:
        outcomes["lost"] += 1


async def load(
    endpoint: str, until: float, concurrency: int, abort_fraction: float, timeout: float, seed: int
) -> Counter:
    client = AsyncClient(endpoint, timeout=timeout)
    outcomes: Counter = Counter()
    rng = random.Random(seed)

    async def stream_loop(worker: int) -> None:
        worker_rng = random.Random(rng.getrandbits(64) + worker)
        while time.monotonic() < until:
            await one_request(client, worker_rng, worker_rng.random() < abort_fraction, outcomes)

    try:
        await asyncio.gather(*(stream_loop(w) for w in range(concurrency)))
    finally:
        client.close()
    return outcomes


def inject_faults(cluster: LaunchedCluster, started: float, until: float, every: float, log: list[dict]) -> None:
    """In a thread: every ``every`` seconds, the next fault of ``FAULTS``."""
    turn = 0
    next_fault = started + every
    while next_fault < until:
        time.sleep(max(0.0, next_fault - time.monotonic()))
        how, victim = FAULTS[turn % len(FAULTS)]
        pid = rank_pids(cluster.output())[victim]
        os.kill(pid, getattr(signal, how))
        log.append({"t": round(time.monotonic() - started, 1), "signal": how, "rank": victim, "pid": pid})
        turn += 1
        next_fault += every


def wait_idle(endpoint: str, timeout: float) -> dict:
    """Stats once every group is ready and reporting and nothing is in flight (or at the timeout)."""
    deadline = time.monotonic() + timeout
    with Client(endpoint, timeout=30) as client:
        while True:
            stats = client.stats()
            groups = stats.groups
            idle = stats.requests_in_flight == 0 and all(
                g["free_blocks"] == g["num_blocks"] and g["kv_held"] == 0 and g["running"] + g["waiting"] == 0
                for g in groups.values()
            )
            if (stats.ready and idle and len(groups) == 3) or time.monotonic() > deadline:
                return {
                    "ready": stats.ready,
                    "groups": groups,
                    "faults": stats.faults,
                    "in_flight": stats.requests_in_flight,
                }
            time.sleep(0.5)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--minutes", default=20.0, show_default=True, help="How long the load runs.")
@click.option("--fault-every", default=180.0, show_default=True, help="Seconds between two faults.")
@click.option("--concurrency", default=6, show_default=True, help="Streams in flight.")
@click.option("--abort-fraction", default=0.1, show_default=True)
@click.option(
    "--request-timeout", default=300.0, show_default=True, help="Seconds without a reply that count a request lost."
)
@click.option("--cluster-args", default=CLUSTER_ARGS, show_default=True, help="launch.py arguments.")
@click.option("--seed", default=0, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(
    minutes: float,
    fault_every: float,
    concurrency: int,
    abort_fraction: float,
    request_timeout: float,
    cluster_args: str,
    seed: int,
    out: Path | None,
) -> None:
    with (
        tempfile.TemporaryDirectory() as tmp,
        LaunchedCluster(cluster_args.split(), Path(tmp) / "launch.log") as cluster,
    ):
        # A short warm-up, so that RSS at start is a serving cluster's.
        asyncio.run(load(cluster.endpoint, time.monotonic() + 10, concurrency, 0.0, request_timeout, seed + 1))
        rss_start = rss_mib(cluster.proc.pid)
        started = time.monotonic()
        until = started + minutes * 60
        faults: list[dict] = []
        injector = threading.Thread(
            target=inject_faults, args=(cluster, started, until, fault_every, faults), daemon=True
        )
        injector.start()
        outcomes = asyncio.run(load(cluster.endpoint, until, concurrency, abort_fraction, request_timeout, seed))
        injector.join()
        end = wait_idle(cluster.endpoint, timeout=180)
        rss_end = rss_mib(cluster.proc.pid)
        exit_code = cluster.stop()
        log = cluster.output()
    leaked = sum(g["num_blocks"] - g["free_blocks"] for g in end["groups"].values())
    result = {
        "command": f"python -m pdserve.bench.soak --minutes {minutes:g} --fault-every {fault_every:g} "
        f"--concurrency {concurrency} --abort-fraction {abort_fraction:g} --seed {seed}",
        "cluster_args": cluster_args,
        "minutes": minutes,
        "requests": dict(outcomes),
        "served": outcomes["served"],
        "aborted": outcomes["aborted"],
        "failed": sum(n for k, n in outcomes.items() if k.startswith("error")),
        "lost": outcomes["lost"] + end["in_flight"],
        "blocks_leaked": leaked,
        "faults_injected": faults,
        "cluster_faults": end["faults"],
        "ready_at_end": end["ready"],
        "groups_at_end": end["groups"],
        "rss_mib": {
            "launcher_start": round(rss_start[0]),
            "launcher_end": round(rss_end[0]),
            "all_start": round(rss_start[1]),
            "all_end": round(rss_end[1]),
        },
        "exit_code": exit_code,
        "restart_log": [line for line in log.splitlines() if re.search(r"failed:|restarts in|restarted as", line)],
    }
    print(
        f"soak: {minutes:g} min, a fault every {fault_every:g} s, {concurrency} streams, {abort_fraction:.0%} aborted"
    )
    f = end["faults"]
    rss = result["rss_mib"]
    row = {
        "served": result["served"],
        "aborted": result["aborted"],
        "failed": result["failed"],
        "lost": result["lost"],
        "blocks leaked": leaked,
        "faults": len(faults),
        "group failures": f.get("group_failures"),
        "restarts": f.get("restarts"),
        "moves": f.get("migrated"),
        "RSS launcher MiB": f"{rss['launcher_start']} -> {rss['launcher_end']}",
        "RSS all MiB": f"{rss['all_start']} -> {rss['all_end']}",
    }
    print("| " + " | ".join(row) + " |")
    print("|" + " ---: |" * len(row))
    print("| " + " | ".join(str(v) for v in row.values()) + " |")
    print(json.dumps({k: result[k] for k in ("requests", "exit_code", "ready_at_end")}))
    write_json(result, out)


if __name__ == "__main__":
    main()
