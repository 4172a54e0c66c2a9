"""The prefill role: run prompts, return the first token at once, hand the KV to a decode group.

Lifecycle of a request here:
1. ``WorkRequest`` -> the engine, as a prefill-only request.
2. First token sampled -> sent to the router immediately (this is the TTFT), and the request
   is *announced* to its decode group (``KVAnnounce``) while its KV blocks stay held.
3. ``KVReply`` accepted -> every rank of the group sends its pieces of the blocks after the
   reply's ``cached_blocks`` (those the decode group holds already); the blocks are freed when
   this rank's send completes (sync: at once; async: polled between steps). Where the decode
   side pulls the KV (``TransferBackend.pulls``), it replies only once its copy is complete:
   the send has nothing left to do and the blocks are freed at once.
   ``KVReply`` refused (the decode group has no room yet, or its pair is still forming) -> the
   announcement is retried later with back-off; the KV stays here meanwhile (back-pressure,
   never a drop), and the later requests to that decode group wait behind it (first
   prefilled, first offered). One waiting
   for staging room (the buffers of sends in flight or announced, shared by every decode group)
   holds back every later one.

Invariant: once a decode group has accepted a transfer it has posted the receive, so the send
always happens, even for a request aborted in between (its blocks are freed afterwards).

Failures: KV not yet announced (the decode side keeps refusing, or is not connected) is held
for ``kv_lease_timeout`` at most from when the loop could first offer it, then freed and the
request handed back to the router (``kv_lease_expired``). When a decode group dies
(``PeerFailed``) every hand-off to it is given up and its KV freed at once; an announce never
answered can only be one to a dead or hung group, which the router's heartbeats catch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import msgspec

from pdserve.cluster.config import Addresses
from pdserve.cluster.leader import GroupLeader
from pdserve.cluster.protocol import KVAnnounce, KVReply, Message, WorkerError, WorkRequest
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.kvtransfer.agent import KVTransferAgent
from pdserve.kvtransfer.base import Transfer, TransferFailed

_RETRY_FIRST_S = 0.002
_RETRY_MAX_S = 0.05


@dataclass
class _Handoff:
    announce: KVAnnounce
    decode_group: int
    block_ids: list[int]
    retry_at: float = 0.0
    backoff: float = _RETRY_FIRST_S
    aborted: bool = False
    # When the loop could first offer it: the step that made it may run on long after (the next
    # batch's prompts), and that time must not count against its lease.
    since: float | None = None


class PrefillLeader(GroupLeader):
    role = "prefill"

    def __init__(
        self,
        group: int,
        addresses: Addresses,
        engine: LLMEngine,
        transfers: KVTransferAgent,
        kv_lease_timeout: float = float("inf"),
        generation: int = 0,
    ) -> None:
        super().__init__(group, addresses, engine)
        self.transfers = transfers  # to every decode group
        self.kv_lease_timeout = kv_lease_timeout
        self.generation = generation  # this group's, named in its announces
        self.work: dict[str, WorkRequest] = {}  # until prefilled: where the KV goes, how to sample
        self.to_announce: deque[_Handoff] = deque()  # waiting for staging room or a retry
        self.announced: dict[str, _Handoff] = {}  # waiting for the decode group's reply
        self.sending: dict[str, Transfer] = {}  # sends in flight

    def handoffs_waiting(self) -> bool:
        return super().handoffs_waiting() or bool(self.to_announce)

    def transfers_pending(self) -> bool:
        # Announced requests await a reply: an accepted one has a receive posted on the other side.
        return bool(self.announced) or bool(self.sending)

    def pairs_forming(self) -> int:
        return len(self.transfers.forming())

    def handle(self, message: Message) -> None:
        if isinstance(message, WorkRequest):
            if self.add(message, prefill_only=True):
                self.work[message.request_id] = message
        elif isinstance(message, KVReply):
            self.on_reply(message)
        else:
            super().handle(message)

    def abort(self, request_id: str) -> None:
        handoff = self.announced.get(request_id)
        if handoff is not None:
            handoff.aborted = True  # the reply decides: send anyway (accepted) or just free
            return
        for queued in list(self.to_announce):
            if queued.announce.request_id == request_id:
                self.to_announce.remove(queued)
        if request_id not in self.sending:  # an in-flight send frees its blocks when done
            super().abort(request_id)
        self.work.pop(request_id, None)

    def on_output(self, out: RequestOutput) -> None:
        work = self.work.pop(out.request_id)
        if out.finish_reason != "prefilled":  # the first token already ended it
            self.emit(out)
            return
        # For the router the request goes on: decoding continues in the decode group. Its
        # prefill timings go with the first token: they are the router's if it is aborted, and
        # its decoding (none here: the engine's 0) the router's to time then.
        self.emit(
            RequestOutput(
                out.request_id,
                out.new_token_ids,
                timings=msgspec.structs.replace(out.timings, decode=None),
                logprobs=out.logprobs,
                prompt_logprobs=out.prompt_logprobs,
            )
        )
        self.next_index.pop(out.request_id, None)  # nothing more goes to the router from here
        block_ids = out.kv_block_ids or []
        announce = KVAnnounce(
            out.request_id,
            self.group,
            work.token_ids,
            out.new_token_ids[0],
            work.sampling,
            out.timings,
            block_ids,
            self.generation,
            work.generated,
        )
        self.to_announce.append(_Handoff(announce, work.decode_group, block_ids))

    def background(self) -> None:
        for request_id in [r for r, transfer in self.sending.items() if transfer.done()]:
            try:
                self.sending[request_id].wait()
            except TransferFailed:  # its decode group died: the router moves the request
                self.kv_transfer_failures += 1
            self._release(request_id)
        now = time.monotonic()
        # A decode group is offered KV in prefill order: one handoff that must wait holds back
        # the later ones to its group, else those take the room that frees and it starves. Staging
        # room is shared by every group, so one handoff waiting for it holds back every later one:
        # else a flow to another group keeps sends in flight, and one larger than the whole
        # bound, which goes only when none is, never goes.
        waiting: set[int] = set()
        room_short = False
        # An announce promises a send: the handoffs awaiting their reply take staging room too,
        # else with nothing in flight every waiting one is announced at once, past the bound.
        promised = sum(self._staging_need(h) for h in self.announced.values()) if self.to_announce else 0
        for _ in range(len(self.to_announce)):
            handoff = self.to_announce.popleft()
            if handoff.since is None:
                handoff.since = now
            elif now - handoff.since > self.kv_lease_timeout:
                self._expire(handoff)
                continue
            held = (
                handoff.decode_group in waiting
                or handoff.retry_at > now
                # Its pair still forming (a group that just joined or restarted) holds back its own.
                or not self.transfers.connected(handoff.decode_group)
            )
            if not held and (room_short or not self._staging_room(handoff, promised)):
                held = room_short = True
            if held:
                waiting.add(handoff.decode_group)
                self.to_announce.append(handoff)
                continue
            self.announced[handoff.announce.request_id] = handoff
            promised += self._staging_need(handoff)
            # Announces may arrive in any order: the decode leader's replies carry the one it took.
            self.send_leader("decode", handoff.decode_group, handoff.announce, any_order=True)

    def _staging_room(self, handoff: _Handoff, promised: int) -> bool:
        """Bound the packed KV held for sends in flight or promised (the first one always goes)."""
        return self.transfers.has_staging_room(handoff.decode_group, len(handoff.block_ids), promised=promised)

    def _staging_need(self, handoff: _Handoff) -> int:
        return self.transfers.staging_need(handoff.decode_group, len(handoff.block_ids))

    def on_reply(self, reply: KVReply) -> None:
        handoff = self.announced.pop(reply.request_id, None)
        if handoff is None:
            return
        if not reply.accepted:
            self.kv_refused += 1
            if handoff.aborted:
                self._release(reply.request_id)
                return
            handoff.retry_at = time.monotonic() + handoff.backoff
            handoff.backoff = min(handoff.backoff * 2, _RETRY_MAX_S)
            self.to_announce.append(handoff)
            return
        # The decode group's prefix cache holds the leading blocks already: send only the rest.
        blocks = handoff.block_ids[reply.cached_blocks :]
        self.sending[reply.request_id] = self.transfers.send(reply.request_id, blocks, handoff.decode_group)

    def _expire(self, handoff: _Handoff) -> None:
        """Its lease ran out before a decode group took the KV: free it, the router decides."""
        request_id = handoff.announce.request_id
        self.kv_transfer_failures += 1
        self.engine.release(request_id)
        self.send_router(
            WorkerError(
                request_id,
                "kv_lease_expired",
                f"decode group {handoff.decode_group} took no KV for {self.kv_lease_timeout:g} s",
            )
        )

    def peer_failed(self, group: int) -> None:
        self.transfers.drop(group)  # its sends fail; background() frees their blocks
        for request_id in [r for r, h in self.announced.items() if h.decode_group == group]:
            del self.announced[request_id]
            self.engine.release(request_id)
        for handoff in [h for h in self.to_announce if h.decode_group == group]:
            self.to_announce.remove(handoff)
            self.engine.release(handoff.announce.request_id)

    def peer_restarted(self, group: int, generation: int) -> None:
        self.transfers.reconnect(group, generation)

    def _release(self, request_id: str) -> None:
        self.sending.pop(request_id, None)
        self.engine.release(request_id)

    def close(self) -> None:
        self.transfers.close()
        super().close()
