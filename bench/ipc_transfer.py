"""KV transfer through the pulling backends of one host (cuda-ipc; shm on CPU), against a device copy.

    python -m pdserve.bench.ipc_transfer --preset qwen2.5-1.5b --devices 0,0 --out ipc.json   # one GPU
    python -m pdserve.bench.ipc_transfer --preset qwen2.5-1.5b --devices 0,1                  # two GPUs
    python -m pdserve.bench.ipc_transfer --preset tiny-llama --devices cpu --tokens 256 --handoff-tokens 64 \\
        --iters 3                                                                          # CPU smoke run

Two processes, as in a cluster with ``--devices 0,0``: a prefill rank and a decode leader, each
with a paged KV pool of the preset's shape (bf16 on GPU, fp32 on CPU; blocks of 16 tokens) and
a ``KVTransferAgent`` over ``kvtransfer.base.create_backend`` (the code the workers run), on one
GPU or two (on one, under CUDA MPS as a cluster's ranks are; ``--no-mps``: time-sliced). The
prefill pool holds random values; a request's blocks are a shuffled, non-contiguous sample of
each pool, drawn independently on each side.

Cases, each a median over ``--iters`` rounds after ``--warmup`` untimed ones:

* ``move N`` (``--tokens``): the decode leader pulls one request of N tokens
  (``agent.recv`` + ``wait``), timed by the CUDA events around its copies (host clock on CPU).
  A matmul queued on the decode GPU just before keeps the GPU busy while the host issues the
  pull, so the time is the GPU's (uploading the block ids, the copies); what issuing costs the
  host is in the handoff's phases.
  Its baseline, in the same process and run: ``torch``'s copy of one contiguous tensor of the
  same byte size into another on the decode GPU (``Tensor.copy_``, events around it).
  ``pct_of_copy`` is copy time / pull time. The first round is verified: the pulled blocks
  equal the prefill pool's, bit for bit.
* ``handoff N`` (``--handoff-tokens``): "prefill done -> decode may start". The prefill rank
  stamps t0 and sends a ``KVAnnounce`` (``cluster.protocol``, with the N prompt ids and block
  ids) as group leaders of one node do (``cluster.datagrams``: a Unix datagram; t0 follows
  over ZMQ); the decode leader waits for it as its loop does (``cluster.inbox``, busy-polling
  for ``--leader-spin-ms`` after its last work, then asleep), decodes it, issues
  ``agent.recv`` and polls ``agent.done`` until true, and stamps t1: the KV is in its pool and
  its reply (which frees the prefill blocks) goes out. Its phases: the announce held
  (``announce_ms``), the copies issued (``issue_ms``), the copies done (``copy_ms``). Both
  stamps are ``time.perf_counter`` (CLOCK_MONOTONIC, one clock for every process of the host).
  Before each announce the prefill rank does what a prefill leader does: it runs the prompt
  (a stand-in: a GPU kernel that spins ``--prompt-ms``, or the CPU busy that long) and waits
  for its end, as the leader waits for the first token; the decode leader idles meanwhile, as
  between requests, and the GPU (one GPU) or the process wakes up from it. ``handoff N hot``
  announces back to back, as for a decode group that is busy anyway, and ``handoff N asleep``
  runs the prompt only ``--asleep-ms`` after the decode leader's last work, past its spin, so
  that it sleeps in ``poll()``.

Prints a table and writes it as JSON to ``--out``, with the issue's targets evaluated: move 16384
at >= 75% of the device copy, handoff 1024 <= 0.3 ms.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import msgpack
import torch
import torch.distributed as dist
import zmq

from pdserve.bench.common import bit_pattern, device_list, time_once, write_json
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.datagrams import DatagramOutbox
from pdserve.cluster.group import RankProcesses, free_port
from pdserve.cluster.inbox import LeaderInbox
from pdserve.cluster.mps import MpsDaemon, MpsError
from pdserve.cluster.protocol import KVAnnounce, Sampling, decode, encode
from pdserve.engine.config import ModelConfig
from pdserve.engine.parallel import head_shard
from pdserve.engine.presets import resolve_model
from pdserve.kvtransfer.agent import KVTransferAgent
from pdserve.kvtransfer.base import PairRendezvous, TransferConfig, TransferTopology, create_backend
from pdserve.kvtransfer.ipc import open_pool

BLOCK_SIZE = 16
TARGETS = (
    ("move 16384", "pct_of_copy", ">=", 75.0),
    ("handoff 1024", "median_ms", "<=", 0.3),
    ("handoff 1024 hot", "median_ms", "<=", 0.3),
)


def _pool(model: ModelConfig, num_blocks: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    heads = head_shard(model.num_heads, model.num_kv_heads, 1, 0).num_kv_heads
    shape = (model.num_layers, 2, num_blocks + 1, BLOCK_SIZE, heads, model.head_dim)
    return torch.empty(shape, dtype=dtype, device=device)


def _blocks(count: int, num_blocks: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=gen)[:count].tolist()


def _rank(rank: int, port: int, options: dict[str, Any], run_dir: str, result_path: str) -> None:
    os.environ.update(options["rank_env"])  # before CUDA starts: the MPS daemon, as a cluster's rank
    devices = options["devices"]
    device = f"cuda:{devices[rank]}" if devices else "cpu"
    if devices:
        torch.cuda.set_device(device)
    torch.set_num_threads(4)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    model = ModelConfig.from_pretrained(options["model_dir"])
    dtype = torch.bfloat16 if devices else torch.float32
    tokens, handoff = options["tokens"], options["handoff_tokens"]
    num_blocks = -(-max(tokens, handoff) // BLOCK_SIZE) * 2
    pool = _pool(model, num_blocks, device, dtype)
    if rank == 0:
        pool.normal_(generator=torch.Generator(device=device).manual_seed(7))
    rendezvous = PairRendezvous("127.0.0.1", port, "ipc/", 600.0)
    topology = TransferTopology(model.num_heads, model.num_kv_heads, (0,), (1,), rank, rendezvous)
    config = TransferConfig("cuda-ipc" if devices else "shm")
    agent = KVTransferAgent({0: create_backend(config, topology, pool)}, config.max_staging_bytes)
    agent.warm_up()
    ctx = zmq.Context.instance()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(f"ipc://{run_dir}/rank{rank}")
    out = ctx.socket(zmq.PUSH)
    out.connect(f"ipc://{run_dir}/rank{1 - rank}")
    result: dict[str, Any] = {}
    leader_at = f"ipc://{run_dir}/leader1"  # where the decode leader takes announces, as in a cluster
    if rank == 0:
        _prefill(options, inbox, out, leader_at, num_blocks, torch.device(device))
    else:
        announces = LeaderInbox(ctx, leader_at)
        result = _decode(options, rendezvous, agent, pool, inbox, out, announces, num_blocks, torch.device(device))
        announces.close()
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{1 - rank}"])  # the prefill pool outlives every pull
    agent.close()
    torch.save(result, result_path)


def _prefill(
    options: dict[str, Any], inbox: zmq.Socket, out: zmq.Socket, decode_at: str, num_blocks: int, device: torch.device
) -> None:
    """Announce one request per handoff round; move rounds need nothing but the pool."""
    announcer = DatagramOutbox()
    rounds = options["warmup"] + options["iters"]
    blocks = -(-options["handoff_tokens"] // BLOCK_SIZE)
    src = _blocks(blocks, num_blocks, seed=1)
    prompt = list(range(options["handoff_tokens"]))
    run_prompt = _prompt_stand_in(device)
    for _, idle_ms, prompt_ms in _handoff_cases(options):
        for i in range(rounds):
            msgpack.unpackb(inbox.recv())  # the decode leader is ready
            time.sleep(idle_ms / 1e3)
            run_prompt(prompt_ms)
            t0 = time.perf_counter()
            if not announcer.send(decode_at, encode(KVAnnounce(f"r{i}", 0, prompt, 1, Sampling(), block_ids=src))):
                raise RuntimeError("the announce did not go as a datagram")
            out.send(msgpack.packb(t0))
            msgpack.unpackb(inbox.recv())  # its reply: the blocks are free again


def _prompt_stand_in(device: torch.device) -> Callable[[float], None]:
    """What a prefill leader does before it announces: run the prompt's forward and wait for its
    first token. Here a kernel that spins on the GPU for the given milliseconds, then a
    synchronize, as the leader's read of the token; on CPU, the process computing that long."""
    if device.type != "cuda":

        def compute(ms: float) -> None:
            end = time.perf_counter() + ms / 1e3
            while time.perf_counter() < end:
                pass

        return compute
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # the first launch loads the kernel
    cycles_per_ms = cycles / time_once(lambda: torch.cuda._sleep(cycles), device)

    def run(ms: float) -> None:
        if ms > 0:
            torch.cuda._sleep(int(ms * cycles_per_ms))
            torch.cuda.synchronize()

    return run


def _handoff_cases(options: dict[str, Any]) -> list[tuple[str, float, float]]:
    """Each handoff case: its name, how long nothing happens before a round's prompt, and how long
    the prompt's stand-in runs (milliseconds)."""
    tokens, prompt_ms = options["handoff_tokens"], options["prompt_ms"]
    return [
        (f"handoff {tokens}", 0.0, prompt_ms),
        (f"handoff {tokens} hot", 0.0, 0.0),
        (f"handoff {tokens} asleep", options["asleep_ms"], prompt_ms),
    ]


def _decode(
    options: dict[str, Any],
    rendezvous: PairRendezvous,
    agent: KVTransferAgent,
    pool: torch.Tensor,
    inbox: zmq.Socket,
    out: zmq.Socket,
    announces: LeaderInbox,
    num_blocks: int,
    device: torch.device,
) -> dict[str, Any]:
    tokens, rounds = options["tokens"], options["warmup"] + options["iters"]
    count = -(-tokens // BLOCK_SIZE)
    src, dst = _blocks(count, num_blocks, seed=1), _blocks(count, num_blocks, seed=2)
    num_bytes = count * agent.backends[0].block_bytes()
    source = open_pool(rendezvous.connect_store(), 0)  # the prefill pool, mapped here as the backend maps it
    pulls, copies = [], []
    a = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    busy = torch.randn(8192, 8192, device=device, dtype=pool.dtype) if device.type == "cuda" else None
    for i in range(rounds):
        pool[:, :, dst] = float("nan")
        if busy is not None:
            torch.cuda.synchronize()
            torch.mm(busy, busy)  # the GPU works while the host issues the pull
        transfer_id = f"m{i}"
        agent.recv(transfer_id, dst, 0, src)
        moved = agent.wait(transfer_id)
        if i == 0 and not torch.equal(bit_pattern(pool[:, :, dst]), bit_pattern(source[:, :, src])):
            raise AssertionError("the pulled blocks differ from the prefill pool's")
        copy_ms = time_once(lambda: b.copy_(a), device)
        if i >= options["warmup"]:
            pulls.append(moved.seconds * 1e3)
            copies.append(copy_ms)
        assert moved.num_bytes == num_bytes
    pull_ms, copy_ms = statistics.median(pulls), statistics.median(copies)
    h_tokens = options["handoff_tokens"]
    h_count = -(-h_tokens // BLOCK_SIZE)
    h_dst = _blocks(h_count, num_blocks, seed=3)
    handoff_cases = {}
    for name, _, _ in _handoff_cases(options):
        handoffs: list[float] = []
        phases: list[tuple[float, float, float]] = []  # announce held, copies issued, copies done
        for i in range(rounds):
            out.send(msgpack.packb("ready"))
            spin_until = time.monotonic() + options["leader_spin_ms"] / 1e3  # as a leader after its last work
            while not (messages := announces.receive(20, spin_until)):
                pass
            (data,) = messages
            announce = decode(data)
            held = time.perf_counter()
            assert isinstance(announce, KVAnnounce)
            agent.recv(announce.request_id, h_dst, announce.prefill_group, announce.block_ids)
            issued = time.perf_counter()
            while not agent.done(announce.request_id):
                pass
            t1 = time.perf_counter()
            t0 = msgpack.unpackb(inbox.recv())  # read last: waiting for it must not delay the pull
            agent.wait(announce.request_id)
            out.send(msgpack.packb("freed"))
            if i >= options["warmup"]:
                handoffs.append((t1 - t0) * 1e3)
                phases.append(((held - t0) * 1e3, (issued - held) * 1e3, (t1 - issued) * 1e3))
        handoff_cases[name] = {
            "bytes": h_count * agent.backends[0].block_bytes(),
            "median_ms": statistics.median(handoffs),
            "p90_ms": sorted(handoffs)[int(0.9 * (len(handoffs) - 1))],
            "announce_ms": statistics.median(p[0] for p in phases),
            "issue_ms": statistics.median(p[1] for p in phases),
            "copy_ms": statistics.median(p[2] for p in phases),
            "samples_ms": handoffs,
        }
    return {
        f"move {tokens}": {
            "bytes": num_bytes,
            "median_ms": pull_ms,
            "gbps": num_bytes / pull_ms / 1e6,
            "copy_median_ms": copy_ms,
            "copy_gbps": num_bytes / copy_ms / 1e6,
            "pct_of_copy": 100 * copy_ms / pull_ms,
            "samples_ms": pulls,
            "copy_samples_ms": copies,
        },
        **handoff_cases,
    }


def evaluate(cases: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target whose case ran: its value and whether it holds."""
    checks = []
    for case, key, op, bound in TARGETS:
        if case in cases:
            value = cases[case][key]
            met = value >= bound if op == ">=" else value <= bound
            checks.append({"case": case, "key": key, "target": f"{op} {bound:g}", "value": value, "met": met})
    return checks


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--preset", "model", default="qwen2.5-1.5b", help="A shape preset or a model directory.")
@click.option("--devices", default="0,0", help="GPUs of the prefill and the decode rank; cpu (or empty): CPU (shm).")
@click.option("--tokens", default=16384, help="Tokens of the moved request.")
@click.option("--handoff-tokens", default=1024, help="Tokens of the handed-off request.")
@click.option("--iters", default=20)
@click.option("--warmup", default=3)
@click.option("--prompt-ms", default=5.0, help="How long the prefill rank's stand-in for a prompt runs.")
@click.option(
    "--asleep-ms", default=200.0, help="The asleep case: idle time before each prompt, past the leader's spin."
)
@click.option(
    "--leader-spin-ms",
    type=float,
    default=None,
    help="The decode leader's busy-poll after its last work (the cluster's --leader-spin-ms).",
    show_default="the cluster's default",
)
@click.option(
    "--mps/--no-mps",
    default=True,
    help="Run both ranks under CUDA MPS when they share one GPU, as a cluster's ranks do (a running control "
    "daemon, or one of the bench's own).",
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(
    model: str,
    devices: str,
    tokens: int,
    handoff_tokens: int,
    iters: int,
    warmup: int,
    prompt_ms: float,
    asleep_ms: float,
    leader_spin_ms: float | None,
    mps: bool,
    out: Path | None,
) -> None:
    """Pull KV pool to pool between two processes; print a table, write JSON."""
    device_ids = [int(d) for d in device_list(devices).split(",") if d.strip()]
    if device_ids and len(device_ids) != 2:
        raise click.UsageError("--devices: the prefill rank's GPU and the decode rank's (e.g. 0,0), or empty")
    if device_ids and not torch.cuda.is_available():
        raise click.UsageError(f"--devices {devices} needs a GPU and none is visible; --devices cpu runs on the CPU")
    try:
        spin_ms = 1e3 * ClusterConfig(leader_spin_ms=leader_spin_ms).leader_spin_s(bool(device_ids))
    except ValueError as e:
        raise click.UsageError(f"--leader-spin-ms: {e}") from None
    if asleep_ms <= spin_ms:
        raise click.UsageError(f"--asleep-ms {asleep_ms:g} must exceed the leader's spin, {spin_ms:g} ms")
    options = {
        "model_dir": str(resolve_model(model)),
        "devices": device_ids,
        "tokens": tokens,
        "handoff_tokens": handoff_tokens,
        "iters": iters,
        "warmup": warmup,
        "prompt_ms": prompt_ms,
        "asleep_ms": asleep_ms,
        "leader_spin_ms": spin_ms,
    }
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pdserve-ipc-") as run_dir:
        daemon = None
        if mps and len(set(device_ids)) == 1:
            try:
                daemon = MpsDaemon.ensure(run_dir)
            except MpsError as e:
                raise click.ClickException(f"{e} (or run with --no-mps)") from None
        options["rank_env"] = daemon.rank_env(None) if daemon is not None else {}
        options["mps"] = daemon is not None
        paths = [os.path.join(run_dir, f"result{r}.pt") for r in range(2)]
        try:
            RankProcesses(_rank, [(r, port, options, run_dir, paths[r]) for r in range(2)]).wait(600)
        finally:
            if daemon is not None:
                daemon.stop()
        cases = torch.load(paths[1])
    checks = evaluate(cases)
    print(f"{model} on {'GPUs ' + devices if device_ids else 'CPU'}, backend {'cuda-ipc' if device_ids else 'shm'}")
    print(f"{'case':20} {'MB':>8} {'median ms':>10} {'GB/s':>8} {'copy ms':>8} {'copy GB/s':>10} {'% of copy':>9}")
    for name, c in cases.items():
        if name.startswith("move"):
            print(
                f"{name:20} {c['bytes'] / 1e6:8.1f} {c['median_ms']:10.3f} {c['gbps']:8.0f} "
                f"{c['copy_median_ms']:8.3f} {c['copy_gbps']:10.0f} {c['pct_of_copy']:9.1f}"
            )
        else:
            print(
                f"{name:20} {c['bytes'] / 1e6:8.1f} {c['median_ms']:10.3f}   (p90 {c['p90_ms']:.3f} ms; announce "
                f"{c['announce_ms']:.3f}, issue {c['issue_ms']:.3f}, copy {c['copy_ms']:.3f})"
            )
    for check in checks:
        verdict = "met" if check["met"] else "NOT met"
        print(f"target {check['case']} {check['key']} {check['target']}: {check['value']:.3f} {verdict}")
    write_json(
        {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(),
            "device": torch.cuda.get_device_name(device_ids[0]) if device_ids else platform.processor(),
            "torch": torch.__version__,
            "options": options,
            "cases": cases,
            "targets": checks,
        },
        out,
    )


if __name__ == "__main__":
    main()
