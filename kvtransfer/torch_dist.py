"""KV transfer over torch.distributed point-to-point: NCCL on GPUs, gloo on CPUs, one code path.

Sender: gather the request's blocks, sliced to each piece's heads, into one contiguous buffer
per destination rank (one message per request per destination, never one per block; or one per
layer range with ``layer_groups > 1``, so that gathering, wire and scattering overlap), then
``isend``. The gather runs on the compute stream, so a later step that reuses those blocks is
ordered after it: the engine may free the blocks as soon as ``send`` returns. The buffer lives
until the send completes (counted in ``staging_bytes``).

Receiver: ``irecv`` one buffer per piece, then scatter it into the rank's own, differently
numbered blocks when the receive completes. The buffers count in ``staging_bytes`` until then.

Sync backends wait before returning; async ones return at once and are polled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from pdserve.engine.parallel import split_range
from pdserve.kvtransfer.base import (
    Transfer,
    TransferBackend,
    TransferConfig,
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
        release: Callable[[int], None],
        start_event: torch.cuda.Event | None,
    ) -> None:
        self.works = works
        self.start_event = start_event
        self.buffers = buffers
        self.num_bytes = sum(b.numel() * b.element_size() for b in buffers)
        self.on_complete = on_complete  # receiver: (buffer, layers, heads, block index) per work
        self.kv_cache = kv_cache
        self.release = release
        self.started = time.perf_counter()
        self.stats: TransferStats | None = None
        # gloo's send/recv works only learn they are complete inside wait(): a helper thread
        # waits for them so that polling stays non-blocking. NCCL works answer is_completed().
        self._landed: threading.Event | None = None
        if kv_cache.device.type == "cpu":
            self._landed = threading.Event()
            threading.Thread(target=self._wait_works, daemon=True).start()

    def _wait_works(self) -> None:
        for work in self.works:
            work.wait()
        assert self._landed is not None
        self._landed.set()

    def done(self) -> bool:
        if self.stats is not None:
            return True
        landed = self._landed.is_set() if self._landed is not None else all(w.is_completed() for w in self.works)
        if not landed:
            return False
        self.wait()
        return True

    def wait(self) -> TransferStats:
        if self.stats is None:
            if self._landed is not None:
                self._landed.wait()
            for i, work in enumerate(self.works):
                if self._landed is None:
                    work.wait()  # makes the current stream wait for this message only, so the
                    # scatter of one layer range overlaps the arrival of the next
                if self.on_complete:
                    buffer, layers, heads, blocks = self.on_complete[i]
                    # index_copy_ through the view: one kernel, ~30% faster than an index_put.
                    self.kv_cache[layers, :, :, :, heads].index_copy_(2, blocks, buffer)
            events = None
            if self.start_event is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()  # after the scatter (receiver) or the send (the stream waited for it)
                events = (self.start_event, end)
            self.stats = TransferStats(self.num_bytes, time.perf_counter() - self.started, events)
            self.release(self.num_bytes)
            self.buffers, self.on_complete = [], []
        return self.stats


class TorchDistributedBackend(TransferBackend):
    def __init__(
        self, config: TransferConfig, topology: TransferTopology, kv_cache: torch.Tensor, is_async: bool
    ) -> None:
        super().__init__(config, topology, kv_cache)
        self.is_async = is_async
        self._staging = 0
        me = topology.tp_rank
        plan = topology.plan()
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

    @property
    def staging_bytes(self) -> int:
        return self._staging

    def _release(self, num_bytes: int) -> None:
        self._staging -= num_bytes

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64).to(self.kv_cache.device, non_blocking=True)

    def _start_event(self) -> torch.cuda.Event | None:
        if self.kv_cache.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def send(self, block_ids: list[int]) -> Transfer:
        start = self._start_event()
        blocks = self._index(block_ids)
        buffers, works = [], []
        for peer, heads, _ in self._pieces:
            for layers in self._layer_ranges:
                packed = self.kv_cache[layers, :, :, :, heads].index_select(2, blocks)  # contiguous
                buffers.append(packed)
                works.append(dist.isend(packed, dst=peer))
        return self._finish(_TorchTransfer(works, buffers, [], self.kv_cache, self._release, start))

    def recv(self, block_ids: list[int], src_block_ids: list[int]) -> Transfer:
        start = self._start_event()
        blocks = self._index(block_ids)
        _, _, _, block_size, _, head_dim = self.kv_cache.shape
        buffers, works, scatters = [], [], []
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
                works.append(dist.irecv(buffer, src=peer))
                scatters.append((buffer, layer_range, heads, blocks))
        return self._finish(_TorchTransfer(works, buffers, scatters, self.kv_cache, self._release, start))

    def _finish(self, transfer: _TorchTransfer) -> Transfer:
        self._staging += transfer.num_bytes  # released by the transfer's wait()
        if not self.is_async:
            transfer.wait()
        else:
            self._pending = [t for t in self._pending if t.stats is None]
            self._pending.append(transfer)
        return transfer

    def warm_up(self) -> None:
        probe = torch.zeros(1, dtype=self.kv_cache.dtype, device=self.kv_cache.device)
        op = dist.isend if self.topology.is_prefill else dist.irecv
        works = [op(probe.clone(), peer) for peer, _, _ in self._pieces]
        for work in works:
            work.wait()
        if self.kv_cache.device.type == "cuda":
            torch.cuda.synchronize(self.kv_cache.device)

    def close(self) -> None:
        for transfer in self._pending:
            transfer.wait()
        self._pending = []


for _name, _async in (("gloo", False), ("gloo-async", True), ("nccl", False), ("nccl-async", True)):
    register_backend(_name)(lambda c, t, kv, _a=_async: TorchDistributedBackend(c, t, kv, is_async=_a))
