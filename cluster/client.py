"""Client library (blocking and asyncio) and CLI for a running cluster.

    python -m pdserve.cluster.client "What is the capital of France?" --max-tokens 64 --stream

Requests are multiplexed over one DEALER socket; replies are matched by ``request_id``.

Liveness: the socket sends ZMQ heartbeats (and the router's own tell it how long to wait), and a
socket monitor watches the connection: once it breaks (the router died, or went silent past the
heartbeat timeout) every request waiting on it raises ``ClusterGone`` at once instead of waiting
out the client's timeout. ZMQ then connects again by itself; either client sends a new request
once that reconnect takes (a router that dropped the client for a stall of the client's own), and
raises ``ClusterGone`` at once once one failed (nothing listens there).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import click
import zmq
import zmq.asyncio
import zmq.utils.monitor

from pdserve.cluster.auth import AUTH_CLIENT_HELP, DEFAULT_CLIENT, secure_client
from pdserve.cluster.protocol import (
    DEFAULT_MAX_MESSAGE_MIB,
    MAX_REQUEST_ID_CHARS,
    Abort,
    Chunk,
    Chunks,
    Error,
    Final,
    Generate,
    Message,
    Ping,
    ProtocolError,
    Sampling,
    Stats,
    StatsRequest,
    decode,
    encode,
)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
DEFAULT_HEARTBEAT_TIMEOUT = 10.0


class ClusterError(RuntimeError):
    """The cluster answered a request with an error."""

    def __init__(self, error: Error) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.code = error.code
        self.error = error


class ClusterUnavailable(TimeoutError):
    """No reply within the timeout. ``connected``: the router is there and still holds the
    request (busy, e.g. prefilling a long prompt), which asks for patience, not for a cluster."""

    def __init__(self, endpoint: str, timeout: float, connected: bool = False, refused: bool = False) -> None:
        if connected:
            message = (
                f"the cluster at {endpoint} is up but sent nothing within {timeout:g} s "
                "(still busy, e.g. with a long prompt: allow it a longer timeout)"
            )
        elif refused:  # something listens, but its ZMQ handshake failed: CURVE keys, or no cluster
            message = (
                f"no answer from a cluster at {endpoint} within {timeout:g} s: it refused this client's "
                "handshake (a cluster started with --auth-keys DIR wants that directory's keys here too: "
                "--auth-keys DIR; or this is not a cluster's client endpoint)"
            )
        else:
            message = (
                f"no answer from a cluster at {endpoint} within {timeout:g} s "
                "(is it running? start one with: python launch.py)"
            )
        super().__init__(message)


class ClusterGone(ClusterUnavailable):
    """The connection to the cluster broke while requests could still be answered on it."""

    def __init__(self, endpoint: str) -> None:
        TimeoutError.__init__(
            self,
            f"lost the connection to the cluster at {endpoint}: its router stopped or died "
            "(requests in flight get no answer)",
        )


class ClientClosed(ClusterGone):
    """The client was closed while a request still waited on it, or is used after closing."""

    def __init__(self, endpoint: str) -> None:
        TimeoutError.__init__(self, f"the client of the cluster at {endpoint} was closed (its requests get no answer)")


_ids = itertools.count()
_CLI_CONNECT_S = 5.0  # pdserve-client: how long a connection may take before "is it running?"
_ABORT_LINGER_MS = 500  # a closing client's wait for its aborts to leave (the router is up: short)
# How long a send waits for a broken connection's reconnect to take or fail. ZMQ tries within its
# reconnect interval; a connect that neither takes nor fails (a stopped router, a host gone from
# the network) must not hold the request for the client's whole timeout.
_RECONNECT_WAIT_S = 2.0
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
# EVENT_CLOSED, while the connection is down: a reconnect attempt failed (nothing accepted it).
_WATCHED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | _HANDSHAKE_FAILED


def _keep_alive(sock: zmq.Socket, heartbeat_timeout: float) -> zmq.Socket:
    """ZMQ heartbeats on a client socket; the monitor socket that reports its connection's
    ``handshake_succeeded``/``disconnected``/``closed`` events."""
    timeout_ms = int(heartbeat_timeout * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, timeout_ms // 4))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    return sock.get_monitor_socket(_WATCHED)


class _Link:
    """The connection's state from its monitor events. Broken: an established connection (its
    handshake done) went down and none came back since. Unreachable: broken, and one of ZMQ's
    attempts to connect again failed since (a live router takes the first one). A connection
    refused at its handshake (wrong keys) never counts as established: its client waits out its
    timeout, as before."""

    def __init__(self) -> None:
        self.up = False
        self.broken = False
        self.unreachable = False
        self.refused = False  # a handshake failed (wrong or no CURVE keys, or no ZMQ peer there)

    def update(self, event: dict[str, Any]) -> None:
        if event["event"] & _HANDSHAKE_FAILED:
            self.refused = True
        elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.up, self.broken, self.unreachable = True, False, False
        elif event["event"] == zmq.EVENT_DISCONNECTED and self.up:
            self.up, self.broken = False, True
        elif event["event"] == zmq.EVENT_CLOSED and self.broken:
            self.unreachable = True


_HOST = r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]"  # a name, an IPv4 address or a bracketed IPv6 one


def normalize_endpoint(endpoint: str) -> str:
    """``tcp://HOST:PORT`` (or ``ipc://PATH``) from that form, ``HOST:PORT`` or a bare ``PORT``."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    rest = endpoint.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    host_ok = re.fullmatch(_HOST, host) is not None if host else rest == endpoint  # tcp:// names its host
    if "://" not in rest and port.isdigit() and 0 < int(port) < 65536 and host_ok:
        return f"tcp://{host or '127.0.0.1'}:{port}"
    expected = "expected tcp://HOST:PORT, HOST:PORT or PORT"
    if endpoint.startswith(("http://", "https://", "/")):  # vLLM's --endpoint is an HTTP route
        expected += " (the cluster's ZMQ endpoint, not an HTTP URL or route)"
    raise ValueError(f"endpoint {endpoint!r}: {expected}")


def _request(
    prompt: str | None,
    token_ids: list[int] | None,
    stream: bool,
    chat: bool,
    request_id: str | None,
    sampling: dict[str, Any],
    batch_chunks: bool = False,
    skip_special_tokens: bool = True,
    include_stop_str_in_output: bool = False,
) -> Generate:
    if request_id is not None and not isinstance(request_id, str):
        raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
    request_id = request_id or f"{os.getpid()}-{next(_ids)}"
    if len(request_id) > MAX_REQUEST_ID_CHARS:  # the router's refusal could not name it: no reply would
        why = f"request_id: longer than {MAX_REQUEST_ID_CHARS} characters"
        raise ClusterError(Error(None, "invalid_field", why))
    if isinstance(sampling.get("logit_bias"), dict):  # {1234: -100} as OpenAI's {"1234": -100}
        sampling = {**sampling, "logit_bias": {str(token): bias for token, bias in sampling["logit_bias"].items()}}
    return Generate(
        request_id=request_id,
        prompt=prompt,
        token_ids=token_ids,
        sampling=Sampling(**sampling),
        stream=stream,
        chat=chat,
        batch_chunks=batch_chunks,
        skip_special_tokens=skip_special_tokens,
        include_stop_str_in_output=include_stop_str_in_output,
    )


def _encoded(request: Generate, max_message_mib: float) -> bytes:
    """The request's message; ClusterError ``request_too_large`` for one past the router's limit,
    which would drop the connection unread, and every other request on it with it."""
    data = encode(request)
    if len(data) > max_message_mib * 2**20:
        why = (
            f"the request is {len(data):,} bytes as a message, over the router's limit of {max_message_mib:g} MiB "
            "(--max-message-mib): shorten its prompt, logit_bias or stop lists"
        )
        raise ClusterError(Error(request.request_id, "request_too_large", why))
    return data


class Client:
    """Blocking client. ``timeout`` bounds the wait for each reply message. Like the ZMQ socket
    it owns, it is not thread-safe: give each thread its own (or use one ``AsyncClient``)."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout: float = 60.0,
        auth_keys: str | None = None,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        auth_client: str = DEFAULT_CLIENT,
        max_message_mib: float = DEFAULT_MAX_MESSAGE_MIB,
    ) -> None:
        self.endpoint = endpoint = normalize_endpoint(endpoint)
        self.timeout = timeout
        self.max_message_mib = max_message_mib  # the router's (--max-message-mib)
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # A send waits while no connection is up (none yet, or refused, e.g. without the right
        # keys): bounded like the wait for a reply (-1: no bound, for a timeout of inf).
        self._socket.setsockopt(zmq.SNDTIMEO, -1 if timeout == math.inf else int(timeout * 1000))
        if auth_keys is not None:
            secure_client(self._socket, auth_keys, auth_client)
        self._monitor = _keep_alive(self._socket, heartbeat_timeout)
        self._link = _Link()
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._socket.connect(endpoint)
        self._buffered: dict[str, list[Message]] = {}
        self._running: set[str] = set()  # ids submitted whose terminal reply was not read yet
        self._stats_tags = itertools.count()

    def close(self) -> None:
        """Abort the requests whose end was not read (given up after a timeout, say): the router
        would otherwise notice only once this client's heartbeats stop, and the cluster would go
        on computing them meanwhile."""
        if self._socket.closed:  # closing twice is harmless
            return
        self._read_link_events()
        if self._running and self._link.up:
            self._socket.setsockopt(zmq.LINGER, _ABORT_LINGER_MS)  # time for the aborts to leave
            for request_id in self._running:
                try:
                    self._socket.send(encode(Abort(request_id)), zmq.NOBLOCK)
                except zmq.Again:
                    break
            self._running.clear()
        self._socket.disable_monitor()
        self._monitor.close()
        self._socket.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def refused(self) -> bool:
        """Whether a handshake with the endpoint failed (see ``ClusterUnavailable``)."""
        return self._link.refused

    def connected(self, within: float) -> bool:
        """Whether a connection to the router is up, waiting at most ``within`` seconds for one."""
        deadline = time.monotonic() + within
        while not self._link.up:
            left = deadline - time.monotonic()
            if left <= 0 or not self._monitor.poll(left * 1000):
                return self._link.up
            self._link.update(zmq.utils.monitor.recv_monitor_message(self._monitor))
        return True

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are (for testing the cluster's handling of bad input)."""
        self._send(data)

    def _send(self, data: bytes) -> None:
        if self._socket.closed:
            raise ClientClosed(self.endpoint)
        self._read_link_events()
        if self._link.broken:
            self._reconnected()
        try:
            self._socket.send(data)
        except zmq.Again:
            raise ClusterUnavailable(self.endpoint, self.timeout) from None

    def _reconnected(self) -> None:
        """Return once a broken connection is up again; ClusterGone once a reconnect failed (at
        once if one did already) or none took within ``_RECONNECT_WAIT_S``. Else the message
        would wait in ZMQ's queue for a reconnect that may never come, and the reply's wait
        would raise ClusterGone for a request that goes out later (as ``AsyncClient._reconnected``)."""
        deadline = time.monotonic() + _RECONNECT_WAIT_S
        while self._link.broken and not self._link.unreachable:
            left = deadline - time.monotonic()
            if left <= 0 or not self._monitor.poll(left * 1000):
                break
            self._link.update(zmq.utils.monitor.recv_monitor_message(self._monitor))
        if not self._link.up:
            raise ClusterGone(self.endpoint)

    def receive(self) -> Message:
        """The next reply, whatever request it belongs to. ``ClusterGone`` as soon as the
        connection breaks, ``ClusterUnavailable`` after ``timeout`` without a reply."""
        if self._socket.closed:
            raise ClientClosed(self.endpoint)
        deadline = time.monotonic() + self.timeout
        while True:
            if not self._socket.poll(0):  # what arrived before a disconnect is still an answer
                self._check_connection()
                left = deadline - time.monotonic()
                ready = dict(self._poller.poll(None if left == math.inf else max(0.0, left) * 1000))
                if self._socket not in ready:
                    if self._monitor not in ready and time.monotonic() >= deadline:
                        raise ClusterUnavailable(self.endpoint, self.timeout, self._link.up, self._link.refused)
                    continue
            message = decode(self._socket.recv())
            if not isinstance(message, Ping):  # the router's, to learn whether this client is still there
                return message

    def _read_link_events(self) -> None:
        while self._monitor.poll(0):
            self._link.update(zmq.utils.monitor.recv_monitor_message(self._monitor))

    def _check_connection(self) -> None:
        self._read_link_events()
        if self._link.broken:
            # Nothing more comes for what was sent over the broken connection, and what came of it
            # unread must not be taken for a later request's that reuses an id.
            self._running.clear()
            self._buffered.clear()
            raise ClusterGone(self.endpoint)

    def _next_for(self, request_id: str) -> Message:
        queue = self._buffered.get(request_id)
        if queue:
            message = queue.pop(0)
            if not queue:
                del self._buffered[request_id]
            return message
        while True:
            message = self.receive()
            if getattr(message, "request_id", None) == request_id:
                return message
            self._keep(message)

    def _keep(self, message: Message) -> None:
        """Buffer a reply read while waiting for another: its request's ``chunks`` read it later.
        Nobody reads one for a request whose end was read (an abort's reply that crossed its
        final): kept, each would stay for the client's life."""
        if isinstance(message, Stats):  # the late reply to a stats ask that timed out: nobody's
            return
        request_id = getattr(message, "request_id", None) or ""
        if request_id and request_id not in self._running:
            return
        self._buffered.setdefault(request_id, []).append(message)

    def submit(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        stream: bool = False,
        chat: bool = True,
        request_id: str | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        **sampling: Any,
    ) -> str:
        """Send a request without waiting; returns its request_id (see ``result``/``chunks``).
        An id whose request's terminal reply was not read yet is refused (``duplicate_request_id``):
        the replies of the two could not be told apart."""
        request = _request(
            prompt,
            token_ids,
            stream,
            chat,
            request_id,
            sampling,
            skip_special_tokens=skip_special_tokens,
            include_stop_str_in_output=include_stop_str_in_output,
        )
        rid = request.request_id or ""
        if rid in self._running:
            why = f"request_id {rid!r} is already running, or its end was not read (chunks, result)"
            raise ClusterError(Error(rid, "duplicate_request_id", why))
        data = _encoded(request, self.max_message_mib)  # a request that cannot go out leaves its id free
        # Counted before it goes: a Ctrl-C may interrupt the send after the message left, and
        # close() must still abort it (an abort of a request never sent is just unknown_request).
        self._running.add(rid)
        try:
            self._send(data)
        except (ClientClosed, ClusterUnavailable):
            self._running.discard(rid)
            raise
        return rid

    def chunks(self, request_id: str) -> Iterator[Chunk | Final]:
        """Chunks of a streaming request in order, then its Final; raises ClusterError on an error.
        Left before its Final (``break``), a later call reads on where it stopped."""
        while True:
            message = self._next_for(request_id)
            if isinstance(message, Error) and message.code == "unknown_request":
                continue  # an abort's reply (it crossed an earlier request's final), not this request's
            if _terminal(message):
                self._running.discard(request_id)
            if isinstance(message, Error):
                raise ClusterError(message)
            assert isinstance(message, (Chunk, Final))
            yield message
            if isinstance(message, Final):
                return

    def result(self, request_id: str) -> Final:
        for message in self.chunks(request_id):
            if isinstance(message, Final):
                return message
        raise AssertionError("unreachable")

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Final:
        return self.result(self.submit(prompt, **kwargs))

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[Chunk | Final]:
        return self.chunks(self.submit(prompt, stream=True, **kwargs))

    def abort(self, request_id: str) -> None:
        self._send(encode(Abort(request_id)))

    def stats(self) -> Stats:
        """The cluster's state: requests in flight and each group's KV pool and queues."""
        tag = next(self._stats_tags)
        self._send(encode(StatsRequest(tag)))
        while True:
            message = self.receive()
            if isinstance(message, Stats):
                if message.tag == tag:  # not the late reply to an ask that timed out
                    return message
                continue
            self._keep(message)


def _terminal(message: Message) -> bool:
    """Whether a reply is its request's last: its Final, or an error other than an abort's."""
    return isinstance(message, Final) or (isinstance(message, Error) and message.code != "unknown_request")


class _Inbox:
    """One request's replies in arrival order, and the future its reader waits on while none is
    there: the reader callback resolves it directly, with no queue or task in between."""

    __slots__ = ("messages", "waiter")

    def __init__(self) -> None:
        self.messages: collections.deque[Message | BaseException] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, message: Message | BaseException) -> None:
        self.messages.append(message)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self, timeout: float) -> Message | BaseException:
        """The next reply; ``asyncio.TimeoutError`` after ``timeout`` seconds without one."""
        if not self.messages:
            loop = asyncio.get_running_loop()
            self.waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self.waiter = None
        return self.messages.popleft()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
_LEFT_FINALS_KEPT = 1024


class AsyncClient:
    """asyncio client: many concurrent requests over one socket. Its streams ask for batched
    chunks (``Generate.batch_chunks``, unless ``batch_chunks=False``): one message a worker step
    for all of them.

    The socket is a plain (blocking-API) one read from the event loop: a reader callback on its
    file descriptor takes every message waiting and hands each to its request's inbox, and sends
    do not block (a full queue waits for the socket to take more). That costs a few loop passes
    a message fewer than ``zmq.asyncio``'s future per receive."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout: float = 60.0,
        batch_chunks: bool = True,
        auth_keys: str | None = None,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        auth_client: str = DEFAULT_CLIENT,
        max_message_mib: float = DEFAULT_MAX_MESSAGE_MIB,
    ) -> None:
        self.endpoint = endpoint = normalize_endpoint(endpoint)
        self.timeout = timeout
        self.batch_chunks = batch_chunks
        self.max_message_mib = max_message_mib  # the router's (--max-message-mib)
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if auth_keys is not None:
            secure_client(self._socket, auth_keys, auth_client)
        self._monitor = _keep_alive(self._socket, heartbeat_timeout)
        self._socket.connect(endpoint)
        self._inboxes: dict[str, _Inbox] = {}
        # Streams left while their request ran, until it ends: whether their abort went out.
        self._left: dict[str, bool] = {}
        # The Finals that ended left streams' requests, for ``cancel`` (the latest: nobody may ask).
        self._left_finals: collections.OrderedDict[str, Final] = collections.OrderedDict()
        self._stats_waiters: dict[int, asyncio.Future[Stats]] = {}  # by their request's tag
        self._stats_tags = itertools.count()
        self._send_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._reconnect_waiters: list[asyncio.Future[None]] = []  # sends on a broken connection
        self._loop: asyncio.AbstractEventLoop | None = None  # where the reader callback runs
        self._fd = -1  # the socket's descriptor, while the loop watches it
        self._watcher: asyncio.Task | None = None
        self._link = _Link()

    def _on_events(self) -> None:
        """The socket's descriptor is readable, or a send may have used up its signal: take every
        message waiting (reading ``EVENTS`` re-arms the descriptor) and wake a blocked send. A
        frame that does not decode is dropped (the router never sends one); a socket failure is
        handed to every waiting request."""
        sock = self._socket
        try:
            while (events := sock.get(zmq.EVENTS)) & _POLLIN:
                try:
                    message: Message = decode(sock.recv(zmq.NOBLOCK))
                except ProtocolError:
                    continue
                self._dispatch(message)
        except zmq.ZMQError as e:
            self._fail_waiting(e)
            self._stop_reading()
            return
        if events & _POLLOUT:
            while self._send_waiters:
                waiter = self._send_waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, Ping):  # the router's, to learn whether this client is still there
            return
        if isinstance(message, Stats):  # one whose asker gave up (or without a tag) is dropped
            waiter = self._stats_waiters.pop(message.tag, None) if message.tag is not None else None
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
            return
        for reply in message.chunks if isinstance(message, Chunks) else (message,):
            rid = getattr(reply, "request_id", None) or ""
            inbox = self._inboxes.get(rid)
            if inbox is not None:
                inbox.put(reply)
            if rid in self._left and _terminal(reply):
                del self._left[rid]
                if inbox is None and isinstance(reply, Final):  # no ``cancel`` waits for it yet
                    self._keep_left_final(rid, reply)

    async def _send(self, data: bytes, timeout: float | None = None) -> None:
        """Send without blocking the loop: past the socket's queue limit, wait until it takes more,
        at most ``timeout`` (default: the client's; then ClusterUnavailable) or until the
        connection breaks. On a connection known to be broken it first waits for ZMQ's reconnect
        (``_reconnected``): ZMQ would queue the message for a reconnect that may never come."""
        if self._socket.closed:
            raise ClientClosed(self.endpoint)
        self._start_reader()
        assert self._loop is not None
        if self._link.broken:
            await self._reconnected()
        while True:
            try:
                self._socket.send(data, zmq.NOBLOCK)
                break
            except zmq.Again:
                waiter = self._loop.create_future()
                self._send_waiters.append(waiter)
                self._loop.call_soon(self._on_events)  # POLLOUT may have come before the wait began
                wait = self.timeout if timeout is None else timeout
                try:
                    await asyncio.wait_for(waiter, wait)
                except ClusterUnavailable:  # ClusterGone: a TimeoutError as well, but no timeout
                    raise
                except asyncio.TimeoutError:
                    raise ClusterUnavailable(self.endpoint, wait, self._link.up, self._link.refused) from None
        # The send may have consumed the descriptor's signal of a message that came meanwhile.
        self._loop.call_soon(self._on_events)

    async def _reconnected(self) -> None:
        """Return once a broken connection is up again; ClusterGone once a reconnect failed
        (at once if one did already) or none took within ``_RECONNECT_WAIT_S``. A router that
        dropped this client (its heartbeats stopped while its process was stopped or stalled)
        takes ZMQ's first reconnect, and the request goes on the new connection."""
        assert self._loop is not None
        if not self._link.unreachable:
            settled = self._loop.create_future()
            self._reconnect_waiters.append(settled)
            try:
                await asyncio.wait_for(settled, _RECONNECT_WAIT_S)
            except ClusterUnavailable:  # ClientClosed: a TimeoutError as well, but no timeout
                raise
            except asyncio.TimeoutError:
                pass
            finally:
                if settled in self._reconnect_waiters:
                    self._reconnect_waiters.remove(settled)
        if not self._link.up:
            raise ClusterGone(self.endpoint)

    async def _watch(self) -> None:
        """Fail every waiting request once the connection breaks; wake the sends waiting for it
        once it is up again or a reconnect failed."""
        monitor = zmq.asyncio.Socket.from_socket(self._monitor)
        while True:
            was_broken = self._link.broken
            self._link.update(zmq.utils.monitor.parse_monitor_message(await monitor.recv_multipart()))
            if self._link.broken and not was_broken:
                self._fail_waiting(ClusterGone(self.endpoint))
            if self._link.up or self._link.unreachable:
                for settled in self._reconnect_waiters:
                    if not settled.done():
                        settled.set_result(None)
                self._reconnect_waiters.clear()

    def _fail_waiting(self, error: BaseException) -> None:
        self._left.clear()  # nothing more comes for what was sent over the broken connection
        for inbox in self._inboxes.values():
            inbox.put(error)
        waiting: list[asyncio.Future[Any]] = [
            *self._stats_waiters.values(),
            *self._send_waiters,
            *self._reconnect_waiters,
        ]
        self._stats_waiters.clear()
        self._send_waiters.clear()
        self._reconnect_waiters.clear()
        for waiter in waiting:
            if not waiter.done():
                waiter.set_exception(error)

    def _start_reader(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the first use, or a new loop (another ``asyncio.run``)
            if self._loop is not None:
                self._stop_reading()
                if self._watcher is not None and not self._loop.is_closed():
                    self._watcher.cancel()
            self._loop = loop
            self._fd = self._socket.FD
            self._loop.add_reader(self._fd, self._on_events)
            self._watcher = self._loop.create_task(self._watch())

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)

    async def stream(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        chat: bool = True,
        request_id: str | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        **sampling: Any,
    ) -> AsyncIterator[Chunk | Final]:
        """Chunks in order, then the Final; raises ClusterError on an error reply. Leaving it before
        its end (``break``, a cancelled task, a timeout) aborts the request; ``cancel`` then
        returns what it used."""
        request = _request(
            prompt,
            token_ids,
            True,
            chat,
            request_id,
            sampling,
            batch_chunks=self.batch_chunks,
            skip_special_tokens=skip_special_tokens,
            include_stop_str_in_output=include_stop_str_in_output,
        )
        rid = request.request_id or ""
        if rid in self._inboxes or rid in self._left:  # its replies could not be told from the running one's
            raise ClusterError(Error(rid, "duplicate_request_id", f"request_id {rid!r} is already running"))
        data = _encoded(request, self.max_message_mib)
        self._left_finals.pop(rid, None)  # an earlier request's with this id
        inbox = self._inboxes[rid] = _Inbox()
        running = False  # sent, and not ended
        try:
            await self._send(data)
            running = True
            while True:
                try:
                    message = await inbox.get(self.timeout)
                except asyncio.TimeoutError:
                    raise ClusterUnavailable(self.endpoint, self.timeout, self._link.up, self._link.refused) from None
                if isinstance(message, BaseException):
                    running = False  # the connection broke: nothing more comes for it
                    raise message
                if isinstance(message, Error) and message.code == "unknown_request":
                    continue  # an abort's reply (it crossed an earlier request's final), not this request's
                running = not _terminal(message)
                if isinstance(message, Error):
                    raise ClusterError(message)
                assert isinstance(message, (Chunk, Final))
                yield message
                if isinstance(message, Final):
                    return
        finally:
            self._inboxes.pop(rid, None)
            if running:  # left (break, a cancelled task) or timed out: its later replies are not a new one's
                self._leave(rid, inbox)

    def _leave(self, rid: str, inbox: _Inbox) -> None:
        """Abort the request of a stream left before its end: nobody can read its tokens. Sent
        without waiting (this runs in the stream's ``finally``); ``cancel`` returns its Final."""
        if any(isinstance(m, BaseException) for m in inbox.messages):  # the connection broke
            return
        ended = next((m for m in inbox.messages if _terminal(m)), None)  # came, but was not read
        if ended is not None:
            if isinstance(ended, Final):
                self._keep_left_final(rid, ended)
            return
        sent = False
        if not self._link.broken:
            try:
                self._socket.send(encode(Abort(rid)), zmq.NOBLOCK)
                sent = True
            except zmq.ZMQError:  # its queue is full, or the client closed: it runs on
                pass
            if sent and self._loop is not None:
                # As in ``_send``: the send may have used up the descriptor's signal of replies
                # that came meanwhile, and every other stream would wait for the next event.
                self._loop.call_soon(self._on_events)
        self._left[rid] = sent

    def _keep_left_final(self, rid: str, final: Final) -> None:
        self._left_finals[rid] = final
        while len(self._left_finals) > _LEFT_FINALS_KEPT:
            self._left_finals.popitem(last=False)

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Final:
        final = None
        async for message in self.stream(prompt, **kwargs):
            if isinstance(message, Final):
                final = message
        assert final is not None
        return final

    async def abort(self, request_id: str) -> None:
        """Stop a request. Over a connection known to be broken there is none left to stop."""
        if not self._link.broken:
            await self._send(encode(Abort(request_id)))

    async def cancel(self, request_id: str, timeout: float | None = None) -> Final | None:
        """Abort a request whose stream was left (leaving aborts it already) and return the
        ``Final`` that ended it, with what it used: the abort's, or its own end that crossed the
        abort. None where that is not to be had: it was read already, the connection is gone, or
        nothing came within ``timeout`` (default: the client's)."""
        if request_id in self._inboxes:  # its stream still reads it
            return None
        final = self._left_finals.pop(request_id, None)
        if final is not None:
            return final
        aborted = self._left.get(request_id, False)
        inbox = self._inboxes[request_id] = _Inbox()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            if not aborted:
                await self._send(encode(Abort(request_id)))
            while True:
                message = await inbox.get(max(0.0, deadline - time.monotonic()))
                if isinstance(message, Final):
                    return message
                if not isinstance(message, Chunk):  # an error (ended already), a broken connection
                    return None
        except (asyncio.TimeoutError, ClusterUnavailable):
            return None
        finally:
            self._inboxes.pop(request_id, None)

    async def stats(self, timeout: float | None = None) -> Stats:
        """The cluster's state (see ``Client.stats``); ClusterUnavailable after ``timeout`` seconds
        (default: the client's), sending included."""
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        tag = next(self._stats_tags)
        waiter = self._stats_waiters[tag] = asyncio.get_running_loop().create_future()
        try:
            await self._send(encode(StatsRequest(tag)), wait)
            try:
                return await asyncio.wait_for(waiter, max(0.0, deadline - time.monotonic()))
            except ClusterUnavailable:  # ClusterGone: a TimeoutError as well, but no timeout
                raise
            except asyncio.TimeoutError:
                raise ClusterUnavailable(self.endpoint, wait, self._link.up, self._link.refused) from None
        finally:
            self._stats_waiters.pop(tag, None)  # its reply, should it come later, is dropped
            if waiter.done() and not waiter.cancelled():
                waiter.exception()  # read: the broken connection's error, raised by the send already
            else:
                waiter.cancel()

    @property
    def refused(self) -> bool:
        """Whether a handshake with the endpoint failed (see ``ClusterUnavailable``)."""
        return self._link.refused

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._socket.closed:
            return
        if self._loop is not None and not self._loop.is_closed():  # not left to wait out their timeout
            self._fail_waiting(ClientClosed(self.endpoint))
        self._stop_reading()
        self._socket.disable_monitor()
        self._monitor.close()
        self._socket.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        self.close()


def endpoint_option(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A click callback: ``--endpoint`` normalized, or a usage error saying which forms it takes."""
    try:
        return normalize_endpoint(value)
    except ValueError as e:
        raise click.BadParameter(str(e).split(": ", 1)[1]) from None


class Seconds(click.ParamType):
    """A wait on the command line, in seconds: positive (``zero``: or 0), inf for no limit. NaN
    is refused too, which ``click.FloatRange`` lets through (no comparison holds for it)."""

    name = "seconds"

    def __init__(self, zero: bool = False) -> None:
        self.zero = zero

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not (seconds >= 0 if self.zero else seconds > 0):
            kind = "non-negative" if self.zero else "positive"
            self.fail(f"must be a {kind} number of seconds (inf: no limit), got {seconds}", param, ctx)
        return seconds


# What the wire's integers hold: a larger value is the cluster's to refuse, not a traceback here.
_INT64 = click.IntRange(-(2**63), 2**63 - 1)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pdserve", prog_name="pdserve-client")
@click.argument("prompt")
@click.option(
    "--endpoint",
    default=DEFAULT_ENDPOINT,
    show_default=True,
    callback=endpoint_option,
    help="The cluster's client endpoint: tcp://HOST:PORT, HOST:PORT or PORT.",
)
@click.option("--max-tokens", default=64, show_default=True, type=_INT64, help="Most tokens to generate.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 for greedy decoding.")
@click.option("--top-p", default=1.0, show_default=True, type=float, help="Nucleus sampling mass.")
@click.option("--top-k", default=-1, show_default=True, type=_INT64, help="Sample from the k likeliest; -1 for all.")
@click.option("--seed", default=None, type=_INT64, help="Seed of this request's sampling.")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Print tokens as they arrive.")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option(
    "--token-ids",
    is_flag=True,
    help="PROMPT is token ids (comma- or space-separated), sent as they are, and the answer is printed as ids: "
    "for a model without a tokenizer (the random-weight presets).",
)
@click.option(
    "--timeout",
    default=60.0,
    show_default=True,
    type=Seconds(),
    help=f"Seconds to wait for each reply (inf: no limit); for the connection, at most {_CLI_CONNECT_S:.0f}.",
)
@click.option("--auth-keys", type=click.Path(file_okay=False), help="The cluster's key directory (--auth-keys there).")
@click.option(
    "--auth-client",
    default=DEFAULT_CLIENT,
    show_default=True,
    help=AUTH_CLIENT_HELP,
)
def main(
    prompt: str,
    endpoint: str,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stream: bool,
    raw: bool,
    token_ids: bool,
    timeout: float,
    auth_keys: str | None,
    auth_client: str,
) -> None:
    """Send PROMPT to a running cluster and print the answer (timings on stderr).

    PROMPT "-" reads the prompt from stdin, as it is (a long one does not fit on a command line).
    """
    if prompt == "-":
        try:
            prompt = sys.stdin.buffer.read().decode()
        except UnicodeDecodeError as e:
            raise click.ClickException(f"the prompt on stdin is not UTF-8 text (byte {e.start})") from None
    ids: list[int] | None = None
    if token_ids:
        try:
            ids = [int(token) for token in prompt.replace(",", " ").split()]
        except ValueError:
            raise click.BadParameter("with --token-ids, PROMPT is integers, comma- or space-separated") from None
    sampling = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    mid_line = False  # an error after partial output starts on a line of its own
    try:
        client = Client(endpoint, timeout, auth_keys, auth_client=auth_client)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    with client:
        try:
            # Nothing listening is said at once, not after the reply timeout.
            connect_s = min(timeout, _CLI_CONNECT_S)
            if not client.connected(within=connect_s):
                raise ClusterUnavailable(endpoint, connect_s, refused=client.refused)
            if ids is None:
                request_id = client.submit(prompt, stream=stream, chat=not raw, **sampling)
            else:
                request_id = client.submit(token_ids=ids, stream=stream, **sampling)
            for message in client.chunks(request_id):
                text = message.text if isinstance(message, Chunk) or not stream else ""
                if ids is not None and (isinstance(message, Chunk) or not stream) and message.token_ids:
                    text = (" " if mid_line else "") + " ".join(map(str, message.token_ids))
                if text:
                    sys.stdout.write(text)
                    sys.stdout.flush()
                    mid_line = not text.endswith("\n")
                if isinstance(message, Final):
                    if mid_line:  # the answer ends its line on stdout, where it was written
                        sys.stdout.write("\n")
                        sys.stdout.flush()
                        mid_line = False
                    t, usage = message.timings, message.usage
                    click.echo(
                        f"[{usage.get('prompt_tokens', 0)} prompt + {usage.get('completion_tokens', 0)} generated, "
                        f"{message.finish_reason}] TTFT {t.get('first_token', 0) * 1e3:.1f} ms, "
                        f"total {t.get('total', 0) * 1e3:.1f} ms",
                        err=True,
                    )
        except (ClusterError, ClusterUnavailable) as e:
            if mid_line:
                click.echo(err=True)
            raise click.ClickException(_as_typed(e, sampling)) from None
        except KeyboardInterrupt:
            # The shell's status for Ctrl-C, not click's "Aborted!" and 1; leaving the with block
            # aborts the request in the cluster.
            if mid_line:
                click.echo(err=True)
            raise SystemExit(130) from None


def _as_typed(error: ClusterError | ClusterUnavailable, options: dict[str, Any]) -> str:
    """The error, naming the option the user typed where the cluster names a request field that
    one of ``options`` (by parameter name) set."""
    if isinstance(error, ClusterError) and error.code == "invalid_request":
        field, _, why = error.error.message.partition(": ")
        if field in options:
            option = f"--{field.replace('_', '-')}"
            named = re.sub(rf"\b{field}\b", option, why)  # a reason that names the field itself
            return f"{error.code}: {named if named != why else f'{option} {why}'}"
    return str(error)


if __name__ == "__main__":
    main(prog_name="python -m pdserve.cluster.client")
