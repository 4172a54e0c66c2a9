"""KV transfer by direct copies between the pools of ranks on one host: CUDA IPC on GPUs (the
same GPU, or GPUs with peer access), POSIX shared memory on CPUs.

Every rank publishes its KV pool, as a handle in its pair's rendezvous store
(``PairRendezvous``): a CUDA IPC memory handle (``torch.multiprocessing``'s own reduction) on
GPUs; on CPUs the pool moves into shared memory and the handle names its file descriptor. The
decode group's leader opens the pools of the prefill ranks it receives from and of its own
group's ranks, in the background (a restarted peer group may still be loading its model:
``connected`` says when the pools are open), and compiles the copy kernel there too
(``compile_copies``). For each request it
then copies every piece of the resharding plan straight from the prefill blocks into the decode
blocks (``kernels.kv_copy``: one launch per piece, no staging buffer), on a stream of its own
that first waits for the work already queued on the compute stream. On GPUs a request of up to
``_GRAPH_MAX_BLOCKS`` blocks is issued by replaying a CUDA graph of the id upload and the
copies (``CopyGraphs``), which costs the host a fraction of the eager launches.

The leader copies for the whole group, so that one event tells when the group's KV is in place:
the decode leader polls it, and only then tells the prefill side, which frees the blocks
(``pulls``). A prefill rank's ``send`` and a decode peer's ``recv`` have nothing to do. The
prefill KV is complete when its leader announces it: the first token it sampled came after
every rank's forward, the writes of the KV included.
"""

from __future__ import annotations

import functools
import math
import os
import pickle
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from pdserve.kernels.kv_copy import PagedKVCopy, paged_kv_copy_ref
from pdserve.kvtransfer.base import (
    BackendTraits,
    Transfer,
    TransferBackend,
    TransferConfig,
    TransferFailed,
    TransferStats,
    TransferTopology,
    register_backend,
)

_POOL_KEY = "pdserve/kv-pool/{rank}"
# Pulls of more blocks go eagerly: their copies take long enough that issuing them is no cost.
_GRAPH_MAX_BLOCKS = 512
# Pulls queued at once that graphs take; more wait for the compute stream together only under
# load, when the eager path's host cost hides behind the steps.
_GRAPH_SLOTS = 4


class _Landed(Transfer):
    """A transfer this rank has nothing (more) to do for."""

    def __init__(self, stats: TransferStats) -> None:
        self.stats = stats

    def done(self) -> bool:
        return True

    def wait(self) -> TransferStats:
        return self.stats


class _Copy(Transfer):
    """The decode leader's copies of one request, complete when their end event is."""

    def __init__(
        self, num_bytes: int, start: torch.cuda.Event, end: torch.cuda.Event, keep: list[torch.Tensor]
    ) -> None:
        self.num_bytes = num_bytes
        self.events = (start, end)
        self.keep = keep  # block-id tensors the copies read, alive until they ran
        self.started = time.perf_counter()
        self.stats: TransferStats | None = None

    def done(self) -> bool:
        if self.stats is None and self.events[1].query():
            self.wait()
        return self.stats is not None

    def wait(self) -> TransferStats:
        if self.stats is None:
            self.events[1].synchronize()
            self.stats = TransferStats(self.num_bytes, time.perf_counter() - self.started, self.events)
            self.keep = []
        return self.stats

    def discard(self) -> None:
        """Given up: the copies are short and already queued, so let them finish now, before the
        blocks they write are handed out again."""
        self.wait()


def publish_pool(store: dist.Store, global_rank: int, kv_cache: torch.Tensor) -> None:
    """Make this rank's pool openable by the other processes of the host (once per rank)."""
    key = _POOL_KEY.format(rank=global_rank)
    if store.check([key]):
        return
    if kv_cache.is_cuda:
        rebuild, args = reduce_tensor(kv_cache)
        assert rebuild is rebuild_cuda_tensor
        handle = ("cuda", args)
    else:
        kv_cache.share_memory_()  # in place: every view of the pool (the layers' caches) follows
        fd, _ = kv_cache.untyped_storage()._share_fd_cpu_()
        handle = ("cpu", (os.getpid(), fd, tuple(kv_cache.shape), kv_cache.dtype))
    # A pickle, read back only by ranks of this cluster through a store bound to loopback.
    store.set(key, pickle.dumps(handle))


def open_pool(store: dist.Store, global_rank: int) -> torch.Tensor:
    """Rank ``global_rank``'s pool, mapped into this process (waits until it is published)."""
    kind, args = pickle.loads(store.get(_POOL_KEY.format(rank=global_rank)))
    if kind == "cuda":
        return rebuild_cuda_tensor(*args)
    pid, fd, shape, dtype = args
    return torch.from_file(f"/proc/{pid}/fd/{fd}", shared=True, size=math.prod(shape), dtype=dtype).view(shape)


class IpcBackend(TransferBackend):
    """The decode leader pulls; see the module docstring."""

    pulls = True

    def __init__(self, config: TransferConfig, topology: TransferTopology, kv_cache: torch.Tensor) -> None:
        super().__init__(config, topology, kv_cache)
        if topology.rendezvous is None:
            raise ValueError(f"the {config.backend} backend needs its pair's rendezvous store")
        self.store = topology.rendezvous.connect_store()
        publish_pool(self.store, topology.global_rank, kv_cache)
        self._copies = not topology.is_prefill and topology.tp_rank == 0
        self._copiers: list[Callable[[torch.Tensor, torch.Tensor], None]] = []  # one per piece
        self._bytes_per_block = 0  # over every piece
        self._stream: torch.cuda.Stream | None = None
        self._graphs: CopyGraphs | None = None  # made by the first pull, on the decode leader's thread
        self._opened = threading.Event()
        self._open_error: BaseException | None = None
        if self._copies:
            threading.Thread(target=self._open_pools, daemon=True).start()
        else:
            self._opened.set()

    def connected(self) -> bool:
        return self._opened.is_set() and self._open_error is None

    def warm_up(self) -> None:
        """Wait until the pools are open."""
        self._opened.wait()
        if self._open_error is not None:
            raise TransferFailed(f"cannot open the peer group's KV pools: {self._open_error}")

    def abandon(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()  # no queued copy may read a pool that is unmapped now
        self._copiers = []
        self._graphs = None

    def _open_pools(self) -> None:
        """The decode leader maps every pool it copies between (each waits until published)."""
        try:
            self._map_pools()
        except (RuntimeError, OSError) as e:
            self._open_error = e
        finally:
            self._opened.set()

    def _map_pools(self) -> None:
        t = self.topology
        if self.kv_cache.is_cuda:
            torch.cuda.set_device(self.kv_cache.device)  # this thread's current device
        pools = {t.decode_ranks[0]: self.kv_cache}
        for piece in t.plan():
            for rank in (t.prefill_ranks[piece.src_rank], t.decode_ranks[piece.dst_rank]):
                if rank not in pools:
                    pools[rank] = open_pool(self.store, rank)
            src, dst = pools[t.prefill_ranks[piece.src_rank]], pools[t.decode_ranks[piece.dst_rank]]
            src_heads = piece.src_slice(t.src_shard(piece.src_rank))
            dst_heads = piece.dst_slice(t.dst_shard(piece.dst_rank))
            if self.kv_cache.is_cuda:
                self._copiers.append(PagedKVCopy(src, dst, src_heads, dst_heads))
            else:
                self._copiers.append(functools.partial(_copy_ref, src, dst, src_heads, dst_heads))
            layers, _, _, block_size, _, head_dim = src.shape
            self._bytes_per_block += 2 * layers * block_size * piece.num_heads * head_dim * src.element_size()
        if self.kv_cache.is_cuda:
            self._stream = torch.cuda.Stream(self.kv_cache.device)
            with torch.cuda.stream(self._stream):
                compile_copies(self._copiers, self.kv_cache.device)
            self._stream.synchronize()

    @property
    def staging_bytes(self) -> int:
        return 0  # pool to pool: nothing is staged

    def send(self, block_ids: list[int]) -> Transfer:
        return _Landed(TransferStats(0, 0.0))

    def recv(self, block_ids: list[int], src_block_ids: list[int]) -> Transfer:
        if not self._copies:
            return _Landed(TransferStats(0, 0.0))
        if len(src_block_ids) != len(block_ids):
            raise ValueError(f"{len(src_block_ids)} prefill blocks announced for {len(block_ids)} decode blocks")
        self.warm_up()  # a no-op once the pools are open
        num_bytes = self._bytes_per_block * len(block_ids)
        if self._stream is None:
            started = time.perf_counter()
            ids = upload_block_ids(src_block_ids, block_ids, self.kv_cache.device)
            for copy in self._copiers:
                copy(ids[0], ids[1])
            return _Landed(TransferStats(num_bytes, time.perf_counter() - started))
        if self._graphs is None:
            self._graphs = CopyGraphs(self._copiers, self.kv_cache.device, _GRAPH_MAX_BLOCKS, _GRAPH_SLOTS)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._stream.wait_event(start)  # blocks freed by steps still queued
        keep: list[torch.Tensor] = []
        with torch.cuda.stream(self._stream):
            if not self._graphs.replay(src_block_ids, block_ids):
                ids = upload_block_ids(src_block_ids, block_ids, self.kv_cache.device)
                for copy in self._copiers:
                    copy(ids[0], ids[1])
                keep.append(ids)
            end.record()
        return _Copy(num_bytes, start, end, keep)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


def upload_block_ids(src_block_ids: list[int], dst_block_ids: list[int], device: torch.device) -> torch.Tensor:
    """Both id lists as rows of one ``(2, count)`` int64 tensor on ``device``: on a GPU from one
    pinned buffer, in one asynchronous copy (the caching host allocator keeps the buffer until
    that copy has run)."""
    if device.type != "cuda":
        return torch.tensor([src_block_ids, dst_block_ids], dtype=torch.int64)
    host = torch.empty((2, len(dst_block_ids)), dtype=torch.int64, pin_memory=True)
    view = host.numpy()
    view[0], view[1] = src_block_ids, dst_block_ids
    return host.to(device, non_blocking=True)


def compile_copies(copiers: list[Callable[[torch.Tensor, torch.Tensor], None]], device: torch.device) -> None:
    """Run every copier on padding ids (nothing is written) in each layout a pull hands it, on the
    current stream, so that Triton compiles and loads the copy kernel now: not at the first pull,
    which every running request would wait for on a machine whose Triton cache is empty, and
    never inside a graph capture. Triton specializes on whether a pointer is 16-byte aligned:
    the destination row of ``upload_block_ids`` is for an even count, 8 bytes past it for an odd one."""
    for count in (2, 1):
        ids = upload_block_ids([0] * count, [-1] * count, device)
        for copy in copiers:
            copy(ids[0], ids[1])


class _GraphSlot:
    """Block-id buffers (pinned and on the device) and the graphs captured over them."""

    def __init__(self, max_blocks: int, device: torch.device) -> None:
        self.host = torch.empty((2, max_blocks), dtype=torch.int64, pin_memory=True)
        self.view = self.host.numpy()
        self.ids = torch.empty((2, max_blocks), dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by bucket (blocks)
        self.last: torch.cuda.Event | None = None  # after the last replay

    def idle(self) -> bool:
        return self.last is None or self.last.query()


class CopyGraphs:
    """Issues a pull as one CUDA graph replay: the upload of its block ids and every piece's copy.

    A graph is captured, at its first use, for a bucket of B blocks (a power of two) and moves
    any count up to B: the ids past the count are padding (destination -1), which the copy
    kernel skips. Each slot owns its id buffers and graphs, and its pinned buffer is written again
    only once its last replay has run, so a queued upload never reads the ids of a later pull.
    The copiers must have run once already (``compile_copies``), so that no capture compiles or
    loads a kernel.
    """

    def __init__(
        self,
        copiers: list[Callable[[torch.Tensor, torch.Tensor], None]],
        device: torch.device,
        max_blocks: int,
        num_slots: int,
    ) -> None:
        self._copiers = copiers
        self.max_blocks = max_blocks
        self._slots = [_GraphSlot(max_blocks, device) for _ in range(num_slots)]

    def replay(self, src_block_ids: list[int], dst_block_ids: list[int]) -> bool:
        """Issue the copies on the current stream; False (nothing issued) when the request has
        more blocks than any graph, or every slot's last replay is still queued."""
        count = len(dst_block_ids)
        if not 0 < count <= self.max_blocks:
            return False
        slot = next((s for s in self._slots if s.idle()), None)
        if slot is None:
            return False
        bucket = 1 << (count - 1).bit_length()
        graph = slot.graphs.get(bucket) or self._capture(slot, bucket)
        slot.view[0, :count] = src_block_ids
        slot.view[1, :count] = dst_block_ids
        slot.view[1, count:bucket] = -1
        graph.replay()
        if slot.last is None:
            slot.last = torch.cuda.Event()
        slot.last.record()
        return True

    def _capture(self, slot: _GraphSlot, bucket: int) -> torch.cuda.CUDAGraph:
        src, dst = slot.ids[0, :bucket], slot.ids[1, :bucket]
        graph = torch.cuda.CUDAGraph()
        # On the copy stream, without the device-wide sync of ``torch.cuda.graph``; thread-local,
        # so that the thread opening a restarted peer's pools may go on meanwhile.
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            slot.ids.copy_(slot.host, non_blocking=True)  # whole rows: one contiguous upload
            for copy in self._copiers:
                copy(src, dst)
        finally:
            graph.capture_end()
        slot.graphs[bucket] = graph
        return graph


def _copy_ref(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_heads: slice,
    dst_heads: slice,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    paged_kv_copy_ref(src, dst, src_ids, dst_ids, src_heads, dst_heads)


register_backend("cuda-ipc", BackendTraits("cuda", same_host=True))(IpcBackend)
register_backend("shm", BackendTraits("cpu", same_host=True))(IpcBackend)
