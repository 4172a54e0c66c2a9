"""The prefill leader driven message by message: a real engine (tiny model, CPU), a stand-in
transfer agent, and the decode group's inbox read directly, no processes."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import zmq

from pdserve.cluster import leader as group_leader
from pdserve.cluster.config import Addresses
from pdserve.cluster.datagrams import DatagramInbox
from pdserve.cluster.protocol import (
    Abort,
    KVAnnounce,
    KVReply,
    Sampling,
    Shutdown,
    TokenOutputs,
    WorkRequest,
    decode,
)
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.kvtransfer.agent import KVTransferAgent
from pdserve.kvtransfer.base import Transfer, TransferFailed, TransferStats
from pdserve.prefill_worker import leader as prefill_leader
from pdserve.prefill_worker.leader import PrefillLeader
from pdserve.tests.cluster.helpers import worker_errors


class StandInTransfers:
    """What the prefill leader uses of ``KVTransferAgent``: room always, sends that land at once."""

    def connected(self, peer_group: int) -> bool:
        return True

    def forming(self) -> list[int]:
        return []

    def has_staging_room(self, peer_group: int, num_blocks: int, promised: int = 0) -> bool:
        return True

    def staging_need(self, peer_group: int, num_blocks: int) -> int:
        return 0

    def close(self) -> None:
        pass


class FrozenClock:
    """The leader module's ``time``: still until the test moves it on."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


class Rig(NamedTuple):
    prefill: PrefillLeader
    inboxes: dict[int, zmq.Socket]  # by decode group
    router: zmq.Socket  # the router's inbox


@pytest.fixture
def leader(tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[PrefillLeader, zmq.Socket]]:
    with leader_setup(tmp_path, tiny_model_dirs, StandInTransfers()) as (prefill, inboxes, _):
        yield prefill, inboxes[0]


@contextlib.contextmanager
def leader_setup(
    tmp_path: Path,
    tiny_model_dirs: dict[str, Path],
    transfers: Any,
    decode_groups: tuple[int, ...] = (0,),
    num_blocks: int = 32,
    kv_lease_timeout: float = float("inf"),
) -> Iterator[Rig]:
    """A prefill leader (tiny model, CPU) over ``transfers``, the inboxes of ``decode_groups`` and
    the router's."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dirs["tiny-llama"]),
            dtype="float32",
            device="cpu",
            max_model_len=128,
            cache=CacheConfig(num_blocks=num_blocks),
        )
    )
    addresses = Addresses(str(tmp_path), "tcp://127.0.0.1:1")
    ctx = zmq.Context.instance()
    router_inbox = ctx.socket(zmq.PULL)
    router_inbox.bind(addresses.router)
    inboxes = {g: ctx.socket(zmq.PULL) for g in decode_groups}
    for g, sock in inboxes.items():
        sock.bind(addresses.leader("decode", g))
    prefill = PrefillLeader(0, addresses, engine, transfers, kv_lease_timeout)
    try:
        yield Rig(prefill, inboxes, router_inbox)
    finally:
        prefill.close()
        router_inbox.close(linger=0)
        for sock in inboxes.values():
            sock.close(linger=0)


def _prefill(leader: PrefillLeader, request_id: str) -> None:
    leader.handle(WorkRequest(request_id, list(range(1, 21)), Sampling(max_tokens=8, temperature=0.0), 0))
    while leader.engine.has_unfinished():
        leader.send_outputs(leader.engine.step())


def _announced(decode_inbox: zmq.Socket, expected: int = 0) -> list[str]:
    """The request ids announced on ``decode_inbox``: the ``expected`` first ones (waited for as
    long as a loaded machine may take), then any more that come within 200 ms."""
    out = []
    while decode_inbox.poll(10_000 if len(out) < expected else 200):
        message = decode(decode_inbox.recv())
        assert isinstance(message, KVAnnounce)
        out.append(message.request_id)
    return out


def test_a_decode_leader_on_the_node_gets_its_announces_as_datagrams(
    tmp_path: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    """A decode leader of the node binds a datagram inbox beside its ZMQ one (``cluster.datagrams``):
    an announce goes there, which wakes the leader alone; without one it goes over ZMQ."""
    with leader_setup(tmp_path, tiny_model_dirs, StandInTransfers(), decode_groups=(0, 1)) as rig:
        datagrams = DatagramInbox.beside(f"ipc://{tmp_path}/decode0")
        assert datagrams is not None
        try:
            rig.prefill.handle(WorkRequest("r", list(range(1, 21)), Sampling(max_tokens=8, temperature=0.0), 0))
            rig.prefill.handle(WorkRequest("s", list(range(1, 21)), Sampling(max_tokens=8, temperature=0.0), 1))
            while rig.prefill.engine.has_unfinished():
                rig.prefill.send_outputs(rig.prefill.engine.step())
            rig.prefill.background()
            announces = [decode(data) for data in datagrams.drain()]
            assert [a.request_id for a in announces if isinstance(a, KVAnnounce)] == ["r"]
            assert _announced(rig.inboxes[0]) == [] and _announced(rig.inboxes[1], 1) == ["s"]
        finally:
            datagrams.close()


def test_a_refused_handoff_is_offered_again_before_any_later_one(
    leader: tuple[PrefillLeader, zmq.Socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode group that refuses KV (full) is offered it again in the order it was
    prefilled: a request prefilled later must not take the room that frees first, or under a
    flood the oldest ones starve until their lease expires and they are prefilled again."""
    prefill, decode_inbox = leader
    clock = FrozenClock()
    monkeypatch.setattr(prefill_leader, "time", clock)
    _prefill(prefill, "old")
    prefill.background()
    assert _announced(decode_inbox, 1) == ["old"]
    prefill.handle(KVReply("old", accepted=False))  # its retry waits a back-off
    _prefill(prefill, "new")
    prefill.background()
    assert _announced(decode_inbox) == []  # "new" waits behind "old"
    clock.now += 1.0
    prefill.background()
    assert _announced(decode_inbox, 2) == ["old", "new"]


def test_a_shutdown_does_not_wait_forever_for_a_handoff_nobody_answers(
    leader: tuple[PrefillLeader, zmq.Socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router stops every group at once: a decode leader that exited before this group's
    announce reached it never answers, and the prefill leader must still stop (not wait until
    the launcher gives up on it and reports an unclean stop)."""
    prefill, decode_inbox = leader
    monkeypatch.setattr(group_leader, "_STOP_TRANSFER_WAIT_S", 0.3)
    _prefill(prefill, "r")
    prefill.background()
    assert _announced(decode_inbox, 1) == ["r"]  # and no reply ever comes
    prefill.handle(Shutdown())
    runs = threading.Thread(target=prefill.run, daemon=True)
    runs.start()
    runs.join(10)
    stopped = not runs.is_alive()
    prefill.announced.clear()  # lets a leader that did not stop end its loop
    runs.join(10)
    assert stopped


class Send(Transfer):
    """A send holding ``nbytes`` of packed KV until the test lands it."""

    def __init__(self, backend: Backend, nbytes: int) -> None:
        self.backend, self.nbytes, self.landed = backend, nbytes, False
        self.cut = False  # ends as a send whose decode group died
        backend.staging += nbytes

    def done(self) -> bool:
        if self.landed and self.nbytes:
            self.backend.staging, self.nbytes = self.backend.staging - self.nbytes, 0
        return self.landed

    def wait(self) -> TransferStats:
        if self.cut:
            raise TransferFailed("the decode group died")
        return TransferStats(0, 0.0)


class Backend:
    """What the agent uses of a push backend to one decode group: blocks of 100 bytes."""

    pulls = False

    def __init__(self, connected: bool = True) -> None:
        self.staging = 0
        self.sends: list[Send] = []
        self.up = connected

    def send(self, block_ids: list[int]) -> Send:
        self.sends.append(Send(self, len(block_ids) * self.staged_block_bytes()))
        return self.sends[-1]

    @property
    def staging_bytes(self) -> int:
        return self.staging

    def staged_block_bytes(self) -> int:
        return 100

    def connected(self) -> bool:
        return self.up

    def abandon(self) -> None:
        self.up = False

    def close(self) -> None:
        pass


def test_a_handoff_larger_than_the_staging_bound_is_not_starved_by_another_groups_flow(
    tmp_path: Path, tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handoff whose KV exceeds the staging bound goes only when no send is in flight. A steady
    flow of small handoffs to another decode group must not keep one in flight for good: the
    big one holds the later ones back, the sends drain, and it goes."""
    clock = FrozenClock()
    monkeypatch.setattr(prefill_leader, "time", clock)
    backends = {0: Backend(), 1: Backend()}
    with two_decode_groups(tmp_path, tiny_model_dirs, backends) as (prefill, inboxes, _):
        prefilled(prefill, "s0", 10, 1)
        prefill.background()
        assert _announced(inboxes[1], 1) == ["s0"]
        prefill.handle(KVReply("s0", True))  # one block in flight to decode group 1
        prefilled(prefill, "big", 80, 0)  # five blocks: 500 bytes, more than the bound leaves
        for i in range(1, 4):
            prefilled(prefill, f"s{i}", 10, 1)
            prefill.background()
            assert _announced(inboxes[0]) == [] and _announced(inboxes[1]) == []  # all wait behind "big"
            clock.now += 1.0
        backends[1].sends[0].landed = True  # the one send in flight completes
        prefill.background()
        assert _announced(inboxes[0], 1) == ["big"]
        prefill.handle(KVReply("big", True))
        backends[0].sends[0].landed = True
        prefill.background()
        assert _announced(inboxes[1], 3) == ["s1", "s2", "s3"]  # then the others, in order


def test_a_decode_group_whose_pair_is_forming_holds_back_only_its_own_handoffs(
    tmp_path: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    """A decode group that just joined (or restarted) is not connected until its pair forms: its
    handoffs wait, and those to the other decode groups go meanwhile."""
    backends = {0: Backend(connected=False), 1: Backend()}
    with two_decode_groups(tmp_path, tiny_model_dirs, backends) as (prefill, inboxes, _):
        prefilled(prefill, "to-joining", 10, 0)
        prefilled(prefill, "to-ready", 10, 1)
        prefill.background()
        assert _announced(inboxes[0]) == [] and _announced(inboxes[1], 1) == ["to-ready"]
        backends[0].up = True
        prefill.background()
        assert _announced(inboxes[0], 1) == ["to-joining"]


@contextlib.contextmanager
def two_decode_groups(tmp_path: Path, tiny_model_dirs: dict[str, Path], backends: dict[int, Backend]) -> Iterator[Rig]:
    """A prefill leader over a real agent (staging bound 500 bytes) to decode groups 0 and 1."""
    agent = KVTransferAgent(backends, max_staging_bytes=500)  # type: ignore[arg-type]
    with leader_setup(tmp_path, tiny_model_dirs, agent, (0, 1), num_blocks=64, kv_lease_timeout=30.0) as setup:
        yield setup


def prefilled(prefill: PrefillLeader, request_id: str, prompt_len: int, decode_group: int) -> None:
    """Prefill a request for ``decode_group``: its handoff waits to be announced."""
    work = WorkRequest(request_id, list(range(1, prompt_len + 1)), Sampling(max_tokens=8), decode_group)
    prefill.handle(work)
    while prefill.engine.has_unfinished():
        prefill.send_outputs(prefill.engine.step())


def test_the_first_tokens_timings_leave_the_decoding_to_the_router(
    tmp_path: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    """The prefill engine ends a request at its first token, with a decode time of 0: sent with
    that token, it was the decode time of every request the router then ended by an abort (every
    stop string's), where the router times the decoding itself (review)."""
    with leader_setup(tmp_path, tiny_model_dirs, StandInTransfers()) as rig:
        _prefill(rig.prefill, "r")
        outputs = []
        while rig.router.poll(10_000 if not outputs else 200):
            message = decode(rig.router.recv())
            if isinstance(message, TokenOutputs):
                outputs += [o for o in message.outputs if o.request_id == "r"]
        (first,) = outputs
        assert first.index == 0 and first.timings.prefill is not None and first.timings.decode is None


def test_a_handed_off_request_leaves_no_state_behind(tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> None:
    """Once its KV has moved, nothing of a request stays on the prefill leader: a long-running
    group would otherwise grow by an entry per request it served."""
    backends = {0: Backend(), 1: Backend()}
    with two_decode_groups(tmp_path, tiny_model_dirs, backends) as (prefill, inboxes, _):
        prefilled(prefill, "r", 10, 0)
        prefill.background()
        assert _announced(inboxes[0], 1) == ["r"]
        prefill.handle(KVReply("r", True))
        backends[0].sends[0].landed = True
        prefill.background()
        assert prefill.engine.stats().free_blocks == 64
        assert not (prefill.next_index or prefill.work or prefill.announced or prefill.sending)


def test_a_send_cut_off_frees_its_blocks_and_counts_as_a_failure(
    tmp_path: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    """A send whose decode group died ends like one that landed (its blocks freed), and the
    group's ``kv_transfer_failures`` counts it, as the decode side counts its own."""
    backends = {0: Backend(), 1: Backend()}
    with two_decode_groups(tmp_path, tiny_model_dirs, backends) as (prefill, inboxes, _):
        for request_id, group in (("cut", 0), ("kept", 1)):
            prefilled(prefill, request_id, 10, group)
        prefill.background()
        for request_id in ("cut", "kept"):
            prefill.handle(KVReply(request_id, True))
        backends[0].sends[0].landed = backends[0].sends[0].cut = True
        backends[1].sends[0].landed = True
        prefill.background()
        assert prefill.stats().kv_transfer_failures == 1
        assert prefill.engine.stats().free_blocks == 64 and not prefill.sending


def test_handoffs_announced_and_not_yet_sending_count_against_the_staging_bound(
    tmp_path: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    """An announce promises a send: with nothing in flight, two handoffs of 300 bytes each must
    not both be announced in one go, or once both are accepted 600 bytes are packed against a
    bound of 500. The second goes once the first one's send has drained."""
    backends = {0: Backend(), 1: Backend()}
    with two_decode_groups(tmp_path, tiny_model_dirs, backends) as (prefill, inboxes, _):
        prefilled(prefill, "a", 40, 0)  # three blocks: 300 bytes
        prefilled(prefill, "b", 40, 1)
        prefill.background()
        assert _announced(inboxes[0], 1) == ["a"] and _announced(inboxes[1]) == []
        prefill.handle(KVReply("a", True))
        prefill.background()
        assert _announced(inboxes[1]) == []  # "a" is still being sent
        backends[0].sends[0].landed = True
        prefill.background()
        assert _announced(inboxes[1], 1) == ["b"]


def leaves_nothing(prefill: PrefillLeader) -> bool:
    return prefill.engine.stats().free_blocks == 64 and not (
        prefill.work or prefill.to_announce or prefill.announced or prefill.sending or prefill.engine.has_unfinished()
    )


@pytest.mark.parametrize("where", ["prefilling", "queued", "announced-refused", "announced-accepted", "sending"])
def test_an_abort_frees_the_kv_wherever_the_request_is(
    tmp_path: Path, tiny_model_dirs: dict[str, Path], where: str
) -> None:
    """An abort frees the request's blocks: at once while it is prefilling or waits to be
    announced; once the decode group's reply comes if it was announced (an accepted one is still
    sent, as the decode side posted its receive); once its send lands if it was sending. No
    announce follows an abort, and the router hears no error (the abort was its own)."""
    backends = {0: Backend(connected=where != "queued"), 1: Backend()}
    with two_decode_groups(tmp_path, tiny_model_dirs, backends) as (prefill, inboxes, router):
        if where == "prefilling":
            prefill.handle(WorkRequest("r", list(range(1, 41)), Sampling(max_tokens=8), 0))
            prefill.handle(Abort("r"))
            while prefill.engine.has_unfinished():
                prefill.send_outputs(prefill.engine.step())
        else:
            prefilled(prefill, "r", 40, 0)  # three blocks
            prefill.background()
            if where != "queued":
                assert _announced(inboxes[0], 1) == ["r"]
            if where == "sending":
                prefill.handle(KVReply("r", True))
            prefill.handle(Abort("r"))
            if where.startswith("announced"):
                assert prefill.engine.stats().free_blocks == 61  # the decode group may be pulling them
                prefill.handle(KVReply("r", where == "announced-accepted"))
            if backends[0].sends:
                assert prefill.engine.stats().free_blocks == 61  # still being sent
                backends[0].sends[0].landed = True
            assert len(backends[0].sends) == (where in ("announced-accepted", "sending"))
        prefill.background()
        assert leaves_nothing(prefill)
        assert _announced(inboxes[0]) == []
        assert worker_errors(router) == []


def test_a_dead_decode_groups_handoffs_are_freed_and_the_others_go_on(
    tmp_path: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    """A decode group fails: the KV held for it, announced or still queued, is freed at once (no
    reply will come), a late reply from it changes nothing, and handoffs to other groups go on."""
    backends = {0: Backend(), 1: Backend()}
    with two_decode_groups(tmp_path, tiny_model_dirs, backends) as (prefill, inboxes, router):
        prefilled(prefill, "other", 10, 1)  # one block, 100 bytes
        prefilled(prefill, "announced", 40, 0)  # three blocks
        prefilled(prefill, "queued", 40, 0)  # three more would pass the 500-byte bound: it waits
        prefill.background()
        assert _announced(inboxes[0], 1) == ["announced"] and _announced(inboxes[1], 1) == ["other"]
        assert [h.announce.request_id for h in prefill.to_announce] == ["queued"]
        prefill.peer_failed(0)
        assert prefill.engine.stats().free_blocks == 63  # only "other" holds its block
        prefill.handle(KVReply("announced", True))  # read after the failure: ignored
        assert backends[0].sends == []
        prefill.handle(KVReply("other", True))
        backends[1].sends[0].landed = True
        prefill.background()
        assert leaves_nothing(prefill)
        assert worker_errors(router) == []  # the router moves the dead group's requests itself


def test_kv_no_decode_group_takes_is_freed_when_its_lease_ends(
    tmp_path: Path, tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """KV that waits to be announced (here its decode group's pair never forms) is held for the
    lease, then freed; the router hears ``kv_lease_expired`` and decides what becomes of it."""
    clock = FrozenClock()
    monkeypatch.setattr(prefill_leader, "time", clock)
    backends = {0: Backend(connected=False), 1: Backend()}
    with two_decode_groups(tmp_path, tiny_model_dirs, backends) as (prefill, inboxes, router):
        prefilled(prefill, "r", 40, 0)
        prefill.background()
        clock.now += 29.0  # within the 30 s lease
        prefill.background()
        assert prefill.engine.stats().free_blocks == 61 and worker_errors(router) == []
        clock.now += 2.0
        prefill.background()
        assert worker_errors(router) == [("r", "kv_lease_expired")]
        assert leaves_nothing(prefill) and _announced(inboxes[0]) == []


def test_a_long_step_after_the_prefill_does_not_count_against_the_lease(
    tmp_path: Path, tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step that prefills a request hands off its KV, then may run the next batch's long
    prompts for longer than the lease: the hand-off is still offered to the decode group, not
    expired unoffered (a valid long prompt used to make another request fail)."""
    clock = FrozenClock()
    monkeypatch.setattr(prefill_leader, "time", clock)
    with two_decode_groups(tmp_path, tiny_model_dirs, {0: Backend(), 1: Backend()}) as (prefill, inboxes, router):
        prefilled(prefill, "r", 40, 0)
        clock.now += 31.0  # the rest of the step: past the 30 s lease
        prefill.background()
        assert worker_errors(router) == []
        assert _announced(inboxes[0], 1) == ["r"]
