"""KV transfer between real rank processes (gloo and shm on CPU, cuda-ipc on one GPU): every
(prefill TP, decode TP) pair.

The parent computes the KV of several requests with the single-process engine. Prefill ranks
load their heads of it into their own pools, send it through the backend (or let the decode
leader pull it); decode ranks receive it into differently numbered blocks and check it,
bitwise, against the parent's KV for their heads.
"""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from pdserve.cluster.group import RankProcesses, free_port
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.parallel import head_shard
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.step_channel import KVCommand
from pdserve.kvtransfer.agent import KVTransferAgent
from pdserve.kvtransfer.base import PairRendezvous, TransferConfig, TransferFailed, TransferTopology, create_backend

NUM_BLOCKS = 96
MAX_P, MAX_D = 3, 4  # one world of 7 ranks serves every pair: prefill 0..2, decode 3..6
PAIRS = [(p, d) for p in (1, 2, 3) for d in (1, 2, 4)]
BACKENDS = [("gloo", 1), ("gloo-async", 1), ("gloo-async", 3)]  # (backend, layer groups per message)


def _exchange(
    rank: int,
    p: int,
    d: int,
    backend: tuple[str, int],
    meta: dict,
    reference: dict[str, torch.Tensor],
    first_decode_rank: int = MAX_P,
    device: str = "cpu",
) -> None:
    """This rank's part of moving every request's KV from a group of ``p`` to one of ``d``."""
    topology = TransferTopology(
        meta["num_heads"],
        meta["num_kv_heads"],
        tuple(range(p)),
        tuple(range(first_decode_rank, first_decode_rank + d)),
        rank,
    )
    shard = topology.src_shard(rank) if topology.is_prefill else topology.dst_shard(rank - first_decode_rank)
    layers, _, _, block_size, _, head_dim = reference[meta["requests"][0]].shape
    cache = torch.full(
        (layers, 2, NUM_BLOCKS + 1, block_size, shard.num_kv_heads, head_dim), float("nan"), device=device
    )
    reference = {k: v.to(device) for k, v in reference.items()}
    config = TransferConfig(backend[0], layer_groups=backend[1])
    agent = KVTransferAgent({0: create_backend(config, topology, cache)}, config.max_staging_bytes)
    side = "src" if topology.is_prefill else "dst"
    heads = slice(shard.kv_start, shard.kv_end)
    posted = 0  # receive buffers: each decode rank gets each of its heads once
    for request_id in meta["requests"]:  # the same order on every rank; all 16 in flight at once
        blocks = meta[side][request_id]
        if topology.is_prefill:
            cache[:, :, blocks] = reference[request_id][:, :, :, :, heads]
        op = "send" if topology.is_prefill else "recv"
        agent.execute(KVCommand(op, request_id, blocks, src_block_ids=meta["src"][request_id]))
        posted += len(blocks) * agent.backends[0].block_bytes()
    if not topology.is_prefill:
        # Posted receives hold their buffers until waited for (sync ones are done already).
        assert agent.staging_bytes() == (posted if backend[0].endswith("async") else 0)
        for request_id in meta["requests"]:
            assert agent.wait(request_id).num_bytes > 0
            got = cache[:, :, meta[side][request_id]]
            if not torch.equal(got, reference[request_id][:, :, :, :, heads]):
                raise AssertionError(
                    f"{backend} p={p} d={d}: KV of {request_id} differs on decode rank {rank - first_decode_rank}"
                )
    agent.close()
    assert agent.staging_bytes() == 0, f"{backend} p={p} d={d}: buffers still counted after close"


def _pull(
    rank: int,
    p: int,
    d: int,
    backend: str,
    meta: dict,
    reference: dict[str, torch.Tensor],
    port: int,
    device: str,
) -> None:
    """A pulling backend's round, called by every rank of the world (it meets them at barriers):
    prefill ranks fill their pools, the decode leader copies every request into its group's
    pools, then each decode rank checks its own."""
    prefill, decode = tuple(range(p)), tuple(range(MAX_P, MAX_P + d))
    agent, cache, blocks = None, None, meta["dst"]
    if rank in prefill or rank in decode:
        # A store prefix per round: each round's pools are new tensors, published afresh.
        rendezvous = PairRendezvous("127.0.0.1", port, f"{backend}/{p}/{d}/", 60.0)
        topology = TransferTopology(meta["num_heads"], meta["num_kv_heads"], prefill, decode, rank, rendezvous)
        shard = topology.src_shard(rank) if rank in prefill else topology.dst_shard(rank - MAX_P)
        layers, _, _, block_size, _, head_dim = reference[meta["requests"][0]].shape
        cache = torch.full(
            (layers, 2, NUM_BLOCKS + 1, block_size, shard.num_kv_heads, head_dim), float("nan"), device=device
        )
        heads = slice(shard.kv_start, shard.kv_end)
        if rank in prefill:
            blocks = meta["src"]
            for request_id in meta["requests"]:
                cache[:, :, blocks[request_id]] = reference[request_id][:, :, :, :, heads].to(device)
        agent = KVTransferAgent({0: create_backend(TransferConfig(backend), topology, cache)}, 1)
        agent.warm_up()
    dist.barrier()
    if rank in decode:
        assert agent is not None
        compiled = _triton_cache_files() if device != "cpu" else []
        for request_id in meta["requests"]:
            agent.execute(KVCommand("recv", request_id, blocks[request_id], src_block_ids=meta["src"][request_id]))
        moved = sum(agent.wait(request_id).num_bytes for request_id in meta["requests"])
        if device != "cpu":  # the copy kernel compiled while the pools opened: no pull compiles one
            assert compiled, "no file in Triton's cache: the test's TRITON_CACHE_DIR is not in use"
            assert _triton_cache_files() == compiled, f"p={p} d={d}: a pull compiled a kernel"
        assert agent.staging_bytes() == 0
        # The leader copies for its whole group: every decode rank's heads, once; peers nothing.
        group_heads = sum(topology.dst_shard(r).num_kv_heads for r in range(d))
        head_bytes = cache[:, :, 0, :, 0].numel() * cache.element_size()  # one block, one head
        expected = sum(len(b) for b in blocks.values()) * group_heads * head_bytes
        assert moved == (expected if rank == MAX_P else 0), (backend, p, d, rank, moved, expected)
    dist.barrier()
    if rank in decode:
        assert cache is not None
        for request_id in meta["requests"]:
            got = cache[:, :, blocks[request_id]].cpu()
            if not torch.equal(got, reference[request_id][:, :, :, :, heads]):
                raise AssertionError(f"{backend} p={p} d={d}: KV of {request_id} differs on decode rank {rank - MAX_P}")
    dist.barrier()  # the prefill pools stay alive until every check is done
    if agent is not None:
        agent.close()


def _triton_cache_files() -> list[Path]:
    return sorted(Path(os.environ["TRITON_CACHE_DIR"]).rglob("*"))


def _rank_main(rank: int, port: int, work_dir: str, pulling: str | None = None, device: str = "cpu") -> None:
    """Every push backend (gloo) in every pair, or the pulling backend ``pulling`` on ``device``."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, MAX_P + MAX_D, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, world_size=MAX_P + MAX_D, rank=rank)
    try:
        meta = json.loads((Path(work_dir) / "meta.json").read_text())
        reference = load_file(str(Path(work_dir) / "kv.safetensors"))
        if pulling is not None:
            for p, d in PAIRS:
                _pull(rank, p, d, pulling, meta, reference, port, device)
            return
        for backend in BACKENDS:
            for p, d in PAIRS:
                if rank < p or MAX_P <= rank < MAX_P + d:
                    _exchange(rank, p, d, backend, meta, reference)
                dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reference_kv(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """KV of 16 prompts of mixed lengths from the single-process engine (8 query / 2 KV heads)."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dirs["tiny-llama"]),
            device="cpu",
            max_model_len=256,
            cache=CacheConfig(num_blocks=NUM_BLOCKS),
        )
    )
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(512) for _ in range(rng.randrange(3, 70))] for i in range(16)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0), prefill_only=True)
    tensors, src_blocks = {}, {}
    for outputs in engine.drain():
        for out in outputs:
            assert out.finish_reason == "prefilled" and out.kv_block_ids
            tensors[out.request_id] = engine.runner.kv_cache[:, :, out.kv_block_ids].contiguous()
            src_blocks[out.request_id] = out.kv_block_ids
    # The receiver gets other, shuffled block numbers.
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    dst_blocks = {}
    for request_id, blocks in src_blocks.items():
        dst_blocks[request_id] = [free.pop() for _ in blocks]
    work_dir = tmp_path_factory.mktemp("kv")
    save_file(tensors, str(work_dir / "kv.safetensors"))
    config = engine.model_config
    (work_dir / "meta.json").write_text(
        json.dumps(
            {
                "requests": list(prompts),
                "src": src_blocks,
                "dst": dst_blocks,
                "num_heads": config.num_heads,
                "num_kv_heads": config.num_kv_heads,
            }
        )
    )
    return work_dir


@pytest.mark.slow
def test_received_kv_is_bitwise_the_prefill_kv(reference_kv: Path) -> None:
    """Prefill TP 1, 2, 3 to decode TP 1, 2, 4 (2 KV heads: uneven, replicated, both ways), sync
    and async, one message or one per layer range, 16 requests in flight; a failing pair names
    itself in the rank's error."""
    port = free_port()
    RankProcesses(_rank_main, [(r, port, str(reference_kv)) for r in range(MAX_P + MAX_D)]).wait(600)


@pytest.mark.slow
def test_pulled_kv_is_bitwise_the_prefill_kv(reference_kv: Path) -> None:
    """The shm backend (the CPU twin of cuda-ipc): in every pair the decode leader copies each
    request straight from the prefill ranks' shared pools into its group's pools."""
    port = free_port()
    args = [(r, port, str(reference_kv), "shm") for r in range(MAX_P + MAX_D)]
    RankProcesses(_rank_main, args).wait(600)


@pytest.mark.gpu
def test_cuda_ipc_kv_is_bitwise_the_prefill_kv_between_processes_on_one_gpu(
    reference_kv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuda-ipc with every rank's pool in its own process on GPU 0 (a TP group could not share
    a GPU under NCCL, but the copy needs none): every pair, bitwise. Triton's cache starts empty,
    as on a new machine, and no pull compiles a kernel: opening the pools did."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # the spawned ranks inherit it
    port = free_port()
    args = [(r, port, str(reference_kv), "cuda-ipc", "cuda:0") for r in range(MAX_P + MAX_D)]
    RankProcesses(_rank_main, args).wait(600)


class _Backend:
    """Stands in for a backend: a fixed block size and buffers in flight."""

    def __init__(self, block_bytes: int, staging_bytes: int, up: bool = True, pulls: bool = False) -> None:
        self._block_bytes, self.staging_bytes, self._up, self.pulls = block_bytes, staging_bytes, up, pulls

    def staged_block_bytes(self) -> int:
        return self._block_bytes

    def connected(self) -> bool:
        return self._up


def test_staging_room_counts_every_peer_group_and_lets_a_lone_transfer_through() -> None:
    idle = KVTransferAgent({0: _Backend(100, 0), 1: _Backend(300, 0)}, max_staging_bytes=1000)  # type: ignore[dict-item]
    assert idle.has_staging_room(1, 50)  # 15000 bytes > the bound, but nothing is in flight
    busy = KVTransferAgent({0: _Backend(100, 400), 1: _Backend(300, 200)}, max_staging_bytes=1000)  # type: ignore[dict-item]
    assert busy.staging_bytes() == 600
    assert busy.has_staging_room(0, 4)  # 600 + 400
    assert not busy.has_staging_room(0, 5)  # 600 + 500
    assert not busy.has_staging_room(1, 2)  # 600 + 600: the peer group's block size counts
    connecting = KVTransferAgent({0: _Backend(100, 0, up=False)}, max_staging_bytes=1000)  # type: ignore[dict-item]
    assert not connecting.has_staging_room(0, 1)  # a pair group still forming (a restarted peer) takes nothing


def test_staging_room_leaves_a_waiting_transfer_its_room() -> None:
    busy = KVTransferAgent({0: _Backend(100, 400), 1: _Backend(300, 200)}, max_staging_bytes=1000)  # type: ignore[dict-item]
    assert busy.has_staging_room(0, 2, keep=(0, 2))  # 600 + 200 + 200
    assert not busy.has_staging_room(0, 2, keep=(1, 1))  # 600 + 200 + 300
    idle = KVTransferAgent({0: _Backend(100, 0), 1: _Backend(300, 0)}, max_staging_bytes=1000)  # type: ignore[dict-item]
    assert idle.has_staging_room(0, 5, keep=(0, 5))
    # One ahead that exceeds the bound goes only alone: nothing may go before it.
    assert not idle.has_staging_room(0, 1, keep=(1, 50))


def test_a_pulled_transfer_takes_no_staging_room() -> None:
    agent = KVTransferAgent({0: _Backend(100, 900), 1: _Backend(300, 0, pulls=True)}, max_staging_bytes=1000)  # type: ignore[dict-item]
    assert agent.has_staging_room(1, 50)  # pool to pool, whatever the others have in flight
    assert agent.has_staging_room(1, 50, keep=(0, 50))
    assert not agent.has_staging_room(0, 2)


def test_head_shards_used_by_the_backend_cover_the_model() -> None:
    topology = TransferTopology(8, 2, (0, 1, 2), (3,), 3)
    assert topology.dst_shard(0) == head_shard(8, 2, 1, 0)
    assert sum(piece.num_heads for piece in topology.plan()) == 2


def _gpu_rank_main(rank: int, init: str, work_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, world_size=2, rank=rank)
    try:
        meta = json.loads((Path(work_dir) / "meta.json").read_text())
        reference = load_file(str(Path(work_dir) / "kv.safetensors"))
        for backend in (("nccl", 1), ("nccl-async", 1), ("nccl-async", 4)):
            _exchange(rank, 1, 1, backend, meta, reference, first_decode_rank=1, device=f"cuda:{rank}")
            torch.cuda.synchronize()
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_nccl_sync_and_async_deliver_bitwise_kv_from_gpu0_to_gpu1(reference_kv: Path) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    RankProcesses(_gpu_rank_main, [(r, init, str(reference_kv)) for r in range(2)]).wait(300)


class _HeldWork:
    """A point-to-point send that completes when the test lets it."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def wait(self) -> bool:
        self.gate.wait()
        return True


@pytest.mark.parametrize(("p", "d", "kv_heads"), [(1, 4, 2), (1, 2, 1), (2, 4, 2), (3, 4, 2), (3, 1, 2), (2, 2, 4)])
def test_staging_room_asks_for_the_bytes_a_send_stages(p: int, d: int, kv_heads: int) -> None:
    """A prefill rank packs one buffer per piece of the plan, so a KV head replicated over
    several decode ranks is packed once for each: the room asked for must be those bytes, or
    the bound on buffers in flight is overrun."""
    num_heads, layers, block_size, head_dim = 8, 2, 4, 8
    gate = threading.Event()
    try:
        for rank in range(p):
            topology = TransferTopology(num_heads, kv_heads, tuple(range(p)), tuple(range(p, p + d)), rank)
            cache = torch.zeros(layers, 2, 9, block_size, topology.src_shard(rank).num_kv_heads, head_dim)
            backend = create_backend(TransferConfig("gloo-async"), topology, cache)
            backend._isend = lambda tensor, peer: _HeldWork(gate)  # type: ignore[attr-defined]
            agent = KVTransferAgent({0: backend}, max_staging_bytes=1 << 30)
            agent.send("t", [1, 2, 3], 0)
            staged = backend.staging_bytes  # what the send holds
            agent.max_staging_bytes = 2 * staged  # another one like it fits, exactly
            assert agent.has_staging_room(0, 3), (p, d, kv_heads, rank)
            if staged:  # (a rank that sends nothing asks for no room)
                agent.max_staging_bytes = 2 * staged - 1
                assert not agent.has_staging_room(0, 3), (p, d, kv_heads, rank)
    finally:
        gate.set()


@pytest.mark.parametrize(("p", "d", "kv_heads"), [(1, 3, 4), (3, 1, 4), (3, 4, 2), (2, 3, 8)])
def test_the_leaders_staging_figures_bound_every_ranks_buffers(p: int, d: int, kv_heads: int) -> None:
    """Only a group's leader checks the bound on buffers in flight, for all its ranks. Where the
    TP degree does not divide the KV heads, rank 0 holds the fewest: it counted its own bytes,
    and the others staged up to twice the bound."""
    num_heads, layers, block_size, head_dim, blocks = 8, 2, 4, 8, [1, 2, 3]
    gate = threading.Event()
    try:
        for prefill in (True, False):
            staged, leader = [], None
            for rank in range(p if prefill else d):
                global_rank = rank if prefill else p + rank
                topology = TransferTopology(num_heads, kv_heads, tuple(range(p)), tuple(range(p, p + d)), global_rank)
                shard = topology.src_shard(rank) if prefill else topology.dst_shard(rank)
                cache = torch.zeros(layers, 2, 9, block_size, shard.num_kv_heads, head_dim)
                backend = create_backend(TransferConfig("gloo-async"), topology, cache)
                backend._isend = backend._irecv = lambda tensor, peer: _HeldWork(gate)  # type: ignore[attr-defined]
                transfer = backend.send(blocks) if prefill else backend.recv(blocks, blocks)
                staged.append(transfer.num_bytes)  # type: ignore[attr-defined]
                leader = leader or backend
            assert leader is not None
            assert leader.staged_block_bytes() * len(blocks) >= max(staged), (prefill, staged)
            assert leader.staging_bytes >= max(staged), (prefill, staged)
    finally:
        gate.set()


def test_a_pair_group_that_fails_to_form_in_any_way_is_not_connected() -> None:
    """Forming the pair's group caught RuntimeError only: anything else (here a timeout too long
    for a timedelta) ended its thread silently, the pair counted as connected, and transfers
    went to the default process group."""
    rendezvous = PairRendezvous("127.0.0.1", free_port(), "kv/x/", 1e14)
    topology = TransferTopology(2, 2, (0,), (1,), 1, rendezvous)
    backend = create_backend(TransferConfig("gloo-async"), topology, torch.zeros(1, 2, 2, 1, 2, 1))
    with pytest.raises(TransferFailed, match="no KV connection to the peer group"):
        backend.recv([0], [0])
    assert not backend.connected()
