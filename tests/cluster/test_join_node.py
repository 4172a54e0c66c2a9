"""A group node's own behaviour, without a cluster: what a stop does before it joined."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import zmq

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.group import free_port
from pdserve.cluster.join import GroupNode, node_settings
from pdserve.cluster.launcher import ClusterError


def test_a_stop_while_the_node_waits_for_the_router_node_ends_the_wait(caplog: pytest.LogCaptureFixture) -> None:
    """Ctrl-C (or SIGTERM) while the router node is not up yet: nothing was started, so the node
    stops at once and quietly, not after --join-timeout with an error. It says what it waits
    for (it used to wait without a word)."""
    port = free_port()  # nothing listens there
    node = GroupNode({"join": f"127.0.0.1:{port}", "role": "decode", "join_timeout": 60.0})
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    began = time.monotonic()
    timer.start()
    try:
        with caplog.at_level(logging.INFO):
            node.start()  # raised ClusterError ("no pdserve router node answers") after its join timeout
        assert f"waiting for the router node at 127.0.0.1:{port} (up to 60 s, --join-timeout)" in caplog.text
        assert node.processes is None
        assert node.serve() == 0
    finally:
        timer.cancel()
        node._cleanup()
    assert time.monotonic() - began < 20.0


def test_a_join_at_a_clusters_client_port_is_named_as_such(capfd: pytest.CaptureFixture[str]) -> None:
    """The client --port and the --master-port are easy to mix up: a join aimed at the client
    port (a ZMQ socket) says so in one line, without torch's C++ stacks of each failed try, and
    not as "no router node answers" (it answered at once)."""
    ctx = zmq.Context.instance()
    client_port = ctx.socket(zmq.ROUTER)
    port = client_port.bind_to_random_port("tcp://127.0.0.1")
    node = GroupNode({"join": f"127.0.0.1:{port}", "role": "decode", "join_timeout": 5.0})
    try:
        with pytest.raises(
            ClusterError, match=rf"^127.0.0.1:{port} is a ZMQ socket \(a cluster's client --port\?\), not a"
        ):
            node.start()
    finally:
        node._cleanup()
        client_port.close(linger=0)
    assert "frame #" not in capfd.readouterr().err


def test_a_group_node_takes_none_of_the_router_nodes_gpu_split() -> None:
    """A router node whose roles share one GPU publishes their memory shares; a group node, whose
    GPUs are its group's own, took them over its own budget (0.3 of its GPU for 0.9)."""
    cluster = {
        "model": "demo",
        "devices": "0,0",
        "gpu_memory_utilization": 0.9,
        "prefill_gpu_memory_utilization": 0.5,
        "decode_gpu_memory_utilization": 0.3,
    }
    node = {"join": "10.0.0.1:29500", "role": "decode"}
    plain = ClusterConfig.from_settings(node_settings(cluster, node))
    assert plain.devices is None and plain.memory_utilization("decode", 1) == 0.9
    own = ClusterConfig.from_settings(node_settings(cluster, {**node, "decode_gpu_memory_utilization": 0.6}))
    assert own.memory_utilization("decode", 1) == 0.6
