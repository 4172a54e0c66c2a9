"""Front-end throughput: how many streamed tokens a second the router and the client library
deliver when the engine is out of the way.

    python -m pdserve.bench.frontend --streams 64,128 --output-len 256 --step-ms 0,2 --out frontend.json

Each configuration starts the real ``Router`` (colocated mode, one group, no tokenizer unless
``--tokenizer`` names a model directory) in a process, and in place of the worker group a
stand-in leader process that streams every request it is given: one ``TokenOutputs`` message a
step holding one token for each of its requests, as the engine's leader sends them, a step
every ``--step-ms`` (0: as fast as the sockets take them). The client is ``AsyncClient`` in this
process with ``--streams`` concurrent streaming requests of ``--output-len`` tokens, asking for
batched chunks (one message a worker step for all streams) or not (``--batch-chunks``: on, off or
both, in turn). Reported: the tokens a second the client received (first send to last final),
the rate the stand-in would have emitted at its step period, and the client-side inter-token
latency. When the delivered rate falls short of the emitted one, the router or the client is
the bottleneck; docs/benchmarks.md gives the rate a GPU's decode steps emit.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from pdserve.bench.common import (
    ON_OFF_BOTH,
    bench_parser,
    command_line,
    fmt,
    format_table,
    metadata,
    parse_ints,
    write_json,
)
from pdserve.bench.metrics import percentile
from pdserve.cluster import reaper
from pdserve.cluster.client import AsyncClient
from pdserve.cluster.config import Addresses, ClusterConfig
from pdserve.cluster.group import die_with_parent, free_port
from pdserve.cluster.protocol import Chunk, Ready, TokenOutput, TokenOutputs, WorkRequest, decode, encode


@dataclass(frozen=True)
class Setup:
    run_dir: str
    endpoint: str
    output_len: int
    step_s: float
    tokenizer: str | None


def router_main(setup: Setup, stop: Any) -> None:
    """The real router until ``stop`` is set."""
    die_with_parent()
    from transformers import AutoTokenizer

    from pdserve.router.openai_app import model_vocab_size
    from pdserve.router.router import Router

    tokenizer = AutoTokenizer.from_pretrained(setup.tokenizer) if setup.tokenizer else None
    router = Router(
        ClusterConfig(mode="colocated"),
        Addresses(setup.run_dir, setup.endpoint),
        tokenizer,
        # The tokenizer's model's, which the front end checks its own against.
        vocab_size=(model_vocab_size(setup.tokenizer) if setup.tokenizer else None) or 32000,
        max_model_len=setup.output_len + 16,
    )
    try:
        while not stop.is_set():
            router.poll(10)
    finally:
        router.close()


def leader_main(setup: Setup, stop: Any) -> None:
    """A stand-in colocated leader: every request gets ``output_len`` tokens, one a step."""
    die_with_parent()
    ctx = zmq.Context()
    addresses = Addresses(setup.run_dir, setup.endpoint)
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(addresses.leader("colocated", 0))
    to_router = ctx.socket(zmq.PUSH)
    to_router.connect(addresses.router)
    to_router.send(encode(Ready("colocated", 0, num_blocks=1)))
    next_index: dict[str, int] = {}
    next_step = time.perf_counter()
    while not stop.is_set():
        while inbox.poll(0 if next_index else 10):
            message = decode(inbox.recv())
            if isinstance(message, WorkRequest):
                next_index[message.request_id] = 0
        if not next_index:
            next_step = time.perf_counter()  # idle: the period starts again with the next request
            continue
        outputs = []
        for request_id, index in list(next_index.items()):
            last = index + 1 == setup.output_len
            # Ids from 1000 up: a real tokenizer's first ids are special tokens, which have no text.
            token = 1000 + index % 1000
            outputs.append(TokenOutput(request_id, index, [token], last, "length" if last else None))
            if last:
                del next_index[request_id]
            else:
                next_index[request_id] = index + 1
        to_router.send(encode(TokenOutputs(outputs)))
        next_step += setup.step_s
        time.sleep(max(0.0, next_step - time.perf_counter()))
    ctx.destroy(linger=0)


async def stream_all(
    endpoint: str, streams: int, output_len: int, batch_chunks: bool
) -> tuple[float, list[list[float]]]:
    """Wall seconds from the first send to the last final, and each request's chunk arrival times."""
    client = AsyncClient(endpoint, batch_chunks=batch_chunks)

    async def one(i: int) -> list[float]:
        times = []
        async for message in client.stream(
            token_ids=[1, 2, 3], request_id=f"s{i}", max_tokens=output_len, ignore_eos=True
        ):
            if isinstance(message, Chunk):
                times.append(time.perf_counter())
        return times

    start = time.perf_counter()
    try:
        arrivals = await asyncio.gather(*(one(i) for i in range(streams)))
    finally:
        client.close()
    return time.perf_counter() - start, list(arrivals)


@contextlib.contextmanager
def stand_in_cluster(output_len: int, step_ms: float, tokenizer: str | None = None) -> Iterator[Setup]:
    """The router and the stand-in leader, each in a fresh process (spawned: no ZMQ context or
    torch state shared over fork), until the block exits; they, and the run directory, go with
    this process however it ends."""
    spawn = mp.get_context("spawn")
    tmp = tempfile.TemporaryDirectory(prefix="pdserve-frontend-")
    keeper = reaper.spawn(tmp.name)  # removes the run directory even if this process is killed
    try:
        with tmp as run_dir:
            setup = Setup(run_dir, f"tcp://127.0.0.1:{free_port()}", output_len, step_ms / 1e3, tokenizer)
            stop = spawn.Event()
            processes = [spawn.Process(target=f, args=(setup, stop), daemon=True) for f in (router_main, leader_main)]
            for p in processes:
                p.start()
            try:
                yield setup
            finally:
                stop.set()
                for p in processes:
                    p.join(10)
    finally:
        assert keeper.stdin is not None
        keeper.stdin.close()  # the reaper finds the directory gone, and exits
        keeper.wait()


def measure(streams: int, output_len: int, step_ms: float, batch_chunks: bool, tokenizer: str | None) -> dict[str, Any]:
    with stand_in_cluster(output_len, step_ms, tokenizer) as setup:
        # A first request waits for the router to come up (the client's timeout covers it).
        asyncio.run(stream_all(setup.endpoint, 1, output_len, batch_chunks))
        wall, arrivals = asyncio.run(stream_all(setup.endpoint, streams, output_len, batch_chunks))
    tokens = sum(len(a) for a in arrivals)
    if tokens != streams * output_len:
        raise RuntimeError(f"received {tokens} tokens of {streams * output_len}")
    gaps = [(b - a) * 1e3 for times in arrivals for a, b in zip(times, times[1:])]
    emitted = streams / (step_ms / 1e3) if step_ms > 0 else None
    return {
        "streams": streams,
        "output_len": output_len,
        "step_ms": step_ms,
        "batch_chunks": batch_chunks,
        "tokenizer": tokenizer,
        "wall_s": wall,
        "delivered_tok_s": tokens / wall,
        "emitted_tok_s": emitted,
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p99_ms": percentile(gaps, 99),
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    return format_table(
        ["streams", "step ms", "batched", "emitted tok/s", "delivered tok/s", "ITL p50 ms", "ITL p99 ms"],
        [
            [
                str(r["streams"]),
                fmt(r["step_ms"], 1),
                "on" if r["batch_chunks"] else "off",
                fmt(r["emitted_tok_s"], 0),
                fmt(r["delivered_tok_s"], 0),
                fmt(r["itl_p50_ms"], 2),
                fmt(r["itl_p99_ms"], 2),
            ]
            for r in rows
        ],
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("frontend", __doc__)
    parser.add_argument("--streams", default="64,128", type=parse_ints, help="concurrent streaming requests")
    parser.add_argument("--output-len", default=256, type=int, help="tokens of every request")
    parser.add_argument("--step-ms", default="0,2", help="the stand-in's step period(s), ms; 0: unpaced")
    parser.add_argument(
        "--batch-chunks",
        default="both",
        choices=sorted(ON_OFF_BOTH),
        help="the client asks for batched chunks (Generate.batch_chunks), or not, or both in turn",
    )
    parser.add_argument("--tokenizer", help="a model directory whose tokenizer the router detokenizes with")
    parser.add_argument("--out", type=Path, help="write every number as JSON here")
    args = parser.parse_args(argv)
    step_ms = [float(s) for s in args.step_ms.split(",") if s.strip()]
    if args.output_len < 2 or any(s < 0 for s in step_ms) or any(n < 1 for n in args.streams):
        parser.error("--output-len must be >= 2, --step-ms >= 0 and --streams >= 1")
    rows = [
        measure(n, args.output_len, s, batched, args.tokenizer)
        for n in args.streams
        for s in step_ms
        for batched in ON_OFF_BOTH[args.batch_chunks]
    ]
    print(table(rows))
    result = {"metadata": metadata(torch.device("cpu"), command_line("pdserve.bench.frontend", argv)), "rows": rows}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
