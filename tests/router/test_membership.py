"""Groups that join and leave a running cluster, on the router's side, in one process: stand-in
leaders are plain sockets, so every message the router sends them is checked (introductions,
drains, removals)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import zmq

from pdserve.cluster.config import Addresses, ClusterConfig
from pdserve.cluster.protocol import (
    CacheEvents,
    Drain,
    Error,
    Final,
    Generate,
    GroupFailed,
    GroupInfo,
    PeerFailed,
    PeerRestarted,
    Ping,
    Ready,
    Sampling,
    Shutdown,
    Stats,
    StatsRequest,
    TokenOutput,
    TokenOutputs,
    WorkerStats,
    WorkRequest,
    encode,
    prefix_hashes,
)
from pdserve.router.router import PING_S, Router
from pdserve.tests.router.helpers import RouterRig


@dataclass
class Rig(RouterRig):
    run_dir: str = ""
    admitted: list[Ready] = field(default_factory=list)
    refusal: str | None = None

    def admit(self, ready: Ready) -> str | None:
        self.admitted.append(ready)
        return self.refusal

    def inbox(self, role: str, group: int) -> str:
        """Bind a stand-in leader's inbox; its address."""
        address = f"ipc://{self.run_dir}/{role}{group}"
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.bind(address)
        self.inboxes[(role, group)] = sock
        return address

    def join(self, role: str, group: int, tp: int = 1) -> str:
        address = self.inbox(role, group)
        self.worker(Ready(role, group, 100, tp=tp, address=address))
        return address

    def generate(self, request_id: str) -> None:
        sampling = Sampling(max_tokens=4, temperature=0.0)
        self.client.send(encode(Generate(request_id=request_id, token_ids=[5, 6, 7], sampling=sampling)))
        self.pump()


def _rig(tmp_path_factory: pytest.TempPathFactory, **settings: object) -> Iterator[Rig]:
    """A router with one prefill group of its own and no decode group: decode groups join."""
    config = ClusterConfig.from_settings({"decode_groups": 0, "master_addr": "127.0.0.1", **settings})
    run_dir = str(tmp_path_factory.mktemp("run"))
    addresses = Addresses(run_dir, f"ipc://{run_dir}/client")
    ctx = zmq.Context.instance()
    rig = Rig(None, ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH), {}, run_dir)  # type: ignore[arg-type]
    rig.inbox("prefill", 0)
    rig.router = Router(config, addresses, None, vocab_size=1000, max_model_len=256, admit=rig.admit)
    rig.client.connect(addresses.client)
    rig.to_router.connect(addresses.router)
    rig.worker(Ready("prefill", 0, 100))
    try:
        yield rig
    finally:
        rig.close()


@pytest.fixture
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    yield from _rig(tmp_path_factory, drain_timeout=60)


@pytest.fixture
def impatient_rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    yield from _rig(tmp_path_factory, dispatch_timeout=2.0)


def test_a_client_gone_while_its_request_waits_for_a_group_has_it_aborted(rig: Rig) -> None:
    """Nothing goes to a client while its request waits for a group, so the router pings it: one
    that is gone had its requests held, a drain waiting on them, until the dispatch timeout."""
    rig.generate("here")
    gone = zmq.Context.instance().socket(zmq.DEALER)
    gone.connect(rig.router.addresses.client)
    sampling = Sampling(max_tokens=4, temperature=0.0)
    gone.send(encode(Generate(request_id="gone", token_ids=[5, 6, 7], sampling=sampling)))
    rig.pump(0.2)
    assert len(rig.router.parked) == 2
    gone.close(linger=0)
    rig.pump(2 * PING_S + 0.5)  # parked that long, then pinged
    assert len(rig.router.parked) == 1 and len(rig.router.requests) == 1  # the one whose client is here
    assert Ping() in rig.replies(pings=True)


def test_a_gone_clients_waiting_requests_expire_without_ending_the_router(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two requests of a client that left wait out the dispatch timeout before a ping finds it
    gone: the first one's no_group cannot reach it, which drops the client's other request too,
    and the expiry then went on to delete that one again: a KeyError out of the router's poll,
    which takes the whole cluster down (review)."""
    for rig in _rig(tmp_path_factory, dispatch_timeout=0.3):
        gone = zmq.Context.instance().socket(zmq.DEALER)
        gone.connect(rig.router.addresses.client)
        sampling = Sampling(max_tokens=4, temperature=0.0)
        for request_id in ("a", "b"):
            gone.send(encode(Generate(request_id=request_id, token_ids=[5, 6, 7], sampling=sampling)))
        rig.pump(0.1)
        assert len(rig.router.parked) == 2
        gone.close(linger=0)
        rig.pump(0.5)  # past the timeout, before a ping
        assert not rig.router.parked and not rig.router.requests
        rig.generate("here")  # and it still serves
        assert len(rig.router.parked) == 1


def test_a_group_joins_by_its_ready_and_meets_the_other_role(rig: Rig) -> None:
    """A request waits while no decode group exists; a decode group's ready (admitted) introduces
    it to the prefill group and back, with each one's address, and the request goes out naming it."""
    rig.generate("r1")
    assert rig.received("prefill", 0) == []
    assert not rig.router.all_ready()
    address = rig.join("decode", 5, tp=2)
    assert [(r.role, r.group, r.tp) for r in rig.admitted] == [("decode", 5, 2)]
    assert rig.received("decode", 5) == [PeerRestarted("prefill", 0, 0, rig.router.leader_addresses[("prefill", 0)])]
    introduced, work = rig.received("prefill", 0)
    assert introduced == PeerRestarted("decode", 5, 0, address)
    assert isinstance(work, WorkRequest) and work.decode_group == 5
    assert rig.router.all_ready()
    (prefill, joined) = rig.router.members()
    assert (joined.role, joined.group, joined.tp, joined.state, joined.joined) == ("decode", 5, 2, "ready", True)
    assert (joined.address, joined.requests, joined.dispatched) == (address, 1, 1)
    assert (prefill.joined, prefill.dispatched) == (False, 1)


def test_the_cluster_serves_while_each_role_has_a_ready_group(rig: Rig) -> None:
    """``stats.unserved_roles`` (what an HTTP front end's /health answers by) lists each role a
    request passes through that has no ready group; ``stats.ready`` needs every group."""

    def stats() -> Stats:
        rig.client.send(encode(StatsRequest()))
        (reply,) = rig.replies()
        assert isinstance(reply, Stats)
        return reply

    assert (stats().unserved_roles, stats().ready) == (["decode"], False)  # no decode group yet
    rig.join("decode", 5)
    rig.join("decode", 6)
    assert (stats().unserved_roles, stats().ready) == ([], True)
    rig.router.group_failed("decode", 5, "killed")
    assert stats().unserved_roles == []  # decode6 serves on
    rig.router.group_failed("decode", 6, "killed")
    assert (stats().unserved_roles, stats().ready) == (["decode"], False)


def test_stats_count_the_routers_requests_and_age_each_groups_report(rig: Rig) -> None:
    """A leader reports between engine steps, so during a long step its report is old: ``stats``
    says how old, beside the requests the router itself has in flight on each group."""
    rig.join("decode", 5)
    rig.received("prefill", 0)
    rig.generate("r1")

    def members() -> list[GroupInfo]:
        rig.client.send(encode(StatsRequest()))
        (stats,) = rig.replies()
        assert isinstance(stats, Stats)
        return stats.members

    prefill, decode = members()
    assert (prefill.requests, decode.requests) == (1, 1)
    assert (prefill.stats_age, decode.stats_age) == (None, None)  # no report yet
    rig.worker(WorkerStats("decode", 5, 100, 100, 0, 0, 0, 0))
    rig.pump(0.3)
    age = members()[1].stats_age
    assert age is not None and 0.3 <= age < 5
    rig.pump(0.2)
    assert members()[1].stats_age >= age + 0.2  # type: ignore[operator]
    rig.worker(WorkerStats("decode", 5, 100, 90, 1, 0, 0, 0))
    assert members()[1].stats_age < 0.2  # type: ignore[operator]
    rig.worker(WorkerStats("prefill", 0, 100, 90, 1, 0, 0, 0))
    rig.router.group_failed("prefill", 0, "killed")  # its next generation's report starts afresh
    assert [(m.state, m.stats_age is None) for m in members()] == [("down", True), ("ready", False)]


def test_pairs_count_as_formed_once_each_ready_group_reports_none_forming(rig: Rig) -> None:
    """What the launcher waits for before it prints its endpoint: a report from every ready group,
    since it got ready, with no KV pair still forming; a failed group's old report does not count."""
    assert rig.router.pairs_forming() == ["prefill0"]  # ready, no report yet
    rig.join("decode", 5)
    assert rig.router.pairs_forming() == ["decode5", "prefill0"]
    rig.worker(WorkerStats("prefill", 0, 100, 100, 0, 0, 0, 0))
    rig.worker(WorkerStats("decode", 5, 100, 100, 0, 0, 0, 0, pairs_forming=1))
    assert rig.router.pairs_forming() == ["decode5"]
    rig.worker(WorkerStats("decode", 5, 100, 100, 0, 0, 0, 0))
    assert rig.router.pairs_forming() == []
    rig.router.group_failed("prefill", 0, "killed")
    assert rig.router.pairs_forming() == []  # not ready: nothing to wait for
    rig.router.group_restarting("prefill", 0, 1)
    rig.worker(Ready("prefill", 0, 100))
    assert rig.router.pairs_forming() == ["prefill0"]


def test_a_stranger_is_refused_with_one_line(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    rig.refusal = "this cluster's rendezvous never handed out decode group index 9"
    with caplog.at_level(logging.WARNING):
        rig.join("decode", 9)
    assert "refused decode group 9" in caplog.text and "never handed out" in caplog.text
    assert rig.received("prefill", 0) == [] and rig.received("decode", 9) == []
    assert [m.group for m in rig.router.members() if m.role == "decode"] == []


def test_only_a_joined_groups_node_may_report_it_failed(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """A group node's report of its own group's failure reaches the supervisor at once; a report
    of a group of the router's node (its own launcher supervises it) or of none is ignored."""
    rig.join("decode", 5)
    rig.worker(GroupFailed("decode", 5, "rank 0 was killed by SIGKILL"))
    rig.worker(GroupFailed("prefill", 0, "forged"))
    rig.worker(GroupFailed("decode", 9, "forged"))
    rig.pump()
    assert rig.router.reported_failures() == [("decode", 5, "its node reports: rank 0 was killed by SIGKILL")]
    assert rig.router.reported_failures() == []
    assert caplog.text.count("ignored a failure report") == 2


def test_a_drained_group_takes_no_new_request_and_leaves_once_it_holds_none(rig: Rig) -> None:
    rig.join("decode", 5)
    rig.join("decode", 6)
    for key in (("prefill", 0), ("decode", 5), ("decode", 6)):
        rig.received(*key)  # the introductions
    rig.generate("r1")
    (first,) = rig.received("prefill", 0)
    draining = first.decode_group
    other = 11 - draining
    rig.worker(Drain("decode", draining))
    assert {m.group: m.state for m in rig.router.members() if m.role == "decode"} == {
        draining: "draining",
        other: "ready",
    }
    for request_id in ("r2", "r3"):
        rig.generate(request_id)
        (work,) = rig.received("prefill", 0)
        assert work.decode_group == other
    assert rig.received("decode", draining) == []  # it still holds r1: it stays
    rig.worker(TokenOutputs([TokenOutput(first.request_id, 0, [11])]))
    rig.worker(TokenOutputs([TokenOutput(first.request_id, 1, [12], finished=True, finish_reason="length")]))
    assert rig.received("decode", draining) == [Shutdown()]
    assert rig.received("prefill", 0) == [PeerFailed("decode", draining, left=True)]  # not a failure
    assert [m.group for m in rig.router.members() if m.role == "decode"] == [other]
    assert [r.request_id for r in rig.replies() if isinstance(r, Final)] == ["r1"]
    assert rig.router.faults["migrated"] == 0


def test_a_joined_group_that_fails_is_forgotten_and_cannot_come_back_under_its_index(rig: Rig) -> None:
    rig.join("decode", 5)
    rig.received("prefill", 0)
    rig.router.group_failed("decode", 5, "rank 0 sent no heartbeat for 3.1 s")
    assert rig.received("prefill", 0) == [PeerFailed("decode", 5)]
    assert rig.router.members()[-1].role == "prefill"
    rig.worker(Ready("decode", 5, 100, tp=1, address=rig.router.addresses.leader("decode", 5)))
    assert ("decode", 5) not in rig.router.tp_sizes and rig.received("prefill", 0) == []


def test_a_restarted_group_meets_the_joined_groups_at_its_ready(rig: Rig) -> None:
    """The router's own group restarts: the joined decode group hears of its failure, not of its
    spawn (the new generation knows only the router node's groups), and both are introduced when
    it is ready."""
    address = rig.join("decode", 5)
    rig.received("prefill", 0)
    rig.received("decode", 5)
    rig.router.group_failed("prefill", 0, "killed")
    assert rig.received("decode", 5) == [PeerFailed("prefill", 0)]
    rig.router.group_restarting("prefill", 0, 1)
    assert rig.received("decode", 5) == []
    rig.worker(Ready("prefill", 0, 100))
    assert rig.received("decode", 5) == [PeerRestarted("prefill", 0, 1, rig.router.leader_addresses[("prefill", 0)])]
    assert rig.received("prefill", 0) == [PeerRestarted("decode", 5, 0, address)]


def test_a_request_no_group_could_take_ends_after_the_dispatch_timeout(
    impatient_rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """With no decode group at all, a request waits dispatch_timeout, then ends with no_group
    (once, naming the missing role, in the router's log too); one that a group joins in time
    is served."""
    rig = impatient_rig
    rig.generate("early")
    rig.pump(1.2)
    rig.generate("late")
    assert len(rig.router.parked) == 2  # the stats line's "waiting for a group"
    with caplog.at_level(logging.WARNING):
        rig.pump(1.0)  # "early" has waited 2.2 s, "late" 1 s
    replies = rig.replies()
    assert [(r.request_id, r.code) for r in replies] == [("early", "no_group")]
    assert isinstance(replies[0], Error) and "no decode group" in replies[0].message
    assert "1 request(s) ended with no_group: no decode group was ready" in caplog.text
    rig.join("decode", 3)
    (_, work) = rig.received("prefill", 0)  # the introduction, then the request that waited
    assert isinstance(work, WorkRequest) and work.decode_group == 3
    assert list(rig.router.requests) == [work.request_id] and not rig.router.parked


def test_joined_decode_groups_have_their_caches_followed(rig: Rig) -> None:
    """Decode groups that join (here every one of them) get a view of their prefix caches from
    their own events, as the groups started with the router do; events of a group that is not
    ready (a dead generation's, still queued) change nothing."""
    index = rig.router.decode_prefix_index
    assert index is not None
    hashes = prefix_hashes(list(range(64)), 16)
    rig.join("decode", 0)
    rig.join("decode", 1)
    rig.worker(CacheEvents("decode", 1, hashes))
    assert index.sizes() == {0: 0, 1: 4}
    rig.router.group_failed("decode", 0, "killed")
    rig.worker(CacheEvents("decode", 0, hashes))
    assert 0 not in index.sizes() and index.matched_tokens(hashes) == {1: 64}


def test_the_router_counts_prompt_and_generated_tokens_a_moved_request_again(rig: Rig) -> None:
    """What the launcher's stats line reads (``token_counts``): a prompt counts at its first
    token; a request moved off a failed group is prefilled again with its tokens so far."""
    rig.join("decode", 5)
    rig.received("prefill", 0)
    rig.generate("r1")  # a 3-token prompt
    (work,) = [m for m in rig.received("prefill", 0) if isinstance(m, WorkRequest)]
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11])]))
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 1, [12])]))
    assert rig.router.token_counts == {"prompt": 3, "generated": 2}
    rig.router.group_failed("decode", 5, "killed")
    rig.join("decode", 6)
    rig.pump()
    (moved,) = [m for m in rig.received("prefill", 0) if isinstance(m, WorkRequest)]
    assert moved.token_ids == [5, 6, 7, 11, 12]
    rig.worker(TokenOutputs([TokenOutput(moved.request_id, 0, [13], finished=True, finish_reason="length")]))
    assert rig.router.token_counts == {"prompt": 3 + 5, "generated": 3}
