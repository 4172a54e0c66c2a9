"""The prefill leader driven message by message: a real engine (tiny model, CPU), a stand-in
transfer agent, and the decode group's inbox read directly, no processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pdserve.cluster.config import Addresses
from pdserve.cluster.protocol import KVAnnounce, KVReply, Sampling, WorkRequest, decode
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.prefill_worker import leader as prefill_leader
from pdserve.prefill_worker.leader import PrefillLeader


class StandInTransfers:
    """What the prefill leader uses of ``KVTransferAgent``: room always, sends that land at once."""

    def has_staging_room(self, peer_group: int, num_blocks: int) -> bool:
        return True

    def close(self) -> None:
        pass


class FrozenClock:
    """The leader module's ``time``: still until the test moves it on."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def leader(tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[PrefillLeader, zmq.Socket]]:
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dirs["tiny-llama"]),
            dtype="float32",
            device="cpu",
            max_model_len=128,
            cache=CacheConfig(num_blocks=32),
        )
    )
    addresses = Addresses(str(tmp_path), "tcp://127.0.0.1:1")
    ctx = zmq.Context.instance()
    router_inbox = ctx.socket(zmq.PULL)
    router_inbox.bind(addresses.router)
    decode_inbox = ctx.socket(zmq.PULL)
    decode_inbox.bind(addresses.leader("decode", 0))
    leader = PrefillLeader(0, addresses, engine, StandInTransfers())  # type: ignore[arg-type]
    try:
        yield leader, decode_inbox
    finally:
        leader.close()
        router_inbox.close(linger=0)
        decode_inbox.close(linger=0)


def _prefill(leader: PrefillLeader, request_id: str) -> None:
    leader.handle(WorkRequest(request_id, list(range(1, 21)), Sampling(max_tokens=8, temperature=0.0), 0))
    while leader.engine.has_unfinished():
        leader.send_outputs(leader.engine.step())


def _announced(decode_inbox: zmq.Socket) -> list[str]:
    out = []
    while decode_inbox.poll(200):
        message = decode(decode_inbox.recv())
        assert isinstance(message, KVAnnounce)
        out.append(message.request_id)
    return out


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
    assert _announced(decode_inbox) == ["old"]
    prefill.handle(KVReply("old", accepted=False))  # its retry waits a back-off
    _prefill(prefill, "new")
    prefill.background()
    assert _announced(decode_inbox) == []  # "new" waits behind "old"
    clock.now += 1.0
    prefill.background()
    assert _announced(decode_inbox) == ["old", "new"]
