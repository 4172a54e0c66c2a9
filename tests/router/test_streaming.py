"""The router and the client library under streaming load, with bench.frontend's stand-in leader
in place of an engine (CPU, real processes and sockets)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from pdserve.bench.frontend import Setup, stand_in_cluster
from pdserve.cluster.protocol import Chunk, Chunks, Final, Generate, Sampling, decode, encode

REQUESTS = 64


@pytest.fixture
def stand_in() -> Iterator[Setup]:
    """A router and a stand-in leader streaming 1000 tokens for every request, unpaced."""
    with stand_in_cluster(output_len=1000, step_ms=0.0) as setup:
        yield setup


def test_a_client_that_reads_late_loses_no_reply(stand_in: Setup) -> None:
    """64000 chunks queue for a client that reads none of them until its requests are done:
    every chunk and every final must still arrive (a ROUTER socket drops replies to a peer past
    its high-water mark, 1000 messages by default). The client's own queues are kept small so
    that the router's fill up within the test's data."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 10)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(stand_in.endpoint)
    try:
        for i in range(REQUESTS):
            sock.send(
                encode(
                    Generate(
                        request_id=f"r{i}", token_ids=[1, 2, 3], sampling=Sampling(max_tokens=1000, ignore_eos=True)
                    )
                )
            )
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


def test_batched_chunks_keep_each_request_in_order(stand_in: Setup) -> None:
    """Requests with ``batch_chunks`` get their chunks inside ``chunks`` messages (several
    requests' chunks of a worker step in one frame), each request's in order and before its
    final; a request on the same connection without it gets plain ``chunk`` messages."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stand_in.endpoint)
    batched = {"b0", "b1", "b2"}
    try:
        for request_id in sorted(batched) + ["plain"]:
            sock.send(
                encode(
                    Generate(
                        request_id=request_id,
                        token_ids=[1, 2, 3],
                        batch_chunks=request_id in batched,
                        sampling=Sampling(max_tokens=1000, ignore_eos=True),
                    )
                )
            )
        tokens: dict[str, list[int]] = {r: [] for r in [*batched, "plain"]}
        finals: dict[str, Final] = {}
        batches = 0
        while len(finals) < 4:
            assert sock.poll(30_000), "no reply within 30 s"
            message = decode(sock.recv())
            if isinstance(message, Chunks):
                batches += 1
                for chunk in message.chunks:
                    assert chunk.request_id in batched and chunk.request_id not in finals
                    tokens[chunk.request_id] += chunk.token_ids
            elif isinstance(message, Chunk):
                assert message.request_id == "plain"
                tokens["plain"] += message.token_ids
            else:
                assert isinstance(message, Final) and message.request_id not in finals
                finals[message.request_id] = message
        for request_id, final in finals.items():
            assert tokens[request_id] == final.token_ids and len(final.token_ids) == 1000
        assert batches < 3 * 1000  # several requests' chunks shared messages
    finally:
        sock.close()
