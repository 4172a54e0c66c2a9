"""A cluster over two (and more) nodes, as real processes on the CPU: the router node
(``launch.py --master-addr 127.0.0.2``) runs the router and a prefill group, group nodes
(``launch.py --join 127.0.0.2:PORT --advertise-addr 127.0.0.3``) each run a decode group. Each
node has its own run directory; they reach each other only over TCP, on distinct loopback
addresses (Linux routes all of 127/8 to lo). Groups join under load, leave with SIGTERM (drained)
or die with SIGKILL (removed after the heartbeat timeout); every request ends once, with the
single engine's greedy tokens.

The tests of this module run in order on one cluster: each starts from where the last left it.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from pdserve.bench.compare import REPO, LaunchedCluster
from pdserve.cluster.client import Chunk, Client, Error, Final
from pdserve.cluster.group import connect_store, free_port
from pdserve.cluster.protocol import GroupInfo, Ready, encode
from pdserve.engine.sampling import SamplingParams
from pdserve.tests.cluster.helpers import wait_until_idle
from pdserve.tests.cluster.test_cluster import mixed_requests, oracle, run_concurrently

ROUTER_NODE = "127.0.0.2"
GROUP_NODES = ("127.0.0.3", "127.0.0.4", "127.0.0.5")
HEARTBEAT_TIMEOUT = 3.0
MAX_TOKENS = 40
PROMPTS = [[17 + i] * (12 + 3 * i) + [42, 7, 99] for i in range(8)]


class GroupNodeProcess:
    """``launch.py --join ...`` in a subprocess, its output in a log file; started on construction,
    returns once its group has joined."""

    def __init__(self, master: str, advertise: str, log_path: Path, *args: str, timeout: float = 180.0) -> None:
        self.log_path = log_path
        command = [sys.executable, "launch.py", "--join", master, "--advertise-addr", advertise, *args]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while (found := re.search(r"joined: \w+ group (\d+) at (\S+)", self.output())) is None:
            assert self.proc.poll() is None, f"the group node exited with {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"the group did not join in {timeout} s:\n{self.output()}"
            time.sleep(0.2)
        self.index, self.address = int(found.group(1)), found.group(2)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["tiny-llama-odd"]  # 9 query / 3 KV heads: prefill tp 2 splits them unevenly


@pytest.fixture(scope="module")
def master_port() -> int:
    return free_port(ROUTER_NODE)


@pytest.fixture(scope="module")
def router_node(cluster_factory, model_dir: Path, master_port: int) -> LaunchedCluster:
    """The router and one prefill group (tp 2); no decode group until one joins."""
    return cluster_factory(
        "--model",
        str(model_dir),
        "--master-addr",
        ROUTER_NODE,
        "--master-port",
        str(master_port),
        "--prefill-tp",
        "2",
        "--decode-groups",
        "0",
        "--num-blocks",
        "200",
        "--heartbeat-timeout",
        str(HEARTBEAT_TIMEOUT),
        "--drain-timeout",
        "60",
    )


class GroupNodes:
    """The decode group nodes (tp 1) of the module's cluster."""

    def __init__(self, master: str, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.master = master
        self.tmp_path_factory = tmp_path_factory
        self.started: list[GroupNodeProcess] = []

    def start(self, advertise: str) -> GroupNodeProcess:
        log = self.tmp_path_factory.mktemp("node") / "node.log"
        node = GroupNodeProcess(self.master, advertise, log, "--role", "decode", "--tp", "1")
        self.started.append(node)
        return node

    def running(self) -> list[GroupNodeProcess]:
        return [n for n in self.started if n.proc.poll() is None]


@pytest.fixture(scope="module")
def nodes(
    router_node: LaunchedCluster, master_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GroupNodes]:
    """Every group node a test starts is killed when the module ends."""
    nodes = GroupNodes(f"{ROUTER_NODE}:{master_port}", tmp_path_factory)
    yield nodes
    for node in nodes.started:
        node.kill()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return oracle(model_dir, PROMPTS, [params] * len(PROMPTS))


def members(client: Client) -> dict[str, GroupInfo]:
    return {f"{m.role}{m.group}": m for m in client.stats().members}


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> float:
    """Poll ``check`` until true; the seconds it took."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - started


def stream_all(client: Client, act: Callable[[], None] | None = None, after_chunks: int = 8) -> list[Final | Error]:
    """Stream every prompt (greedy), call ``act`` once ``after_chunks`` chunks have arrived, and
    collect each request's one terminal message, checking that its chunks add up to its final."""
    ids = {
        client.submit(token_ids=p, stream=True, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True): i
        for i, p in enumerate(PROMPTS)
    }
    streamed: dict[int, list[int]] = {i: [] for i in ids.values()}
    terminal: dict[int, Final | Error] = {}
    chunks = 0
    while len(terminal) < len(ids):
        message = client.receive()
        index = ids[message.request_id]
        assert index not in terminal, f"request {index} got a message after its terminal one: {message}"
        if isinstance(message, Chunk):
            streamed[index] += message.token_ids
            chunks += 1
            if chunks == after_chunks and act is not None:
                act()
        else:
            terminal[index] = message
            if isinstance(message, Final):
                assert streamed[index] == message.token_ids, f"request {index}: the stream repeats or skips a token"
    return [terminal[i] for i in range(len(PROMPTS))]


def token_ids(terminal: list[Final | Error]) -> list[list[int]]:
    errors = [m for m in terminal if isinstance(m, Error)]
    assert not errors, errors
    return [m.token_ids for m in terminal]


@pytest.mark.slow
def test_prefill_on_one_node_and_decode_on_another_match_the_single_engine(
    router_node: LaunchedCluster, nodes: GroupNodes, model_dir: Path, reference: list[list[int]]
) -> None:
    """A decode group joins from its own node: requests are prefilled on the router node (tp 2),
    their KV crosses to the other node (tp 1) over a pair group formed at run time, and the tokens
    are the single engine's. ``--status`` lists both groups with their role, TP, devices, address."""
    node = nodes.start(GROUP_NODES[0])
    assert node.address.startswith(f"tcp://{GROUP_NODES[0]}:")
    with Client(router_node.endpoint, timeout=120) as client:
        prompts, params = mixed_requests(500, 12, seed=4)
        finals = run_concurrently(client, prompts, params)
        assert [f.token_ids for f in finals] == oracle(model_dir, prompts, params)
        assert token_ids(stream_all(client)) == reference
        wait_until_idle(client, also=lambda groups: set(groups) == {"prefill0", f"decode{node.index}"})
        groups = members(client)
    assert set(groups) == {"prefill0", f"decode{node.index}"}
    prefill, decode = groups["prefill0"], groups[f"decode{node.index}"]
    assert (prefill.tp, prefill.devices, prefill.joined, prefill.state) == (2, ["cpu", "cpu"], False, "ready")
    assert prefill.address.startswith(f"tcp://{ROUTER_NODE}:")
    assert (decode.tp, decode.devices, decode.joined, decode.state) == (1, ["cpu"], True, "ready")
    assert decode.address == node.address
    assert decode.dispatched == prefill.dispatched == 12 + len(PROMPTS)
    status = subprocess.run(
        [sys.executable, "launch.py", "--status", router_node.endpoint],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    rows = {line.split()[0]: line.split() for line in status.stdout.splitlines()[1:] if line.startswith(("p", "d"))}
    assert rows["prefill0"][1:5] == ["prefill", "2", "ready", "cpu,cpu"]
    assert rows[f"decode{node.index}"][1:6] == ["(joined)", "decode", "1", "ready", "cpu"]
    assert node.address in status.stdout and "0/200 (0%)" in status.stdout


@pytest.mark.slow
def test_a_decode_group_that_joins_under_load_starts_taking_requests(
    router_node: LaunchedCluster, nodes: GroupNodes, reference: list[list[int]]
) -> None:
    """Requests keep coming while a second decode group joins: once it is ready the router sends
    it some, and every request, before, during and after the join, gets the single engine's tokens."""
    joined: list[GroupNodeProcess] = []
    with Client(router_node.endpoint, timeout=120) as client:
        assert token_ids(stream_all(client, lambda: joined.append(nodes.start(GROUP_NODES[1])))) == reference
        (node,) = joined
        deadline = time.monotonic() + 120
        while members(client)[f"decode{node.index}"].dispatched == 0:
            assert time.monotonic() < deadline, "the joined group never got a request"
            assert token_ids(stream_all(client)) == reference
        assert len([m for m in members(client).values() if m.role == "decode" and m.state == "ready"]) == 2


@pytest.mark.slow
def test_a_group_drained_with_sigterm_under_load_loses_no_request(
    router_node: LaunchedCluster, reference: list[list[int]], nodes: GroupNodes
) -> None:
    """SIGTERM on the newest group node while that group decodes requests: the router sends it no
    new ones, it finishes those it holds (none moves: no migration), then it leaves and its node
    exits 0; every request gets the single engine's tokens, and the cluster serves on without it."""
    with Client(router_node.endpoint, timeout=120) as client, Client(router_node.endpoint, timeout=60) as watcher:
        decodes = sorted(g for g, m in members(watcher).items() if m.role == "decode")
        assert len(decodes) == 2, decodes
        victim_name = decodes[-1]
        node = next(n for n in nodes.running() if f"decode{n.index}" == victim_name)
        before = watcher.stats().faults

        def drain() -> None:
            wait_for("the group to hold a request", lambda: members(watcher)[victim_name].requests > 0, 30)
            node.proc.send_signal(signal.SIGTERM)

        assert token_ids(stream_all(client, drain)) == reference
        assert node.proc.wait(timeout=90) == 0, node.output()
        assert "left the cluster" in node.output()
        assert victim_name not in members(watcher)
        after = watcher.stats().faults
        assert after["migrated"] == before["migrated"] and after["group_failures"] == before["group_failures"]
        assert token_ids(stream_all(client)) == reference
        wait_until_idle(watcher)


@pytest.mark.slow
def test_a_group_killed_with_sigkill_is_removed_within_the_heartbeat_timeout(
    router_node: LaunchedCluster, reference: list[list[int]], nodes: GroupNodes
) -> None:
    """kill -9 of a group node mid-stream (its ranks die with it): the router removes the group
    when its heartbeats stop, within the heartbeat timeout, moves its requests to the decode group
    left, and every request still gets the single engine's tokens."""
    node = nodes.start(GROUP_NODES[2])
    victim = f"decode{node.index}"
    with Client(router_node.endpoint, timeout=120) as client, Client(router_node.endpoint, timeout=60) as watcher:
        wait_for("the new group to be ready", lambda: members(watcher)[victim].state == "ready", 30)

        def kill() -> None:
            wait_for("the group to hold a request", lambda: members(watcher)[victim].requests > 0, 30)
            node.proc.kill()

        before = watcher.stats().faults
        assert token_ids(stream_all(client, kill)) == reference
        wait_for("the group's removal", lambda: victim not in members(watcher), HEARTBEAT_TIMEOUT + 10)
        # The router's own account: how long the group had been silent when it was removed.
        silent = re.search(
            rf"decode group {node.index} \(joined at run time\) failed: rank 0 sent no heartbeat for ([\d.]+) s",
            router_node.output(),
        )
        assert silent is not None, router_node.output()[-3000:]
        assert float(silent.group(1)) < HEARTBEAT_TIMEOUT + 1
        after = watcher.stats().faults
        assert after["group_failures"] == before["group_failures"] + 1 and after["migrated"] > before["migrated"]
        assert after["restarts"] == before["restarts"], "a joined group is not the router node's to restart"
        assert token_ids(stream_all(client)) == reference


@pytest.mark.slow
def test_bad_joins_get_one_line_errors_and_change_nothing(
    router_node: LaunchedCluster, master_port: int, reference: list[list[int]], tmp_path: Path
) -> None:
    """A group node pointed at no router node, or with a TP the model cannot split, stops with one
    line; a ready message from a group the rendezvous never handed an index (a stranger) is
    refused with one line in the router node's log; the cluster serves on."""

    def join(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "launch.py", "--join", *args]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)

    nobody = join(f"{ROUTER_NODE}:{free_port(ROUTER_NODE)}", "--role", "decode")
    assert nobody.returncode != 0
    assert nobody.stderr.strip().splitlines()[-1].startswith("Error: no pdserve router node answers at"), nobody.stderr
    too_wide = join(f"{ROUTER_NODE}:{master_port}", "--role", "decode", "--tp", "16")
    assert too_wide.returncode != 0
    assert too_wide.stderr.strip().splitlines()[-1].startswith("Error: --tp 16:"), too_wide.stderr
    wrong_role = join(f"{ROUTER_NODE}:{master_port}", "--role", "colocated")
    assert "runs --mode disagg" in wrong_role.stderr.strip().splitlines()[-1], wrong_role.stderr
    router = connect_store(f"tcp://{ROUTER_NODE}:{master_port}", timeout_s=10).get("cluster/router").decode()
    stranger = zmq.Context.instance().socket(zmq.PUSH)
    stranger.connect(router)
    stranger.send(encode(Ready("decode", 99, 100, tp=1, address="tcp://127.0.0.9:9")))
    stranger.close(linger=1000)
    settings = json.loads(connect_store(f"tcp://{ROUTER_NODE}:{master_port}", timeout_s=10).get("cluster/settings"))
    assert settings["decode_groups"] == 0 and "master_addr" not in settings
    with Client(router_node.endpoint, timeout=120) as client:
        wait_for("the refusal in the log", lambda: "refused decode group 99" in router_node.output(), 10)
        assert "decode99" not in members(client)
        assert token_ids(stream_all(client)) == reference
    assert router_node.stop() == 0, router_node.output()[-4000:]
