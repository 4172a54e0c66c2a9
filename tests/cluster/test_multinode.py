"""A cluster over two (and more) nodes, as real processes on the CPU: the router node
(``launch.py --master-addr``) runs the router and a prefill group, group nodes (``launch.py
--join``) each run a decode group. Each node has its own run directory, and they reach each
other only over TCP: where the test may (root, with ``ip``), the router node and the group nodes
run in network namespaces of their own, joined by a veth pair (the test reaches the router's
client endpoint over a second one); elsewhere on distinct loopback addresses (Linux routes all
of 127/8 to lo). Groups join under load, leave with SIGTERM (drained) or die with SIGKILL
(removed after the heartbeat timeout); every request ends once, with the single engine's greedy
tokens.

The tests of this module run in order on one cluster: each starts from where the last left it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdserve.bench.compare import REPO, LoggedProcess
from pdserve.cluster.client import Chunk, Client, Error, Final
from pdserve.cluster.group import SAME_STOP_S, free_port
from pdserve.cluster.protocol import GroupInfo
from pdserve.engine.sampling import SamplingParams
from pdserve.tests.cluster.helpers import MAX_MODEL_LEN, mixed_requests, oracle, run_concurrently, wait_until_idle

HEARTBEAT_TIMEOUT = 3.0
# A process that reads the rendezvous like a group node, then claims a group index it never got.
STRANGER = """
import json, zmq
from pdserve.cluster.group import connect_store
from pdserve.cluster.protocol import Ready, encode
store = connect_store("tcp://{master}", timeout_s=10)
settings = json.loads(store.get("cluster/settings"))
assert settings["decode_groups"] == 0 and "master_addr" not in settings, settings
sock = zmq.Context.instance().socket(zmq.PUSH)
sock.connect(store.get("cluster/router").decode())
sock.send(encode(Ready("decode", 99, 100, tp=1, address="tcp://{address}:9")))
sock.close(linger=2000)
"""
MAX_TOKENS = 40
PROMPTS = [[17 + i] * (12 + 3 * i) + [42, 7, 99] for i in range(8)]


@dataclass
class Topology:
    """Where the nodes run: their addresses, and the namespace (if any) each kind of node runs in."""

    router_addr: str  # the router node's --master-addr
    client_host: str  # its --host: where the test reaches the client endpoint
    group_addrs: tuple[str, ...]  # one --advertise-addr per group node
    namespaces: dict[str, str] = field(default_factory=dict)  # "router" | "group" -> netns
    interfaces: dict[str, str] = field(default_factory=dict)  # "router" | "group" -> gloo's interface there

    def command(self, node: str, *argv: str) -> list[str]:
        """``python ARGV`` on a node of this kind."""
        netns = self.namespaces.get(node)
        return [*(["ip", "netns", "exec", netns] if netns else []), sys.executable, *argv]

    def env(self, node: str) -> dict[str, str]:
        interface = self.interfaces.get(node)
        return {**os.environ, **({"GLOO_SOCKET_IFNAME": interface} if interface else {})}

    def free_port(self) -> int:
        """A port nothing listens on at the router node's address (a fresh namespace has all
        free; below the range ZMQ and the OS hand out)."""
        return 29400 if self.namespaces else free_port(self.router_addr)


def _network_namespaces(tag: str) -> Topology | None:
    """Two namespaces, router and group, joined by a veth pair, and the router's reachable from
    here over another; None where the machine does not allow it."""
    if os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return None
    router, group = f"pdmn-r{tag}", f"pdmn-g{tag}"
    client_net = f"10.79.{int(tag) % 250}"  # apart from a namespace of an earlier run the kernel has yet to free
    steps = [
        f"netns add {router}",
        f"netns add {group}",
        f"link add pr{tag} type veth peer name pg{tag}",
        f"link set pr{tag} netns {router}",
        f"link set pg{tag} netns {group}",
        f"link add pc{tag} type veth peer name ph{tag}",
        f"link set pc{tag} netns {router}",
        f"-n {router} addr add 10.78.0.1/24 dev pr{tag}",
        f"-n {group} addr add 10.78.0.2/24 dev pg{tag}",
        f"-n {group} addr add 10.78.0.3/24 dev pg{tag}",
        f"-n {group} addr add 10.78.0.4/24 dev pg{tag}",
        f"-n {router} addr add {client_net}.1/24 dev pc{tag}",
        f"addr add {client_net}.254/24 dev ph{tag}",
        f"-n {router} link set pr{tag} up",
        f"-n {router} link set pc{tag} up",
        f"-n {router} link set lo up",
        f"-n {group} link set pg{tag} up",
        f"-n {group} link set lo up",
        f"link set ph{tag} up",
    ]
    for step in steps:
        if subprocess.run(["ip", *step.split()], capture_output=True).returncode != 0:
            _remove_namespaces(tag)
            return None
    return Topology(
        "10.78.0.1",
        f"{client_net}.1",
        ("10.78.0.2", "10.78.0.3", "10.78.0.4"),
        {"router": router, "group": group},
        {"router": f"pr{tag}", "group": f"pg{tag}"},
    )


def _remove_namespaces(tag: str) -> None:
    """The veth pair with an end here first: a deleted namespace, and the pairs with an end in it,
    go only when the kernel gets round to it (seconds later, or more)."""
    subprocess.run(["ip", "link", "del", f"ph{tag}"], capture_output=True)
    for netns in (f"pdmn-r{tag}", f"pdmn-g{tag}"):
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)


@pytest.fixture(scope="module")
def topology() -> Iterator[Topology]:
    tag = str(os.getpid() % 100_000)
    namespaces = _network_namespaces(tag)
    if namespaces is None:
        yield Topology("127.0.0.2", "127.0.0.1", ("127.0.0.3", "127.0.0.4", "127.0.0.5"))
        return
    try:
        yield namespaces
    finally:
        _remove_namespaces(tag)


class NodeProcess(LoggedProcess):
    """``launch.py ARGS`` on a node, its output in a log file; started on construction, returns
    once ``ready`` (a regex) matches the output."""

    def __init__(
        self, topology: Topology, node: str, args: list[str], log_path: Path, ready: str, timeout: float = 300.0
    ) -> None:
        self.start(topology.command(node, "launch.py", *args), log_path, topology.env(node))
        deadline = time.monotonic() + timeout
        while (found := re.search(ready, self.output())) is None:
            assert self.proc.poll() is None, f"{args[:2]} exited with {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"{args[:2]}: not ready in {timeout} s:\n{self.output()}"
            time.sleep(0.2)
        self.ready = found


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["tiny-llama-odd"]  # 9 query / 3 KV heads: prefill tp 2 splits them unevenly


@dataclass
class RouterNode:
    process: NodeProcess
    endpoint: str
    master: str  # its rendezvous, HOST:PORT

    def output(self) -> str:
        return self.process.output()


@pytest.fixture(scope="module")
def router_node(topology: Topology, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterNode]:
    """The router and one prefill group (tp 2); no decode group until one joins."""
    master_port = 29500 if topology.namespaces else free_port(topology.router_addr)
    port = 5555 if topology.namespaces else free_port(topology.client_host)
    args = ["--model", str(model_dir), "--max-model-len", str(MAX_MODEL_LEN), "--host", topology.client_host]
    args += ["--port", str(port), "--master-addr", topology.router_addr, "--master-port", str(master_port)]
    args += ["--prefill-tp", "2", "--decode-groups", "0", "--num-blocks", "200"]
    args += ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--drain-timeout", "60", "--restart-backoff", "0.5"]
    log = tmp_path_factory.mktemp("router-node") / "launch.log"
    process = NodeProcess(topology, "router", args, log, r"(?m)^endpoint (tcp://\S+)")
    try:
        yield RouterNode(process, process.ready.group(1), f"{topology.router_addr}:{master_port}")
    finally:
        process.kill()


class GroupNodes:
    """The decode group nodes (tp 1) of the module's cluster."""

    def __init__(self, topology: Topology, master: str, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.topology = topology
        self.master = master
        self.tmp_path_factory = tmp_path_factory
        self.started: list[NodeProcess] = []

    def start(self, number: int) -> NodeProcess:
        """Start group node ``number`` (its address is the topology's ``group_addrs[number]``)."""
        log = self.tmp_path_factory.mktemp("group-node") / "launch.log"
        advertise = self.topology.group_addrs[number]
        args = ["--join", self.master, "--advertise-addr", advertise, "--role", "decode", "--tp", "1"]
        node = NodeProcess(self.topology, "group", args, log, r"joined: \w+ group (\d+) at (\S+)")
        node.index, node.address = int(node.ready.group(1)), node.ready.group(2)
        self.started.append(node)
        return node

    def running(self) -> list[NodeProcess]:
        return [n for n in self.started if n.proc.poll() is None]


@pytest.fixture(scope="module")
def nodes(
    topology: Topology, router_node: RouterNode, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GroupNodes]:
    """Every group node a test starts is killed when the module ends."""
    nodes = GroupNodes(topology, router_node.master, tmp_path_factory)
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
    topology: Topology, router_node: RouterNode, nodes: GroupNodes, model_dir: Path, reference: list[list[int]]
) -> None:
    """A decode group joins from its own node: requests are prefilled on the router node (tp 2),
    their KV crosses to the other node (tp 1) over a pair group formed at run time, and the tokens
    are the single engine's. ``--status`` lists both groups with their role, TP, devices, address."""
    node = nodes.start(0)
    assert node.address.startswith(f"tcp://{topology.group_addrs[0]}:")
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
    assert prefill.address.startswith(f"tcp://{topology.router_addr}:")
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
    router_node: RouterNode, nodes: GroupNodes, reference: list[list[int]]
) -> None:
    """Requests keep coming while a second decode group joins: once it is ready the router sends
    it some, and every request, before, during and after the join, gets the single engine's tokens."""
    joined: list[NodeProcess] = []
    with Client(router_node.endpoint, timeout=120) as client:
        assert token_ids(stream_all(client, lambda: joined.append(nodes.start(1)))) == reference
        (node,) = joined
        deadline = time.monotonic() + 120
        while members(client)[f"decode{node.index}"].dispatched == 0:
            assert time.monotonic() < deadline, "the joined group never got a request"
            assert token_ids(stream_all(client)) == reference
        assert len([m for m in members(client).values() if m.role == "decode" and m.state == "ready"]) == 2


@pytest.mark.slow
def test_a_group_drained_with_sigterm_under_load_loses_no_request(
    router_node: RouterNode, reference: list[list[int]], nodes: GroupNodes
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
    router_node: RouterNode, reference: list[list[int]], nodes: GroupNodes
) -> None:
    """kill -9 of a group node mid-stream (its ranks die with it): the router removes the group
    when its heartbeats stop, within the heartbeat timeout, moves its requests to the decode group
    left, and every request still gets the single engine's tokens."""
    node = nodes.start(2)
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
def test_a_joined_group_whose_rank_dies_is_removed_at_once(
    router_node: RouterNode, reference: list[list[int]], nodes: GroupNodes
) -> None:
    """kill -9 of a joined group's rank, its node alive: the node tells the router, which
    removes the group and moves its requests at once; they used to wait for the heartbeat
    timeout. Every request still gets the single engine's tokens."""
    node = nodes.start(2)  # on the address of the node the test before killed
    victim = f"decode{node.index}"
    with Client(router_node.endpoint, timeout=120) as client, Client(router_node.endpoint, timeout=60) as watcher:
        wait_for("the new group to be ready", lambda: members(watcher)[victim].state == "ready", 30)
        (pid,) = [int(p) for p in re.findall(rf" {victim}\.0 INFO rank up: pid (\d+)", node.output())]

        def kill() -> None:
            wait_for("the group to hold a request", lambda: members(watcher)[victim].requests > 0, 30)
            os.kill(pid, signal.SIGKILL)

        assert token_ids(stream_all(client, kill)) == reference
        assert node.proc.wait(timeout=30) == 1, node.output()
        reported = f"decode group {node.index} (joined at run time) failed: its node reports: rank 0 was killed"
        assert reported in router_node.output(), router_node.output()[-3000:]
        assert victim not in members(watcher)
        assert token_ids(stream_all(client)) == reference


@pytest.mark.slow
def test_a_group_node_stopped_twice_leaves_at_once(router_node: RouterNode, model_dir: Path, nodes: GroupNodes) -> None:
    """A second SIGTERM while the group drains (as the launcher takes a second stop): the node
    leaves now, exit 0, and the router moves what the group held; the node used to ignore it
    and wait out the drain. The group's rank is stopped (SIGSTOP) first, so that the drain
    cannot end before the second stop (and the two stops come well within the heartbeat
    timeout). Each request still gets the single engine's tokens."""
    prompt, long = PROMPTS[0], 400
    (expected,) = oracle(model_dir, [prompt], [SamplingParams(max_tokens=long, temperature=0.0, ignore_eos=True)])
    node = nodes.start(2)  # on the address of the nodes the tests before ended
    victim = f"decode{node.index}"
    with Client(router_node.endpoint, timeout=120) as client, Client(router_node.endpoint, timeout=60) as watcher:
        wait_for("the new group to be ready", lambda: members(watcher)[victim].state == "ready", 30)
        (pid,) = [int(p) for p in re.findall(rf" {victim}\.0 INFO rank up: pid (\d+)", node.output())]
        before = watcher.stats().faults
        ids = [client.submit(token_ids=prompt, max_tokens=long, temperature=0.0, ignore_eos=True) for _ in range(4)]
        # Decoding (its worker's report), not only dispatched to it: a request whose prefill has
        # not ended yet goes to another group once this one drains.
        decoding = lambda: watcher.stats().groups.get(victim, {}).get("running", 0) > 0  # noqa: E731
        wait_for("the group to decode a request", decoding, 30)
        os.kill(pid, signal.SIGSTOP)
        node.proc.send_signal(signal.SIGTERM)
        wait_for("the drain", lambda: "drains:" in node.output(), 2)
        time.sleep(SAME_STOP_S + 0.1)  # a second stop, not the same one sent twice
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(timeout=30) == 0, node.output()
        assert [client.result(i).token_ids for i in ids] == [expected] * len(ids)
        assert "left the cluster at once" in node.output()
        assert f"decode group {node.index} (joined at run time) failed: its node reports" in router_node.output()
        assert victim not in members(watcher) and watcher.stats().faults["migrated"] > before["migrated"]


@pytest.mark.slow
def test_a_restarted_group_of_the_router_node_meets_the_joined_groups_again(
    router_node: RouterNode, reference: list[list[int]]
) -> None:
    """A prefill rank on the router node is killed mid-stream: its group restarts as generation 1,
    and at its ready the router introduces it to the joined decode group (their first pair group
    died with it), so requests flow across the nodes again; every request, moved or not, gets the
    single engine's tokens."""
    (pid,) = [int(p) for p in re.findall(r" prefill0\.1 INFO rank up: pid (\d+), generation 0", router_node.output())]
    with Client(router_node.endpoint, timeout=120) as client, Client(router_node.endpoint, timeout=60) as watcher:
        before = watcher.stats().faults
        assert token_ids(stream_all(client, lambda: os.kill(pid, signal.SIGKILL), after_chunks=4)) == reference
        wait_for("the restart", lambda: watcher.stats().faults["restarts"] == before["restarts"] + 1, 60)
        wait_for("the prefill group back", lambda: members(watcher)["prefill0"].state == "ready", 90)
        assert token_ids(stream_all(client)) == reference
        assert [m.state for m in members(watcher).values()] == ["ready", "ready"]


@pytest.mark.slow
def test_bad_joins_get_one_line_errors_and_change_nothing(
    topology: Topology, router_node: RouterNode, nodes: GroupNodes, reference: list[list[int]]
) -> None:
    """A group node pointed at no router node, or with a TP the model cannot split, stops with one
    line; a ready message from a group the rendezvous never handed an index (a stranger on a group
    node's machine) is refused with one line in the router node's log; the cluster serves on. Runs
    last: then SIGTERM on the router node stops the whole cluster, the group nodes with exit 0."""

    def on_group_node(*argv: str) -> subprocess.CompletedProcess[str]:
        command = topology.command("group", *argv)
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, env=topology.env("group"))

    nobody = on_group_node(
        "launch.py",
        "--join",
        f"{topology.router_addr}:{topology.free_port()}",
        "--role",
        "decode",
        "--join-timeout",
        "2",
    )
    assert nobody.returncode != 0
    assert re.match(r"Error: no pdserve router node answers at \S+ within 2 s", nobody.stderr.strip().splitlines()[-1])
    assert "frame #" not in nobody.stderr  # one line, not torch's C++ stacks of each try
    too_wide = on_group_node("launch.py", "--join", router_node.master, "--role", "decode", "--tp", "16")
    assert too_wide.returncode != 0
    assert too_wide.stderr.strip().splitlines()[-1].startswith("Error: --tp 16:"), too_wide.stderr
    wrong_role = on_group_node("launch.py", "--join", router_node.master, "--role", "colocated")
    assert "runs --mode disagg" in wrong_role.stderr.strip().splitlines()[-1], wrong_role.stderr
    elsewhere = on_group_node(
        "launch.py", "--join", router_node.master, "--role", "decode", "--advertise-addr", "10.255.255.1"
    )
    assert elsewhere.returncode != 0
    last = elsewhere.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: --advertise-addr 10.255.255.1: not an address of this machine"), elsewhere.stderr
    too_few = on_group_node("launch.py", "--join", router_node.master, "--role", "decode", "--num-blocks", "1")
    assert too_few.returncode != 0
    assert too_few.stderr.strip().splitlines()[-1].startswith("Error: --num-blocks 1 holds 16 tokens"), too_few.stderr
    stranger = on_group_node("-c", STRANGER.format(master=router_node.master, address=topology.group_addrs[0]))
    assert stranger.returncode == 0, stranger.stderr
    with Client(router_node.endpoint, timeout=120) as client:
        wait_for("the refusal in the log", lambda: "refused decode group 99" in router_node.output(), 10)
        assert "decode99" not in members(client)
        assert token_ids(stream_all(client)) == reference
    assert router_node.process.stop() == 0, router_node.output()[-4000:]
    for node in nodes.running():  # the router's shutdown stopped their groups too
        assert node.proc.wait(timeout=60) == 0, node.output()[-3000:]


@pytest.mark.slow
def test_a_group_node_whose_router_node_dies_exits_with_one_line(
    topology: Topology, model_dir: Path, nodes: GroupNodes, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SIGKILL on the router node: its group nodes stop their ranks and exit 1 with one line,
    not torch's C++ stack of a store call on a closed connection. Its own router node: the
    module's stopped in the test before."""
    master_port = topology.free_port()
    args = ["--model", str(model_dir), "--max-model-len", str(MAX_MODEL_LEN), "--host", topology.client_host]
    port = 5555 if topology.namespaces else free_port(topology.client_host)
    args += ["--port", str(port), "--master-addr", topology.router_addr]
    args += ["--master-port", str(master_port), "--decode-groups", "0", "--num-blocks", "100"]
    log = tmp_path_factory.mktemp("dying-router-node") / "launch.log"
    with NodeProcess(topology, "router", args, log, r"(?m)^endpoint (tcp://\S+)") as router:
        nodes.master = f"{topology.router_addr}:{master_port}"
        node = nodes.start(0)
        router.proc.kill()
        assert node.proc.wait(timeout=60) == 1, node.output()[-3000:]
    assert f"the router node at {nodes.master} is gone" in node.output().strip().splitlines()[-1]
    assert "frame #" not in node.output(), node.output()[-3000:]
