"""Request ids between clients and a real router in this process, whose stand-in leaders are
plain sockets: the client library (``cluster.client``, blocking and asyncio) with replies that
cross, ids used again, a router that goes away after answering; the ids the router makes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import zmq

from pdserve.cluster.client import (
    AsyncClient,
    Client,
    ClientClosed,
    ClusterError,
    ClusterGone,
    ClusterUnavailable,
)
from pdserve.cluster.protocol import (
    MAX_REQUEST_ID_CHARS,
    Abort,
    Chunk,
    Error,
    Final,
    Generate,
    Sampling,
    Stats,
    StatsRequest,
    TokenOutput,
    TokenOutputs,
    WorkRequest,
    decode,
    encode,
)
from pdserve.router.router import PING_S
from pdserve.tests.router.helpers import RouterRig, router_rig

_C = TypeVar("_C", Client, AsyncClient)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[RouterRig]:
    with router_rig(tmp_path, {"decode_groups": 1}, RouterRig) as rig:
        yield rig


def _work(rig: RouterRig) -> WorkRequest:
    (work,) = [m for m in rig.received("prefill", 0) if isinstance(m, WorkRequest)]
    return work


def test_a_worker_message_the_router_fails_on_ends_only_its_request(
    rig: RouterRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception while the router applies one request's tokens (a router bug, or a worker's:
    a token id its tokenizer cannot decode) ends that request with ``internal_error`` and its
    workers' part; the other request of the same message goes on. It used to leave the router's
    loop and take the launcher, every group and every client down."""
    with Client(rig.router.addresses.client, timeout=5.0) as client:
        client.submit(token_ids=[5, 6, 7], request_id="bad", max_tokens=4)
        client.submit(token_ids=[5, 6, 7], request_id="good", max_tokens=4)
        rig.pump(0.2)
        works = {w.request_id: w for w in rig.received("prefill", 0) if isinstance(w, WorkRequest)}
        bad_id, good_id = sorted(works)  # the router's ids, in arrival order
        on_tokens = rig.router._on_tokens

        def failing(output: TokenOutput) -> None:
            if output.request_id == bad_id:
                raise OverflowError("out of range integral type conversion attempted")
            on_tokens(output)

        monkeypatch.setattr(rig.router, "_on_tokens", failing)
        rig.worker(TokenOutputs([TokenOutput(bad_id, 0, [-1]), TokenOutput(good_id, 0, [11], True, "length")]))
        with pytest.raises(ClusterError) as failed:
            client.result("bad")
        assert failed.value.code == "internal_error"
        assert client.result("good").token_ids == [11]
    assert Abort(bad_id) in rig.received("decode", works[bad_id].decode_group)
    assert rig.router.requests == {}


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_while_its_request_sends_it_nothing_has_it_aborted(rig: RouterRig, stream: bool) -> None:
    """A request that streams nothing until its final sends its client nothing while it runs, so
    the router pings a client quiet for a second: one that is gone has the request aborted on
    the workers, where it used to run to its end (its KV held, a drain waiting on it). A
    streaming request's next chunk tells the same."""
    gone = zmq.Context.instance().socket(zmq.DEALER)
    gone.connect(rig.router.addresses.client)
    sampling = Sampling(max_tokens=200, temperature=0.0)
    gone.send(encode(Generate(request_id="gone", token_ids=[5, 6, 7], sampling=sampling, stream=stream)))
    rig.pump(0.2)
    work = _work(rig)
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11])]))  # the first token, from prefill
    gone.close(linger=0)
    rig.pump(0.2)
    if stream:
        rig.worker(TokenOutputs([TokenOutput(work.request_id, 1, [12])]))
    else:
        rig.pump(2 * PING_S + 0.5)
    assert rig.router.requests == {} and rig.router.client_load == {}
    assert Abort(work.request_id) in rig.received("decode", work.decode_group)


def test_an_abort_that_crossed_its_final_does_not_end_the_ids_next_request(rig: RouterRig) -> None:
    """An abort that crosses its request's final is answered ``unknown_request``: that reply is
    the abort's, not a request's end, so the next request using the id again (allowed once the
    first has ended) gets its own final."""
    with Client(rig.router.addresses.client, timeout=2.0) as client:
        client.submit(token_ids=[5, 6, 7], request_id="x", max_tokens=1)
        rig.worker(TokenOutputs([TokenOutput(_work(rig).request_id, 0, [11], True, "length")]))
        client.abort("x")  # crosses the final
        rig.pump()
        assert client.result("x").token_ids == [11]
        client.submit(token_ids=[5, 6, 7], request_id="x", max_tokens=1)
        rig.worker(TokenOutputs([TokenOutput(_work(rig).request_id, 0, [12], True, "length")]))
        assert client.result("x").token_ids == [12]


def test_a_client_without_a_reply_timeout_waits_as_long_as_it_takes(rig: RouterRig) -> None:
    """``timeout=inf`` (the CLI's ``--timeout inf``): no bound, not an OverflowError from turning
    it into ZMQ's milliseconds."""
    with Client(rig.router.addresses.client, timeout=float("inf")) as client:
        client.submit(token_ids=[5, 6, 7], request_id="x", max_tokens=1)
        rig.worker(TokenOutputs([TokenOutput(_work(rig).request_id, 0, [11], True, "length")]))
        assert client.result("x").token_ids == [11]


def test_a_stream_left_early_is_read_on_later_and_holds_its_id_until_then(rig: RouterRig) -> None:
    """A blocking stream left with ``break`` while its request runs: a later ``chunks`` reads on
    where it stopped, and until its end is read its id is refused (the client used to answer a
    new request of that id with the first one's final, read from the socket before its own)."""
    with Client(rig.router.addresses.client, timeout=2.0) as client:
        client.submit(token_ids=[5, 6, 7], request_id="q", stream=True, max_tokens=3)
        first = _work(rig)
        rig.worker(TokenOutputs([TokenOutput(first.request_id, 0, [11])]))
        for _ in client.chunks("q"):
            break
        rig.worker(TokenOutputs([TokenOutput(first.request_id, 1, [12, 13], True, "length")]))
        with pytest.raises(ClusterError) as refused:
            client.submit(token_ids=[5, 6, 7], request_id="q", max_tokens=1)
        assert refused.value.code == "duplicate_request_id"
        rest = list(client.chunks("q"))
        assert isinstance(rest[-1], Final) and rest[-1].token_ids == [11, 12, 13]
        client.submit(token_ids=[5, 6, 7], request_id="q", max_tokens=1)  # its end read: free again
        rig.worker(TokenOutputs([TokenOutput(_work(rig).request_id, 0, [99], True, "length")]))
        assert client.result("q").token_ids == [99]
        assert client._buffered == {}


def test_the_blocking_client_keeps_no_reply_nobody_will_read(rig: RouterRig) -> None:
    """Replies read while waiting for another request are buffered for their own; once read, and
    for a request whose end was read already (an abort's reply that crossed its final), nothing
    stays: each left an entry for the client's life (review: 2 a round, without end)."""
    with Client(rig.router.addresses.client, timeout=2.0) as client:
        for round in range(4):
            ids = [f"a{round}", f"b{round}"]
            for rid in ids:
                client.submit(token_ids=[5, 6, 7], request_id=rid, stream=True, max_tokens=1)
            for work in [m for m in rig.received("prefill", 0) if isinstance(m, WorkRequest)]:
                rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11], True, "length")]))
            for rid in reversed(ids):  # b's read first: a's replies wait in the buffer meanwhile
                assert [type(m) for m in client.chunks(rid)] == [Chunk, Final]
            client.abort(ids[0])  # after its end: the router answers unknown_request
            rig.pump()
        client.submit(token_ids=[5, 6, 7], request_id="c", max_tokens=1)  # read past the last abort's reply
        rig.worker(TokenOutputs([TokenOutput(_work(rig).request_id, 0, [12], True, "length")]))
        assert client.result("c").token_ids == [12]
        assert client._buffered == {}


def test_the_blocking_client_refuses_an_id_still_running(rig: RouterRig) -> None:
    """As AsyncClient: a submit with the id of a request whose end was not read yet is refused by
    the client (the router refused it too, and that error was taken for the first request's)."""
    with Client(rig.router.addresses.client, timeout=2.0) as client:
        client.submit(token_ids=[5, 6, 7], request_id="a", max_tokens=1)
        with pytest.raises(ClusterError) as refused:
            client.submit(token_ids=[5, 6, 7], request_id="a", max_tokens=1)
        assert refused.value.code == "duplicate_request_id"
        rig.worker(TokenOutputs([TokenOutput(_work(rig).request_id, 0, [11], True, "length")]))
        assert client.result("a").token_ids == [11]
        client.submit(token_ids=[5, 6, 7], request_id="a", max_tokens=1)  # ended and read: free again
        rig.worker(TokenOutputs([TokenOutput(_work(rig).request_id, 0, [12], True, "length")]))
        assert client.result("a").token_ids == [12]


def test_a_second_stream_with_a_running_streams_id_leaves_the_first_one_alone(rig: RouterRig) -> None:
    """The second stream is refused (``duplicate_request_id``); the first still gets its tokens
    and final. Its replies could not be told apart, so the client refuses it itself: giving it
    the id's inbox took the first stream's replies, then dropped them with it."""

    async def main() -> tuple[list[Chunk | Final], ClusterError | None]:
        client = AsyncClient(rig.router.addresses.client, timeout=2.0)
        pumping = True

        async def pump() -> None:
            while pumping:
                rig.router.poll(0)
                await asyncio.sleep(0.002)

        async def stream() -> list[Chunk | Final]:
            return [m async for m in client.stream(token_ids=[5, 6, 7], request_id="x", max_tokens=3)]

        pumper = asyncio.create_task(pump())
        try:
            first = asyncio.create_task(stream())
            inbox = rig.inboxes[("prefill", 0)]
            for _ in range(500):
                if inbox.poll(0):
                    break
                await asyncio.sleep(0.005)
            work = decode(inbox.recv())
            assert isinstance(work, WorkRequest)
            refused = None
            try:
                await stream()
            except ClusterError as e:
                refused = e
            rig.to_router.send(encode(TokenOutputs([TokenOutput(work.request_id, 0, [11, 12, 13], True, "length")])))
            return await first, refused
        finally:
            pumping = False
            await pumper
            client.close()

    first, refused = asyncio.run(main())
    assert refused is not None and refused.code == "duplicate_request_id"
    assert isinstance(first[-1], Final) and first[-1].token_ids == [11, 12, 13]


def test_an_async_stream_left_early_aborts_and_takes_nothing_of_the_next_one_with_its_id(rig: RouterRig) -> None:
    """An AsyncClient stream left (``break``) while its request runs: nobody can read its tokens,
    so the client aborts it (the router tells the prefill leader) and ``cancel`` returns the
    abort's Final. A stream started with its id before that Final came is refused (their replies
    could not be told apart); one started after is served with its own tokens, none of the
    first one's that were still on their way."""
    aborts: list[str] = []

    async def work() -> WorkRequest:
        inbox = rig.inboxes[("prefill", 0)]
        for _ in range(500):
            rig.router.poll(0)
            if inbox.poll(0):
                message = decode(inbox.recv())
                if isinstance(message, Abort):
                    aborts.append(message.request_id)
                    continue
                assert isinstance(message, WorkRequest)
                return message
            await asyncio.sleep(0.005)
        raise AssertionError("no work")

    async def reply(output: TokenOutput) -> None:
        rig.to_router.send(encode(TokenOutputs([output])))
        for _ in range(20):
            rig.router.poll(0)
            await asyncio.sleep(0.005)

    async def main() -> tuple[list[Chunk | Final], ClusterError | None, Final | None, list[Chunk | Final]]:
        client = AsyncClient(rig.router.addresses.client, timeout=2.0)
        try:
            first = client.stream(token_ids=[5, 6, 7], request_id="q", max_tokens=4)
            chunk = asyncio.create_task(anext(first))
            running = await work()
            await reply(TokenOutput(running.request_id, 0, [11]))
            assert isinstance(await chunk, Chunk)
            await first.aclose()  # left, as a ``break`` leaves it

            seen: list[Chunk | Final] = []
            refused = None

            async def second() -> None:
                async for message in client.stream(token_ids=[5, 6, 7], request_id="q", max_tokens=1):
                    seen.append(message)

            # The first request's next token is on its way; the router has not read the abort yet.
            rig.to_router.send(encode(TokenOutputs([TokenOutput(running.request_id, 1, [12])])))
            # Both wait at the router before it reads either (a loaded machine delivers either one
            # first), so that it reads them in its turn: the worker's token, then the abort.
            assert rig.router.inbox.poll(2000) and rig.router.frontend.poll(2000)
            try:
                await second()
            except ClusterError as e:
                refused = e
            await reply(TokenOutput(running.request_id, 2, [13]))  # read after the abort: the request is gone
            cancelled = await client.cancel("q")
            third = asyncio.create_task(client.generate(token_ids=[5, 6, 7], request_id="q", max_tokens=1))
            await reply(TokenOutput((await work()).request_id, 0, [99], True, "length"))
            assert aborts == [running.request_id]
            return seen, refused, cancelled, [await third]
        finally:
            client.close()

    seen, refused, cancelled, (final,) = asyncio.run(main())
    assert seen == []
    assert refused is not None and refused.code == "duplicate_request_id"
    # What it used: the tokens the router had when it read the abort (13 came after).
    assert cancelled is not None and cancelled.finish_reason == "abort" and cancelled.token_ids == [11, 12]
    assert isinstance(final, Final) and final.token_ids == [99]


def test_a_request_id_over_the_limit_is_refused_at_once(rig: RouterRig) -> None:
    """The router refuses an id over 256 characters without echoing it: the client could not
    match that reply and waited out its timeout, then said the cluster was busy."""
    long_id = "x" * (MAX_REQUEST_ID_CHARS + 1)
    started = time.monotonic()
    # At once: well within the clients' timeouts, which a loaded machine cannot reach by chance.
    with Client(rig.router.addresses.client, timeout=30.0) as client, pytest.raises(ClusterError) as refused:
        client.generate(token_ids=[5, 6, 7], request_id=long_id, max_tokens=1)
    assert refused.value.code == "invalid_field"

    async def main() -> None:
        async with AsyncClient(rig.router.addresses.client, timeout=30.0) as client:
            await client.generate(token_ids=[5, 6, 7], request_id=long_id, max_tokens=1)

    with pytest.raises(ClusterError) as refused:
        asyncio.run(main())
    assert refused.value.code == "invalid_field"
    assert time.monotonic() - started < 10.0


def test_a_request_larger_than_the_routers_limit_is_refused_before_sending(rig: RouterRig) -> None:
    """Sent, a message over the router's --max-message-mib drops the connection unread, and every
    other request of the client with it (an HTTP front end's clients share one): the client
    refuses it, and its id stays free, as for a request that cannot be encoded (a seed past
    64 bits), which used to leave the id taken for the client's life (review)."""
    large = [100_000] * 300_000  # 1.5 MB as a message: 5 bytes an id
    with Client(rig.router.addresses.client, timeout=2.0, max_message_mib=1.0) as client:
        with pytest.raises(ClusterError) as refused:
            client.submit(token_ids=large, request_id="big", max_tokens=1)
        assert refused.value.code == "request_too_large" and "--max-message-mib" in str(refused.value)
        with pytest.raises(OverflowError):
            client.submit(token_ids=[5, 6, 7], request_id="big", max_tokens=1, seed=2**64)
        client.submit(token_ids=[5, 6, 7], request_id="big", max_tokens=1)
        rig.worker(TokenOutputs([TokenOutput(_work(rig).request_id, 0, [11], True, "length")]))
        assert client.result("big").token_ids == [11]

    async def main() -> None:
        async with AsyncClient(rig.router.addresses.client, timeout=2.0, max_message_mib=1.0) as client:
            await client.generate(token_ids=large, max_tokens=1)

    with pytest.raises(ClusterError) as refused:
        asyncio.run(main())
    assert refused.value.code == "request_too_large"
    rig.pump()
    assert rig.received("prefill", 0) == []


def test_a_late_stats_reply_is_not_kept(rig: RouterRig) -> None:
    """A stats ask that timed out is answered later, while the client waits for a request: that
    reply is nobody's and must not pile up in the client's buffers."""
    with Client(rig.router.addresses.client, timeout=0.3) as client:
        with pytest.raises(ClusterUnavailable):
            client.stats()  # the router is not polled meanwhile
        rig.pump()  # now it answers
        client.submit(token_ids=[5, 6, 7], request_id="s", max_tokens=1)
        rig.worker(TokenOutputs([TokenOutput(_work(rig).request_id, 0, [11], True, "length")]))
        assert client.result("s").token_ids == [11]
        assert client._buffered == {}


def test_a_request_id_that_is_not_a_string_is_refused_before_sending(rig: RouterRig) -> None:
    with Client(rig.router.addresses.client, timeout=2.0) as client, pytest.raises(TypeError, match="string"):
        client.submit(token_ids=[5, 6, 7], request_id=7, max_tokens=1)  # type: ignore[arg-type]

    async def main() -> None:
        async with AsyncClient(rig.router.addresses.client, timeout=2.0) as client:
            await client.generate(token_ids=[5, 6, 7], request_id=b"x", max_tokens=1)

    with pytest.raises(TypeError, match="string"):
        asyncio.run(main())
    rig.pump()
    assert rig.received("prefill", 0) == []


def test_a_closed_client_says_so_when_used_again(rig: RouterRig) -> None:
    """Each call on a closed client raises ``ClientClosed``, not ZMQ's "not a socket"."""
    client = Client(rig.router.addresses.client, timeout=2.0)
    client.close()
    for use in (lambda: client.submit(token_ids=[5, 6, 7]), client.stats, client.receive, lambda: client.abort("a")):
        with pytest.raises(ClientClosed):
            use()

    async def main() -> list[BaseException]:
        async_client = AsyncClient(rig.router.addresses.client, timeout=2.0)
        async_client.close()
        uses = (async_client.generate(token_ids=[5, 6, 7]), async_client.stats(), async_client.abort("a"))
        return await asyncio.gather(*uses, return_exceptions=True)

    errors = asyncio.run(main())
    assert all(isinstance(e, ClientClosed) for e in errors), errors


def test_closing_an_async_client_ends_the_requests_waiting_on_it(rig: RouterRig) -> None:
    """A stream and a stats ask still waiting when the client is closed raise at once; they
    waited out the client's timeout, then said the cluster was up but busy."""

    async def main() -> list[BaseException | None]:
        client = AsyncClient(rig.router.addresses.client, timeout=3.0)
        stream = asyncio.create_task(client.generate(token_ids=[5, 6, 7], max_tokens=1))
        stats = asyncio.create_task(client.stats())
        await asyncio.sleep(0.1)  # both sent; the router is not read, so nothing comes back
        client.close()
        done, _ = await asyncio.wait([stream, stats], timeout=1.0)
        return [task.exception() if task in done else None for task in (stream, stats)]

    errors = asyncio.run(main())
    assert all(isinstance(e, ClientClosed) for e in errors), errors


def test_an_async_client_serves_one_event_loop_after_another(rig: RouterRig) -> None:
    """One AsyncClient used from two ``asyncio.run``s in turn: its reader was left on the first
    loop, closed by then, and the second run's first request raised RuntimeError."""
    client = AsyncClient(rig.router.addresses.client, timeout=2.0)

    async def ask() -> int:
        pumping = True

        async def pump() -> None:
            while pumping:
                rig.router.poll(0)
                await asyncio.sleep(0.002)

        pumper = asyncio.create_task(pump())
        try:
            return (await client.stats()).requests_in_flight
        finally:
            pumping = False
            await pumper

    try:
        assert asyncio.run(ask()) == 0
        assert asyncio.run(ask()) == 0
    finally:
        client.close()


def test_a_final_that_arrived_before_the_router_went_away_is_read(tmp_path: Path) -> None:
    """The router answers, then exits (a drained shutdown): the final already in the client's
    socket is the answer, not ``ClusterGone``."""
    endpoint = f"ipc://{tmp_path}/client"
    server = zmq.Context.instance().socket(zmq.ROUTER)
    server.bind(endpoint)
    with Client(endpoint, timeout=5.0) as client:
        assert client.connected(within=5.0)
        request_id = client.submit(token_ids=[1, 2, 3], max_tokens=1)
        assert server.poll(5000)
        identity, data = server.recv_multipart()
        assert decode(data).request_id == request_id
        final = Final(request_id, "length", [4], "", {"prompt_tokens": 3, "completion_tokens": 1}, {"total": 0.1})
        server.send_multipart([identity, encode(final)])
        time.sleep(0.2)
        server.close(linger=1000)
        time.sleep(0.5)  # the client's monitor has seen the disconnect
        assert client.result(request_id) == final


def test_an_async_stats_ask_whose_router_dies_raises_cluster_gone(tmp_path: Path) -> None:
    """The connection breaks while ``AsyncClient.stats`` waits: ClusterGone, as for a stream. It
    is a TimeoutError too (``asyncio.TimeoutError`` since Python 3.11), which the wait took for
    its own timeout: ClusterUnavailable, saying nothing came within the whole timeout."""
    endpoint = f"ipc://{tmp_path}/client"
    server = zmq.Context.instance().socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(endpoint)

    async def main() -> None:
        async with AsyncClient(endpoint, timeout=30.0) as client:
            ask = asyncio.create_task(client.stats())
            assert await asyncio.to_thread(server.poll, 5000)
            server.close()  # the router dies before it answers
            await asyncio.wait_for(ask, 10)

    started = time.monotonic()
    with pytest.raises(ClusterGone):
        asyncio.run(main())
    assert time.monotonic() - started < 10


def _slowly_reconnecting_client(endpoint: str, kind: type[_C]) -> _C:
    """A client whose socket tries to connect again 1-2 s after a drop (ZMQ's default: 0.1-0.2
    s), so that a test's steps fit before the first attempt."""
    context = zmq.Context.instance()
    context.setsockopt(zmq.RECONNECT_IVL, 1000)  # the sockets made next: the client's
    try:
        return kind(endpoint, timeout=30.0)
    finally:
        context.setsockopt(zmq.RECONNECT_IVL, 100)  # ZMQ's default again


def _answer_stats(router: zmq.Socket) -> None:
    """Answer one stats request on ``router``, with 3 requests in flight."""
    assert router.poll(10_000)
    identity, frame = router.recv_multipart()
    request = decode(frame)
    assert isinstance(request, StatsRequest)
    router.send_multipart([identity, encode(Stats(3, {}, tag=request.tag))])


def _rebind(router: zmq.Socket, endpoint: str) -> None:
    for _ in range(100):  # the port frees as the closed socket's I/O thread lets go of it
        try:
            router.bind(endpoint)
            return
        except zmq.ZMQError:
            time.sleep(0.001)
    router.bind(endpoint)


def test_replies_read_before_a_drop_are_not_a_later_requests_of_that_id(tmp_path: Path) -> None:
    """Chunks of a stream read while the client waited for another request, then the connection
    broke: once ZMQ reconnects, a new request of the stream's id gets its own replies alone, not
    the old request's chunks before them (review)."""
    endpoint = f"ipc://{tmp_path}/client"
    server = zmq.Context.instance().socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(endpoint)
    with Client(endpoint, timeout=5.0) as client:
        assert client.connected(within=5.0)
        client.submit(token_ids=[1, 2], request_id="a", stream=True, max_tokens=4)
        client.submit(token_ids=[1, 2], request_id="b", max_tokens=4)
        identity = b""
        for _ in range(2):
            assert server.poll(5000)
            identity, _ = server.recv_multipart()
        for text in ("old-1", "old-2"):
            server.send_multipart([identity, encode(Chunk("a", [4], text))])
        time.sleep(0.2)
        server.close()  # the router dies while the client waits for "b"
        with pytest.raises(ClusterGone):
            client.result("b")
        server = zmq.Context.instance().socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        _rebind(server, endpoint)
        client.submit(token_ids=[1, 2], request_id="a", stream=True, max_tokens=1)
        assert server.poll(5000)
        identity, _ = server.recv_multipart()
        server.send_multipart([identity, encode(Chunk("a", [9], "new"))])
        final = Final("a", "length", [9], "new", {"prompt_tokens": 2, "completion_tokens": 1}, {})
        server.send_multipart([identity, encode(final)])
        assert [m.text for m in client.chunks("a")] == ["new", "new"]
    server.close()


def test_a_blocking_send_after_a_drop_goes_out_once_zmq_reconnects() -> None:
    """The blocking client as the async one below: a request made while the dropped connection
    is down waits for ZMQ's reconnect and is answered on it; once a reconnect fails (the router
    gone for good), a request raises ClusterGone after that one attempt."""
    context = zmq.Context.instance()
    first = context.socket(zmq.ROUTER)
    first.setsockopt(zmq.LINGER, 0)
    port = first.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    second = context.socket(zmq.ROUTER)
    second.setsockopt(zmq.LINGER, 0)
    with _slowly_reconnecting_client(endpoint, Client) as client:
        client.send_raw(encode(StatsRequest(0)))
        assert first.poll(5000)
        first.close()  # the client is dropped
        with pytest.raises(ClusterGone):  # what was in flight is gone with the connection
            client.receive()
        _rebind(second, endpoint)
        answering = threading.Thread(target=_answer_stats, args=(second,))
        answering.start()
        assert client.stats().requests_in_flight == 3  # it went out on the new connection
        answering.join()
        second.close()  # and now nothing comes back
        time.sleep(0.05)  # the monitor reports the disconnect
        started = time.monotonic()
        with pytest.raises(ClusterGone):
            client.stats()
        assert time.monotonic() - started < 5  # one failed reconnect, 1-2 s, not the timeout


def test_an_async_send_after_a_drop_goes_out_once_zmq_reconnects() -> None:
    """A router that dropped this client (its heartbeats stopped while its process was stopped)
    takes ZMQ's reconnect at once: a request made while the connection is down waits for it and
    goes out on it, instead of ClusterGone from a healthy cluster. Once nothing takes the
    reconnect (the router gone for good), a request raises ClusterGone after that one attempt.
    Reconnects come 1-2 s apart here, so that the test's own steps fit before the first."""
    context = zmq.Context.instance()
    first = context.socket(zmq.ROUTER)
    first.setsockopt(zmq.LINGER, 0)
    port = first.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    client = _slowly_reconnecting_client(endpoint, AsyncClient)
    second = context.socket(zmq.ROUTER)
    second.setsockopt(zmq.LINGER, 0)

    async def main() -> None:
        try:
            ask = asyncio.create_task(client.stats())
            assert await asyncio.to_thread(first.poll, 5000)
            first.close()  # the client is dropped
            with pytest.raises(ClusterGone):  # what was in flight is gone with the connection
                await asyncio.wait_for(ask, 10)
            _rebind(second, endpoint)
            again = asyncio.create_task(client.stats(timeout=10))
            await asyncio.to_thread(_answer_stats, second)  # it went out on the new connection
            assert (await again).requests_in_flight == 3
            second.close()  # and now nothing comes back
            await asyncio.sleep(0.05)  # the monitor reports the disconnect
            started = time.monotonic()
            with pytest.raises(ClusterGone):
                await asyncio.wait_for(client.stats(), 10)
            assert time.monotonic() - started < 5  # one failed reconnect, 1-2 s, not the timeout
        finally:
            client.close()

    asyncio.run(main())


def test_closing_an_async_client_ends_a_send_waiting_for_its_reconnect() -> None:
    """A call waiting for the reconnect of a dropped connection ends with ClientClosed when the
    client closes, not ClusterGone after the wait."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = _slowly_reconnecting_client(f"tcp://127.0.0.1:{port}", AsyncClient)

    async def main() -> None:
        ask = asyncio.create_task(client.stats())
        assert await asyncio.to_thread(router.poll, 5000)
        router.close()
        with pytest.raises(ClusterGone):
            await asyncio.wait_for(ask, 10)
        again = asyncio.create_task(client.stats())
        await asyncio.sleep(0.1)
        assert not again.done()  # waiting for the reconnect
        client.close()
        with pytest.raises(ClientClosed):
            await asyncio.wait_for(again, 1)

    asyncio.run(main())


def test_an_id_the_router_makes_is_not_one_the_client_is_using(rig: RouterRig) -> None:
    """A generate without a request_id gets one from the router ("req-N"); a client that names
    its own requests that way must not see its unnamed one refused as a duplicate."""
    sampling = Sampling(max_tokens=4)
    # The router's ids count from 0, and the first request's own internal id takes 0.
    rig.client.send(encode(Generate(request_id="req-1", token_ids=[5, 6, 7], sampling=sampling)))
    rig.client.send(encode(Generate(token_ids=[5, 6, 7], sampling=sampling)))
    assert rig.replies() == []  # nothing refused
    assert len([m for m in rig.received("prefill", 0) if isinstance(m, WorkRequest)]) == 2


def test_a_named_request_id_already_running_is_still_refused(rig: RouterRig) -> None:
    """The router renames only requests the client left unnamed: its own id, running already,
    is a duplicate, not renamed and served."""
    generate = Generate(request_id="x", token_ids=[5, 6, 7], sampling=Sampling(max_tokens=4))
    rig.client.send(encode(generate))
    rig.client.send(encode(generate))
    (refused,) = rig.replies()
    assert isinstance(refused, Error) and (refused.request_id, refused.code) == ("x", "duplicate_request_id")
    assert len([m for m in rig.received("prefill", 0) if isinstance(m, WorkRequest)]) == 1


def test_the_asyncio_client_is_an_async_context_manager(rig: RouterRig) -> None:
    """``async with AsyncClient(...)``, as ``with Client(...)``: the client is closed on the way
    out, an error or not."""

    async def main() -> AsyncClient:
        async with AsyncClient(rig.router.addresses.client, timeout=2.0) as client:
            pass
        return client

    client = asyncio.run(main())
    with pytest.raises(zmq.ZMQError):  # closed: nothing more goes out
        client._socket.send(b"")


@pytest.mark.parametrize("named", [True, False])
def test_a_router_bug_while_dispatching_ends_the_request_once_and_frees_its_id(
    rig: RouterRig, monkeypatch: pytest.MonkeyPatch, named: bool
) -> None:
    """An exception after the request was registered (in dispatch) answers ``internal_error``
    and ends the request: its id is free again, and a later drop of the client sends nothing.
    Also for a request the router named (no request_id given), which used to stay registered
    and get an error without its id."""

    def broken(request_id: str) -> None:
        raise RuntimeError("a bug")

    with monkeypatch.context() as patch:
        patch.setattr(rig.router, "_dispatch", broken)
        request_id = "x" if named else None
        rig.client.send(encode(Generate(request_id, token_ids=[5, 6, 7], sampling=Sampling(max_tokens=1))))
        (reply,) = rig.replies()
    assert isinstance(reply, Error) and reply.code == "internal_error"
    assert reply.request_id == "x" if named else reply.request_id.startswith("req-")
    assert rig.router.requests == {} and rig.router.client_load == {}
    rig.client.send(encode(Generate("x", token_ids=[5, 6, 7], sampling=Sampling(max_tokens=1))))
    rig.pump()
    rig.worker(TokenOutputs([TokenOutput(_work(rig).request_id, 0, [11], True, "length")]))
    *_, final = rig.replies()
    assert isinstance(final, Final) and final.token_ids == [11]
