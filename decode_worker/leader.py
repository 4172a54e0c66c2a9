"""The decode role: receive prefilled requests' KV, then decode them with continuous batching.

Lifecycle of a request here:
1. ``KVAnnounce`` from a prefill leader -> reserve blocks for the prompt's KV, starting with the
   longest prefix of its full blocks that this group's prefix cache holds (the KV of requests
   it received or decoded before: a chat's earlier turns, a shared system prompt; a request's
   received blocks enter the cache at its first decode step). None free, or its receive buffers would take
   the leader's buffers in flight past ``max_staging_bytes``: reply refused (the prefill side
   keeps the KV and retries). Refused announces get room in the order they were first refused,
   across prefill groups: while one waits, a later one goes only if it leaves that one its
   room. Otherwise reply accepted, naming the ``cached_blocks`` it held,
   then every rank of the group posts its receive of the other blocks (the command rides the
   step channel, in order). A pulling backend (``TransferBackend.pulls``) copies those from
   the prefill pool instead, and the reply waits until that copy is complete: it tells the
   prefill side to free the blocks.
2. Receive complete (sync: at once; async: polled between steps, so several are in flight while
   the group keeps decoding) -> the request joins continuous batching; its first decode step
   makes each peer wait for its own part first (``StepPlan.kv_ready``).
3. Tokens stream to the router from output index 1 (index 0, the first token, came from
   prefill); the final one carries the transfer time and size.

Invariant: a posted receive always completes (the prefill side always sends once accepted),
so an abort during a transfer frees the blocks only after the leader's part of it; the peers'
parts are then discarded (a discarded receive is never written into the cache, and its
buffers go once it lands). An abort may arrive before the
request's announcement (the router tells both groups at once; the prefill side announces when
its prefill ends): its id is remembered for ``_ABORTED_TTL_S`` and its announcement refused, so
the prefill side frees the KV and nothing is decoded.

Failures: a receive not complete within ``kv_lease_timeout`` (its sender hung), or cut off by
the sender's death, frees its blocks and is discarded on every rank: whatever lands later is
never written into the cache. A pulled one's reply still goes, so the prefill side frees its
blocks too. The router hears ``kv_lease_expired`` or ``kv_transfer_failed``
and moves the request. A dead prefill group (``PeerFailed``) takes its receives with it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from pdserve.cluster.config import Addresses
from pdserve.cluster.leader import FIRST_DECODED, GroupLeader
from pdserve.cluster.protocol import KVAnnounce, KVReply, Message, WorkerError
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.sampling import RequestError
from pdserve.engine.timings import RequestTimings
from pdserve.kvtransfer.agent import KVTransferAgent
from pdserve.kvtransfer.base import TransferFailed, TransferStats

# Long enough for any announcement still on its way, short and bounded so the memory stays small.
_ABORTED_TTL_S = 120.0
_ABORTED_MAX = 100_000
# How long room is kept for an announce refused for want of it, after its last try: the prefill
# side retries well within this unless it gave the request up.
_ROOM_WAIT_TTL_S = 1.0


class _Receive(NamedTuple):
    """A request whose KV is arriving: its announce, and the leading blocks this group's
    prefix cache held already (not transferred)."""

    announce: KVAnnounce
    cached_blocks: int


class _RoomWait(NamedTuple):
    """An announce refused for want of free blocks or staging room, to be retried."""

    prefill_group: int
    num_blocks: int  # its prompt's: the free blocks a later request must leave it
    moving_blocks: int  # those that move (its prompt's, less any this group caches): the staging room
    refused_at: float


class DecodeLeader(GroupLeader):
    role = "decode"

    def __init__(
        self,
        group: int,
        addresses: Addresses,
        engine: LLMEngine,
        transfers: KVTransferAgent,
        kv_lease_timeout: float = float("inf"),
        prefill_generations: Sequence[int] = (),
    ) -> None:
        super().__init__(group, addresses, engine)
        self.transfers = transfers  # from every prefill group
        self.kv_lease_timeout = kv_lease_timeout
        # Each prefill group's generation that the transfers are connected to (joined groups: once
        # introduced); an announce of another generation is a dead one's, read late.
        self.prefill_generations = dict(enumerate(prefill_generations))
        self.receiving: dict[str, _Receive] = {}
        self.receive_started: dict[str, float] = {}
        self.aborted_in_flight: set[str] = set()
        self.aborted: OrderedDict[str, float] = OrderedDict()  # request -> when its abort came, oldest first
        self.room_waits: OrderedDict[str, _RoomWait] = OrderedDict()  # first refused first
        # Prefill's timings and the transfer's stats, read once the request's first step is back
        # (on CUDA the transfer time comes from events: reading it earlier could stall the loop).
        self.handoffs: dict[str, tuple[RequestTimings, TransferStats]] = {}

    def transfers_pending(self) -> bool:
        return bool(self.receiving)

    def pairs_forming(self) -> int:
        return len(self.transfers.forming())

    def handle(self, message: Message) -> None:
        if isinstance(message, KVAnnounce):
            self.on_announce(message)
        else:
            super().handle(message)

    def on_announce(self, announce: KVAnnounce) -> None:
        request_id = announce.request_id
        known = self.prefill_generations.get(announce.prefill_group, announce.generation)
        if announce.generation < known:
            # Its sender is gone, and a receive posted for it would take the next send of the new
            # generation's pair: drop it (the router moved or ended its request already).
            return
        if announce.generation > known:  # ahead of its PeerRestarted here: it asks again later
            self.send_leader("prefill", announce.prefill_group, KVReply(request_id, accepted=False))
            return
        if request_id in self.aborted:  # aborted before its KV was announced: never decode it
            self.send_leader("prefill", announce.prefill_group, KVReply(request_id, accepted=False))
            return
        if not self.transfers.connected(announce.prefill_group):  # its pair still forming
            self.send_leader("prefill", announce.prefill_group, KVReply(request_id, accepted=False))
            return
        # Room goes to announces in the order they were first refused, across prefill groups:
        # a later one goes only if it leaves the first waiting one its room, else a steady flow
        # from one prefill group starves a large request from another.
        num_blocks = moving = self.engine.blocks_for(len(announce.token_ids))
        ahead = self._first_room_wait(request_id)
        keep = None if ahead is None else (ahead.prefill_group, ahead.moving_blocks)
        if not self.transfers.has_staging_room(announce.prefill_group, moving, keep):
            # Only the blocks this group's prefix cache lacks move: count them only now, since
            # matching a long prompt costs the loop more than this check.
            moving -= self.engine.cached_blocks(announce.token_ids)
            if not self.transfers.has_staging_room(announce.prefill_group, moving, keep):
                self._wait_for_room(announce, num_blocks, moving)
                return
        try:
            reservation = self.engine.reserve(
                request_id,
                announce.token_ids,
                announce.first_token,
                announce.sampling.to_params(),
                keep_free=0 if ahead is None else ahead.num_blocks + 1,  # and its own headroom block
                generated=announce.generated,
            )
        except RequestError as e:
            self.room_waits.pop(request_id, None)
            self.send_leader("prefill", announce.prefill_group, KVReply(request_id, accepted=False))
            self.send_router(WorkerError(request_id, "invalid_request", str(e)))
            return
        if reservation is None:
            self._wait_for_room(announce, num_blocks, moving)
            return
        self.room_waits.pop(request_id, None)
        # Only the blocks after those this group's prefix cache already holds move.
        cached = reservation.num_cached_blocks
        if not self.transfers.pulls(announce.prefill_group):
            self.send_leader(
                "prefill", announce.prefill_group, KVReply(request_id, accepted=True, cached_blocks=cached)
            )
        self.transfers.recv(
            request_id, reservation.block_ids[cached:], announce.prefill_group, announce.block_ids[cached:]
        )
        self.receiving[request_id] = _Receive(announce, cached)
        self.receive_started[request_id] = time.monotonic()
        self.next_index[request_id] = FIRST_DECODED

    def _first_room_wait(self, request_id: str) -> _RoomWait | None:
        """The announce first refused for want of room and still retried, unless that is this one."""
        expired = time.monotonic() - _ROOM_WAIT_TTL_S
        while self.room_waits and next(iter(self.room_waits.values())).refused_at < expired:
            self.room_waits.popitem(last=False)  # given up on the prefill side (its lease, an abort)
        first = next(iter(self.room_waits), None)
        return None if first in (None, request_id) else self.room_waits[first]

    def _wait_for_room(self, announce: KVAnnounce, num_blocks: int, moving_blocks: int) -> None:
        """Refuse for now; the prefill side keeps the KV and asks again (in its first place here)."""
        wait = _RoomWait(announce.prefill_group, num_blocks, moving_blocks, time.monotonic())
        self.room_waits[announce.request_id] = wait  # an existing key keeps its place
        self.send_leader("prefill", announce.prefill_group, KVReply(announce.request_id, accepted=False))

    def background(self) -> None:
        expired = time.monotonic() - _ABORTED_TTL_S
        while self.aborted and (len(self.aborted) > _ABORTED_MAX or next(iter(self.aborted.values())) < expired):
            self.aborted.popitem(last=False)
        for request_id in [r for r in self.receiving if self.transfers.done(r)]:
            announce, cached = receive = self.receiving.pop(request_id)
            self.receive_started.pop(request_id, None)
            try:
                stats = self.transfers.wait(request_id)
            except TransferFailed as e:
                self._give_up(request_id, receive, "kv_transfer_failed", str(e))
                continue
            if self.transfers.pulls(announce.prefill_group):  # the copy is done: the prefill side may free
                self.send_leader("prefill", announce.prefill_group, KVReply(request_id, True, cached))
            if request_id in self.aborted_in_flight:
                self.aborted_in_flight.discard(request_id)
                self.transfers.discard(request_id)  # the peers' parts, never to be waited for
                self.engine.abort(request_id)
                self.next_index.pop(request_id, None)
                continue
            self.handoffs[request_id] = (announce.timings, stats)
            self.engine.admit(request_id)
        # After the arrivals: KV that landed during a long step is taken, not thrown away.
        lease_end = time.monotonic() - self.kv_lease_timeout
        for request_id in [r for r, t in self.receive_started.items() if t < lease_end]:
            why = f"its KV did not arrive in {self.kv_lease_timeout:g} s"
            self._give_up(request_id, self.receiving.pop(request_id), "kv_lease_expired", why)

    def _give_up(self, request_id: str, receive: _Receive, code: str, why: str) -> None:
        """A receive that will never be admitted: free its blocks; the router moves the request
        (unless it was aborted meanwhile)."""
        self.kv_transfer_failures += 1
        self.receive_started.pop(request_id, None)
        # On every rank: a peer's part is otherwise held (its staging buffers too) for good.
        self.transfers.discard(request_id)
        group = receive.announce.prefill_group
        if self.transfers.pulls(group):  # its copies are over (discarded): the prefill side may free
            self.send_leader("prefill", group, KVReply(request_id, True, receive.cached_blocks))
        self.engine.abort(request_id)
        self.next_index.pop(request_id, None)
        if request_id in self.aborted_in_flight:
            self.aborted_in_flight.discard(request_id)
        else:
            self.send_router(WorkerError(request_id, code, why))

    def peer_failed(self, group: int) -> None:
        self.transfers.drop(group)
        self._forget_room_waits(group)
        for request_id in [r for r, a in self.receiving.items() if a.announce.prefill_group == group]:
            self.receiving.pop(request_id)
            self.receive_started.pop(request_id, None)
            self.aborted_in_flight.discard(request_id)
            self.engine.abort(request_id)
            self.next_index.pop(request_id, None)

    def peer_restarted(self, group: int, generation: int) -> None:
        self.prefill_generations[group] = generation
        self._forget_room_waits(group)
        self.transfers.reconnect(group, generation)

    def _forget_room_waits(self, group: int) -> None:
        for request_id in [r for r, w in self.room_waits.items() if w.prefill_group == group]:
            del self.room_waits[request_id]

    def abort(self, request_id: str) -> None:
        self.aborted[request_id] = time.monotonic()
        self.room_waits.pop(request_id, None)
        if request_id in self.receiving:
            self.aborted_in_flight.add(request_id)  # free after the receive lands
            return
        self.handoffs.pop(request_id, None)
        super().abort(request_id)

    def on_output(self, out: RequestOutput) -> None:
        if out.finished:
            # Queue and prefill times come from the prefill group; this group adds the rest.
            prefill_timings, stats = self.handoffs.pop(out.request_id, (RequestTimings(), None))
            timings = msgspec.structs.replace(
                prefill_timings, decode=out.timings.decode, decode_cached_tokens=out.timings.cached_tokens
            )
            if stats is not None:
                timings = msgspec.structs.replace(
                    timings, transfer=stats.seconds, transfer_bytes=float(stats.num_bytes)
                )
            out = dataclasses.replace(out, timings=timings)
        elif self.next_index.get(out.request_id) == FIRST_DECODED and out.request_id in self.handoffs:
            # The transfer goes to the router with the first tokens too: a request ended by an
            # abort (a stop string the HTTP front end matched), whose final the router writes, counts it.
            stats = self.handoffs[out.request_id][1]
            moved = RequestTimings(transfer=stats.seconds, transfer_bytes=float(stats.num_bytes))
            out = dataclasses.replace(out, timings=moved)
        self.emit(out)

    def close(self) -> None:
        self.transfers.close()
        super().close()
