"""The router and the client library under streaming load, with bench.frontend's stand-in leader
in place of an engine (CPU, real processes and sockets)."""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time
from collections.abc import Iterator

import pytest
import zmq

from bench.frontend import Setup, leader_main, main, router_main
from cluster.group import free_port
from cluster.protocol import Chunk, Final, Generate, Sampling, decode, encode

REQUESTS = 64


@pytest.fixture
def stand_in_cluster() -> Iterator[Setup]:
    """A router and a stand-in leader streaming 1000 tokens for every request, unpaced."""
    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="pdserve-test-") as run_dir:
        setup = Setup(run_dir, f"tcp://127.0.0.1:{free_port()}", output_len=1000, step_s=0.0, tokenizer=None)
        stop = spawn.Event()
        processes = [spawn.Process(target=f, args=(setup, stop), daemon=True) for f in (router_main, leader_main)]
        for p in processes:
            p.start()
        yield setup
        stop.set()
        for p in processes:
            p.join(10)


def test_a_client_that_reads_late_loses_no_reply(stand_in_cluster: Setup) -> None:
    """64000 chunks queue for a client that reads none of them until its requests are done:
    every chunk and every final must still arrive (a ROUTER socket drops replies to a peer past
    its high-water mark, 1000 messages by default). The client's own queues are kept small so
    that the router's fill up within the test's data."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 10)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(stand_in_cluster.endpoint)
    try:
        for i in range(REQUESTS):
            sock.send(encode(Generate(request_id=f"r{i}", token_ids=[1, 2, 3],
                                      sampling=Sampling(max_tokens=1000, ignore_eos=True))))
        time.sleep(4.0)  # the router streams everything meanwhile
        chunks: dict[str, int] = {f"r{i}": 0 for i in range(REQUESTS)}
        finals = set()
        while len(finals) < REQUESTS:
            assert sock.poll(30_000), f"no reply within 30 s: {chunks}, finals {sorted(finals)}"
            message = decode(sock.recv())
            if isinstance(message, Chunk):
                chunks[message.request_id] += len(message.token_ids)
            else:
                assert isinstance(message, Final) and len(message.token_ids) == 1000
                finals.add(message.request_id)
        assert chunks == {f"r{i}": 1000 for i in range(REQUESTS)}
    finally:
        sock.close()


def test_frontend_benchmark_counts_every_token() -> None:
    result = main(["--streams", "3", "--output-len", "20", "--step-ms", "0,1"])
    assert [(r["streams"], r["step_ms"]) for r in result["rows"]] == [(3, 0.0), (3, 1.0)]
    for row in result["rows"]:
        assert row["delivered_tok_s"] == pytest.approx(3 * 20 / row["wall_s"])
        assert row["itl_p50_ms"] <= row["itl_p99_ms"]
    assert result["rows"][1]["emitted_tok_s"] == pytest.approx(3000)
