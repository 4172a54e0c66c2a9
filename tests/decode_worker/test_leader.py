"""The decode leader driven message by message, in each order an abort can take against the
request's ``kv_announce``: a real engine (tiny model, CPU) and a stand-in transfer agent whose
receives land when the test says, no processes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from pdserve.cluster.config import Addresses
from pdserve.cluster.datagrams import DatagramInbox
from pdserve.cluster.protocol import Abort, KVAnnounce, KVReply, Message, Sampling, TokenOutputs, decode
from pdserve.decode_worker import leader as leader_module
from pdserve.decode_worker.leader import DecodeLeader
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.timings import RequestTimings
from pdserve.kvtransfer.agent import KVTransferAgent
from pdserve.kvtransfer.base import Transfer, TransferFailed, TransferStats
from pdserve.tests.cluster.helpers import worker_errors

NUM_BLOCKS = 32
PROMPT = list(range(1, 41))  # 40 tokens: 3 blocks of 16


class StandInTransfers:
    """What the decode leader uses of ``KVTransferAgent``: a receive is posted by ``recv`` and
    lands when the test calls ``land``; ``pulling``: as a pulling backend (cuda-ipc, shm)."""

    def __init__(self, pulling: bool = False) -> None:
        self.pulling = pulling
        self.staging_room: int | None = None  # blocks a staging backend has room for; None: any
        self.room_asked: list[int] = []  # the block counts ``has_staging_room`` was asked about
        self.kept: list[tuple[int, int] | None] = []  # and the room it was asked to keep
        self.posted: dict[str, list[int]] = {}
        self.sources: dict[str, list[int]] = {}  # the prefill blocks named in each receive
        self.landed: set[str] = set()
        self.unformed: list[int] = []  # prefill groups whose pair is still forming
        self.dropped: list[int] = []  # prefill groups given up (dead)

    def connected(self, peer_group: int) -> bool:
        return True

    def forming(self) -> list[int]:
        return self.unformed

    def has_staging_room(self, peer_group: int, num_blocks: int, keep: tuple[int, int] | None = None) -> bool:
        self.room_asked.append(num_blocks)
        self.kept.append(keep)
        return self.staging_room is None or num_blocks <= self.staging_room

    def pulls(self, peer_group: int) -> bool:
        return self.pulling

    def recv(self, request_id: str, block_ids: list[int], peer_group: int, src_block_ids: list[int]) -> None:
        self.posted[request_id] = list(block_ids)
        self.sources[request_id] = list(src_block_ids)

    def land(self, request_id: str) -> None:
        assert request_id in self.posted
        self.landed.add(request_id)

    def done(self, request_id: str) -> bool:
        return request_id in self.landed

    def wait(self, request_id: str) -> TransferStats:
        self.landed.discard(request_id)
        return TransferStats(num_bytes=len(self.posted.pop(request_id)), host_seconds=0.0)

    def discard(self, request_id: str) -> None:
        self.posted.pop(request_id, None)

    def drop(self, peer_group: int) -> None:
        self.dropped.append(peer_group)

    def reconnect(self, peer_group: int, generation: int) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Setup:
    leader: DecodeLeader
    engine: LLMEngine
    transfers: Any  # StandInTransfers, or a real agent
    prefill_inboxes: list[zmq.Socket]  # prefill groups 0 and 1
    router_inbox: zmq.Socket

    def worker_errors(self) -> list[tuple[str, str]]:
        """The (request, code) of every ``WorkerError`` the leader sent the router so far."""
        return worker_errors(self.router_inbox)

    def replies(self, prefill_group: int = 0) -> list[Message]:
        """What the leader sent the prefill group so far."""
        inbox, out = self.prefill_inboxes[prefill_group], []
        while inbox.poll(200):
            out.append(decode(inbox.recv()))
        return out

    def announce(
        self, request_id: str, prompt: list[int] = PROMPT, generation: int = 0, prefill_group: int = 0
    ) -> None:
        src_blocks = list(range(100, 100 + self.engine.blocks_for(len(prompt))))
        sampling = Sampling(max_tokens=8, temperature=0.0)
        self.leader.handle(
            KVAnnounce(request_id, prefill_group, prompt, 7, sampling, block_ids=src_blocks, generation=generation)
        )

    def decode_all(self) -> list[int]:
        """Step the engine until it is idle; the tokens it generated."""
        tokens = []
        while self.engine.has_unfinished():
            outputs = self.engine.step()
            tokens += [t for out in outputs for t in out.new_token_ids]
            self.leader.send_outputs(outputs)
        return tokens

    def free_blocks(self) -> int:
        return self.engine.stats().free_blocks

    def first_turn(self) -> list[int]:
        """Chat turn "t0" (``PROMPT``) received and decoded to its end, its blocks left in this
        group's prefix cache: its answer, the first token included."""
        self.announce("t0")
        self.transfers.land("t0")
        self.leader.background()
        return [7, *self.decode_all()]


@pytest.fixture
def setup(request: pytest.FixtureRequest, tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> Iterator[Setup]:
    with leader_setup(tmp_path, tiny_model_dirs, StandInTransfers(pulling=getattr(request, "param", False))) as s:
        yield s


@contextlib.contextmanager
def leader_setup(
    tmp_path: Path, tiny_model_dirs: dict[str, Path], transfers: Any, kv_lease_timeout: float = float("inf")
) -> Iterator[Setup]:
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dirs["tiny-llama"]),
            dtype="float32",
            device="cpu",
            max_model_len=128,
            cache=CacheConfig(num_blocks=NUM_BLOCKS),
        )
    )
    addresses = Addresses(str(tmp_path), "tcp://127.0.0.1:1")
    ctx = zmq.Context.instance()
    router_inbox = ctx.socket(zmq.PULL)
    router_inbox.bind(addresses.router)
    prefill_inboxes = [ctx.socket(zmq.PULL) for _ in range(2)]
    for group, inbox in enumerate(prefill_inboxes):
        inbox.bind(addresses.leader("prefill", group))
    leader = DecodeLeader(0, addresses, engine, transfers, kv_lease_timeout, prefill_generations=[0, 0])
    try:
        yield Setup(leader, engine, transfers, prefill_inboxes, router_inbox)
    finally:
        leader.close()
        router_inbox.close(linger=0)
        for inbox in prefill_inboxes:
            inbox.close(linger=0)


def test_an_abort_before_the_announce_refuses_it_and_reserves_nothing(setup: Setup) -> None:
    """Abort first, announce second (the order the issue's leak needed): the announce is refused,
    no block is reserved and no receive posted, and nothing is ever decoded. The same announce
    without an abort (another id) is accepted: the oracle that the refusal is the abort's doing."""
    setup.leader.handle(Abort("late"))
    setup.announce("late")
    assert setup.replies() == [KVReply("late", accepted=False)]
    assert setup.transfers.posted == {}
    assert setup.free_blocks() == NUM_BLOCKS
    setup.leader.background()
    assert not setup.engine.has_unfinished()

    setup.announce("other")
    assert setup.replies() == [KVReply("other", accepted=True)]
    assert set(setup.transfers.posted) == {"other"}
    assert setup.free_blocks() == NUM_BLOCKS - 3


def test_an_abort_during_the_receive_frees_the_blocks_once_it_lands(setup: Setup) -> None:
    """Announce, accept, then abort while the receive is in flight: the blocks stay reserved
    (the prefill side is still writing into them) until the receive lands, then are freed, and
    the request never joins the batch."""
    setup.announce("r")
    assert setup.replies() == [KVReply("r", accepted=True)]
    setup.leader.handle(Abort("r"))
    setup.leader.background()
    assert setup.free_blocks() == NUM_BLOCKS - 3  # the receive still writes into them
    setup.transfers.land("r")
    setup.leader.background()
    assert setup.free_blocks() == NUM_BLOCKS
    assert not setup.engine.has_unfinished() and setup.transfers.posted == {}


def test_an_abort_after_admission_frees_the_running_request(setup: Setup) -> None:
    setup.announce("r")
    setup.transfers.land("r")
    setup.leader.background()
    assert setup.engine.has_unfinished()
    setup.leader.handle(Abort("r"))
    assert not setup.engine.has_unfinished() and setup.free_blocks() == NUM_BLOCKS
    setup.announce("r")  # a stray second announce of an aborted id is refused too
    assert setup.replies()[-1] == KVReply("r", accepted=False)


def test_the_first_decoded_tokens_carry_the_transfer(setup: Setup) -> None:
    """The transfer's size and time go to the router with the request's first decoded tokens, not
    only with its last: a request that ends by an abort, whose final the router writes, counts
    them too. Later outputs carry no timings until the last."""
    setup.announce("r")
    setup.transfers.land("r")
    setup.leader.background()
    sent = []
    while setup.engine.has_unfinished():
        setup.leader.send_outputs(setup.engine.step())
    while setup.router_inbox.poll(200):
        message = decode(setup.router_inbox.recv())
        if isinstance(message, TokenOutputs):
            sent += message.outputs
    assert [o.index for o in sent] == list(range(1, 8))
    first, *middle, last = sent
    assert first.timings.transfer_bytes == 3.0 and first.timings.transfer is not None  # the stand-in's 3 blocks
    assert all(o.timings == RequestTimings() for o in middle)
    assert last.finished and last.timings.transfer_bytes == 3.0


def test_stats_report_the_groups_transfer_failures(setup: Setup) -> None:
    assert setup.leader.stats().kv_transfer_failures == 0
    setup.leader.kv_transfer_failures = 2  # what a leader counts as it gives a transfer up
    assert setup.leader.stats().kv_transfer_failures == 2


def test_stats_report_the_pairs_still_forming(setup: Setup) -> None:
    """What the launcher waits for before it prints its endpoint (``Router.pairs_forming``)."""
    assert setup.leader.stats().pairs_forming == 0
    setup.transfers.unformed = [0, 2]
    assert setup.leader.stats().pairs_forming == 2


@pytest.mark.parametrize("setup", [True], indirect=True)
def test_a_pulled_receive_is_accepted_only_once_it_has_landed(setup: Setup) -> None:
    """A pulling backend copies from the prefill pool: the accepted reply, which lets the prefill
    side free its blocks, waits until the copy has landed; an abort meanwhile still gets it."""
    setup.announce("r")
    assert setup.replies() == []
    setup.leader.background()
    assert setup.replies() == []  # still copying: the prefill blocks must stay
    setup.transfers.land("r")
    setup.leader.background()
    assert setup.replies() == [KVReply("r", accepted=True)]
    assert setup.engine.has_unfinished()
    setup.announce("gone")
    setup.leader.handle(Abort("gone"))
    setup.transfers.land("gone")
    setup.leader.background()
    assert setup.replies() == [KVReply("gone", accepted=True)]  # the prefill side frees its copy
    assert setup.free_blocks() == NUM_BLOCKS - 3  # only "r" holds blocks


@pytest.mark.parametrize("setup", [False, True], indirect=True, ids=["push", "pull"])
def test_a_later_turn_receives_only_the_blocks_the_cache_lacks(setup: Setup) -> None:
    """A request decoded here leaves its full blocks (prompt and output) in the prefix cache; a
    later one whose prompt extends it (a chat's next turn) reserves them, the reply names how
    many (``cached_blocks``), and only the rest is received, from the matching prefill blocks.
    A pulled receive's reply, sent once the copy landed, names them too."""
    pulling = setup.transfers.pulling
    setup.announce("t0")
    setup.transfers.land("t0")
    setup.leader.background()
    assert setup.replies() == [KVReply("t0", accepted=True, cached_blocks=0)]
    answer = [7, *setup.decode_all()]
    assert len(answer) == 8
    # Its 47 computed tokens (the last output's KV is never computed) fill two blocks.
    prompt = PROMPT + answer + list(range(200, 210))  # 58 tokens: 4 blocks, the first two cached
    setup.announce("t1", prompt)
    assert len(setup.transfers.posted["t1"]) == 2 and setup.transfers.sources["t1"] == [102, 103]
    assert setup.replies() == ([] if pulling else [KVReply("t1", accepted=True, cached_blocks=2)])
    setup.transfers.land("t1")
    setup.leader.background()
    if pulling:
        assert setup.replies() == [KVReply("t1", accepted=True, cached_blocks=2)]
    assert setup.free_blocks() == NUM_BLOCKS - 4
    setup.decode_all()
    stats = setup.leader.stats()
    assert stats.prefix_hit_tokens == 2 * 16 and stats.free_blocks == NUM_BLOCKS
    # 65 computed tokens of "t1" fill four blocks, its first two those of "t0".
    assert stats.prefix_cached_blocks == 4


def test_staging_room_is_asked_for_the_blocks_the_cache_lacks(setup: Setup) -> None:
    """A staging backend's room bounds the blocks that move: a later turn whose first two of
    four blocks this group caches fits in room for two; a cold prompt of four blocks does not."""
    answer = setup.first_turn()
    setup.replies()
    setup.transfers.staging_room = 2
    setup.announce("cold", list(range(300, 358)))  # 58 tokens: 4 blocks, none cached
    assert setup.replies() == [KVReply("cold", accepted=False)]
    setup.announce("t1", PROMPT + answer + list(range(200, 210)))  # 4 blocks, 2 cached
    assert setup.replies() == [KVReply("t1", accepted=True, cached_blocks=2)]
    assert len(setup.transfers.posted["t1"]) == 2
    assert setup.transfers.room_asked[-2:] == [4, 2]  # the cache is matched only when room is short


def test_a_request_waiting_for_staging_room_keeps_its_whole_prompts_blocks_free(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "t1" (4 blocks, 2 of them cached here) waits for staging room. A later request from
    another prefill group must leave it staging room for the 2 that move, and free blocks for its
    whole prompt (the cached two may be evicted meanwhile) plus the headroom block: before, both
    were the 2 blocks that move."""
    answer = setup.first_turn()
    setup.replies()
    setup.transfers.staging_room = 1
    setup.announce("t1", PROMPT + answer + list(range(200, 210)))  # 4 blocks, 2 cached: 2 move
    assert setup.replies() == [KVReply("t1", accepted=False)]
    kept_free = []
    reserve = setup.engine.reserve

    def recording_reserve(*args: Any, **kwargs: Any) -> Any:
        kept_free.append(kwargs["keep_free"])
        return reserve(*args, **kwargs)

    monkeypatch.setattr(setup.engine, "reserve", recording_reserve)
    setup.transfers.staging_room = None
    setup.announce("x", [5, 6, 7], prefill_group=1)
    assert setup.replies(1) == [KVReply("x", accepted=True)]
    assert setup.transfers.kept[-1] == (0, 2)
    assert kept_free == [4 + 1]


def test_an_abort_during_a_partial_receive_caches_nothing_that_was_arriving(setup: Setup) -> None:
    """Aborted while the blocks after its cached prefix are still arriving: once they land every
    block is free again, and the cache holds only what it held before."""
    answer = setup.first_turn()
    cached_before = setup.engine.stats().prefix_cache.cached_blocks  # type: ignore[union-attr]
    setup.replies()
    setup.announce("t1", PROMPT + answer + list(range(200, 230)))
    assert setup.replies() == [KVReply("t1", accepted=True, cached_blocks=2)]
    setup.leader.handle(Abort("t1"))
    setup.transfers.land("t1")
    setup.leader.background()
    stats = setup.engine.stats()
    assert stats.free_blocks == NUM_BLOCKS and not setup.engine.has_unfinished()
    assert stats.prefix_cache is not None and stats.prefix_cache.cached_blocks == cached_before


class Part(Transfer):
    """One rank's part of a pushed receive: lands when the test says, and holds its buffers until
    it is waited for (scattered into the cache) or discarded."""

    def __init__(self) -> None:
        self.landed = False
        self.held = True
        self.fails = False

    def done(self) -> bool:
        return self.landed

    def wait(self) -> TransferStats:
        self.held = False
        if self.fails:
            raise TransferFailed("the sender died")
        return TransferStats(0, 0.0)

    def discard(self) -> None:
        self.held = False


class PushBackend:
    """What the agent uses of a push backend (nccl-async, gloo-async) on one rank."""

    pulls = False

    def __init__(self) -> None:
        self.parts: list[Part] = []

    def recv(self, block_ids: list[int], src_block_ids: list[int]) -> Part:
        self.parts.append(Part())
        return self.parts[-1]

    @property
    def staging_bytes(self) -> int:
        return sum(1024 for part in self.parts if part.held)

    def staged_block_bytes(self) -> int:
        return 1

    def connected(self) -> bool:
        return True

    def close(self) -> None:
        pass


class ToPeer:
    """The leader's step channel to one TP peer, whose agent executes each command at once."""

    def __init__(self, peer: KVTransferAgent) -> None:
        self.peer = peer

    def send(self, command: Any) -> None:
        self.peer.execute(command)


@pytest.mark.parametrize("ending", ["abort", "failure"])
def test_a_receive_given_up_on_the_leader_lets_go_of_the_peers_parts(
    tmp_path: Path, tiny_model_dirs: dict[str, Path], ending: str
) -> None:
    """Decode TP 2 over a push backend: a receive aborted while it moved, or whose leader part
    failed, is never admitted, so no step tells the peer to wait for its part; the peer must still
    let the part go (its buffers, and a later write into blocks freed meanwhile)."""
    leader_backend, peer_backend = PushBackend(), PushBackend()
    peer = KVTransferAgent({0: peer_backend}, 1 << 30)  # type: ignore[dict-item]
    agent = KVTransferAgent({0: leader_backend}, 1 << 30, ToPeer(peer))  # type: ignore[dict-item,arg-type]
    with leader_setup(tmp_path, tiny_model_dirs, agent) as setup:
        setup.announce("r")
        assert peer.staging_bytes() == 1024
        if ending == "abort":
            setup.leader.handle(Abort("r"))
        else:
            leader_backend.parts[0].fails = True
        leader_backend.parts[0].landed = True
        setup.leader.background()
        assert setup.free_blocks() == NUM_BLOCKS and not setup.engine.has_unfinished()
        assert agent.staging_bytes() == 0
        assert peer.staging_bytes() == 0, "the peer still holds its part"
        # A failed one goes back to the router, which moves it; an aborted one was its own doing.
        assert setup.worker_errors() == ([] if ending == "abort" else [("r", "kv_transfer_failed")])


def test_a_pulled_receive_whose_lease_expires_frees_the_prefill_blocks(
    tmp_path: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    """Where the decode side pulls, only its reply frees the prefill side's blocks: a receive it
    gives up (its lease expired) must still send it, once its copies are over, or the prefill
    group holds that KV for good; the router hears the expiry and moves the request."""
    transfers = StandInTransfers(pulling=True)
    with leader_setup(tmp_path, tiny_model_dirs, transfers, kv_lease_timeout=0.05) as setup:
        setup.announce("r")
        assert setup.replies() == []  # copying
        time.sleep(0.1)
        setup.leader.background()
        assert setup.replies() == [KVReply("r", accepted=True)]
        assert setup.free_blocks() == NUM_BLOCKS and "r" not in transfers.posted
        assert setup.worker_errors() == [("r", "kv_lease_expired")]


def test_kv_that_landed_during_a_long_step_is_admitted_though_its_lease_ran_out(
    tmp_path: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    """The leader looks at its receives between steps: one that landed while a step ran past its
    lease is decoded, not thrown away and moved by the router."""
    transfers = StandInTransfers()
    with leader_setup(tmp_path, tiny_model_dirs, transfers, kv_lease_timeout=0.05) as setup:
        setup.announce("r")
        transfers.land("r")
        time.sleep(0.1)  # the step
        setup.leader.background()
        assert setup.worker_errors() == []
        assert len(setup.decode_all()) == 7  # the first of its 8 tokens came from the prefill side


def test_an_announce_of_a_dead_prefill_generation_is_dropped(setup: Setup) -> None:
    """A prefill group restarted: an announce its dead generation left in this leader's inbox,
    read after the reconnection, must post no receive (it would take the new pair's next send,
    another request's KV) and reserve nothing; the new generation's announces are served."""
    setup.leader.peer_restarted(0, 1)
    setup.announce("old", generation=0)
    assert setup.replies() == [] and setup.transfers.posted == {}
    assert setup.free_blocks() == NUM_BLOCKS
    setup.announce("new", generation=1)
    assert setup.replies() == [KVReply("new", accepted=True)] and set(setup.transfers.posted) == {"new"}
    setup.announce("newer", generation=2)  # ahead of its restart notice: refused, so it asks again
    assert setup.replies() == [KVReply("newer", accepted=False)] and "newer" not in setup.transfers.posted


LONG = list(range(1, 121))  # 120 tokens: 8 blocks


def fill_to_eight_free_blocks(setup: Setup) -> None:
    """Three long receives in flight: 24 blocks reserved, 8 free, a headroom of 3."""
    for request_id in ("a", "b", "c"):
        setup.announce(request_id, LONG)
    assert setup.replies() == [KVReply(r, accepted=True) for r in ("a", "b", "c")]
    assert setup.free_blocks() == NUM_BLOCKS - 24


def test_a_request_refused_for_room_is_not_overtaken_by_another_prefill_groups(setup: Setup) -> None:
    """Prefill group 1's long request is refused for want of blocks; group 0's short one, which
    would fit alone, must then wait too, else a steady flow of short requests from one prefill
    group takes every block that frees and the long one starves. Once blocks free, the long one
    goes first, then the short one."""
    fill_to_eight_free_blocks(setup)
    setup.announce("long", LONG, prefill_group=1)  # 8 + 3 > 8
    assert setup.replies(1) == [KVReply("long", accepted=False)]
    setup.announce("short", prefill_group=0)  # 3 + 3 <= 8 alone, but it would leave "long" 5
    assert setup.replies(0) == [KVReply("short", accepted=False)]
    assert setup.free_blocks() == NUM_BLOCKS - 24

    setup.leader.handle(Abort("a"))
    setup.transfers.land("a")
    setup.leader.background()  # "a" landed and is freed: 16 free, a headroom of 2
    assert setup.free_blocks() == NUM_BLOCKS - 16
    setup.announce("short", prefill_group=0)  # 3 + 2 + 8 <= 16: leaves "long" its room
    assert setup.replies(0) == [KVReply("short", accepted=True)]
    setup.announce("long", LONG, prefill_group=1)
    assert setup.replies(1) == [KVReply("long", accepted=True)]
    assert setup.free_blocks() == NUM_BLOCKS - 16 - 3 - 8


@pytest.mark.parametrize("ending", ["abort", "no retry"])
def test_a_request_no_longer_waiting_for_room_holds_none(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    """The waiting request aborted, or never asking again (its prefill side gave it up): a later
    request from another prefill group then gets the room it fits in."""
    monkeypatch.setattr(leader_module, "_ROOM_WAIT_TTL_S", 0.05)
    fill_to_eight_free_blocks(setup)
    setup.announce("long", LONG, prefill_group=1)
    assert setup.replies(1) == [KVReply("long", accepted=False)]
    if ending == "abort":
        setup.leader.handle(Abort("long"))
    else:
        time.sleep(0.1)
    setup.announce("short", prefill_group=0)
    assert setup.replies(0) == [KVReply("short", accepted=True)]


def test_a_request_aborted_during_its_receive_leaves_no_state_behind(setup: Setup) -> None:
    setup.announce("r")
    setup.leader.handle(Abort("r"))
    setup.transfers.land("r")
    setup.leader.background()
    assert setup.free_blocks() == NUM_BLOCKS
    leader = setup.leader
    assert not (leader.next_index or leader.receiving or leader.receive_started or leader.aborted_in_flight)


def test_a_later_request_leaves_the_waiting_one_room_for_its_own_headroom_too(setup: Setup) -> None:
    """ "long" (8 blocks) waits for room with 16 free and a headroom of 2. A 6-block request from
    another prefill group would leave it 8 + 2, but reserving it adds a block of headroom: "long"
    would then need 11 of the 10 left. So the 6-block one waits, and "long" goes."""
    fill_to_eight_free_blocks(setup)
    setup.announce("long", LONG, prefill_group=1)
    assert setup.replies(1) == [KVReply("long", accepted=False)]
    setup.leader.handle(Abort("a"))
    setup.transfers.land("a")
    setup.leader.background()
    assert setup.free_blocks() == NUM_BLOCKS - 16
    setup.announce("mid", list(range(1, 97)), prefill_group=0)  # 96 tokens: 6 blocks
    assert setup.replies(0) == [KVReply("mid", accepted=False)]
    setup.announce("long", LONG, prefill_group=1)
    assert setup.replies(1) == [KVReply("long", accepted=True)]


def test_replies_keep_their_order_on_zmq_where_the_prefill_leader_takes_datagrams(setup: Setup, tmp_path: Path) -> None:
    """A prefill leader of the node binds a datagram inbox beside its ZMQ one (``cluster.datagrams``),
    but the replies go over ZMQ, in the order the receives were posted: a push backend's sends
    follow the order the prefill leader reads them. As datagrams, those past the socket's queue
    fell back to ZMQ and were read before the earlier ones still queued."""
    datagrams = DatagramInbox.beside(f"ipc://{tmp_path}/prefill0")
    assert datagrams is not None
    try:
        ids = [f"r{i}" for i in range(16)]  # past a default Linux datagram queue (10)
        for request_id in ids:
            setup.announce(request_id, prompt=[5, 6, 7])
        assert setup.replies(0) == [KVReply(r, accepted=True) for r in ids]
        assert list(setup.transfers.posted) == ids
        assert list(datagrams.drain()) == []
    finally:
        datagrams.close()


def test_an_announce_this_group_cannot_serve_is_refused_and_the_router_told(setup: Setup) -> None:
    """A prompt past this group's own limits (here its model length, which may be shorter than
    the prefill group's) is refused (the prefill side frees its KV), nothing is reserved, and
    the router ends the request with the reason."""
    setup.announce("long", list(range(1, 201)))  # 200 tokens, past max_model_len 128
    assert setup.replies() == [KVReply("long", accepted=False)]
    assert setup.worker_errors() == [("long", "invalid_request")]
    assert setup.free_blocks() == NUM_BLOCKS and setup.transfers.posted == {}
    setup.announce("fits")
    assert setup.replies() == [KVReply("fits", accepted=True)]


def test_a_dead_prefill_groups_receives_are_freed_and_the_others_go_on(setup: Setup) -> None:
    """A prefill group fails: the blocks reserved for its receives are freed at once (the KV will
    never come), a late landing of one changes nothing, and another group's receive is admitted
    and decoded."""
    setup.announce("gone", prefill_group=0)
    setup.announce("kept", prefill_group=1)
    assert setup.free_blocks() == NUM_BLOCKS - 6
    setup.leader.peer_failed(0)
    assert setup.transfers.dropped == [0]
    assert setup.free_blocks() == NUM_BLOCKS - 3
    setup.transfers.land("gone")
    setup.transfers.land("kept")
    setup.leader.background()
    assert set(setup.engine.requests) == {"kept"}
    assert len(setup.decode_all()) == 7  # after the first token, which came from prefill
    assert setup.free_blocks() == NUM_BLOCKS and not setup.leader.receiving
    assert setup.worker_errors() == []  # the router moves the dead group's requests itself
