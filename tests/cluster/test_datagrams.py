"""The leaders' datagram side channel: what goes, what falls back to ZMQ, and what an inbox
reads. No engine, no processes."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from pdserve.cluster.datagrams import MAX_DATAGRAM_BYTES, DatagramInbox, DatagramOutbox, datagram_path


def test_an_ipc_endpoint_has_a_datagram_path_beside_it_and_tcp_has_none() -> None:
    assert datagram_path("ipc:///tmp/run/decode0") == "/tmp/run/decode0.dgram"
    assert datagram_path("tcp://10.0.0.2:41000") is None
    assert DatagramInbox.beside("tcp://10.0.0.2:41000") is None


def test_datagrams_arrive_whole_and_in_order(tmp_path: Path) -> None:
    inbox = DatagramInbox.beside(f"ipc://{tmp_path}/decode0")
    assert inbox is not None
    outbox = DatagramOutbox()
    try:
        messages = [b"first", bytes(range(256)) * 100, b"", b"x" * MAX_DATAGRAM_BYTES]
        for data in messages:
            assert outbox.send(f"ipc://{tmp_path}/decode0", data)
        assert list(inbox.drain()) == messages
        assert list(inbox.drain()) == []  # nothing waiting: no block
    finally:
        outbox.close()
        inbox.close()
    assert not (tmp_path / "decode0.dgram").exists()


def test_what_cannot_go_as_a_datagram_is_refused_for_zmq(tmp_path: Path) -> None:
    outbox = DatagramOutbox()
    endpoint = f"ipc://{tmp_path}/prefill1"
    assert not outbox.send(endpoint, b"no inbox yet")
    assert not outbox.send("tcp://127.0.0.1:5", b"another node")
    inbox = DatagramInbox.beside(endpoint)
    assert inbox is not None
    assert not outbox.send(endpoint, b"x" * (MAX_DATAGRAM_BYTES + 1))
    sent = 0
    while outbox.send(endpoint, b"y" * 4096):  # nobody reads: the queue fills, then sends are refused
        sent += 1
        assert sent < 100_000
    assert sent > 0 and len(list(inbox.drain())) == sent
    inbox.close()
    assert not outbox.send(endpoint, b"inbox gone")
    outbox.close()


def test_a_dead_inboxs_socket_file_is_replaced(tmp_path: Path) -> None:
    """A restarted group binds where its dead predecessor's socket file was left; a send to
    that file while nobody holds it is refused, not lost in a queue."""
    path = tmp_path / "decode0.dgram"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(path))
    stale.close()  # the file stays, as a killed process leaves it
    outbox = DatagramOutbox()
    assert not outbox.send(f"ipc://{tmp_path}/decode0", b"to the dead")
    inbox = DatagramInbox.beside(f"ipc://{tmp_path}/decode0")
    assert inbox is not None
    assert outbox.send(f"ipc://{tmp_path}/decode0", b"to the new one")
    assert list(inbox.drain()) == [b"to the new one"]
    inbox.close()
    outbox.close()


def test_a_path_too_long_for_a_unix_socket_means_no_inbox(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    with caplog.at_level(logging.WARNING):
        assert DatagramInbox.beside(f"ipc://{deep}/decode0") is None
    assert "peers will use ZMQ alone" in caplog.text
    outbox = DatagramOutbox()
    assert not outbox.send(f"ipc://{deep}/decode0", b"x")
    outbox.close()
