"""Process failures in a real cluster (``launch.py`` on CPU, the demo model): ranks killed with
SIGKILL or stopped with SIGSTOP under load, KV leases, a client that goes silent, and the
router's own death. Every request must end exactly once, its output (greedy, or sampled with a
seed) must match an uninterrupted run token for token, and every KV block must come back."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.bench.compare import LaunchedCluster
from pdserve.bench.soak import rank_pids
from pdserve.cluster.client import Chunk, Client, ClusterError, ClusterGone, ClusterUnavailable, Error, Final
from pdserve.cluster.group import free_port
from pdserve.engine.sampling import SamplingParams
from pdserve.tests.cluster.helpers import front_end_pids, oracle, wait_until_idle

HEARTBEAT_TIMEOUT = 3.0
CLIENT_HEARTBEAT_TIMEOUT = 2.0
SERVING_AGAIN_S = 90.0  # back-off + a group's start on a busy 2-core machine, with room
PROMPTS = [[17 + i] * (12 + 3 * i) + [42, 7, 99] for i in range(10)]
MAX_TOKENS = 48
# Half greedy, half sampled with a seed: a moved request's draws depend on its seed and each
# token's position, so it goes on as it would have on its first group.
SAMPLING = [
    {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
    if i % 2 == 0
    else {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.9, "top_k": 60, "seed": 1000 + i}
    for i in range(len(PROMPTS))
]
# A moved request's output so far counts as output for its penalties and min_tokens, as on its
# first group: otherwise its later tokens would differ from an uninterrupted run's.
for i in range(0, len(PROMPTS), 3):
    SAMPLING[i] |= {"frequency_penalty": 0.8, "presence_penalty": 0.4, "repetition_penalty": 1.2}
for i in range(1, len(PROMPTS), 4):
    SAMPLING[i] |= {"min_tokens": MAX_TOKENS, "stop_token_ids": list(range(0, 1000, 2))}


def serving(client: Client, restarts: int) -> dict[str, dict[str, int]]:
    """Wait until ``restarts`` restarts are done, every group is ready and reporting, and every
    block is free; the groups' stats."""
    deadline = time.monotonic() + SERVING_AGAIN_S
    while True:
        stats = client.stats()
        if stats.ready and stats.faults["restarts"] >= restarts and len(stats.groups) == 2:
            break
        assert time.monotonic() < deadline, f"not serving again within {SERVING_AGAIN_S} s: {stats}"
        time.sleep(0.3)
    return wait_until_idle(client, also=lambda groups: len(groups) == 2)


def run_with_fault(client: Client, act: callable, after_chunks: int = 12) -> dict[int, Final | Error]:
    """Stream every prompt (``SAMPLING``), call ``act`` once ``after_chunks`` chunks have arrived,
    and collect each request's one terminal message, checking that its chunks add up to its final."""
    ids = {client.submit(token_ids=p, stream=True, **SAMPLING[i]): i for i, p in enumerate(PROMPTS)}
    streamed: dict[int, list[int]] = {i: [] for i in ids.values()}
    terminal: dict[int, Final | Error] = {}
    chunks = 0
    deadline = time.monotonic() + 300
    while len(terminal) < len(ids):
        assert time.monotonic() < deadline, f"requests without a terminal message: {set(ids.values()) - set(terminal)}"
        message = client.receive()
        index = ids[message.request_id]
        assert index not in terminal, f"request {index} got a message after its terminal one: {message}"
        if isinstance(message, Chunk):
            streamed[index] += message.token_ids
            chunks += 1
            if chunks == after_chunks:
                act()
        else:
            terminal[index] = message
            if isinstance(message, Final):
                assert streamed[index] == message.token_ids, f"request {index}: the stream repeats or skips a token"
    timeout, client.timeout = client.timeout, 0.5
    try:
        with pytest.raises(ClusterUnavailable):  # nothing may follow a terminal message
            print("a message after every request ended:", client.receive())
    finally:
        client.timeout = timeout
    return terminal


@pytest.fixture(scope="module")
def cluster(cluster_factory) -> LaunchedCluster:
    return cluster_factory(
        "--model",
        "demo",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "2",
        "--num-blocks",
        "300",
        "--heartbeat-timeout",
        str(HEARTBEAT_TIMEOUT),
        "--restart-backoff",
        "0.5",
        "--client-heartbeat-timeout",
        str(CLIENT_HEARTBEAT_TIMEOUT),
    )


@pytest.fixture(scope="module")
def expected(demo_model_dir: Path) -> list[list[int]]:
    """The prompts' outputs (``SAMPLING``) from the single-process engine."""
    params = [SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()}) for s in SAMPLING]
    return oracle(demo_model_dir, PROMPTS, params)


@pytest.fixture(scope="module")
def reference(cluster: LaunchedCluster, expected: list[list[int]]) -> list[list[int]]:
    """The prompts' outputs (``SAMPLING``) on the cluster before any failure: the single engine's."""
    with Client(cluster.endpoint, timeout=120) as client:
        ids = [client.submit(token_ids=p, **SAMPLING[i]) for i, p in enumerate(PROMPTS)]
        outputs = [client.result(i).token_ids for i in ids]
    assert outputs == expected
    return outputs


@pytest.fixture
def client(cluster: LaunchedCluster) -> Iterator[Client]:
    with Client(cluster.endpoint, timeout=120) as client:
        yield client


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, victim",
    [
        ("SIGKILL", "decode0.1"),
        ("SIGKILL", "prefill0.1"),
        ("SIGKILL", "prefill0.0"),
        ("SIGKILL", "decode0.0"),
        ("SIGSTOP", "decode0.1"),
        ("SIGSTOP", "prefill0.0"),
    ],
)
def test_a_failed_group_restarts_and_its_requests_finish_as_if_nothing_happened(
    cluster: LaunchedCluster, reference: list[list[int]], client: Client, how: str, victim: str
) -> None:
    """Mid-stream, one rank is killed (or stopped: only its heartbeats tell). Its whole group is
    restarted; requests it held move to the restarted group, prefilled again with their tokens so
    far: each ends once, with the tokens of an uninterrupted run and no token repeated or
    skipped in its stream; the cluster serves again and every block is free afterwards."""
    before = client.stats().faults
    pid = rank_pids(cluster.output())[victim]
    terminal = run_with_fault(client, lambda: os.kill(pid, getattr(signal, how)))
    errors = {i: m for i, m in terminal.items() if isinstance(m, Error)}
    assert not errors, errors
    assert [terminal[i].token_ids for i in range(len(PROMPTS))] == reference
    serving(client, restarts=before["restarts"] + 1)
    after = client.stats().faults
    # A stopped rank can hold up its pair in a blocking (gloo) transfer too: then both restart.
    assert after["group_failures"] >= before["group_failures"] + 1, after
    if victim.startswith("decode"):  # every request was decoding there when it failed
        assert after["migrated"] > before["migrated"], after
    if how == "SIGSTOP":
        group = victim.split(".")[0]
        assert re.search(
            rf"{group[:-1]} group {group[-1]} \(generation \d+\) failed: rank \d sent no heartbeat", cluster.output()
        )
    # Served again, by the new generation.
    assert client.generate(token_ids=PROMPTS[1], **SAMPLING[1]).token_ids == reference[1]


@pytest.mark.slow
def test_a_client_that_goes_silent_has_its_requests_aborted(cluster: LaunchedCluster, client: Client) -> None:
    """A client process stopped mid-request (its connection stays open, its ZMQ heartbeats stop):
    the router drops it after its heartbeat timeout and aborts its requests on the workers, long
    before they would have finished."""
    script = (
        "import sys, time\n"
        "from pdserve.cluster.client import Client\n"
        f"c = Client({cluster.endpoint!r}, heartbeat_timeout={CLIENT_HEARTBEAT_TIMEOUT})\n"
        "ids = [c.submit(token_ids=[5, 6, 7], stream=True, max_tokens=400, ignore_eos=True) for _ in range(4)]\n"
        "print('sent', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"sent\n"
        deadline = time.monotonic() + 30
        while client.stats().groups.get("decode0", {}).get("running", 0) < 4:
            assert time.monotonic() < deadline, "the silent client's requests never started decoding"
            time.sleep(0.1)
        proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until_idle(client, timeout=CLIENT_HEARTBEAT_TIMEOUT + 15)
        assert time.monotonic() - stopped < CLIENT_HEARTBEAT_TIMEOUT + 15
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_clients_learn_at_once_that_the_router_died_and_nothing_is_left_behind(cluster: LaunchedCluster) -> None:
    """kill -9 of launch.py (the router's process): a waiting client raises ClusterGone within its
    heartbeat timeout instead of its 120 s reply timeout, every rank exits, and the run directory
    is removed. Runs last: it ends the module's cluster."""
    run_dir = Path(re.search(r"run directory (\S+)", cluster.output()).group(1))
    pids = list(rank_pids(cluster.output()).values())
    assert run_dir.is_dir()
    with Client(cluster.endpoint, timeout=120, heartbeat_timeout=CLIENT_HEARTBEAT_TIMEOUT) as client:
        request_id = client.submit(token_ids=[5, 6, 7], stream=True, max_tokens=400, ignore_eos=True)
        next(client.chunks(request_id))
        cluster.proc.kill()
        killed = time.monotonic()
        with pytest.raises(ClusterGone):
            for _ in client.chunks(request_id):
                pass
        assert time.monotonic() - killed < CLIENT_HEARTBEAT_TIMEOUT + 1
    cluster.proc.wait()
    deadline = time.monotonic() + 10
    while run_dir.exists() or any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, (
            f"left behind: run dir {run_dir.exists()}, ranks {[p for p in pids if _alive(p)]}"
        )
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie is dead


@pytest.mark.slow
def test_kv_no_decode_group_accepts_is_freed_when_its_lease_expires(cluster_factory) -> None:
    """A decode pool held by a long request (400 prompt tokens, 25 of its 40 blocks, growing)
    refuses a 250-token request's KV (16 blocks) for as long as it decodes: with a 1 s lease the
    prefill side frees that KV, and with no move allowed the request ends with worker_failed;
    every block on both sides comes back."""
    cluster = cluster_factory(
        "--model",
        "demo",
        "--transfer",
        "gloo-async",
        "--num-blocks",
        "40",
        "--kv-lease-timeout",
        "1",
        "--migration-limit",
        "0",
    )
    with Client(cluster.endpoint, timeout=120) as client:
        hog = client.submit(token_ids=[3] * 400, max_tokens=100, ignore_eos=True)
        deadline = time.monotonic() + 60
        while client.stats().groups.get("decode0", {}).get("running", 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        blocked = client.submit(token_ids=[9] * 250, max_tokens=10, ignore_eos=True)
        with pytest.raises(ClusterError) as failed:
            client.result(blocked)
        assert failed.value.code == "worker_failed" and "kv_lease_expired" in str(failed.value)
        assert client.stats().groups.get("decode0", {}).get("running", 0) == 1, (
            "the hog ended first: no lease was tested"
        )
        assert len(client.result(hog).token_ids) == 100
        groups = wait_until_idle(client, also=lambda groups: groups["prefill0"]["kv_transfer_failures"] >= 1)
        assert groups["prefill0"]["kv_transfer_failures"] == 1  # the expired lease, and nothing else
    assert cluster.stop() == 0, cluster.output()[-4000:]


@pytest.mark.slow
def test_a_killed_http_front_end_is_started_again_and_zmq_clients_never_notice(cluster_factory) -> None:
    """kill -9 of the HTTP front end (it holds nothing but its own clients' connections): a ZMQ
    client's stream runs on to its final, and the launcher starts the front end again."""
    port = free_port()
    cluster = cluster_factory("--model", "demo", "--http-port", str(port))
    (killed,) = front_end_pids(cluster.proc.pid)
    with Client(cluster.endpoint, timeout=120) as client:
        request_id = client.submit(token_ids=[5, 6, 7], stream=True, max_tokens=100, ignore_eos=True)
        chunks = client.chunks(request_id)
        next(chunks)
        os.kill(killed, signal.SIGKILL)
        final = list(chunks)[-1]
        assert isinstance(final, Final) and len(final.token_ids) == 100
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                break
        assert time.monotonic() < deadline, f"the front end is not back:\n{cluster.output()[-3000:]}"
        time.sleep(0.3)
    (restarted,) = front_end_pids(cluster.proc.pid)
    assert restarted != killed
    assert "the HTTP front end was killed by SIGKILL" in cluster.output()
    assert cluster.stop() == 0, cluster.output()[-4000:]


def test_an_http_front_end_past_its_restarts_stays_down_and_zmq_serves_on(cluster_factory) -> None:
    """With --max-restarts 0 a killed HTTP front end is not started again: the launcher says the
    port has no front end left, the ZMQ endpoint still serves, and the cluster stops cleanly."""
    port = free_port()
    cluster = cluster_factory("--model", "demo", "--http-port", str(port), "--max-restarts", "0")
    (killed,) = front_end_pids(cluster.proc.pid)
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while f"no HTTP front end is left on port {port}; the ZMQ endpoint serves on" not in cluster.output():
        assert time.monotonic() < deadline, cluster.output()[-3000:]
        time.sleep(0.2)
    assert front_end_pids(cluster.proc.pid) == []
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    with Client(cluster.endpoint, timeout=120) as client:
        assert len(client.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True).token_ids) == 4
    assert cluster.stop() == 0, cluster.output()[-4000:]


@pytest.mark.slow
def test_a_rank_whose_loop_hangs_is_ended_by_its_watchdog_and_its_group_restarts(
    cluster_factory, expected: list[list[int]]
) -> None:
    """A decode peer stopped mid-stream leaves its leader waiting in a collective, its process
    running and sending heartbeats (their timeout is set past the test's length, so only the
    watchdog can tell): the leader's watchdog ends it with every thread's stack in the log, the
    group restarts, and every request ends once with the tokens of an uninterrupted run."""
    cluster = cluster_factory(
        "--model",
        "demo",
        "--decode-tp",
        "2",
        "--transfer",
        "gloo-async",  # a blocking transfer may hold a loop for its lease, longer than this watchdog
        "--num-blocks",
        "300",
        "--heartbeat-timeout",
        "3600",
        "--watchdog-timeout",
        "5",
        "--restart-backoff",
        "0.5",
    )
    with Client(cluster.endpoint, timeout=120) as client:
        ids = [client.submit(token_ids=p, **SAMPLING[i]) for i, p in enumerate(PROMPTS)]
        reference = [client.result(i).token_ids for i in ids]
        assert reference == expected
        before = client.stats().faults
        stopped = rank_pids(cluster.output())["decode0.1"]
        terminal = run_with_fault(client, lambda: os.kill(stopped, signal.SIGSTOP))
        errors = {i: m for i, m in terminal.items() if isinstance(m, Error)}
        assert not errors, errors
        assert [terminal[i].token_ids for i in range(len(PROMPTS))] == reference
        serving(client, restarts=before["restarts"] + 1)
        assert client.stats().faults["migrated"] > before["migrated"]
    log = cluster.output()
    assert re.search(r"decode group 0 \(generation 0\) failed: rank \d was ended by its watchdog", log), log[-4000:]
    assert "the serve loop made no progress" in log
    assert "(most recent call first)" in log and " in _lead" in log  # every stack, the serve loop's too
    assert "sent no heartbeat" not in log
    assert cluster.stop() == 0, log[-4000:]


@pytest.mark.slow
def test_a_cluster_that_gives_up_ends_every_request_with_its_error(cluster_factory) -> None:
    """With no restart left, the last decode group's failure stops the cluster: every client
    reads why, over ZMQ and over HTTP (streamed or not), and none a cut connection."""
    port = free_port()
    cluster = cluster_factory("--model", "demo", "--http-port", str(port), "--max-restarts", "0")
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    plain: list[httpx.Response] = []
    posting = threading.Thread(target=lambda: plain.append(httpx.post(url, json=body, timeout=120)))
    with (
        Client(cluster.endpoint, timeout=120) as client,
        httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as stream,
    ):
        posting.start()
        chunks = client.chunks(client.submit(token_ids=[5, 6, 7], stream=True, max_tokens=400, ignore_eos=True))
        next(chunks)
        events = (line for line in stream.iter_lines() if line)
        assert '"text"' in next(events)  # decoding
        deadline = time.monotonic() + 60
        while client.stats().requests_in_flight < 3:  # the plain request too
            assert time.monotonic() < deadline, "the non-streamed request never came in"
            time.sleep(0.1)
        os.kill(rank_pids(cluster.output())["decode0.0"], signal.SIGKILL)
        with pytest.raises(ClusterError) as failed:
            list(chunks)
        rest = list(events)
        posting.join(timeout=60)
    assert failed.value.code == "worker_failed" and "every decode group failed for good" in str(failed.value)
    assert rest[-1] == "data: [DONE]", rest[-3:]
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "worker_failed", rest[-3:]
    (response,) = plain
    assert response.status_code == 503 and response.json()["error"]["code"] == "worker_failed", response.text
    assert cluster.proc.wait(timeout=60) == 1
    log = cluster.output()
    assert "stays down: it failed after 0 restart(s) in a row (--max-restarts 0)" in log
    assert " moves (move " not in log, log[-3000:]  # nowhere to go: ended, not moved
