"""KV transfer over torch.distributed point-to-point: NCCL on GPUs, gloo on CPUs, one code path.

Sender: gather the request's blocks, sliced to each piece's heads, into one contiguous buffer
per destination rank (one message per request per destination, never one per block; or one per
layer range with ``layer_groups > 1``, so that gathering, wire and scattering overlap), then
``isend``. The gather runs on the compute stream, so a later step that reuses those blocks is
ordered after it: the engine may free the blocks as soon as ``send`` returns. The buffer lives
until the send completes (counted in ``staging_bytes``, as the rank of the side that packs the
most would count it: the leader checks the bound for all).

Receiver: ``irecv`` one buffer per piece, then scatter it into the rank's own, differently
numbered blocks when the receive completes. The buffers count in ``staging_bytes`` until then.

Sync backends wait before returning; async ones return at once and are polled.

With a ``PairRendezvous`` in the topology the backend forms a process group of its own for its
(prefill group, decode group) pair, in a background thread (the survivors of a restart keep
serving while the restarted group loads its model); a transfer waits for it. On gloo a peer's
death fails the transfers in flight (``TransferFailed``), and since gloo misses a death in the
middle of a message, so does a wait longer than the pair's ``transfer_timeout_s``. NCCL's works
never notice a dead peer: there they fail once the leader hears the peer group failed
(``abandon``).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from pdserve.engine.parallel import split_range
from pdserve.kvtransfer.base import (
    BackendTraits,
    PairRendezvous,
    Transfer,
    TransferBackend,
    TransferConfig,
    TransferFailed,
    TransferStats,
    TransferTopology,
    register_backend,
)


class _TorchTransfer(Transfer):
    def __init__(
        self,
        works: list[dist.Work],
        buffers: list[torch.Tensor],
        on_complete: list[tuple[torch.Tensor, slice, slice, torch.Tensor]],
        kv_cache: torch.Tensor,
        release: Callable[[], None],  # once: the buffers stop counting as staged
        start_event: torch.cuda.Event | None,
        timeout_s: float = math.inf,
    ) -> None:
        self.works = works
        self.timeout_s = timeout_s
        self.start_event = start_event
        self.buffers = buffers
        self.num_bytes = sum(b.numel() * b.element_size() for b in buffers)
        self.on_complete = on_complete  # receiver: (buffer, layers, heads, block index) per work
        self.kv_cache = kv_cache
        self.release = release
        self.started = time.perf_counter()
        self.stats: TransferStats | None = None
        self.error: TransferFailed | None = None
        self.discarded = False
        self._cut: str | None = None  # why the helper thread's wait failed
        # gloo's send/recv works only learn they are complete inside wait(): a helper thread
        # waits for them so that polling stays non-blocking. NCCL works answer is_completed().
        self._landed: threading.Event | None = None
        if kv_cache.device.type == "cpu":
            self._landed = threading.Event()
            threading.Thread(target=self._wait_works, daemon=True).start()

    def _wait_works(self) -> None:
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as e:  # the peer died: gloo closes the connection
            self._cut = f"KV transfer cut off: {e}"
        assert self._landed is not None
        self._landed.set()

    def done(self) -> bool:
        if self.done_already:
            return True
        landed = self._landed.is_set() if self._landed is not None else all(w.is_completed() for w in self.works)
        if not landed:
            return False
        with contextlib.suppress(TransferFailed):
            self.wait()
        return True

    def fail(self, reason: str) -> None:
        """Cut off: never scatter; the buffers stop counting now (the works keep them alive)."""
        if self.stats is None and self.error is None:
            self.error = TransferFailed(reason)
            self.release()
            self.on_complete = []

    @property
    def done_already(self) -> bool:
        """Settled (complete or failed) without polling the wire."""
        return self.stats is not None or self.error is not None

    def discard(self) -> None:
        self.discarded = True
        self.on_complete = []  # whatever lands later is never written into the cache

    def wait(self) -> TransferStats:
        if self.stats is None and self.error is None and self._landed is not None:
            left = self.timeout_s - (time.perf_counter() - self.started)
            if not self._landed.wait(None if left >= threading.TIMEOUT_MAX else max(0.0, left)):
                # The helper thread keeps the works, and so the buffers, until gloo lets go.
                self.fail(f"KV transfer not complete after {self.timeout_s:g} s")
            elif self._cut is not None:
                self.fail(self._cut)
        if self.error is not None:
            raise self.error
        if self.stats is None:
            for i, work in enumerate(self.works):
                if self._landed is None:
                    work.wait()  # makes the current stream wait for this message only, so the
                    # scatter of one layer range overlaps the arrival of the next
                if self.on_complete:
                    buffer, layers, heads, blocks = self.on_complete[i]
                    # index_copy_ through the view: one kernel, faster than an index_put.
                    self.kv_cache[layers, :, :, :, heads].index_copy_(2, blocks, buffer)
            events = None
            if self.start_event is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()  # after the scatter (receiver) or the send (the stream waited for it)
                events = (self.start_event, end)
            self.stats = TransferStats(self.num_bytes, time.perf_counter() - self.started, events)
            self.release()
            self.buffers, self.on_complete = [], []
        return self.stats


class TorchDistributedBackend(TransferBackend):
    def __init__(
        self, config: TransferConfig, topology: TransferTopology, kv_cache: torch.Tensor, is_async: bool
    ) -> None:
        super().__init__(config, topology, kv_cache)
        self.is_async = is_async
        self._staged_blocks = 0
        me = topology.tp_rank
        plan = topology.plan()
        # Every rank of a side moves the same blocks, one buffer per piece of the plan, but where
        # the TP degree does not divide the KV heads they hold different numbers of them. The
        # leader checks the staging bound for the whole group, so it counts the rank that packs
        # the most (with a replicated head packed once per piece).
        heads_per_rank: dict[int, int] = {}
        for piece in plan:
            side_rank = piece.src_rank if topology.is_prefill else piece.dst_rank
            heads_per_rank[side_rank] = heads_per_rank.get(side_rank, 0) + piece.num_heads
        self._most_heads = max(heads_per_rank.values(), default=0)
        if topology.is_prefill:
            shard = topology.src_shard(me)
            self._pieces = [
                (topology.decode_ranks[p.dst_rank], p.src_slice(shard), p.num_heads) for p in plan if p.src_rank == me
            ]
        else:
            shard = topology.dst_shard(me)
            self._pieces = [
                (topology.prefill_ranks[p.src_rank], p.dst_slice(shard), p.num_heads) for p in plan if p.dst_rank == me
            ]
        self._pending: list[_TorchTransfer] = []
        num_layers = kv_cache.shape[0]
        groups = min(config.layer_groups, num_layers)
        self._layer_ranges = [slice(*split_range(num_layers, groups, g)) for g in range(groups)]
        self._group: dist.ProcessGroup | None = None
        self._group_error: BaseException | None = None
        self._abandoned = False
        self._connecting: threading.Thread | None = None
        self._timeout_s = math.inf if topology.rendezvous is None else topology.rendezvous.transfer_timeout_s
        if topology.rendezvous is not None:
            self._connecting = threading.Thread(target=self._connect, args=(topology.rendezvous,), daemon=True)
            self._connecting.start()

    def _connect(self, rendezvous: PairRendezvous) -> None:
        """Form the pair's own process group (every rank of both groups calls it), then open the
        connections (``warm_up``)."""
        try:
            timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
            store = rendezvous.connect_store()
            size = len(self.topology.prefill_ranks) + len(self.topology.decode_ranks)
            rank = self.topology.global_rank
            if self.kv_cache.device.type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self._group = dist.ProcessGroupNCCL(store, rank, size, options)
            else:
                self._group = dist.ProcessGroupGloo(store, rank, size, timeout)
            self._probe()
        except Exception as e:  # whatever it is (torch's store errors are RuntimeErrors), the pair is down
            self._group_error = e

    def _await_group(self) -> None:
        if self._connecting is not None:
            self._connecting.join()
            self._connecting = None
        if self._abandoned or self._group_error is not None:
            raise TransferFailed(f"no KV connection to the peer group: {self._group_error or 'abandoned'}")

    def connected(self) -> bool:
        if self._abandoned or self._group_error is not None:
            return False
        return self._connecting is None or not self._connecting.is_alive()

    def _isend(self, tensor: torch.Tensor, peer: int) -> dist.Work:
        if self._group is not None:
            return self._group.send([tensor], peer, 0)
        return dist.isend(tensor, dst=peer)

    def _irecv(self, tensor: torch.Tensor, peer: int) -> dist.Work:
        if self._group is not None:
            return self._group.recv([tensor], peer, 0)
        return dist.irecv(tensor, src=peer)

    @property
    def staging_bytes(self) -> int:
        for transfer in self._pending:  # discarded transfers release their buffers once the wire is done
            if transfer.discarded:
                transfer.done()
        return self._staged_blocks * self.staged_block_bytes()

    def staged_block_bytes(self) -> int:
        """The most any rank of this side packs for one block: one buffer per piece, so a head
        sent to several decode ranks is packed once for each."""
        return self.block_bytes() // self.kv_cache.shape[4] * self._most_heads

    def _release(self, num_blocks: int) -> None:
        self._staged_blocks -= num_blocks

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64).to(self.kv_cache.device, non_blocking=True)

    def _start_event(self) -> torch.cuda.Event | None:
        if self.kv_cache.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def send(self, block_ids: list[int]) -> Transfer:
        self._await_group()
        start = self._start_event()
        blocks = self._index(block_ids)
        buffers, works = [], []
        try:
            for peer, heads, _ in self._pieces:
                for layers in self._layer_ranges:
                    packed = self.kv_cache[layers, :, :, :, heads].index_select(2, blocks)  # contiguous
                    buffers.append(packed)
                    works.append(self._isend(packed, peer))
        except RuntimeError as e:
            return self._cut_off(e)
        transfer = _TorchTransfer(
            works, buffers, [], self.kv_cache, functools.partial(self._release, len(block_ids)), start, self._timeout_s
        )
        return self._finish(transfer, len(block_ids))

    def recv(self, block_ids: list[int], src_block_ids: list[int]) -> Transfer:
        self._await_group()
        start = self._start_event()
        blocks = self._index(block_ids)
        _, _, _, block_size, _, head_dim = self.kv_cache.shape
        buffers, works, scatters = [], [], []
        try:
            for peer, heads, num_heads in self._pieces:
                for layer_range in self._layer_ranges:
                    buffer = torch.empty(
                        layer_range.stop - layer_range.start,
                        2,
                        len(block_ids),
                        block_size,
                        num_heads,
                        head_dim,
                        dtype=self.kv_cache.dtype,
                        device=self.kv_cache.device,
                    )
                    buffers.append(buffer)
                    works.append(self._irecv(buffer, peer))
                    scatters.append((buffer, layer_range, heads, blocks))
        except RuntimeError as e:
            return self._cut_off(e)
        release = functools.partial(self._release, len(block_ids))
        transfer = _TorchTransfer(works, buffers, scatters, self.kv_cache, release, start, self._timeout_s)
        return self._finish(transfer, len(block_ids))

    def _cut_off(self, error: RuntimeError) -> Transfer:
        """A transfer whose post failed (gloo: the peer's connection is already reset, before the
        router's ``peer_failed`` got here): failed at once, like one cut off in flight."""
        transfer = _TorchTransfer([], [], [], self.kv_cache, functools.partial(self._release, 0), None)
        transfer.fail(f"KV transfer cut off: {error}")
        return transfer

    def _finish(self, transfer: _TorchTransfer, num_blocks: int) -> Transfer:
        self._staged_blocks += num_blocks  # released by the transfer's wait()
        if not self.is_async:
            with contextlib.suppress(TransferFailed):  # the handle reports it: done, and its wait raises
                transfer.wait()
        else:
            # A discarded transfer goes once landed (its buffers with it), never scattered.
            self._pending = [t for t in self._pending if not (t.discarded and t.done()) and not t.done_already]
            self._pending.append(transfer)
        return transfer

    def warm_up(self) -> None:
        if self.topology.rendezvous is None:  # a pair group opens its connections as it forms
            self._probe()

    def _probe(self) -> None:
        probe = torch.zeros(1, dtype=self.kv_cache.dtype, device=self.kv_cache.device)
        op = self._isend if self.topology.is_prefill else self._irecv
        works = [op(probe.clone(), peer) for peer, _, _ in self._pieces]
        for work in works:
            work.wait()
        if self.kv_cache.device.type == "cuda":
            torch.cuda.synchronize(self.kv_cache.device)

    def abandon(self) -> None:
        self._abandoned = True
        for transfer in self._pending:
            transfer.fail("the peer group failed")
        self._pending = []

    def close(self) -> None:
        if self._abandoned or not self.connected():
            self.abandon()
            return
        for transfer in self._pending:
            with contextlib.suppress(TransferFailed):
                transfer.wait()
        self._pending = []


# NCCL refuses a communicator with two ranks on one GPU.
for _device, _collectives in (("cpu", "gloo"), ("cuda", "nccl")):
    for _async in (False, True):
        register_backend(
            _collectives + "-async" * _async,
            BackendTraits(_device, blocking=not _async, shares_gpu=_device == "cpu"),
        )(lambda c, t, kv, _a=_async: TorchDistributedBackend(c, t, kv, is_async=_a))
