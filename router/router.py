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
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from pdserve.cluster.auth import secure_server
from pdserve.cluster.config import Addresses, ClusterConfig
from pdserve.cluster.protocol import (
    Abort,
    CacheEvents,
    Chunk,
    Chunks,
    Error,
    Final,
    Generate,
    Message,
    ProtocolError,
    Ready,
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

# Messages queued for one client before it counts as gone: far beyond what a reading client
# lets pile up, small enough that one that never reads cannot grow the router without bound.
_CLIENT_SEND_HWM = 100_000


@dataclass
class RequestState:
    """The router's record of one accepted request."""

    client: bytes  # ZMQ identity of the client connection
    client_request_id: str
    stream: bool
    num_prompt_tokens: int
    entry_group: tuple[str, int]  # prefill (or colocated) group
    decode_group: int | None
    outstanding_tokens: int
    batch_chunks: bool = False  # its chunks go out in one ``chunks`` message a worker step
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    pending: dict[int, TokenOutput] = field(default_factory=dict)  # out-of-order outputs by index
    detokenizer: IncrementalDetokenizer | None = None


class Router:
    def __init__(
        self, config: ClusterConfig, addresses: Addresses, tokenizer: Any, vocab_size: int, max_model_len: int
    ) -> None:
        self.config = config
        self.addresses = addresses
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.ctx = zmq.Context.instance()
        self.frontend = self.ctx.socket(zmq.ROUTER)
        # Mandatory routing: a send to a gone client, or to one whose queue is full, raises
        # instead of being dropped silently, so its requests can be ended (``_drop_client``).
        self.frontend.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.frontend.setsockopt(zmq.SNDHWM, _CLIENT_SEND_HWM)
        self.frontend.setsockopt(zmq.MAXMSGSIZE, int(config.max_message_mib * 2**20))
        self._authenticator = None if config.auth_keys is None else secure_server(self.frontend, config.auth_keys)
        self.frontend.bind(addresses.client)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(addresses.router)
        self._poller = zmq.Poller()  # built once: poll() runs every loop of the launcher
        self._poller.register(self.frontend, zmq.POLLIN)
        self._poller.register(self.inbox, zmq.POLLIN)
        self.leaders: dict[tuple[str, int], zmq.Socket] = {}
        for role, group, _ in config.groups():
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(addresses.leader(role, group))
            self.leaders[(role, group)] = sock
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
        self.requests: dict[str, RequestState] = {}
        self.by_client: dict[tuple[bytes, str], str] = {}
        self.client_load: dict[bytes, int] = {}  # requests in flight by client
        self.ready: set[tuple[str, int]] = set()
        self.worker_stats: dict[str, dict[str, int]] = {}
        self.accepting = True
        self._ids = itertools.count()
        self._chunks: dict[bytes, list[Chunk]] = {}  # batched chunks not yet sent, by client
        self.rejections = RejectionLog(logger)
        self._peer = ""  # the address of the client whose message is being handled

    # -- start-up and shutdown -----------------------------------------------------------

    def all_ready(self) -> bool:
        return len(self.ready) == len(self.leaders)

    def poll(self, timeout_ms: int) -> None:
        """Handle whatever arrives within ``timeout_ms`` (then everything already queued)."""
        events = dict(self._poller.poll(timeout_ms))
        while self.inbox in events or self.frontend in events:
            if self.inbox in events:
                self._on_worker(self.inbox.recv())
            if self.frontend in events:
                frames = self.frontend.recv_multipart(copy=False)
                if len(frames) == 2:
                    self._peer = _peer_address(frames[1])
                    self._on_client(frames[0].bytes, frames[1].bytes)
            events = dict(self._poller.poll(0))

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
            self._reply(client, Error(request_id, "internal_error", f"{type(e).__name__}: {e}"))

    def _handle_client(self, client: bytes, message: Message) -> None:
        if isinstance(message, Generate):
            self._on_generate(client, message)
        elif isinstance(message, Abort):
            request_id = self.by_client.get((client, message.request_id))
            if request_id is None:
                self._reject(
                    client,
                    Error(
                        message.request_id,
                        "unknown_request",
                        f"no request {message.request_id!r} is running for this client",
                    ),
                )
                return
            self._abort_workers(request_id)
            self._final(request_id, "abort")
        elif isinstance(message, StatsRequest):
            self._reply(
                client,
                Stats(
                    len(self.requests), dict(self.worker_stats), self.all_ready(), self.accepting, self.max_model_len
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
        client_id = request.request_id or f"req-{next(self._ids)}"
        if not self.accepting:
            self._reply(client, Error(client_id, "shutting_down", "the cluster is shutting down"))
            return
        if self.client_load.get(client, 0) >= self.config.max_requests_per_client:
            limit = self.config.max_requests_per_client
            self._reject(client, Error(client_id, "overloaded", f"this client has {limit} requests in flight already"))
            return
        if len(self.requests) >= self.config.max_requests:
            self._reject(client, Error(client_id, "overloaded", "the cluster has too many requests in flight"))
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
        outstanding = len(token_ids) + params.max_tokens
        cached, sizes, hashes = None, None, []
        if self.prefix_index is not None:
            hashes = self.prefix_index.hashes(token_ids)
            # The engine computes a prompt's last token whatever it caches: a block ending with it never hits.
            cached = self.prefix_index.matched_tokens(hashes[: (len(token_ids) - 1) // self.prefix_index.block_size])
            sizes = self.prefix_index.sizes()
        entry = self.entry_policy.pick(self.entry_load, cached, sizes)
        if self.prefix_index is not None:
            self.prefix_index.dispatched(request_id, entry, hashes)
        decode_group = self.decode_policy.pick(self.decode_load) if self.decode_load else None
        self.entry_load[entry] += outstanding
        if decode_group is not None:
            self.decode_load[decode_group] += outstanding
        state = RequestState(
            client,
            client_id,
            request.stream,
            len(token_ids),
            (self.entry_role, entry),
            decode_group,
            outstanding,
            request.batch_chunks,
        )
        if self.tokenizer is not None:
            state.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.requests[request_id] = state
        self.by_client[(client, client_id)] = request_id
        self.client_load[client] = self.client_load.get(client, 0) + 1
        work = WorkRequest(request_id, token_ids, request.sampling, decode_group if decode_group is not None else -1)
        self.leaders[state.entry_group].send(encode(work))

    def _prompt_tokens(self, request: Generate) -> list[int]:
        if (request.prompt is None) == (request.token_ids is None):
            raise RequestError("prompt", "give exactly one of prompt (text) and token_ids")
        if request.prompt is not None:
            if not request.prompt:
                raise RequestError("prompt", "is empty")
            if len(request.prompt) > self.config.max_prompt_chars:
                raise RequestError(
                    "prompt", f"has {len(request.prompt)} characters, more than {self.config.max_prompt_chars}"
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
        if isinstance(message, TokenOutputs):
            for output in message.outputs:
                self._on_tokens(output)
            for client in list(self._chunks):  # one message a client for the step's batched chunks
                self._flush_chunks(client)
        elif isinstance(message, WorkerError):
            if message.request_id in self.requests:
                self._abort_workers(message.request_id)
                self._terminal_error(message.request_id, message.code, message.message)
        elif isinstance(message, CacheEvents):
            if self.prefix_index is not None and message.role == self.entry_role:
                self.prefix_index.apply(message.group, message.hashes)
        elif isinstance(message, WorkerStats):
            stats = dataclasses.asdict(message)
            self.worker_stats[f"{stats.pop('role')}{stats.pop('group')}"] = stats
        elif isinstance(message, Ready):
            self.ready.add((message.role, message.group))
            if self.prefix_index is not None and message.role == self.entry_role:
                self.prefix_index.reset(message.group)  # a group (re)starts with an empty cache
            logger.info("%s group %d ready (%d KV blocks)", message.role, message.group, message.num_blocks)

    def _on_tokens(self, output: TokenOutput) -> None:
        state = self.requests.get(output.request_id)
        if state is None:
            return  # aborted or failed earlier: its terminal message is already out
        state.pending[output.index] = output
        while len(state.token_ids) in state.pending:  # apply outputs in index order
            current = state.pending.pop(len(state.token_ids))
            if state.first_token is None:
                state.first_token = time.monotonic()
                if self.prefix_index is not None:
                    self.prefix_index.settled(output.request_id)
            state.token_ids.extend(current.token_ids)
            delta = state.detokenizer.add(current.token_ids) if state.detokenizer else ""
            if current.finished and state.detokenizer:
                delta += state.detokenizer.flush()
            state.text.append(delta)
            if state.stream:
                chunk = Chunk(state.client_request_id, current.token_ids, delta)
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
        if self.prefix_index is not None:
            self.prefix_index.settled(request_id)
        if self.client_load[state.client] > 1:
            self.client_load[state.client] -= 1
        else:
            del self.client_load[state.client]
        self.entry_load[state.entry_group[1]] -= state.outstanding_tokens
        if state.decode_group is not None:
            self.decode_load[state.decode_group] -= state.outstanding_tokens
        return state

    def _final(self, request_id: str, reason: str, worker_timings: RequestTimings | None = None) -> None:
        state = self._release(request_id)
        now = time.monotonic()
        timings = worker_timings or RequestTimings()
        first_token = None if state.first_token is None else state.first_token - state.arrival
        if first_token is not None and timings.prefill is not None:
            # The whole wait before prefill began, as the router saw it: the engine's own queue
            # misses the time the request sat unread in a worker's inbox behind a long step.
            timings = dataclasses.replace(timings, queue=max(0.0, first_token - timings.prefill))
        timings = dataclasses.replace(timings, total=now - state.arrival, first_token=first_token)
        self._reply(
            state.client,
            Final(
                state.client_request_id,
                reason,
                state.token_ids,
                "".join(state.text),
                {"prompt_tokens": state.num_prompt_tokens, "completion_tokens": len(state.token_ids)},
                timings.as_dict(),
            ),
        )

    def _terminal_error(self, request_id: str, code: str, message: str) -> None:
        state = self._release(request_id)
        self._reply(state.client, Error(state.client_request_id, code, message))

    def _abort_workers(self, request_id: str) -> None:
        state = self.requests[request_id]
        self.leaders[state.entry_group].send(encode(Abort(request_id)))
        if state.decode_group is not None:
            self.leaders[("decode", state.decode_group)].send(encode(Abort(request_id)))


def _peer_address(frame: zmq.Frame) -> str:
    """The sender's address as ZMQ knows it (an IP for TCP), or "" where it has none."""
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:
        return ""
