"""The router: the cluster's ZMQ front door.

Clients talk to a ROUTER socket (``cluster.protocol``). The router validates every request
before dispatch (protocol shape, sampling ranges, vocabulary, length), tokenizes text, picks a
prefill group and a decode group (or a colocated group), and turns the workers' token outputs
into ordered chunks with incremental text and one final message.

Invariant: every accepted request ends with exactly one terminal message to its client
(``Final`` or ``Error``); bad input gets an ``Error`` reply and never stops the loop. The one
exception is a client the router can no longer reach (disconnected, or so far behind in reading
that its send queue is full): its requests are aborted on the workers and dropped.

Limits keep one client from holding up the others: a message over ``max_message_mib`` is never
read (ZMQ drops the connection), a text prompt over ``max_prompt_chars`` is refused before it is
tokenized, and requests beyond ``max_requests_per_client`` or ``max_requests`` get ``overloaded``.
Each refusal is logged at WARNING with the client's address, rate-limited per error code.

Membership: the groups the router's node starts are known from the config; a group on another
machine joins at run time (``cluster.join``) by its ``ready`` (role, TP, address), which the
``admit`` check of the router's node accepts or refuses, and the router then introduces it to
every group of the other role (``peer_restarted``, both ways) so that their KV pair groups form.
A joined group leaves by ``drain`` (no new requests; shut down once it holds none, or after
``drain_timeout`` with the rest moved), or is removed when its heartbeats stop; it never restarts.

Failures: the router dispatches only to ready groups (a request waits while a role has none, up
to ``dispatch_timeout``), watches every ready group's heartbeats (``check_heartbeats``), and
when a group fails (``group_failed``, from the launcher) moves each request it held: prefilled
again on live groups with its tokens so far (``_migrate``), under a new internal id so that
nothing the dead group still sends is applied, up to ``migration_limit`` moves, then
``worker_failed``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from pdserve.cluster.auth import secure_server
from pdserve.cluster.config import Addresses, ClusterConfig, prompt_chars_limit
from pdserve.cluster.protocol import (
    Abort,
    CacheEvents,
    Chunk,
    Chunks,
    Drain,
    Error,
    Final,
    Generate,
    GroupFailed,
    GroupInfo,
    Heartbeat,
    Logprobs,
    Message,
    PeerFailed,
    PeerRestarted,
    Ping,
    ProtocolError,
    Ready,
    Sampling,
    Shutdown,
    Stats,
    StatsRequest,
    TokenOutput,
    TokenOutputs,
    WorkerError,
    WorkerStats,
    WorkRequest,
    decode,
    encode,
)
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling import RequestError, validate_request
from pdserve.engine.timings import RequestTimings
from pdserve.engine.tokenization import encode_prompt
from pdserve.router.policy import create_policy
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.rejection_log import RejectionLog, shorten

logger = logging.getLogger(__name__)
PING_S = 1.0

# Messages queued for one client before it counts as gone: far beyond what a reading client
# lets pile up, small enough that one that never reads cannot grow the router without bound.
_CLIENT_SEND_HWM = 100_000
# Worker errors that mean "this attempt lost its KV", not "this request is wrong": it moves.
_MIGRATE_CODES = ("kv_lease_expired", "kv_transfer_failed")
# How long one ``poll`` goes on reading while messages keep coming, before it returns the loop
# to the launcher (which fails dead groups, moves their requests and expires parked ones).
_READ_BUDGET_S = 0.05
_OTHER_ROLE = {"prefill": "decode", "decode": "prefill"}


@dataclass
class RequestState:
    """The router's record of one accepted request."""

    client: bytes  # ZMQ identity of the client connection
    client_request_id: str
    stream: bool
    prompt_ids: list[int]
    sampling: Sampling
    outstanding_tokens: int
    batch_chunks: bool = False  # its chunks go out in one ``chunks`` message a worker step
    include_stop_str_in_output: bool = False  # the text keeps the stopping token's
    entry_group: tuple[str, int] | None = None  # prefill (or colocated) group; None until dispatched
    decode_group: int | None = None
    entry_charge: int = 0  # tokens it adds to its entry group's load: none once a prefill group is done with it
    base_id: str = ""  # the internal id of its first attempt; a move adds ".N"
    migrations: int = 0
    offset: int = 0  # tokens streamed before the current attempt (its output index 0 is this one)
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    pending: dict[int, TokenOutput] = field(default_factory=dict)  # out-of-order outputs by index
    # The current attempt's worker timings so far: the entry group's with its first token (queue,
    # prefill, cached tokens), the KV transfer's with the first decoded tokens. A final the router
    # writes itself (an abort) carries them.
    worker_timings: RequestTimings | None = None
    first_prefill: float | None = None  # the first attempt's: a moved request's prefill in its final
    detokenizer: IncrementalDetokenizer | None = None
    logprobs: Logprobs | None = None  # of every token so far, where the request asked for them
    prompt_logprobs: Logprobs | None = None  # from its first attempt's first token


class Router:
    def __init__(
        self,
        config: ClusterConfig,
        addresses: Addresses,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        admit: Callable[[Ready], str | None] | None = None,
    ) -> None:
        """``admit``: whether a group the config does not name may join (None: it may; else why
        not); without it no group joins."""
        self.config = config
        self.admit = admit
        self.addresses = addresses
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_prompt_chars = prompt_chars_limit(config.max_prompt_chars, max_model_len)
        self.ctx = zmq.Context.instance()
        self.frontend = self.ctx.socket(zmq.ROUTER)
        # Mandatory routing: a send to a gone client, or to one whose queue is full, raises
        # instead of being dropped silently, so its requests can be ended (``_drop_client``).
        self.frontend.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.frontend.setsockopt(zmq.SNDHWM, _CLIENT_SEND_HWM)
        self.frontend.setsockopt(zmq.MAXMSGSIZE, int(config.max_message_mib * 2**20))
        self._authenticator = None if config.auth_keys is None else secure_server(self.frontend, config.auth_keys)
        # ZMQ heartbeats: a client that vanished without closing its connection is dropped, and a
        # client learns of a dead router, within this timeout (the TTL tells the client).
        # Set before bind: a listener copies the socket's options when it is bound.
        heartbeat_ms = int(config.client_heartbeat_timeout * 1000)
        self.frontend.setsockopt(zmq.HEARTBEAT_IVL, max(1, heartbeat_ms // 4))
        self.frontend.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_ms)
        self.frontend.setsockopt(zmq.HEARTBEAT_TTL, heartbeat_ms)
        self.frontend.bind(addresses.client)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(addresses.router)
        self._poller = zmq.Poller()  # built once: poll() runs every loop of the launcher
        self._poller.register(self.frontend, zmq.POLLIN)
        self._poller.register(self.inbox, zmq.POLLIN)
        self.leaders: dict[tuple[str, int], zmq.Socket] = {}
        self.leader_addresses: dict[tuple[str, int], str] = {}
        self.tp_sizes = {(role, group): tp for role, group, tp in config.groups()}
        for key in self.tp_sizes:
            self._connect_leader(key)
        self.generations = dict.fromkeys(self.tp_sizes, 0)
        self.joined: set[tuple[str, int]] = set()  # groups that joined at run time
        self.gone: set[tuple[str, int]] = set()  # joined groups that left or failed: never back
        self.draining: dict[tuple[str, int], float] = {}  # group -> when its drain times out
        self.devices: dict[tuple[str, int, int], str] = {}  # (role, group, tp rank) -> its device
        self.dispatched: Counter[tuple[str, int]] = Counter()
        entry_role = "colocated" if config.mode == "colocated" else "prefill"
        self.entry_load = {g: 0 for r, g, _ in config.groups() if r == entry_role}
        self.decode_load = {g: 0 for r, g, _ in config.groups() if r == "decode"}
        self.entry_role = entry_role
        self.entry_policy = create_policy(config.dispatch, config.cache_aware_margin)
        self.decode_policy = create_policy(config.dispatch, config.cache_aware_margin)
        # What each entry group's prefix cache holds, from its own events: for cache-aware dispatch.
        cache = config.engine.cache
        self.prefix_index = (
            PrefixIndex(self.entry_load, cache.block_size)
            if self.entry_policy.uses_cache and cache.enable_prefix_caching
            else None
        )
        # The same of the decode groups, whose caches keep the requests they decoded (a chat's
        # earlier turns): the KV of a prompt's prefix held there does not move. Built without
        # any decode group too: they may all join at run time.
        self.decode_prefix_index = (
            PrefixIndex(self.decode_load, cache.block_size)
            if self.decode_policy.uses_cache and cache.enable_prefix_caching and entry_role == "prefill"
            else None
        )
        self.requests: dict[str, RequestState] = {}
        self.by_client: dict[tuple[bytes, str], str] = {}
        self.client_load: dict[bytes, int] = {}  # requests in flight by client
        self._last_sent: dict[bytes, float] = {}  # when each client with requests in flight last got a message
        self.ready: set[tuple[str, int]] = set()
        # Groups spawned and not yet ready: a ``ready`` from any other is a dead generation's.
        self.starting: set[tuple[str, int]] = set(self.tp_sizes)
        self.last_beat: dict[tuple[str, int, int], float] = {}  # (role, group, tp rank) -> when
        # When the last poll began and how long it could wait: between polls nothing is read,
        # and the longest such gap since the last heartbeat check is this process's own stall.
        self._last_poll: tuple[float, float] | None = None
        self._unread = 0.0
        self._failures: list[tuple[str, int, str]] = []  # joined groups their nodes reported failed
        self._next_ping = 0.0  # when quiet clients are next asked whether they are there
        # Requests waiting for a ready group of a role -> since when; in that order (dispatch_timeout).
        self.parked: dict[str, float] = {}
        # Requests moved off a group, sent again at the next poll: the launcher's supervision pass
        # runs between polls, so a group that died with (or just before) the one they leave is
        # failed by then instead of taking them, which would cost each a second move.
        self._moved: list[str] = []
        self.faults = {"group_failures": 0, "restarts": 0, "migrated": 0, "worker_failed": 0}
        # Since start: prompt tokens prefilled (a moved request's tokens so far again) and tokens
        # generated, as their first tokens and chunks come.
        self.token_counts = {"prompt": 0, "generated": 0}
        self.worker_stats: dict[str, dict[str, int]] = {}
        self.stats_time: dict[str, float] = {}  # when each group's ``worker_stats`` came
        self.accepting = True
        self._ids = itertools.count()
        self._chunks: dict[bytes, list[Chunk]] = {}  # batched chunks not yet sent, by client
        self.rejections = RejectionLog(logger)
        self._peer = ""  # the address of the client whose message is being handled

    # -- start-up and shutdown -----------------------------------------------------------

    def all_ready(self) -> bool:
        """Every group known is ready, and every role has one that takes requests."""
        return len(self.ready) == len(self.tp_sizes) and not self.unserved_roles()

    def unserved_roles(self) -> list[str]:
        """The roles a request passes through with no ready group that takes requests: none while
        requests run (other groups of a role may be restarting)."""
        roles = [self.entry_role] + (["decode"] if self.entry_role == "prefill" else [])
        serving = {role for role, group in self.ready - set(self.draining)}
        return [role for role in roles if role not in serving]

    def is_ready(self, key: tuple[str, int]) -> bool:
        return key in self.ready

    def pairs_forming(self) -> list[str]:
        """Ready groups that have not yet reported, since they got ready, that they can move KV
        with every group of the other role they know: their first requests' KV would wait."""
        names = [f"{role}{group}" for role, group in sorted(self.ready)]
        return [name for name in names if self.worker_stats.get(name, {}).get("pairs_forming", 1) > 0]

    def _connect_leader(self, key: tuple[str, int], address: str | None = None) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 0)  # never block the router on a group that stopped reading
        self.leader_addresses[key] = address or self.addresses.leader(*key)
        sock.connect(self.leader_addresses[key])
        self.leaders[key] = sock

    # -- failures ------------------------------------------------------------------------

    def check_heartbeats(self, timeout: float) -> list[tuple[str, int, str]]:
        """``(role, group, cause)`` of each ready group one of whose ranks sent no heartbeat for
        ``timeout`` seconds. After this process itself read nothing for half of that (stopped,
        or starved of CPU), the beats still wait unread in its sockets: every deadline then
        starts again, as no rank's silence can be told from its own."""
        now = time.monotonic()
        unread, self._unread = self._unread, 0.0
        if self._last_poll is not None:  # counted here, not again by the next poll
            unread = max(unread, now - sum(self._last_poll))
            self._last_poll = (now, 0.0)
        if unread > timeout / 2 and self.last_beat:
            logger.warning(
                "the router read nothing for %.1f s (this process was stopped or starved of CPU): "
                "every group's heartbeat deadline starts again",
                unread,
            )
            self.last_beat = dict.fromkeys(self.last_beat, now)
            return []
        silent = []
        for role, group in sorted(self.ready):
            for rank in range(self.tp_sizes[(role, group)]):
                since = now - self.last_beat.get((role, group, rank), now)
                if since > timeout:
                    silent.append(
                        (role, group, f"rank {rank} sent no heartbeat for {since:.1f} s (stopped, hung or dead)")
                    )
                    break
        return silent

    def group_failed(self, role: str, group: int, cause: str) -> None:
        """A group is gone (its processes are already killed): stop sending to it, tell the other
        role's leaders, and move every request it held."""
        key = (role, group)
        self.faults["group_failures"] += 1
        self.ready.discard(key)
        self.starting.discard(key)
        self.worker_stats.pop(f"{role}{group}", None)
        self.stats_time.pop(f"{role}{group}", None)
        for beat in [b for b in self.last_beat if b[:2] == key]:
            del self.last_beat[beat]
        sock = self.leaders.pop(key, None)
        if sock is not None:
            sock.close(linger=0)  # what was queued for the dead group must not reach its successor
        other = _OTHER_ROLE.get(role)
        for (peer_role, _), peer in self.leaders.items():
            if peer_role == other:
                peer.send(encode(PeerFailed(role, group)))
        for request_id in [r for r, state in self.requests.items() if self._held_by(state, key)]:
            if request_id in self.requests:
                self._migrate(request_id, f"{role} group {group} failed: {cause}")
        if key in self.joined:  # its node supervises it, not the router's: it never comes back
            self._forget(key)

    def group_restarting(self, role: str, group: int, generation: int) -> None:
        """A failed group was spawned again as ``generation``: the other role's leaders connect to it
        (those that joined at run time once it is ready: it was spawned knowing only the others)."""
        self._connect_leader((role, group))
        self.starting.add((role, group))
        self.generations[(role, group)] = generation
        other = _OTHER_ROLE.get(role)
        for key, peer in self.leaders.items():
            if key[0] == other and key not in self.joined:
                peer.send(encode(PeerRestarted(role, group, generation)))

    def _introduce(self, key: tuple[str, int], peers: list[tuple[str, int]]) -> None:
        """Have group ``key`` and each of ``peers`` (of the other role) form their KV pair group."""
        for peer in peers:
            for to, of in ((key, peer), (peer, key)):
                message = PeerRestarted(of[0], of[1], self.generations[of], self.leader_addresses[of])
                self.leaders[to].send(encode(message))

    def _join(self, ready: Ready) -> None:
        """A group the config does not name says it is ready: admit it, or log why not."""
        key = (ready.role, ready.group)
        if key in self.gone:
            why = "it left the cluster before; a group that joins again takes a new index"
        elif self.admit is None:
            why = "this cluster takes no joins (its router node runs without --master-addr)"
        else:
            why = self.admit(ready) or ""
        if why:
            self.rejections.warning(
                "join_refused", "router: refused %s group %d (%s): %s", ready.role, ready.group, ready.address, why
            )
            return
        self.tp_sizes[key] = ready.tp
        self.generations[key] = 0
        self.joined.add(key)
        self._connect_leader(key, ready.address)
        (self.entry_load if ready.role == self.entry_role else self.decode_load)[ready.group] = 0
        index = self._cache_index(ready.role)
        if index is not None:
            index.add_group(ready.group)
        self.starting.add(key)

    def _forget(self, key: tuple[str, int]) -> None:
        """A joined group left or failed: no trace of it stays but its requests' history."""
        role, group = key
        self.gone.add(key)
        self.joined.discard(key)
        for table in (self.tp_sizes, self.generations, self.leader_addresses, self.draining):
            table.pop(key, None)
        (self.entry_load if role == self.entry_role else self.decode_load).pop(group, None)
        index = self._cache_index(role)
        if index is not None:
            index.remove_group(group)
        self.ready.discard(key)
        self.starting.discard(key)
        self.worker_stats.pop(f"{role}{group}", None)
        self.stats_time.pop(f"{role}{group}", None)
        for rank in [r for r in self.devices if r[:2] == key]:
            del self.devices[rank]
        for beat in [b for b in self.last_beat if b[:2] == key]:
            del self.last_beat[beat]
        sock = self.leaders.pop(key, None)
        if sock is not None:
            sock.close(linger=1000)  # its shutdown still goes out

    def reported_failures(self) -> list[tuple[str, int, str]]:
        """``(role, group, cause)`` of each joined group whose node reported it failed since the
        last call: the supervisor removes them as it removes a group whose heartbeats stopped."""
        failures, self._failures = self._failures, []
        return failures

    def _reported_failure(self, message: GroupFailed) -> None:
        key = (message.role, message.group)
        if key not in self.joined or not (key in self.ready or key in self.starting):
            self.rejections.warning(
                "failure_refused",
                "router: ignored a failure report of %s group %d: it is not a live group that joined at run time",
                message.role,
                message.group,
            )
            return
        self._failures.append((message.role, message.group, f"its node reports: {shorten(message.cause)}"))

    def _drain(self, message: Drain) -> None:
        key = (message.role, message.group)
        if key not in self.joined or key not in self.ready:
            self.rejections.warning(
                "drain_refused",
                "router: refused to drain %s group %d: it is not a ready group that joined at run time",
                message.role,
                message.group,
            )
            return
        if key not in self.draining:
            self.draining[key] = time.monotonic() + self.config.drain_timeout
            logger.info("%s group %d drains: no new requests, it leaves once it holds none", *key)

    def _check_drains(self) -> None:
        """Retire each draining group that holds no request; past its drain timeout, move what
        it still holds first."""
        now = time.monotonic()
        for key, deadline in list(self.draining.items()):
            held = [r for r, state in self.requests.items() if self._held_by(state, key)]
            if held and now < deadline:
                continue
            for request_id in held:
                if request_id in self.requests:
                    self._migrate(request_id, f"{key[0]} group {key[1]} left before the request finished")
            self.leaders[key].send(encode(Shutdown()))
            other = _OTHER_ROLE.get(key[0])
            for peer_key, peer in self.leaders.items():
                if peer_key[0] == other:
                    peer.send(encode(PeerFailed(*key, left=True)))
            self._forget(key)
            logger.info("%s group %d left the cluster", *key)

    def group_state(self, key: tuple[str, int]) -> str:
        """A known group's ``GroupInfo.state``: starting, ready, draining or down."""
        if key not in self.ready and key not in self.starting:
            return "down"
        return "draining" if key in self.draining else "ready" if key in self.ready else "starting"

    def group_states(self) -> dict[str, str]:
        """Every known group's state by name (``prefill0``), for the launcher's stats line."""
        return {f"{role}{group}": self.group_state((role, group)) for role, group in self.tp_sizes}

    def members(self) -> list[GroupInfo]:
        """Every group known, for ``stats``."""
        out = []
        now = time.monotonic()
        for (role, group), tp in sorted(self.tp_sizes.items(), key=lambda item: (item[0][0] == "decode", item[0])):
            key = (role, group)
            state = self.group_state(key)
            held = [s for s in self.requests.values() if self._held_by(s, key)]
            load = (self.entry_load if role == self.entry_role else self.decode_load).get(group, 0)
            reported = self.stats_time.get(f"{role}{group}")
            out.append(
                GroupInfo(
                    role,
                    group,
                    tp,
                    state,
                    self.leader_addresses.get(key, ""),
                    [self.devices.get((role, group, rank), "") for rank in range(tp)],
                    key in self.joined,
                    len(held),
                    load,
                    self.dispatched[key],
                    None if reported is None else now - reported,
                )
            )
        return out

    def _held_by(self, state: RequestState, key: tuple[str, int]) -> bool:
        """Whether a failure of group ``key`` loses this request's state: its decode group, its
        colocated group, or its prefill group before decoding began (the KV may not have moved)."""
        role, group = key
        if role == "decode":
            return state.decode_group == group
        return state.entry_group == key and (role == "colocated" or len(state.token_ids) - state.offset <= 1)

    def _migrate(self, request_id: str, cause: str) -> None:
        """Move a request to live groups, prefilled again with its tokens so far, or end it with
        ``worker_failed`` past the migration limit."""
        state = self.requests[request_id]
        self._abort_workers(request_id)
        if state.migrations >= self.config.migration_limit:
            self.faults["worker_failed"] += 1
            why = (
                f"{cause} (the request moved {state.migrations} time(s), migration limit {self.config.migration_limit})"
            )
            logger.warning("request %s ends with worker_failed: %s", state.client_request_id, why)
            self._terminal_error(request_id, "worker_failed", why)
            return
        self._unassign(request_id, state)
        del self.requests[request_id]
        state.migrations += 1
        logger.info(
            "request %s moves (move %d, after %d tokens): %s",
            state.client_request_id,
            state.migrations,
            len(state.token_ids),
            cause,
        )
        self.faults["migrated"] += 1
        state.offset = len(state.token_ids)
        state.pending.clear()
        new_id = f"{state.base_id}.{state.migrations}"
        self.requests[new_id] = state
        self.by_client[(state.client, state.client_request_id)] = new_id
        self._moved.append(new_id)

    def _unassign(self, request_id: str, state: RequestState) -> None:
        """The request leaves its groups (it ended, or moves): their loads and the prompt it was
        computing in its entry group's cache view drop it."""
        if self.prefix_index is not None:
            self.prefix_index.settled(request_id)
        self._release_entry_load(state)
        if state.decode_group is not None and state.decode_group in self.decode_load:
            self.decode_load[state.decode_group] -= state.outstanding_tokens
        state.entry_group, state.decode_group = None, None

    def _release_entry_load(self, state: RequestState) -> None:
        """Its entry group's load drops it (a group that left the cluster has none to take back)."""
        if state.entry_group is not None and state.entry_group[1] in self.entry_load:
            self.entry_load[state.entry_group[1]] -= state.entry_charge
        state.entry_charge = 0

    def _taking(self, role: str) -> dict[int, int]:
        """The groups of ``role`` that take new requests (ready, not draining), with their loads."""
        loads = self.decode_load if role == "decode" else self.entry_load
        taking = self.ready - set(self.draining)
        return {g: load for g, load in loads.items() if (role, g) in taking}

    def _dispatch(self, request_id: str) -> None:
        """Send a request to a ready prefill (or colocated) group, naming a ready decode group;
        park it while a role has none."""
        state = self.requests[request_id]
        entries, decodes = self._taking(self.entry_role), self._taking("decode")
        if not entries or (self.entry_role == "prefill" and not decodes):
            self.parked.setdefault(request_id, time.monotonic())
            return
        self.parked.pop(request_id, None)
        prompt = state.prompt_ids + state.token_ids  # a moved request continues after what its client has
        cached, sizes, hashes = None, None, []
        if self.prefix_index is not None:
            hashes = self.prefix_index.hashes(prompt)
            # The engine computes a prompt's last token whatever it caches: a block ending with it never hits.
            cached, sizes = self.prefix_index.lookup(hashes, len(prompt), entries)
        entry = self.entry_policy.pick(entries, cached, sizes)
        if self.prefix_index is not None:
            self.prefix_index.dispatched(request_id, entry, hashes)
        decode_cached, decode_sizes = None, None
        if self.decode_prefix_index is not None and decodes:
            hashes = hashes or self.decode_prefix_index.hashes(prompt)
            decode_cached, decode_sizes = self.decode_prefix_index.lookup(hashes, len(prompt), decodes)
        decode_group = self.decode_policy.pick(decodes, decode_cached, decode_sizes) if decodes else None
        state.entry_group, state.decode_group = (self.entry_role, entry), decode_group
        state.entry_charge = state.outstanding_tokens
        self.entry_load[entry] += state.entry_charge
        self.dispatched[state.entry_group] += 1
        if decode_group is not None:
            self.decode_load[decode_group] += state.outstanding_tokens
            self.dispatched[("decode", decode_group)] += 1
        work = WorkRequest(
            request_id,
            prompt,
            state.sampling,
            decode_group if decode_group is not None else -1,
            generated=len(state.token_ids),
        )
        self.leaders[state.entry_group].send(encode(work))

    def _dispatch_parked(self) -> None:
        for request_id in list(self.parked):
            if request_id in self.requests and self.requests[request_id].entry_group is None:
                self._dispatch(request_id)  # taken, or parked on with its first wait's time
            else:
                del self.parked[request_id]

    def _expire_parked(self) -> None:
        """End the requests that waited ``dispatch_timeout`` for a ready group of a role: a
        cluster with no group of a role must not hold its clients forever."""
        timeout = self.config.dispatch_timeout
        now = time.monotonic()
        ended: Counter[str] = Counter()
        for request_id, since in list(self.parked.items()):
            if now - since <= timeout:
                break  # the rest began to wait later
            if self.parked.pop(request_id, None) is None:
                continue  # dropped with its client, whom an error just before found gone
            if request_id in self.requests and self.requests[request_id].entry_group is None:
                missing = self.entry_role if not self._taking(self.entry_role) else "decode"
                self._terminal_error(
                    request_id,
                    "no_group",
                    f"no {missing} group was ready to serve it for {timeout:g} s (--dispatch-timeout)",
                )
                ended[missing] += 1
        for missing, count in ended.items():  # the operator's side of the clients' errors
            logger.warning(
                "%d request(s) ended with no_group: no %s group was ready for %g s (--dispatch-timeout)",
                count,
                missing,
                timeout,
            )

    def _ping_quiet_clients(self) -> None:
        """Every ``PING_S``, a ping to each client with a request in flight that got nothing for
        that long (a request parked until a group comes, or one that streams nothing until its
        final): only a failed send tells that a client is gone, and its requests are then aborted,
        not run to their end (a drain waiting on them) or held until the dispatch timeout."""
        now = time.monotonic()
        if now < self._next_ping:
            return
        self._next_ping = now + PING_S
        for client in [c for c, sent in self._last_sent.items() if now - sent >= PING_S]:
            self._send(client, encode(Ping()))

    def poll(self, timeout_ms: int) -> None:
        """Handle whatever arrives within ``timeout_ms``, then what is already queued for up to
        ``_READ_BUDGET_S`` (the rest waits for the next call)."""
        start = time.monotonic()
        if self._last_poll is not None:
            self._unread = max(self._unread, start - sum(self._last_poll))
        self._last_poll = (start, timeout_ms / 1000)
        moved, self._moved = self._moved, []
        for request_id in moved:  # not ended meanwhile (an abort, its client gone, fail_all)
            if request_id in self.requests:
                self._dispatch(request_id)
        events = dict(self._poller.poll(timeout_ms))
        budget_end = time.monotonic() + _READ_BUDGET_S
        while (self.inbox in events or self.frontend in events) and time.monotonic() < budget_end:
            if self.inbox in events:
                self._on_worker(self.inbox.recv())
            if self.frontend in events:
                frames = self.frontend.recv_multipart(copy=False)
                if len(frames) == 2:
                    self._peer = _peer_address(frames[1])
                    self._on_client(frames[0].bytes, frames[1].bytes)
            events = dict(self._poller.poll(0))
        # Reading counts as reading: a stall is only time between polls (``check_heartbeats``).
        self._last_poll = (start, max(timeout_ms / 1000, time.monotonic() - start))
        if self.draining:
            self._check_drains()
        if self.parked:
            self._expire_parked()
        if self._last_sent:
            self._ping_quiet_clients()

    def stop_accepting(self) -> None:
        self.accepting = False

    def fail_all(self, code: str, message: str) -> None:
        """End every in-flight request with an error (drain timeout, dead worker)."""
        for request_id in list(self.requests):
            if request_id in self.requests:  # not dropped with its client by a send before
                self._abort_workers(request_id)
                self._terminal_error(request_id, code, message)

    def shutdown_workers(self) -> None:
        for sock in self.leaders.values():
            sock.send(encode(Shutdown()))

    def close(self) -> None:
        for sock in (self.frontend, self.inbox, *self.leaders.values()):
            sock.close()
        if self._authenticator is not None:
            self._authenticator.stop()

    # -- clients -------------------------------------------------------------------------

    def _reply(self, client: bytes, message: Message) -> None:
        self._flush_chunks(client)  # a request's chunks go before anything sent after them
        self._send(client, encode(message))

    def _reject(self, client: bytes, error: Error) -> None:
        """Refuse a client's message: the error goes back, and a line (rate-limited) to the log."""
        self.rejections.warning(
            error.code,
            "router: refused a message of client %s (%s): %s: %s",
            self._peer or "?",
            client.hex(),
            error.code,
            shorten(error.message),
        )
        self._reply(client, error)

    def _flush_chunks(self, client: bytes) -> None:
        chunks = self._chunks.pop(client, None)
        if chunks:
            self._send(client, encode(Chunks(chunks)))

    def _send(self, client: bytes, data: bytes) -> None:
        try:
            self.frontend.send_multipart([client, data], flags=zmq.NOBLOCK)
            if client in self._last_sent:
                self._last_sent[client] = time.monotonic()
        except zmq.Again:
            self._drop_client(client, "stopped reading (its send queue is full)")
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._drop_client(client, "disconnected")

    def _drop_client(self, client: bytes, why: str) -> None:
        """A client that cannot be reached: abort its requests, which it can no longer hear of."""
        self._chunks.pop(client, None)
        dropped = [rid for (c, _), rid in self.by_client.items() if c == client]
        for request_id in dropped:
            self._abort_workers(request_id)
            self._release(request_id)
        if dropped:
            self.rejections.warning(
                "client_dropped", "router: a client %s; aborted its %d request(s)", why, len(dropped)
            )

    def _on_client(self, client: bytes, data: bytes) -> None:
        try:
            message = decode(data)
        except ProtocolError as e:
            self._reject(client, Error(e.request_id, e.code, e.message))
            return
        try:
            self._handle_client(client, message)
        except Exception as e:  # a router bug must cost one request, never the cluster
            logger.exception("router: failed on a %s message", message.type)
            request_id = getattr(message, "request_id", None)
            why = f"{type(e).__name__}: {e}"
            registered = self.by_client.get((client, request_id))
            if registered is None:
                self._reply(client, Error(request_id, "internal_error", why))
                return
            # Registered before the failure: end it here, or it would hold its id and a client
            # slot and get a second terminal message from a later drop or shutdown.
            with contextlib.suppress(Exception):
                self._abort_workers(registered)
            self._terminal_error(registered, "internal_error", why)

    def _handle_client(self, client: bytes, message: Message) -> None:
        if isinstance(message, Generate):
            self._on_generate(client, message)
        elif isinstance(message, Abort):
            request_id = self.by_client.get((client, message.request_id))
            if request_id is None:
                # Replied, not logged: an abort crossing its request's final is every client's race.
                why = f"no request {message.request_id!r} is running for this client"
                self._reply(client, Error(message.request_id, "unknown_request", why))
                return
            self._abort_workers(request_id)
            self._final(request_id, "abort", self.requests[request_id].worker_timings)
        elif isinstance(message, StatsRequest):
            self._reply(
                client,
                Stats(
                    len(self.requests),
                    dict(self.worker_stats),
                    self.all_ready(),
                    self.accepting,
                    self.max_model_len,
                    dict(self.faults),
                    self.members(),
                    message.tag,
                    self.vocab_size,
                    self.unserved_roles(),
                ),
            )
        else:
            self._reject(
                client,
                Error(
                    getattr(message, "request_id", None),
                    "unexpected_type",
                    f"clients may send generate, abort or stats_request, not {message.type}",
                ),
            )

    def _on_generate(self, client: bytes, request: Generate) -> None:
        client_id = request.request_id
        if not client_id:  # made here: never one this client is using
            while not client_id or (client, client_id) in self.by_client:
                client_id = f"req-{next(self._ids)}"
            request.request_id = client_id  # its name from now on, also for ``_on_client``'s guard
        if not self.accepting:
            self._reply(client, Error(client_id, "shutting_down", "the cluster is shutting down"))
            return
        if self.client_load.get(client, 0) >= self.config.max_requests_per_client:
            limit = self.config.max_requests_per_client
            why = (
                f"this connection has {limit} requests in flight already (--max-requests-per-client; an HTTP "
                "front end's clients share its one connection): retry later"
            )
            self._reject(client, Error(client_id, "overloaded", why))
            return
        if len(self.requests) >= self.config.max_requests:
            why = f"the cluster has {self.config.max_requests} requests in flight (--max-requests): retry later"
            self._reject(client, Error(client_id, "overloaded", why))
            return
        if (client, client_id) in self.by_client:
            self._reject(
                client, Error(client_id, "duplicate_request_id", f"request_id {client_id!r} is already running")
            )
            return
        try:
            token_ids = self._prompt_tokens(request)
            params = request.sampling.to_params()
            # Text prompts were tokenized here: their ids are the model's own.
            validate_request(token_ids, params, self.vocab_size, self.max_model_len, tokens_field="token_ids")
        except RequestError as e:
            self._reject(client, Error(client_id, "invalid_request", str(e)))
            return
        request_id = f"{next(self._ids)}"
        state = RequestState(
            client,
            client_id,
            request.stream,
            token_ids,
            request.sampling,
            len(token_ids) + params.max_tokens,
            request.batch_chunks,
            request.include_stop_str_in_output,
            base_id=request_id,
        )
        if self.tokenizer is not None:
            state.detokenizer = IncrementalDetokenizer(self.tokenizer, request.skip_special_tokens, token_ids)
        if params.logprobs is not None:
            state.logprobs = Logprobs([], [], [])
        self.requests[request_id] = state
        self.by_client[(client, client_id)] = request_id
        self.client_load[client] = self.client_load.get(client, 0) + 1
        self._last_sent.setdefault(client, time.monotonic())
        self._dispatch(request_id)

    def _prompt_tokens(self, request: Generate) -> list[int]:
        if (request.prompt is None) == (request.token_ids is None):
            raise RequestError("prompt", "give exactly one of prompt (text) and token_ids")
        if request.prompt is not None:
            if not request.prompt:
                raise RequestError("prompt", "is empty")
            if len(request.prompt) > self.max_prompt_chars:
                raise RequestError(
                    "prompt",
                    f"has {len(request.prompt)} characters, more than {self.max_prompt_chars} (--max-prompt-chars)",
                )
            if self.tokenizer is None:
                raise RequestError("prompt", "this model has no tokenizer: send token_ids")
            return encode_prompt(
                self.tokenizer, request.prompt, chat=request.chat, parse_special_tokens=self.config.parse_special_tokens
            )
        if not request.token_ids:
            raise RequestError("token_ids", "is empty")
        return request.token_ids

    # -- workers -------------------------------------------------------------------------

    def _on_worker(self, data: bytes) -> None:
        try:
            message = decode(data)
        except ProtocolError as e:
            logger.error("router: dropped a bad worker message: %s", e)
            return
        try:
            self._handle_worker(message)
        except Exception:  # a bug (here or in a worker) must cost its request, never the cluster
            logger.exception("router: failed on a %s message from a worker", message.type)

    def _handle_worker(self, message: Message) -> None:
        if isinstance(message, TokenOutputs):
            for output in message.outputs:
                try:
                    self._on_tokens(output)
                except Exception as e:
                    logger.exception("router: failed on the tokens of request %s", output.request_id)
                    if output.request_id in self.requests:
                        with contextlib.suppress(Exception):
                            self._abort_workers(output.request_id)
                        self._terminal_error(output.request_id, "internal_error", f"{type(e).__name__}: {e}")
            for client in list(self._chunks):  # one message a client for the step's batched chunks
                self._flush_chunks(client)
        elif isinstance(message, WorkerError):
            if message.request_id in self.requests:
                if message.code in _MIGRATE_CODES:
                    self._migrate(message.request_id, f"{message.code}: {message.message}")
                else:
                    self._abort_workers(message.request_id)
                    self._terminal_error(message.request_id, message.code, message.message)
        elif isinstance(message, CacheEvents):
            # As for stats: events from a group that is not ready are a dead generation's.
            index = self._cache_index(message.role)
            if index is not None and (message.role, message.group) in self.ready:
                index.apply(message.group, message.hashes)
        elif isinstance(message, WorkerStats):
            # A leader reports after its ``ready``: a report from a group that is not ready is a
            # dead generation's, still queued.
            if (message.role, message.group) in self.ready:
                stats = msgspec.structs.asdict(message)
                name = f"{stats.pop('role')}{stats.pop('group')}"
                self.worker_stats[name] = stats
                self.stats_time[name] = time.monotonic()
        elif isinstance(message, Heartbeat):
            key = (message.role, message.group)
            if key in self.ready:
                self.last_beat[(*key, message.tp_rank)] = time.monotonic()
            if key in self.tp_sizes and 0 <= message.tp_rank < self.tp_sizes[key]:
                self.devices[(*key, message.tp_rank)] = message.device
        elif isinstance(message, Drain):
            self._drain(message)
        elif isinstance(message, GroupFailed):
            self._reported_failure(message)
        elif isinstance(message, Ready):
            key = (message.role, message.group)
            if key not in self.tp_sizes:
                self._join(message)
            if key not in self.starting:
                return
            self.starting.discard(key)
            self.ready.add(key)
            now = time.monotonic()
            for rank in range(self.tp_sizes[key]):
                self.last_beat[(*key, rank)] = now
            index = self._cache_index(message.role)
            if index is not None:
                index.reset(message.group)  # a group (re)starts with an empty cache
            logger.info("%s group %d ready (%d KV blocks)", message.role, message.group, message.num_blocks)
            # Pairs the router's node did not arrange at spawn (a joined group on either side) form now.
            other = _OTHER_ROLE.get(message.role)
            self._introduce(
                key,
                [k for k in sorted(self.ready) if k[0] == other and (key in self.joined or k in self.joined)],
            )
            self._dispatch_parked()

    def _cache_index(self, role: str) -> PrefixIndex | None:
        """The view of ``role``'s prefix caches that dispatch reads, if it reads one."""
        if role == self.entry_role:
            return self.prefix_index
        return self.decode_prefix_index if role == "decode" else None

    def _on_tokens(self, output: TokenOutput) -> None:
        state = self.requests.get(output.request_id)
        if state is None:
            return  # aborted, failed or moved earlier: its terminal message is already out
        state.pending[output.index + state.offset] = output
        while len(state.token_ids) in state.pending:  # apply outputs in index order
            current = state.pending.pop(len(state.token_ids))
            prompt_logprobs = None
            if current.index == 0:
                self.token_counts["prompt"] += len(state.prompt_ids) + state.offset
                if state.offset == 0:  # a moved request's new attempt has a longer "prompt"
                    prompt_logprobs = state.prompt_logprobs = current.prompt_logprobs
                    state.first_prefill = current.timings.prefill
                state.worker_timings = current.timings
                if self.prefix_index is not None:  # this attempt's first token: its prompt is in
                    self.prefix_index.settled(output.request_id)
                if self.entry_role == "prefill":  # and the prefill group is done with it
                    self._release_entry_load(state)
            elif current.timings.transfer_bytes is not None and state.worker_timings is not None:
                moved = current.timings  # the decode group's first tokens: its KV is in
                state.worker_timings = msgspec.structs.replace(
                    state.worker_timings, transfer=moved.transfer, transfer_bytes=moved.transfer_bytes
                )
            if state.first_token is None:
                state.first_token = time.monotonic()
            state.token_ids.extend(current.token_ids)
            if state.logprobs is not None and current.logprobs is not None:
                state.logprobs.extend(current.logprobs)
            self.token_counts["generated"] += len(current.token_ids)
            shown = current.token_ids
            if current.finish_reason == "stop" and not state.include_stop_str_in_output:
                shown = shown[:-1]  # the EOS or stop id that ended it: its text is left out, as vLLM's
            delta = state.detokenizer.add(shown) if state.detokenizer else ""
            if current.finished and state.detokenizer:
                delta += state.detokenizer.flush()
            state.text.append(delta)
            if state.stream:
                chunk = Chunk(state.client_request_id, current.token_ids, delta, current.logprobs, prompt_logprobs)
                if state.batch_chunks:
                    self._chunks.setdefault(state.client, []).append(chunk)
                else:
                    self._reply(state.client, chunk)
                    if output.request_id not in self.requests:  # its client was dropped
                        return
            if current.finished:
                self._final(output.request_id, current.finish_reason or "stop", current.timings)
                return

    # -- terminal messages ---------------------------------------------------------------

    def _release(self, request_id: str) -> RequestState:
        state = self.requests.pop(request_id)
        self.by_client.pop((state.client, state.client_request_id), None)
        self.parked.pop(request_id, None)
        if self.client_load[state.client] > 1:
            self.client_load[state.client] -= 1
        else:
            del self.client_load[state.client]
            self._last_sent.pop(state.client, None)
        self._unassign(request_id, state)
        return state

    def _final(self, request_id: str, reason: str, worker_timings: RequestTimings | None = None) -> None:
        state = self._release(request_id)
        now = time.monotonic()
        timings = worker_timings or RequestTimings()
        if state.migrations:
            # The last attempt's prefill and decode are a part of its decoding, by the router's
            # clock below: its queue and prefill are the first attempt's, as its first token is.
            timings = msgspec.structs.replace(timings, prefill=state.first_prefill, decode=None)
        first_token = None if state.first_token is None else state.first_token - state.arrival
        if first_token is not None and timings.prefill is not None:
            # The whole wait before prefill began, as the router saw it: the engine's own queue
            # misses the time the request sat unread in a worker's inbox behind a long step.
            timings = msgspec.structs.replace(timings, queue=max(0.0, first_token - timings.prefill))
        timings = msgspec.structs.replace(timings, total=now - state.arrival, first_token=first_token)
        # A moved request's attempt matched its prompt and the tokens it had so far: of those,
        # only the prompt's count in its usage (cached tokens never exceed the prompt tokens).
        prompt_tokens = len(state.prompt_ids)
        timings = msgspec.structs.replace(
            timings,
            cached_tokens=_at_most(timings.cached_tokens, prompt_tokens),
            decode_cached_tokens=_at_most(timings.decode_cached_tokens, prompt_tokens),
        )
        if timings.decode is None and state.first_token is not None:
            # Its decoding ends here, by the router's clock: a group's own figure comes only with
            # a last token, which an aborted request never has (nor one moved: see above).
            timings = msgspec.structs.replace(timings, decode=now - state.first_token)
        self._reply(
            state.client,
            Final(
                state.client_request_id,
                reason,
                state.token_ids,
                "".join(state.text),
                {"prompt_tokens": len(state.prompt_ids), "completion_tokens": len(state.token_ids)},
                timings.as_dict(),
                state.logprobs,
                state.prompt_logprobs,
            ),
        )

    def _terminal_error(self, request_id: str, code: str, message: str) -> None:
        state = self._release(request_id)
        self._reply(state.client, Error(state.client_request_id, code, message))

    def _abort_workers(self, request_id: str) -> None:
        """Tell the live groups serving a request to stop it (a failed group has no socket)."""
        state = self.requests[request_id]
        groups = [state.entry_group] + ([("decode", state.decode_group)] if state.decode_group is not None else [])
        for key in groups:
            if key is not None and key in self.leaders:
                self.leaders[key].send(encode(Abort(request_id)))


def _at_most(count: float | None, limit: int) -> float | None:
    return None if count is None else min(count, float(limit))


def _peer_address(frame: zmq.Frame) -> str:
    """The sender's address as ZMQ knows it (an IP for TCP), or "" where it has none."""
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:
        return ""
