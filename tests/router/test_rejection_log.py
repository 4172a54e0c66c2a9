"""Rejected client input is logged with the client's address, at most a few lines per class and
interval, then a count of what was left out."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from pdserve.cluster.config import Addresses, ClusterConfig
from pdserve.cluster.group import free_port
from pdserve.cluster.protocol import Error, Generate, decode, encode
from pdserve.router.rejection_log import LINES_PER_INTERVAL, RejectionLog, shorten
from pdserve.router.router import Router


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_each_kind_has_its_own_bucket_and_the_count_of_suppressed_lines(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    log = RejectionLog(logging.getLogger("test.rejections"), burst=3, interval=30.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.rejections"):
        assert [log.warning("a", "a %d", i) for i in range(5)] == [True, True, True, False, False]
        assert log.warning("b", "b") is True  # another kind is not held back by a's flood
        clock.now += 10.0  # a third of the interval: one line back
        assert log.warning("a", "a late") is True
        assert log.warning("a", "a later") is False
    assert caplog.messages == ["a 0", "a 1", "a 2", "b", "suppressed 2 similar messages (a)", "a late"]
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_shorten_cuts_long_details_and_says_how_long() -> None:
    assert shorten("abc", 5) == "abc"
    assert shorten("x" * 1000, 5) == "xxxxx... (1000 characters)"
    forged = "x\n2026-12-07 00:00:00,000 launcher ERROR FORGED\r\x1b[2K"
    assert shorten(forged) == "x\\n2026-12-07 00:00:00,000 launcher ERROR FORGED\\r\\x1b[2K"
    assert shorten("日本語 ✓") == "日本語 ✓"  # printable text stays as it is


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Router]:
    """The real router with no worker group behind it (only refusals are asked of it)."""
    router = Router(
        ClusterConfig(mode="colocated"),
        Addresses(str(tmp_path), f"tcp://127.0.0.1:{free_port()}"),
        tokenizer=None,
        vocab_size=100,
        max_model_len=64,
    )
    try:
        yield router
    finally:
        router.close()


def _replies(router: Router, sock: zmq.Socket, count: int) -> list[Error]:
    replies = []
    for _ in range(2000):
        router.poll(5)
        while sock.poll(0):
            replies.append(decode(sock.recv()))
        if len(replies) >= count:
            break
    assert len(replies) == count and all(isinstance(r, Error) for r in replies), replies
    return replies


def test_a_burst_of_bad_frames_is_logged_rate_limited(router: Router, caplog: pytest.LogCaptureFixture) -> None:
    """300 malformed frames: every one gets its error, the log gets the first few lines (naming
    the client's address and the error), a request refused for another reason still gets its
    line, and once the interval has passed the next bad frame's line comes after the count of
    those left out."""
    clock = FakeClock()
    router.rejections.clock = clock
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(router.addresses.client)
    burst = 300
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.router.router"):
            for i in range(burst):
                sock.send(b"\xc1" + bytes([i % 256]))
            assert {r.code for r in _replies(router, sock, burst)} == {"malformed"}
            lines = [m for m in caplog.messages if "refused" in m]
            assert len(lines) == LINES_PER_INTERVAL, caplog.messages
            assert all("client 127.0.0.1 (" in m and ": malformed: " in m for m in lines), lines
            assert not any("suppressed" in m for m in caplog.messages)

            caplog.clear()
            sock.send(encode(Generate(request_id="big", token_ids=[1, 100], stream=False)))
            (error,) = _replies(router, sock, 1)
            assert error.code == "invalid_request"
            assert len(caplog.messages) == 1 and ": invalid_request: token_ids" in caplog.messages[0]

            caplog.clear()
            clock.now += 3600.0
            sock.send(msgpack.packb({"type": "abort", "version": 1, "request_id": "x" * 100_000}))
            (error,) = _replies(router, sock, 1)
            assert error.code == "invalid_field"
            sock.send(b"")
            _replies(router, sock, 1)
            assert caplog.messages[0].startswith("router: refused a message of client 127.0.0.1")
            assert ": invalid_field: " in caplog.messages[0] and len(caplog.messages[0]) < 400
            assert caplog.messages[1:] == [
                f"suppressed {burst - LINES_PER_INTERVAL} similar messages (malformed)",
                caplog.messages[2],
            ]
            assert ": malformed: " in caplog.messages[2]
    finally:
        sock.close()


def test_the_http_front_end_logs_refused_requests_rate_limited(
    demo_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bad bodies and unknown paths get their 4xx and a line each naming the client, up to the
    limit per error code; no cluster is needed to refuse them."""
    from fastapi.testclient import TestClient

    from pdserve.router.openai_app import Frontend

    frontend = Frontend(f"tcp://127.0.0.1:{free_port()}", str(demo_model_dir), served_model_name="demo")
    frontend.max_model_len = 512  # what the cluster would say (none runs here)
    http = TestClient(frontend.app())  # no lifespan: nothing here reaches the cluster
    with caplog.at_level(logging.WARNING, logger="pdserve.router.openai_app"):
        for _ in range(3 * LINES_PER_INTERVAL):
            response = http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
            assert response.status_code == 400 and response.json()["error"]["code"] == "malformed_json"
        assert http.post("/v1/completions", json={"model": "other", "prompt": "hi"}).status_code == 404
        assert http.get("/v2/nothing").status_code == 404
    lines = caplog.messages
    assert len([m for m in lines if ": 400 malformed_json: " in m]) == LINES_PER_INTERVAL, lines
    assert len([m for m in lines if ": 404 model_not_found: " in m]) == 1, lines
    assert len([m for m in lines if "refused GET /v2/nothing" in m and ": 404 not_found: " in m]) == 1, lines
    assert all("of client testclient:" in m for m in lines), lines
