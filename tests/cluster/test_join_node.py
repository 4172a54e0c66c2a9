"""A group node's own behaviour, without a cluster: what a stop does before it joined."""

from __future__ import annotations

import os
import signal
import threading
import time

from pdserve.cluster.group import free_port
from pdserve.cluster.join import GroupNode


def test_a_stop_while_the_node_waits_for_the_router_node_ends_the_wait() -> None:
    """Ctrl-C (or SIGTERM) while the router node is not up yet: nothing was started, so the node
    stops at once and quietly, not after --join-timeout with an error."""
    port = free_port()  # nothing listens there
    node = GroupNode({"join": f"127.0.0.1:{port}", "role": "decode", "join_timeout": 60.0})
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    began = time.monotonic()
    timer.start()
    try:
        node.start()  # raised ClusterError ("no pdserve router node answers") after its join timeout
        assert node.processes is None
        assert node.serve() == 0
    finally:
        timer.cancel()
        node._cleanup()
    assert time.monotonic() - began < 20.0
