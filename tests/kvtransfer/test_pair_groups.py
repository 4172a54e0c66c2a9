"""KV transfer over a pair's own process group (``PairRendezvous``), between real processes:
a discarded receive never writes what lands later, the pair keeps its order afterwards, a
peer's death fails the transfers in flight instead of hanging them, and a restarted peer is
reached again through ``KVTransferAgent``'s drop and reconnect."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pdserve.cluster.group import connect_store, free_port
from pdserve.kvtransfer.agent import KVTransferAgent
from pdserve.kvtransfer.base import (
    PairRendezvous,
    Transfer,
    TransferBackend,
    TransferConfig,
    TransferFailed,
    TransferTopology,
    create_backend,
)
from pdserve.kvtransfer.torch_dist import _TorchTransfer

SHAPE = (2, 2, 9, 4, 2, 8)  # layers, K/V, blocks (8 + the dummy), block size, KV heads, head dim
TIMEOUT_S = 60.0


def _backend(port: int, prefix: str, is_prefill: bool, cache: torch.Tensor) -> TransferBackend:
    topology = TransferTopology(
        4, 2, (0,), (1,), 0 if is_prefill else 1, PairRendezvous("127.0.0.1", port, prefix, TIMEOUT_S)
    )
    return create_backend(TransferConfig("gloo-async"), topology, cache)


def _store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _prefill(port: int, generation: int, die: bool) -> None:
    torch.set_num_threads(1)
    store = _store(port)
    cache = (
        torch.arange(SHAPE[2], dtype=torch.float32).view(1, 1, -1, 1, 1, 1).expand(SHAPE).contiguous()
    )  # block b holds b
    backend = _backend(port, f"kv/g{generation}/", True, cache)
    store.wait(["discarded"])  # the decode side gave its first receive up before this one is sent
    backend.send([1, 2]).wait()
    backend.send([3]).wait()
    if die:
        store.set("dying", "1")
        os._exit(1)
    store.wait(["done"])


def _run(port: int, generation: int, die: bool) -> mp.Process:
    proc = mp.get_context("spawn").Process(target=_prefill, args=(port, generation, die))
    proc.start()
    return proc


@pytest.mark.slow
def test_a_discarded_receive_never_writes_a_dead_peer_fails_fast_and_a_new_generation_connects() -> None:
    port = free_port()
    store = connect_store(f"tcp://127.0.0.1:{port}", serve=True)
    generations = {0: 0}
    cache = torch.zeros(SHAPE)

    def connect(peer_group: int, generation: int) -> TransferBackend:
        return _backend(port, f"kv/g{generation}/", False, cache)

    agent = KVTransferAgent({0: connect(0, 0)}, 2**30, connect=connect)
    first = _run(port, generations[0], die=True)
    try:
        agent.recv("late", [5, 6], 0)  # its lease "expires" before the data comes
        agent.discard("late")
        store.set("discarded", "1")
        agent.recv("next", [0], 0)
        agent.wait("next")
        # The late data (blocks 1 and 2 of the sender) landed before the next transfer's, and went
        # nowhere: polling settles the discarded receive (its buffer goes) without writing it.
        assert agent.staging_bytes() == 0
        assert torch.equal(cache[:, :, 0], torch.full(cache[:, :, 0].shape, 3.0))
        assert not cache[:, :, 5:7].any()
        store.wait(["dying"])
        agent.recv("cut", [7], 0)  # the sender is dead: it fails instead of hanging
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=20)
        while not agent.done("cut"):
            assert datetime.datetime.now() < deadline, "a receive from a dead peer hangs"
            time.sleep(0.05)
        with pytest.raises(TransferFailed):
            agent.wait("cut")
        assert agent.staging_bytes() == 0
        # The peer restarts as generation 1: drop the old pair, connect the new one.
        agent.drop(0)
        agent.reconnect(0, 1)
        second = _run(port, 1, die=False)
        store.set("discarded", "1")
        agent.recv("a", [5, 6], 0)
        agent.recv("b", [7], 0)
        agent.wait("a"), agent.wait("b")
        assert torch.equal(cache[:, :, 5], torch.full(cache[:, :, 5].shape, 1.0))
        assert torch.equal(cache[:, :, 7], torch.full(cache[:, :, 7].shape, 3.0))
        assert agent.connected(0)
        store.set("done", "1")
        second.join(30)
        assert second.exitcode == 0
    finally:
        for proc in (first, locals().get("second")):
            if proc is not None and proc.is_alive():
                proc.kill()
        agent.close()


BIG_SHAPE = (2, 2, 257, 64, 2, 128)  # 256 blocks of 256 KiB: far more than the sockets' buffers hold
WIRE_TIMEOUT_S = 2.0


def _big_backend(port: int, is_prefill: bool, cache: torch.Tensor) -> TransferBackend:
    rendezvous = PairRendezvous("127.0.0.1", port, "kv/big/", TIMEOUT_S, transfer_timeout_s=WIRE_TIMEOUT_S)
    topology = TransferTopology(4, 2, (0,), (1,), 0 if is_prefill else 1, rendezvous)
    return create_backend(TransferConfig("gloo"), topology, cache)


def _big_sender(port: int) -> None:
    torch.set_num_threads(1)
    store = _store(port)
    backend = _big_backend(port, True, torch.ones(BIG_SHAPE))
    store.wait(["send"])
    backend.send(list(range(BIG_SHAPE[2] - 1)))  # the receiver is stopped: this blocks, and is killed


def _big_receiver(port: int) -> None:
    torch.set_num_threads(1)
    store = _store(port)
    backend = _big_backend(port, False, torch.zeros(BIG_SHAPE))
    while not backend.connected():
        time.sleep(0.05)
    store.set("connected", "1")
    transfer = backend.recv(list(range(BIG_SHAPE[2] - 1)), [])  # sync gloo: returns once settled
    store.set("failed", "1" if transfer.done() and _raises(transfer) else "0")


def _raises(transfer: Transfer) -> bool:
    try:
        transfer.wait()
    except TransferFailed:
        return True
    return False


@pytest.mark.slow
def test_a_sender_killed_mid_message_fails_the_receive_within_the_transfer_timeout() -> None:
    """gloo never fails a receive whose sender died with part of its message on the wire: it
    waits for the pair group's timeout (a restarted peer's start-up). A sync receive would hold
    its decode leader, deaf to the router, that long: it fails after the transfer timeout."""
    port = free_port()
    store = connect_store(f"tcp://127.0.0.1:{port}", serve=True)
    ctx = mp.get_context("spawn")
    sender, receiver = ctx.Process(target=_big_sender, args=(port,)), ctx.Process(target=_big_receiver, args=(port,))
    sender.start(), receiver.start()
    try:
        store.wait(["connected"])
        time.sleep(1.0)  # the receive is posted; then the receiver stops reading
        os.kill(receiver.pid, signal.SIGSTOP)
        store.set("send", "1")
        time.sleep(2.0)  # the sender fills the sockets' buffers and blocks mid-message
        assert sender.is_alive()
        sender.kill()
        sender.join()
        os.kill(receiver.pid, signal.SIGCONT)
        deadline = time.monotonic() + WIRE_TIMEOUT_S + 15
        while not store.check(["failed"]):
            assert time.monotonic() < deadline, "a receive cut off mid-message hangs"
            time.sleep(0.1)
        assert store.get("failed") == b"1"
    finally:
        for proc in (sender, receiver):
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.join()


class _HeldWork:
    """A gloo work that completes when the test lets it."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def wait(self) -> None:
        self.released.wait()


def test_a_transfer_timeout_beyond_what_a_wait_takes_means_no_timeout() -> None:
    """--kv-lease-timeout is any positive number: one past the longest wait Python's locks
    take must not make every transfer fail."""
    work = _HeldWork()
    transfer = _TorchTransfer([work], [], [], torch.zeros(1), lambda: None, None, timeout_s=1e12)
    threading.Timer(0.2, work.released.set).start()
    assert transfer.wait().num_bytes == 0
