"""KV transfer between a prefill and a decode rank through the real backends, against raw send/recv.

    python -m pdserve.bench.transfer --preset qwen2.5-1.5b --out transfer.json            # 2 GPUs
    python -m pdserve.bench.transfer --preset qwen2.5-1.5b --prefill-tp 2 --decode-tp 2   # 4 GPUs
    python -m pdserve.bench.transfer --preset tiny-llama --device cpu --sizes 64,256 --concurrent 4x128 \\
        --iters 2 --out x.json                                                     # CPU smoke run

One torch.distributed world of ``P + D`` rank processes: global ranks ``0..P-1`` are a prefill
group (GPUs ``0..P-1``), ``P..P+D-1`` a decode group (the next GPUs); NCCL on GPUs, gloo on CPU
(one thread per process). Every rank holds a paged KV pool ``[layers, 2, num_blocks + 1, 16,
local_kv_heads, head_dim]`` of the preset's shape (bf16 on GPU, fp32 on CPU) filled with
pseudo-random non-zero values (a hash of the element index and the rank, see ``fill_pattern``),
and a ``KVTransferAgent`` over ``kvtransfer.base.create_backend`` for the sync backend (nccl /
gloo) and the async one (nccl-async / gloo-async): the code the workers run. A request's blocks
are a shuffled, non-contiguous sample of the pool, drawn independently on each side.

Cases (each verified once, bitwise, on every decode rank: before its first, untimed round the
receiving blocks are overwritten with NaN; after it the receiver recomputes the sender's pool
from the shared pattern and compares the received blocks' bit patterns to the sender's):

* ``sync N`` (``--sizes``): one request of N tokens through the sync backend. Every rank meets
  at a barrier (a one-element all-reduce, then ``torch.cuda.synchronize``); a decode rank then
  times ``agent.execute(recv)`` + ``agent.wait`` + ``torch.cuda.synchronize``, a prefill rank
  ``agent.execute(send)`` + the handle's ``wait()`` + synchronize. The request's time is the slowest
  decode rank's. Bytes are what the decode ranks received (K and V, all layers, their heads).
  Then, alone, each side's extra copy: the sender's gather (``pack_ms``) and the receiver's
  scatter (``unpack_ms``) exactly as the backend writes them, beside ``index_select`` /
  ``index_copy_`` along the block dimension (``pack_index_select_ms``, ``unpack_index_copy_ms``).
* ``raw``, in every case, interleaved with its rounds: ``dist.isend``/``dist.irecv`` of one
  preallocated contiguous tensor per (prefill rank, decode rank) piece of the resharding plan,
  each the byte size of the backend's message (for TP 1 -> 1 one tensor of the request's
  bytes), timed the same way. "% of raw" is raw time / backend time.
* ``handoff N`` (``--handoff-tokens``, async backend): the path "prefill done -> decode may
  start" of ``prefill_worker`` / ``decode_worker``. The prefill leader stamps t0 and pushes a
  msgpack ``KVAnnounce`` (``cluster.protocol``, with the N prompt token ids) over ZMQ PUSH/PULL
  (ipc); the decode leader replies ``KVReply(accepted)`` and calls ``agent.recv``, which sends
  the recv ``KVCommand`` to its TP peers over the step channel (``engine.step_channel.StepSender``)
  and posts its receive; the prefill leader, on the reply, calls ``agent.send`` likewise; every
  decode rank busy-polls ``agent.done(id)`` and stamps t1 when it turns true (the scatter into
  the pool is then queued on the compute stream, ahead of any decode step: decode may start).
  The prefill leader announces ``--settle-ms`` after the barrier, so the decode leader is
  already idle in its receive, as between requests (``barrier_skew_ms`` records the skew).
  The handoff is max over decode ranks of t1, minus t0. Both stamps are ``time.perf_counter``,
  which on Linux is ``CLOCK_MONOTONIC``, one clock for every process of the host, so t1 - t0
  needs no correction; the metadata records the clock, and an NTP-style offset between the
  leaders estimated from ZMQ ping-pongs (``clock_offset_us``, expected ~0) is subtracted only if
  the clock is not host-wide. Also reported: ``synced_ms`` (t1 after a
  ``torch.cuda.synchronize``: the scatter finished), ``announce_ms`` (t0 to the decode leader
  holding the announce), and ``rtt_based_ms``, measured on the prefill leader alone: t0 to the
  arrival of a "landed" message the decode leader pushes at its t1, minus half the median ZMQ
  round trip (``zmq_rtt_us``, from the same ping-pongs). ``announce_encode_us`` /
  ``announce_decode_us`` (and ``reply_*``) time the ``cluster.protocol`` codec on those
  messages in the parent process: the message handling inside the handoff.
* ``concurrent KxN`` (``--concurrent``, async backend): K requests of N tokens posted
  back-to-back on both sides (no ZMQ), time from the barrier until every decode rank has seen
  all K ``done`` and synchronized; raw is one message of the K requests' total bytes per piece.
  ``ratio_to_raw`` is backend time / raw time.

Numbers are medians over ``--iters`` rounds after ``--warmup`` untimed ones (the first of
which is the verified one). Targets of the issue are evaluated where their case ran: sync
16384 >= 250 GB/s and >= 75 % of raw, handoff 1024 <= 1 ms, concurrent 8x4096 <= 1.25x raw.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist
import zmq
from tqdm import tqdm

from pdserve.bench.common import bench_parser, bit_pattern, format_table, parse_ints, time_once
from pdserve.cluster.group import RankProcesses, free_port, join_world
from pdserve.cluster.protocol import KVAnnounce, KVReply, Sampling
from pdserve.cluster.protocol import decode as decode_message
from pdserve.cluster.protocol import encode as encode_message
from pdserve.engine.config import ModelConfig, parse_dtype
from pdserve.engine.presets import load_preset
from pdserve.engine.step_channel import KVCommand, StepReceiver, StepSender
from pdserve.kvtransfer.agent import KVTransferAgent
from pdserve.kvtransfer.base import Transfer, TransferConfig, TransferStats, TransferTopology, create_backend

BLOCK_SIZE = 16
# The targets: (case, key, comparison, bound).
TARGETS = (
    ("sync 16384", "gbps", ">=", 250.0),
    ("sync 16384", "pct_of_raw", ">=", 75.0),
    ("handoff 1024", "median_ms", "<=", 1.0),
    ("concurrent 8x4096", "ratio_to_raw", "<=", 1.25),
)
_PING_WARMUP, _PINGS = 20, 200
# Every process started on the GPU machine needs these (/work/shared/ENVIRONMENT.md).
_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Case:
    kind: str  # "sync" | "handoff" | "concurrent"
    tokens: int  # per request
    requests: int = 1

    @property
    def name(self) -> str:
        if self.kind == "concurrent":
            return f"concurrent {self.requests}x{self.tokens}"
        return f"{self.kind} {self.tokens}"

    @property
    def blocks(self) -> int:
        return -(-self.tokens // BLOCK_SIZE)


@dataclass(frozen=True)
class Setup:
    """Everything a rank process needs (pickled into it)."""

    device: str  # "cuda" | "cpu"
    dtype: str
    prefill_tp: int
    decode_tp: int
    layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    cases: tuple[Case, ...]
    iters: int
    warmup: int
    seed: int
    settle_ms: float
    init_method: str
    run_dir: str
    layer_groups: int = 1  # messages per request per destination (TransferConfig.layer_groups)

    @property
    def world_size(self) -> int:
        return self.prefill_tp + self.decode_tp

    @property
    def prefill_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.prefill_tp))

    @property
    def decode_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.prefill_tp, self.world_size))

    def backend_name(self, is_async: bool) -> str:
        base = "nccl" if self.device == "cuda" else "gloo"
        return f"{base}-async" if is_async else base


# -- the KV pattern ----------------------------------------------------------------------------

_CHUNK = 1 << 24
_MASK31 = 0x7FFFFFFF


def pattern_seed(seed: int, global_rank: int) -> int:
    return (seed * 1_000_003 + global_rank * 7_919 + 1) & _MASK31


def fill_pattern(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill a contiguous ``tensor`` with pseudo-random values in (-4, 4), never zero: a hash of
    each element's flat index and ``seed`` in int64 arithmetic without overflow, so that any
    process on any device can recompute another rank's pool bit for bit."""
    flat = tensor.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        end = min(start + _CHUNK, flat.numel())
        h = torch.arange(start, end, dtype=torch.int64, device=tensor.device) & _MASK31
        h = (h * 1_103_515_245 + seed) & _MASK31
        h = ((h ^ (h >> 15)) * 1_274_126_177) & _MASK31
        h = ((h ^ (h >> 13)) * 747_796_405) & _MASK31
        h = h ^ (h >> 16)
        flat[start:end] = ((h & 0xFFFF).to(torch.float32) - 32767.5) / 8192.0
    return tensor


def block_ids(seed: int, case: Case, side: str, num_blocks: int) -> list[list[int]]:
    """``case.requests`` disjoint lists of ``case.blocks`` shuffled pool blocks; ``side`` is
    "src" or "dst", so the two sides number the same request differently."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{case.name}/{side}".encode()))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    n = case.blocks
    return [perm[i * n : (i + 1) * n] for i in range(case.requests)]


# -- one rank -----------------------------------------------------------------------------------


class _Rank:
    def __init__(self, setup: Setup, rank: int) -> None:
        self.setup = setup
        self.rank = rank
        self.device = torch.device(f"cuda:{rank}" if setup.device == "cuda" else "cpu")
        self.dtype = parse_dtype(setup.dtype)
        self.topology = TransferTopology(
            setup.num_heads, setup.num_kv_heads, setup.prefill_ranks, setup.decode_ranks, rank
        )
        self.is_prefill = self.topology.is_prefill
        self.tp_rank = self.topology.tp_rank
        self.is_leader = self.tp_rank == 0
        tp = self.topology
        self.shard = tp.src_shard(self.tp_rank) if self.is_prefill else tp.dst_shard(self.tp_rank)
        self.pool = self._pool(self.shard.num_kv_heads, pattern_seed(setup.seed, rank))
        self.sync_agent, self.async_agent = (
            KVTransferAgent({0: create_backend(config, tp, self.pool)}, config.max_staging_bytes)
            for config in (
                TransferConfig(setup.backend_name(is_async), layer_groups=setup.layer_groups)
                for is_async in (False, True)
            )
        )
        # This rank's pieces of the plan: (peer global rank, heads, local head slice, peer's head slice).
        self.pieces = []
        for p in tp.plan():
            if self.is_prefill and p.src_rank == self.tp_rank:
                self.pieces.append(
                    (
                        tp.decode_ranks[p.dst_rank],
                        p.num_heads,
                        p.src_slice(self.shard),
                        p.dst_slice(tp.dst_shard(p.dst_rank)),
                    )
                )
            elif not self.is_prefill and p.dst_rank == self.tp_rank:
                self.pieces.append(
                    (
                        tp.prefill_ranks[p.src_rank],
                        p.num_heads,
                        p.dst_slice(self.shard),
                        p.src_slice(tp.src_shard(p.src_rank)),
                    )
                )
        self._references: dict[int, torch.Tensor] = {}
        self._token = torch.zeros(1, device=self.device)
        self.results: dict[str, dict[str, Any]] = {}

    def _pool(self, kv_heads: int, seed: int) -> torch.Tensor:
        s = self.setup
        pool = torch.empty(
            s.layers, 2, s.num_blocks + 1, BLOCK_SIZE, kv_heads, s.head_dim, dtype=self.dtype, device=self.device
        )
        return fill_pattern(pool, seed)

    # -- timing helpers ---------------------------------------------------------------------

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """Every rank of the world here, with no GPU work of this rank outstanding."""
        dist.all_reduce(self._token)
        self.sync()

    def block_bytes(self, heads: int) -> int:
        s = self.setup
        return 2 * s.layers * BLOCK_SIZE * heads * s.head_dim * self.pool.element_size()

    def raw_buffers(self, num_blocks: int) -> list[tuple[int, torch.Tensor]]:
        """One contiguous tensor per piece, the size of the backend's message for ``num_blocks``."""
        s = self.setup
        buffers = []
        for peer, heads, _, _ in self.pieces:
            t = torch.empty(
                s.layers, 2, num_blocks, BLOCK_SIZE, heads, s.head_dim, dtype=self.dtype, device=self.device
            )
            buffers.append((peer, fill_pattern(t, 12345) if self.is_prefill else t))
        return buffers

    def raw(self, buffers: list[tuple[int, torch.Tensor]]) -> float:
        self.barrier()
        start = time.perf_counter()
        if self.is_prefill:
            works = [dist.isend(t, dst=peer) for peer, t in buffers]
        else:
            works = [dist.irecv(t, src=peer) for peer, t in buffers]
        for work in works:
            work.wait()
        self.sync()
        return (time.perf_counter() - start) * 1e3

    def _done(self, agent: KVTransferAgent, transfer_id: str, transfer: Transfer) -> bool:
        """Decode rank: ``agent.done(id)``, as the decode worker polls. Prefill rank: the handle's
        ``done()``, as the prefill worker polls (the agent forgets a completed send at its next
        ``execute``, so a send's id may no longer be known to it)."""
        return transfer.done() if self.is_prefill else agent.done(transfer_id)

    def _settle(self, agent: KVTransferAgent, transfer_id: str, transfer: Transfer) -> TransferStats:
        return transfer.wait() if self.is_prefill else agent.wait(transfer_id)

    # -- verification -----------------------------------------------------------------------

    def poison(self, blocks: list[list[int]]) -> None:
        if not self.is_prefill:
            for ids in blocks:
                self.pool[:, :, ids] = float("nan")

    def verify(self, case: Case, src: list[list[int]], dst: list[list[int]]) -> int:
        """Decode rank: the received blocks, bit for bit, against the senders' pools. Returns bytes compared."""
        if self.is_prefill:
            return 0
        compared = 0
        for peer, _, mine, theirs in self.pieces:
            if peer not in self._references:
                shard = self.topology.src_shard(self.setup.prefill_ranks.index(peer))
                self._references[peer] = self._pool(shard.num_kv_heads, pattern_seed(self.setup.seed, peer))
            reference = self._references[peer]
            for request, (src_ids, dst_ids) in enumerate(zip(src, dst)):
                want = reference[:, :, src_ids][:, :, :, :, theirs]
                got = self.pool[:, :, dst_ids][:, :, :, :, mine]
                if not torch.equal(bit_pattern(got), bit_pattern(want)):
                    bad = (bit_pattern(got) != bit_pattern(want)).sum().item()
                    raise AssertionError(
                        f"{case.name}: request {request} from rank {peer} differs on decode rank "
                        f"{self.rank} ({bad} of {got.numel()} elements)"
                    )
                compared += got.numel() * got.element_size()
        return compared

    # -- cases ------------------------------------------------------------------------------

    def run(self) -> None:
        cases = self.setup.cases
        bar = tqdm(cases, desc="kv transfer", unit="case", disable=self.rank != 0, file=sys.stderr)
        for case in bar:
            bar.set_postfix_str(case.name)
            src = block_ids(self.setup.seed, case, "src", self.setup.num_blocks)
            dst = block_ids(self.setup.seed, case, "dst", self.setup.num_blocks)
            run = {"sync": self.case_sync, "handoff": self.case_handoff, "concurrent": self.case_concurrent}[case.kind]
            self.results[case.name] = run(case, src, dst)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.sync_agent.close()
        self.async_agent.close()

    def case_sync(self, case: Case, src: list[list[int]], dst: list[list[int]]) -> dict[str, Any]:
        op, blocks = ("send", src[0]) if self.is_prefill else ("recv", dst[0])
        raw = self.raw_buffers(case.blocks)
        out: dict[str, Any] = {"ms": [], "raw_ms": [], "bytes": 0, "raw_bytes": _nbytes(raw), "verified_bytes": 0}
        for i in range(self.setup.warmup + self.setup.iters):
            if i == 0:
                self.poison(dst)
            transfer_id = f"{case.name}/{i}"
            self.barrier()
            start = time.perf_counter()
            transfer = self.sync_agent.execute(KVCommand(op, transfer_id, blocks))
            stats = self._settle(self.sync_agent, transfer_id, transfer)
            self.sync()
            ms = (time.perf_counter() - start) * 1e3
            if i == 0:
                out["verified_bytes"] = self.verify(case, src, dst)
            raw_ms = self.raw(raw)
            out["bytes"] = stats.num_bytes
            if i >= self.setup.warmup:
                out["ms"].append(ms)
                out["raw_ms"].append(raw_ms)
        out.update(self.pack_times(blocks))
        return out

    def _time_op(self, fn: Any) -> float:
        """Milliseconds of one call of ``fn`` (CUDA events on GPU: kernel time plus launch gaps)."""
        if self.device.type == "cuda":
            self.sync()
        return time_once(fn, self.device)

    def pack_times(self, blocks: list[int]) -> dict[str, float]:
        """This rank's share of the backend's extra copies, alone (no transfer running): the
        sender's gather (``kv_cache[:, :, blocks, :, heads].contiguous()``, what
        ``TorchDistributedBackend.send`` runs per piece) or the receiver's scatter
        (``kv_cache[:, :, blocks, :, heads] = buffer``, what ``_TorchTransfer.wait`` runs),
        including the block-id upload; and, where a piece covers all of the rank's heads,
        ``index_select`` / ``index_copy_`` along the block dimension for comparison.
        Medians over ``--iters`` calls, summed over the rank's pieces."""
        pool = self.pool
        local_heads = pool.shape[4]
        main, alternative = [], []
        for _ in range(self.setup.warmup + self.setup.iters):
            total = alt = 0.0
            for _, num_heads, heads, _ in self.pieces:

                def index() -> torch.Tensor:
                    return torch.tensor(blocks, dtype=torch.int64).to(self.device, non_blocking=True)

                if self.is_prefill:
                    total += self._time_op(lambda: pool[:, :, index(), :, heads].contiguous())
                    if num_heads == local_heads:
                        alt += self._time_op(lambda: torch.index_select(pool, 2, index()))
                else:
                    idx = index()
                    buffer = pool[:, :, idx, :, heads].contiguous()  # what landed: writing it back changes nothing

                    def scatter() -> None:
                        pool[:, :, index(), :, heads] = buffer

                    total += self._time_op(scatter)
                    if num_heads == local_heads:
                        alt += self._time_op(lambda: pool.index_copy_(2, index(), buffer))
            main.append(total)
            alternative.append(alt)
        main, alternative = main[self.setup.warmup :], alternative[self.setup.warmup :]
        key = "pack" if self.is_prefill else "unpack"
        alt_key = "pack_index_select" if self.is_prefill else "unpack_index_copy"
        out = {f"{key}_ms": statistics.median(main) if self.pieces else 0.0}
        if any(num_heads == local_heads for _, num_heads, _, _ in self.pieces):
            out[f"{alt_key}_ms"] = statistics.median(alternative)
        return out

    def case_concurrent(self, case: Case, src: list[list[int]], dst: list[list[int]]) -> dict[str, Any]:
        op, blocks = ("send", src) if self.is_prefill else ("recv", dst)
        raw = self.raw_buffers(case.blocks * case.requests)
        agent = self.async_agent
        out: dict[str, Any] = {
            "ms": [],
            "done_ms": [],
            "raw_ms": [],
            "bytes": 0,
            "raw_bytes": _nbytes(raw),
            "verified_bytes": 0,
        }
        for i in range(self.setup.warmup + self.setup.iters):
            if i == 0:
                self.poison(dst)
            ids = [f"{case.name}/{i}/{k}" for k in range(case.requests)]
            self.barrier()
            start = time.perf_counter()
            transfers = {t: agent.execute(KVCommand(op, t, b)) for t, b in zip(ids, blocks)}
            pending = set(ids)
            while pending:  # what a worker's background() does between steps
                pending = {t for t in pending if not self._done(agent, t, transfers[t])}
                if self.device.type == "cpu":
                    time.sleep(0)  # let gloo's helper threads have the GIL
            done_ms = (time.perf_counter() - start) * 1e3
            num_bytes = sum(self._settle(agent, t, transfers[t]).num_bytes for t in ids)
            self.sync()
            ms = (time.perf_counter() - start) * 1e3
            if i == 0:
                out["verified_bytes"] = self.verify(case, src, dst)
            raw_ms = self.raw(raw)
            out["bytes"] = num_bytes
            if i >= self.setup.warmup:
                out["ms"].append(ms)
                out["done_ms"].append(done_ms)
                out["raw_ms"].append(raw_ms)
        return out

    def case_handoff(self, case: Case, src: list[list[int]], dst: list[list[int]]) -> dict[str, Any]:
        s = self.setup
        role = "prefill" if self.is_prefill else "decode"
        other = "decode" if self.is_prefill else "prefill"
        tp = s.prefill_tp if self.is_prefill else s.decode_tp
        ctx = zmq.Context.instance()
        sockets: list[zmq.Socket] = []
        inbox = out_sock = steps = None
        step_rx = None
        if self.is_leader:
            inbox = ctx.socket(zmq.PULL)
            inbox.setsockopt(zmq.LINGER, 0)
            inbox.bind(f"ipc://{s.run_dir}/{role}")
            out_sock = ctx.socket(zmq.PUSH)
            out_sock.setsockopt(zmq.LINGER, 1000)
            out_sock.connect(f"ipc://{s.run_dir}/{other}")
            sockets += [inbox, out_sock]
            if tp > 1:
                steps = StepSender(f"ipc://{s.run_dir}/{role}-steps", tp)
        else:
            step_rx = StepReceiver(f"ipc://{s.run_dir}/{role}-steps", self.tp_rank)
        # The leader issues each transfer on its whole group, as the workers do: through an agent
        # over the async backend that sends the command to its peers on the step channel.
        agent = self.async_agent
        if self.is_leader:
            agent = KVTransferAgent(agent.backends, agent.max_staging_bytes, steps)
        raw = self.raw_buffers(case.blocks)
        out: dict[str, Any] = {"raw_ms": [], "bytes": 0, "raw_bytes": _nbytes(raw), "verified_bytes": 0}
        try:
            self.barrier()
            if self.is_leader:
                out.update(self._pings(inbox, out_sock))
            tokens = list(range(1000, 1000 + case.tokens))  # the prompt the announce carries
            keys = ("t_announce", "t_landed") if self.is_prefill else ("t_received", "t_done", "t_synced")
            for key in ("t_start", *keys):
                out[key] = []
            for i in range(s.warmup + s.iters):
                if i == 0:
                    self.poison(dst)
                transfer_id = f"{case.name}/{i}"
                self.barrier()
                t_start = time.perf_counter()
                if self.is_prefill:
                    stamps, num_bytes = self._handoff_prefill(
                        agent, transfer_id, tokens, src[0], inbox, out_sock, step_rx
                    )
                else:
                    stamps, num_bytes = self._handoff_decode(agent, transfer_id, dst[0], inbox, out_sock, step_rx)
                if i == 0:
                    out["verified_bytes"] = self.verify(case, src, dst)
                raw_ms = self.raw(raw)
                out["bytes"] = num_bytes
                if i >= s.warmup:
                    out["t_start"].append(t_start)
                    for key, value in stamps.items():
                        out[key].append(value)
                    out["raw_ms"].append(raw_ms)
        finally:
            if steps is not None:
                steps.shutdown()
            if step_rx is not None:
                step_rx.close()
            for sock in sockets:
                sock.close()
        return out

    def _pings(self, inbox: zmq.Socket, out_sock: zmq.Socket) -> dict[str, list[float]]:
        """ZMQ round trips between the leaders; NTP-style clock offset (decode minus prefill)."""
        rtts, offsets = [], []
        for i in range(_PING_WARMUP + _PINGS):
            if self.is_prefill:
                t0 = time.perf_counter()
                out_sock.send(msgpack.packb({"ping": i}))
                reply = msgpack.unpackb(inbox.recv())
                t3 = time.perf_counter()
                if i >= _PING_WARMUP:
                    rtts.append(((t3 - t0) - (reply["t2"] - reply["t1"])) * 1e6)
                    offsets.append(((reply["t1"] - t0) + (reply["t2"] - t3)) / 2 * 1e6)
            else:
                msgpack.unpackb(inbox.recv())
                t1 = time.perf_counter()
                out_sock.send(msgpack.packb({"t1": t1, "t2": time.perf_counter()}))
        return {"zmq_rtt_us": rtts, "clock_offset_us": offsets} if self.is_prefill else {}

    def _handoff_prefill(
        self,
        agent: KVTransferAgent,
        transfer_id: str,
        tokens: list[int],
        blocks: list[int],
        inbox: zmq.Socket | None,
        out_sock: zmq.Socket | None,
        step_rx: StepReceiver | None,
    ) -> tuple[dict[str, float], int]:
        if not self.is_leader:  # a peer: the leader's command arrives on the step channel
            assert step_rx is not None
            command = step_rx.receive()
            assert isinstance(command, KVCommand)
            num_bytes = agent.execute(command).wait().num_bytes  # as the prefill worker: by handle
            self.sync()
            return {}, num_bytes
        assert inbox is not None and out_sock is not None
        # Let the decode leader settle in its receive (idle, as a worker between requests), so
        # that barrier exit skew does not count as handoff time.
        time.sleep(self.setup.settle_ms / 1e3)
        t_announce = time.perf_counter()
        out_sock.send(encode_message(KVAnnounce(transfer_id, 0, tokens, 7, Sampling(max_tokens=16))))
        reply = decode_message(inbox.recv())
        if not (isinstance(reply, KVReply) and reply.accepted and reply.request_id == transfer_id):
            raise RuntimeError(f"unexpected reply to {transfer_id}: {reply}")
        transfer = agent.send(transfer_id, blocks, peer_group=0)
        landed = msgpack.unpackb(inbox.recv())
        t_landed = time.perf_counter()
        if landed.get("landed") != transfer_id:
            raise RuntimeError(f"unexpected message waiting for {transfer_id} to land: {landed}")
        num_bytes = transfer.wait().num_bytes
        self.sync()
        return {"t_announce": t_announce, "t_landed": t_landed}, num_bytes

    def _handoff_decode(
        self,
        agent: KVTransferAgent,
        transfer_id: str,
        blocks: list[int],
        inbox: zmq.Socket | None,
        out_sock: zmq.Socket | None,
        step_rx: StepReceiver | None,
    ) -> tuple[dict[str, float], int]:
        if self.is_leader:
            assert inbox is not None and out_sock is not None
            announce = decode_message(inbox.recv())
            t_received = time.perf_counter()
            if not (isinstance(announce, KVAnnounce) and announce.request_id == transfer_id):
                raise RuntimeError(f"unexpected message instead of the announce of {transfer_id}: {announce}")
            out_sock.send(encode_message(KVReply(transfer_id, accepted=True)))
            agent.recv(transfer_id, blocks, peer_group=0, src_block_ids=[])
        else:
            assert step_rx is not None
            received = step_rx.receive()
            t_received = time.perf_counter()
            assert isinstance(received, KVCommand)
            agent.execute(received)
        while not agent.done(transfer_id):
            if self.device.type == "cpu":
                time.sleep(0)  # let gloo's helper thread have the GIL
        t_done = time.perf_counter()
        if self.is_leader:
            assert out_sock is not None
            out_sock.send(msgpack.packb({"landed": transfer_id, "t": t_done}))
        num_bytes = agent.wait(transfer_id).num_bytes
        self.sync()
        t_synced = time.perf_counter()
        return {"t_received": t_received, "t_done": t_done, "t_synced": t_synced}, num_bytes


def _nbytes(buffers: list[tuple[int, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in buffers)


def _rank_main(setup: Setup, rank: int) -> None:
    torch.set_num_threads(1)
    backend = "nccl" if setup.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    join_world(backend, setup.init_method, setup.world_size, rank)
    try:
        bench = _Rank(setup, rank)
        bench.run()
        info = {
            "rank": rank,
            "role": "prefill" if bench.is_prefill else "decode",
            "tp_rank": bench.tp_rank,
            "device_name": torch.cuda.get_device_name(bench.device)
            if setup.device == "cuda"
            else (platform.processor() or "cpu"),
            "nccl": str(torch.cuda.nccl.version()) if setup.device == "cuda" else None,
            "pool_shape": list(bench.pool.shape),
            "cases": bench.results,
        }
        Path(setup.run_dir, f"rank{rank}.json").write_text(json.dumps(info))
        bench.barrier()
    finally:
        dist.destroy_process_group()


# -- aggregation --------------------------------------------------------------------------------


def _stats(times: Sequence[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def _per_iter_max(ranks: list[dict], case: str, key: str) -> list[float]:
    return [max(values) for values in zip(*(r["cases"][case][key] for r in ranks))]


def _gbps(num_bytes: int, ms: float) -> float:
    return num_bytes / (ms / 1e3) / 1e9 if ms > 0 else float("inf")


def aggregate(setup: Setup, ranks: list[dict], shared_clock: bool) -> list[dict[str, Any]]:
    prefill = [r for r in ranks if r["role"] == "prefill"]
    decode = [r for r in ranks if r["role"] == "decode"]
    prefill_leader = next(r for r in prefill if r["tp_rank"] == 0)
    decode_leader = next(r for r in decode if r["tp_rank"] == 0)
    rows = []
    for case in setup.cases:
        name = case.name
        entry: dict[str, Any] = {
            "case": name,
            "kind": case.kind,
            "backend": setup.backend_name(case.kind != "sync"),
            "tokens": case.tokens,
            "requests": case.requests,
            "blocks_per_request": case.blocks,
            "bytes": sum(r["cases"][name]["bytes"] for r in decode),
            "raw_bytes": sum(r["cases"][name]["raw_bytes"] for r in decode),
            "verified_bytes": sum(r["cases"][name]["verified_bytes"] for r in decode),
        }
        entry["verified"] = entry["verified_bytes"] == entry["bytes"] > 0
        if case.kind == "handoff":
            leader = prefill_leader["cases"][name]
            offset_us = statistics.median(leader["clock_offset_us"])
            correction = 0.0 if shared_clock else offset_us / 1e6  # decode clock minus prefill clock
            t0 = leader["t_announce"]
            done = [max(v) for v in zip(*(r["cases"][name]["t_done"] for r in decode))]
            synced = [max(v) for v in zip(*(r["cases"][name]["t_synced"] for r in decode))]
            received = decode_leader["cases"][name]["t_received"]
            rtt_us = statistics.median(leader["zmq_rtt_us"])
            times = [(d - correction - a) * 1e3 for d, a in zip(done, t0)]
            entry.update(_stats(times))
            entry["times_ms"] = times
            entry["synced_ms"] = statistics.median((d - correction - a) * 1e3 for d, a in zip(synced, t0))
            entry["announce_ms"] = statistics.median((d - correction - a) * 1e3 for d, a in zip(received, t0))
            entry["rtt_based_ms"] = statistics.median(
                (landed - a) * 1e3 - rtt_us / 2e3 for landed, a in zip(leader["t_landed"], t0)
            )
            entry["barrier_skew_ms"] = statistics.median(
                (d - correction - a) * 1e3 for d, a in zip(decode_leader["cases"][name]["t_start"], leader["t_start"])
            )
            entry["zmq_rtt_us"] = rtt_us
            entry["clock_offset_us"] = offset_us
            entry["clock_corrected"] = not shared_clock
        else:
            times = _per_iter_max(decode, name, "ms")
            entry.update(_stats(times))
            entry["times_ms"] = times
            send = _per_iter_max(prefill, name, "ms")
            entry["send_median_ms"] = statistics.median(send)
            if case.kind == "sync":
                for side, key in (
                    (prefill, "pack_ms"),
                    (prefill, "pack_index_select_ms"),
                    (decode, "unpack_ms"),
                    (decode, "unpack_index_copy_ms"),
                ):
                    values = [r["cases"][name][key] for r in side if key in r["cases"][name]]
                    if values:
                        entry[key] = max(values)
            if case.kind == "concurrent":
                entry["done_median_ms"] = statistics.median(_per_iter_max(decode, name, "done_ms"))
        raw = _per_iter_max(decode, name, "raw_ms")
        entry["raw"] = {**_stats(raw), "gbps": _gbps(entry["raw_bytes"], statistics.median(raw))}
        entry["raw_times_ms"] = raw
        entry["gbps"] = _gbps(entry["bytes"], entry["median_ms"])
        entry["pct_of_raw"] = 100.0 * entry["raw"]["median_ms"] / entry["median_ms"]
        entry["ratio_to_raw"] = entry["median_ms"] / entry["raw"]["median_ms"]
        rows.append(entry)
    return rows


def codec_cost(tokens: int, rounds: int = 50) -> dict[str, float]:
    """Microseconds (median) of ``cluster.protocol`` encode and decode of the handoff's
    ``KVAnnounce`` (its prompt has ``tokens`` ids) and ``KVReply``, in this process: the part of
    the handoff that is message handling, not transfer."""
    announce = KVAnnounce("r", 0, list(range(1000, 1000 + tokens)), 7, Sampling(max_tokens=16), {})
    reply = KVReply("r", accepted=True)
    out = {}
    for name, message in (("announce", announce), ("reply", reply)):
        data = encode_message(message)
        for op, fn, arg in (("encode", encode_message, message), ("decode", decode_message, data)):
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                fn(arg)
                times.append((time.perf_counter() - start) * 1e6)
            out[f"{name}_{op}_us"] = statistics.median(times)
        out[f"{name}_bytes"] = len(data)
    return out


def evaluate_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_name = {r["case"]: r for r in rows}
    out = []
    for case, key, op, bound in TARGETS:
        if case in by_name:
            value = by_name[case][key]
            out.append(
                {
                    "case": case,
                    "metric": key,
                    "op": op,
                    "target": bound,
                    "value": value,
                    "met": value >= bound if op == ">=" else value <= bound,
                }
            )
    return out


def results_table(rows: list[dict[str, Any]]) -> str:
    headers = ["case", "bytes", "ms", "GB/s", "raw GB/s", "% of raw"]
    cells = [
        [
            r["case"],
            str(r["bytes"]),
            f"{r['median_ms']:.3f}",
            f"{r['gbps']:.2f}",
            f"{r['raw']['gbps']:.2f}",
            f"{r['pct_of_raw']:.1f}",
        ]
        for r in rows
    ]
    return format_table(headers, cells)


# -- command line ---------------------------------------------------------------------------------


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(parse_ints(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _concurrent(text: str) -> tuple[int, int]:
    try:
        count, tokens = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected COUNTxTOKENS, e.g. 8x4096, got {text!r}") from None
    if count < 1 or tokens < 1:
        raise argparse.ArgumentTypeError(f"COUNT and TOKENS must be positive, got {text!r}")
    return count, tokens


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser("transfer", __doc__)
    p.add_argument("--preset", default="qwen2.5-1.5b", help="model-shape preset (configs/models)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="KV dtype (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--sizes", type=_ints, default=(1024, 4096, 16384, 65536), help="tokens per request, sync cases")
    p.add_argument("--handoff-tokens", type=int, default=1024, help="tokens of the async handoff request (0: skip)")
    p.add_argument("--concurrent", type=_concurrent, default=(8, 4096), help="COUNTxTOKENS in flight at once")
    p.add_argument("--no-concurrent", action="store_true")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds per case (the first is verified)")
    p.add_argument(
        "--num-blocks", type=int, default=None, help="pool blocks per rank (default: the largest case's need plus 25%%)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--layer-groups",
        type=int,
        default=1,
        help="messages per request per destination, each a range of layers (overlaps copies and wire)",
    )
    p.add_argument(
        "--settle-ms",
        type=float,
        default=2.0,
        help="handoff: pause after the barrier before the announce (the decode leader waits idle)",
    )
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds before the ranks are stopped")
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 1:
        p.error("--iters and --warmup must be >= 1")
    if args.prefill_tp < 1 or args.decode_tp < 1:
        p.error("TP degrees must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = ModelConfig.from_hf_dict(load_preset(args.preset))
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = parse_dtype(dtype_name)
    world = args.prefill_tp + args.decode_tp
    if args.device == "cuda":
        if torch.cuda.device_count() < world:
            raise SystemExit(f"{world} ranks need {world} GPUs, {torch.cuda.device_count()} visible")
        for key, value in _GPU_ENV.items():
            os.environ.setdefault(key, value)
    cases = [Case("sync", n) for n in args.sizes]
    if args.handoff_tokens > 0:
        cases.append(Case("handoff", args.handoff_tokens))
    if not args.no_concurrent:
        cases.append(Case("concurrent", args.concurrent[1], args.concurrent[0]))
    need = max(c.blocks * c.requests for c in cases)
    num_blocks = args.num_blocks or need + max(need // 4, 4)
    if num_blocks < need:
        raise SystemExit(f"--num-blocks {num_blocks}: the largest case needs {need}")
    command = " ".join(sys.orig_argv) if argv is None else " ".join(["python", "-m", "pdserve.bench.transfer", *argv])

    with tempfile.TemporaryDirectory(prefix="pdserve-bench-transfer-") as run_dir:
        setup = Setup(
            device=args.device,
            dtype=dtype_name,
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
            layers=model.num_layers,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            num_blocks=num_blocks,
            cases=tuple(cases),
            iters=args.iters,
            warmup=args.warmup,
            seed=args.seed,
            settle_ms=args.settle_ms,
            init_method=f"tcp://127.0.0.1:{free_port()}",
            run_dir=run_dir,
            layer_groups=args.layer_groups,
        )
        started = time.perf_counter()
        RankProcesses(_rank_main, [(setup, r) for r in range(world)]).wait(args.timeout)
        wall_s = time.perf_counter() - started
        ranks = [json.loads(Path(run_dir, f"rank{r}.json").read_text()) for r in range(world)]

    clock = time.get_clock_info("perf_counter")
    shared_clock = clock.implementation == "clock_gettime(CLOCK_MONOTONIC)" and sys.platform.startswith("linux")
    rows = aggregate(setup, ranks, shared_clock)
    for row in rows:
        if row["kind"] == "handoff":
            row.update(codec_cost(row["tokens"]))
    targets = evaluate_targets(rows)
    metadata = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": args.device,
        "gpu_name": ranks[0]["device_name"] if args.device == "cuda" else None,
        "device_names": [r["device_name"] for r in ranks],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ranks[0]["nccl"],
        "command": command,
        "preset": args.preset,
        "dtype": dtype_name,
        "prefill_tp": args.prefill_tp,
        "decode_tp": args.decode_tp,
        "layer_groups": args.layer_groups,
        "layers": model.num_layers,
        "num_heads": model.num_heads,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "block_size": BLOCK_SIZE,
        "kv_bytes_per_token": model.kv_bytes_per_token(dtype),
        "num_blocks": num_blocks,
        "pool_shapes": [r["pool_shape"] for r in ranks],
        "backends": {"sync": setup.backend_name(False), "async": setup.backend_name(True)},
        "iters": args.iters,
        "warmup": args.warmup,
        "seed": args.seed,
        "clock": clock.implementation,
        "shared_clock": shared_clock,
        "env": {k: os.environ.get(k) for k in (*_GPU_ENV, "OMP_NUM_THREADS")},
        "wall_s": wall_s,
    }
    result = {"metadata": metadata, "cases": rows, "targets": targets, "setup": asdict(setup)}
    print(results_table(rows))
    sync_rows = [r for r in rows if r["kind"] == "sync"]
    if sync_rows:
        print(
            "\nbackend copies alone (slowest rank; ms): sender gather, its index_select equivalent, receiver "
            "scatter, its index_copy_ equivalent, send time on the sender"
        )
        for r in sync_rows:
            print(
                f"  {r['case']:<12} pack {_fmt(r.get('pack_ms'))}  index_select {_fmt(r.get('pack_index_select_ms'))}"
                f"  unpack {_fmt(r.get('unpack_ms'))}  index_copy_ {_fmt(r.get('unpack_index_copy_ms'))}"
                f"  send {_fmt(r.get('send_median_ms'))}"
            )
    for row in rows:
        if row["kind"] == "handoff":
            print(
                f"{row['case']}: {row['median_ms']:.3f} ms announce -> decode may start (synced "
                f"{row['synced_ms']:.3f} ms, announce arrives {row['announce_ms']:.3f} ms, round-trip based "
                f"{row['rtt_based_ms']:.3f} ms, ZMQ RTT {row['zmq_rtt_us']:.0f} us; announce encode "
                f"{row['announce_encode_us']:.0f} us + decode {row['announce_decode_us']:.0f} us)"
            )
        if row["kind"] == "concurrent":
            print(f"{row['case']}: {row['ratio_to_raw']:.2f}x the raw time of one {row['raw_bytes']}-byte message")
    for t in targets:
        print(
            f"target {t['case']} {t['metric']} {t['op']} {t['target']}: {t['value']:.3f} "
            f"{'met' if t['met'] else 'NOT met'}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
