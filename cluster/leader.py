"""The loop and sockets every group leader shares, whatever its role.

The leader (TP rank 0 of a group) owns the engine and the group's control sockets: an inbox
bound at its address (``cluster.inbox``: the router and the other role's leaders send to it)
and PUSH sockets to the router and to other leaders. Leaders of one node send each other
datagrams instead where they can (``cluster.datagrams``): a KV hand-off then waits for one
process to wake up, not three. Its TP peers follow its steps (``ModelRunner.run_peer``). A role
(``cluster.colocated``, ``prefill_worker.leader``, ``decode_worker.leader``) subclasses
``GroupLeader`` with the messages it handles and what it does with its engine's outputs.
"""

from __future__ import annotations

import logging
import time
from typing import ClassVar

import zmq

from pdserve.cluster.config import Addresses
from pdserve.cluster.datagrams import DatagramOutbox
from pdserve.cluster.inbox import LeaderInbox
from pdserve.cluster.protocol import (
    ROOT_HASH,
    Abort,
    CacheEvents,
    Logprobs,
    Message,
    PeerFailed,
    PeerRestarted,
    ProtocolError,
    Ready,
    Shutdown,
    TokenOutput,
    TokenOutputs,
    WorkerError,
    WorkerStats,
    WorkRequest,
    block_hash,
    decode,
    encode,
)
from pdserve.cluster.watchdog import Watchdog
from pdserve.engine.engine import CacheEvent, LLMEngine, RequestOutput
from pdserve.engine.sampling import RequestError
from pdserve.engine.timings import RequestTimings

logger = logging.getLogger(__name__)

_STATS_INTERVAL_S = 0.2
# How often a leader whose engine is idle looks at its KV hand-offs in flight (a send or copy that
# completes, a retry that is due); a message wakes it at once. Not 0: on CPUs, where the leader
# does not spin, a busy loop would take a core from the ranks' compute.
_HANDOFF_POLL_MS = 1
# Seconds a stopping leader waits for its KV hand-offs to settle. The router stops every group at
# once, so a peer that has not answered by then has exited (a hand-off announced to a decode
# leader that left first is never answered); the exit frees what the hand-off held.
_STOP_TRANSFER_WAIT_S = 10.0
_NO_TIMINGS = RequestTimings()
# A decode group's first output: with it go the KV transfer's timings (index 0 is the prefill group's).
FIRST_DECODED = 1


class CacheEventHashes:
    """An engine cache listener that keeps the events as signed block hashes, in order:
    ``h`` for a block inserted, ``-h`` for one evicted. ``take`` hands them over."""

    def __init__(self) -> None:
        self._hash_of: dict[int, int] = {}  # cached node id -> its prefix's hash
        self._pending: list[int] = []

    def __call__(self, event: CacheEvent) -> None:
        if event.kind == "insert":
            value = block_hash(self._hash_of.get(event.parent_id, ROOT_HASH), event.token_ids)
            self._hash_of[event.node_id] = value
            self._pending.append(value)
        else:
            self._pending.append(-self._hash_of.pop(event.node_id))

    def take(self) -> list[int]:
        pending, self._pending = self._pending, []
        return pending


class GroupLeader:
    """Socket plumbing, the serve loop, request intake and output streaming of one group."""

    role: ClassVar[str]  # prefill | decode | colocated: names the group's address and its reports

    def __init__(self, group: int, addresses: Addresses, engine: LLMEngine) -> None:
        self.group = group
        self.addresses = addresses
        self.engine = engine
        self.ctx = zmq.Context.instance()
        self.inbox = LeaderInbox(self.ctx, addresses.leader(self.role, group))
        self.to_router = self._push(addresses.router)
        self._leaders: dict[tuple[str, int], zmq.Socket] = {}
        self._to_leaders = DatagramOutbox()
        # Leaders that joined at run time, or live on other machines: where the router said they listen.
        self._peer_addresses: dict[tuple[str, int], str] = {}
        self.next_index: dict[str, int] = {}  # request -> index of its next output token
        self._stopped_at: float | None = None  # when the router's shutdown came
        self.kv_refused = 0
        # A role's KV transfers that failed or were given up (refusals are kv_refused, not these).
        self.kv_transfer_failures = 0
        self._outputs: list[TokenOutput] = []
        # The router routes by what each group's prefix cache holds: it learns that from here.
        self._cache_events: CacheEventHashes | None = CacheEventHashes()
        if not engine.set_cache_listener(self._cache_events):
            self._cache_events = None

    def _push(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(address)
        return sock

    def send_router(self, message: Message) -> None:
        self.to_router.send(encode(message))

    def send_leader(self, role: str, group: int, message: Message, any_order: bool = False) -> None:
        """Send to another group's leader over ZMQ, which keeps the order of this leader's
        messages to it; with ``any_order`` as a datagram where one can go (``cluster.datagrams``):
        it may then overtake earlier messages."""
        key = (role, group)
        address = self._peer_addresses.get(key) or self.addresses.leader(role, group)
        data = encode(message)
        if any_order and self._to_leaders.send(address, data):
            return
        if key not in self._leaders:
            self._leaders[key] = self._push(address)
        self._leaders[key].send(data)

    # -- loop ----------------------------------------------------------------------------

    def run(self, watchdog: Watchdog | None = None, idle_spin_s: float = 0.0) -> None:
        """Serve until the router shuts the group down, ticking ``watchdog`` every time round.
        For ``idle_spin_s`` after its last work the leader busy-polls its inbox instead of
        sleeping (``cluster.inbox``)."""
        tp = self.engine.config.parallel.tp_size
        address = self.addresses.leader(self.role, self.group)
        self.send_router(Ready(self.role, self.group, self.engine.stats().num_blocks, tp, address))
        next_stats = spin_until = 0.0
        try:
            while not self.stopping or (self.transfers_pending() and not self._stop_overdue()):
                if watchdog is not None:
                    watchdog.tick()  # an idle leader comes round every 20 ms too
                if self.engine.has_unfinished():
                    timeout, spin_until = 0, time.monotonic() + idle_spin_s
                elif self.handoffs_waiting():
                    timeout, spin_until = _HANDOFF_POLL_MS, time.monotonic() + idle_spin_s
                else:
                    timeout = 20
                for data in self.inbox.receive(timeout, spin_until):
                    self._dispatch(data)
                self.background()
                if self.engine.has_unfinished() and not self.stopping:
                    self.send_outputs(self.engine.step(emit=self.send_outputs))
                self.flush_cache_events()  # those of aborts and releases, which no step sends
                if time.monotonic() >= next_stats:
                    self.send_router(self.stats())
                    next_stats = time.monotonic() + _STATS_INTERVAL_S
        finally:
            self.close()

    def stats(self) -> WorkerStats:
        s = self.engine.stats()
        cache = s.prefix_cache
        return WorkerStats(
            self.role,
            self.group,
            s.num_blocks,
            s.free_blocks,
            s.running,
            s.waiting,
            s.kv_held,
            self.kv_refused,
            prefix_queried_tokens=0 if cache is None else cache.hit_tokens + cache.miss_tokens,
            prefix_hit_tokens=0 if cache is None else cache.hit_tokens,
            prefix_evicted_blocks=0 if cache is None else cache.evicted_blocks,
            kv_transfer_failures=self.kv_transfer_failures,
            pairs_forming=self.pairs_forming(),
            preemptions=s.preemptions,
            prefix_cached_blocks=0 if cache is None else cache.cached_blocks,
        )

    @property
    def stopping(self) -> bool:
        return self._stopped_at is not None

    def _stop_overdue(self) -> bool:
        assert self._stopped_at is not None
        if time.monotonic() - self._stopped_at <= _STOP_TRANSFER_WAIT_S:
            return False
        logger.warning(
            "%s%d: stopping with KV hand-offs unanswered after %g s (their peers exited)",
            self.role,
            self.group,
            _STOP_TRANSFER_WAIT_S,
        )
        return True

    def handoffs_waiting(self) -> bool:
        """KV hand-offs this leader looks at between steps: those in flight, and any it retries."""
        return self.transfers_pending()

    def transfers_pending(self) -> bool:
        """KV handed to or from another group and not yet settled (must finish before exit)."""
        return False

    def pairs_forming(self) -> int:
        """Groups of the other role whose KV pair with this group is still forming."""
        return 0

    def background(self) -> None:
        """Work between steps that is not a message (transfers to poll, retries)."""

    def _dispatch(self, data: bytes) -> None:
        try:
            message = decode(data)
        except ProtocolError as e:  # internal sockets: log and carry on
            logger.error("%s%d: dropped a bad internal message: %s", self.role, self.group, e)
            return
        self.handle(message)

    def handle(self, message: Message) -> None:
        """A message on the inbox; a role handles its own first and passes the rest here."""
        if isinstance(message, Abort):
            self.abort(message.request_id)
        elif isinstance(message, Shutdown):
            if self._stopped_at is None:
                self._stopped_at = time.monotonic()
        elif isinstance(message, PeerFailed):
            logger.log(
                logging.INFO if message.left else logging.WARNING,
                "%s%d: %s group %d %s",
                self.role,
                self.group,
                message.role,
                message.group,
                "left the cluster" if message.left else "failed",
            )
            sock = self._leaders.pop((message.role, message.group), None)
            # What was queued for the dead group must not reach its successor. A reply sent before
            # its restart is known may: the successor ignores replies to announces it never made.
            if sock is not None:
                sock.close(linger=0)
            self.peer_failed(message.group)
        elif isinstance(message, PeerRestarted):
            if message.address:
                key = (message.role, message.group)
                self._peer_addresses[key] = message.address
                sock = self._leaders.pop(key, None)
                if sock is not None:
                    sock.close(linger=0)
            self.peer_restarted(message.group, message.generation)
        else:
            logger.error("%s%d: unexpected %s", self.role, self.group, message.type)

    def peer_failed(self, group: int) -> None:
        """A group of the other role died: give up every KV hand-off with it (the router moves
        its requests)."""

    def peer_restarted(self, group: int, generation: int) -> None:
        """A group of the other role is back as ``generation``: connect the KV transfers to it."""

    def add(self, request: WorkRequest, prefill_only: bool = False) -> bool:
        """Queue a request in the engine; a refused one gets a terminal error at the router."""
        try:
            self.engine.add_request(
                request.request_id,
                request.token_ids,
                request.sampling.to_params(),
                prefill_only=prefill_only,
                generated=request.generated,
            )
        except RequestError as e:
            self.send_router(WorkerError(request.request_id, "invalid_request", str(e)))
            return False
        self.next_index[request.request_id] = 0
        return True

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.next_index.pop(request_id, None)

    def on_output(self, out: RequestOutput) -> None:
        """One of the engine's outputs; a role may change what the router gets of it."""
        self.emit(out)

    def emit(self, out: RequestOutput) -> None:
        """Queue a request's new tokens for the router (sent once per step, ``flush_outputs``);
        its first output (the entry group's: index 0) and its finished one carry the timings."""
        index = self.next_index.get(out.request_id, 0)
        self._outputs.append(
            TokenOutput(
                out.request_id,
                index,
                out.new_token_ids,
                out.finished,
                out.finish_reason,
                out.timings if out.finished or index <= FIRST_DECODED else _NO_TIMINGS,
                None if out.logprobs is None else Logprobs.of(out.logprobs),
                None if out.prompt_logprobs is None else Logprobs.of(out.prompt_logprobs),
            )
        )
        if out.finished:
            self.next_index.pop(out.request_id, None)
        else:
            self.next_index[out.request_id] = index + len(out.new_token_ids)

    def send_outputs(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to the router now (also those the engine read back ahead of an eager
        step, before its launch)."""
        for out in outputs:
            self.on_output(out)
        self.flush_outputs()

    def flush_outputs(self) -> None:
        """One message per step for every request's tokens: per-request messages cost more than
        the decode step itself at large batch sizes."""
        if self._outputs:
            # A prompt's blocks reach the router's cache view before its first token does.
            self.flush_cache_events()
            self.send_router(TokenOutputs(self._outputs))
            self._outputs = []

    def flush_cache_events(self) -> None:
        """The prefix cache's inserts and evictions since the last call, to the router."""
        if self._cache_events is not None:
            hashes = self._cache_events.take()
            if hashes:
                self.send_router(CacheEvents(self.role, self.group, hashes))

    def close(self) -> None:
        self.engine.abort_all()
        self.engine.close()  # releases the TP peers and the CUDA graphs before the group goes
        for sock in (self.to_router, *self._leaders.values()):
            sock.close()
        self.inbox.close()
        self._to_leaders.close()
