"""The KV transfer interface and the registry of backends.

A backend moves the KV of one request from the ranks of a prefill group to the ranks of a
decode group, following the resharding plan. Each rank calls it for its own part: a prefill
rank ``send``s its pieces, a decode rank ``recv``s the pieces it needs. Both return a
``Transfer`` handle; a synchronous backend returns one that is already complete.

Ordering invariant: between one prefill rank and one decode rank, transfers are issued in the
same order on both sides (the decode leader accepts transfers in order, and every rank issues
its part in accept order), as point-to-point collectives require.

Push backends (``torch_dist``) send from the prefill side into receives the decode side posted.
A pulling backend (``ipc``: CUDA IPC, shared memory) copies on the decode side straight from
the prefill pool: its ``recv`` needs the prefill side's block ids, its ``send`` has nothing to do,
and the prefill side keeps the blocks until the decode side reports the pull complete.

A new backend (NIXL, RDMA) subclasses ``TransferBackend`` and registers itself with
``@register_backend("name", BackendTraits(...))``; the workers only ever see this interface, and
the launcher only its traits (where it may run, whether it blocks).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from pdserve.engine.config import setting
from pdserve.engine.parallel import HeadShard, head_shard
from pdserve.kvtransfer.plan import Piece, resharding_plan


@dataclass(frozen=True)
class TransferStats:
    """Bytes this rank moved for one transfer, and how long it took.

    On CUDA the time comes from events recorded around the transfer on the compute stream
    (``events``): host clocks would only see the enqueue. Reading ``seconds`` then waits for the
    end event, so read it once the request is done, not on the hot path.
    """

    num_bytes: int
    host_seconds: float  # from submit to the host observing completion
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = field(default=None, repr=False, compare=False)

    @property
    def seconds(self) -> float:
        if self.events is None:
            return self.host_seconds
        start, end = self.events
        end.synchronize()
        return start.elapsed_time(end) / 1e3


@dataclass(frozen=True)
class TransferConfig:
    """How KV moves between a prefill and a decode group."""

    backend: str = setting(
        "auto",
        help="KV transfer backend: a name in the registry (cuda-ipc, nccl, nccl-async, shm, gloo, gloo-async).",
        section="KV transfer",
        default_text="auto: cuda-ipc on GPUs of one host with peer access, nccl-async otherwise or once groups "
        "may join (--master-addr), gloo on CPU",
        key="transfer",
    )
    # Beyond the bound the prefill side holds its announce and the decode side refuses one.
    staging_mib: float = setting(
        4096.0,
        help="KV buffers (packed sends, posted receives) a rank may hold for transfers in flight, MiB.",
        section="KV transfer",
    )
    # With more than one, gathering, the wire and scattering of different layer ranges overlap.
    layer_groups: int = setting(
        1,
        help="KV messages per request and destination rank, each a contiguous range of layers.",
        section="KV transfer",
    )

    def __post_init__(self) -> None:
        if self.backend != "auto" and self.backend not in available_backends():
            raise ValueError(
                f"unknown KV transfer backend {self.backend!r}; available: auto, {', '.join(available_backends())}"
            )
        # Named by their settings' keys (transfer_...), as the launcher shows a check's message.
        if not 0 < self.staging_mib < math.inf:
            raise ValueError(f"transfer_staging_mib must be a positive finite number, got {self.staging_mib}")
        if self.layer_groups < 1:
            raise ValueError(f"transfer_layer_groups must be >= 1, got {self.layer_groups}")

    @property
    def traits(self) -> BackendTraits:
        """The backend's traits (``auto`` resolved first: ``resolved``)."""
        return backend_traits(self.backend)

    @property
    def max_staging_bytes(self) -> int:
        return max(1, int(self.staging_mib * 2**20))

    def resolved(self, on_gpu: bool, peer_access: bool = True) -> TransferConfig:
        """This config with ``auto`` replaced by the backend for the device, checked against it.
        ``peer_access``: every prefill GPU and decode GPU pair can map each other's memory (one
        host; a GPU always can its own)."""
        if self.backend == "auto":
            backend = ("cuda-ipc" if peer_access else "nccl-async") if on_gpu else "gloo"
            return dataclasses.replace(self, backend=backend)
        traits = self.traits
        if traits.device == "cuda" and not on_gpu:
            raise ValueError(f"--transfer {self.backend} needs GPUs; on CPU use {' or '.join(backends_for('cpu'))}")
        if traits.device == "cpu" and on_gpu:
            raise ValueError(
                f"--transfer {self.backend} moves CPU tensors; on GPUs use {' or '.join(backends_for('cuda'))}"
            )
        if traits.same_host and on_gpu and not peer_access:
            raise ValueError(
                f"--transfer {self.backend} needs peer access between every prefill and decode GPU; use "
                f"{' or '.join(backends_for('cuda', same_host=False))}"
            )
        return self


@dataclass(frozen=True)
class PairRendezvous:
    """Where the ranks of one (prefill group, decode group) pair meet to form a process group
    of their own: a TCPStore and a key prefix that names both groups' generations, so that a
    restarted group forms a new pair group with the survivors while nobody else restarts."""

    host: str
    port: int
    prefix: str  # e.g. "kv/prefill0.g0-decode1.g2/"
    timeout_s: float  # the pair group's own: forming it waits for a restarted peer's start-up
    # One transfer's wait on the wire, after which it fails: gloo never fails a receive whose
    # sender died mid-message, it waits out the group's timeout.
    transfer_timeout_s: float = math.inf

    def connect_store(self) -> dist.Store:
        """A client of the store, its keys under the pair's prefix."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        return dist.PrefixStore(self.prefix, dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout))


@dataclass(frozen=True)
class TransferTopology:
    """One (prefill group, decode group) pair as seen from one of its ranks."""

    num_heads: int
    num_kv_heads: int
    # Ranks in the process group the transfers use, index = TP rank in the group: global ranks of
    # the default world, or, with ``rendezvous``, 0.. for prefill then decode in the pair's group.
    prefill_ranks: tuple[int, ...]
    decode_ranks: tuple[int, ...]
    global_rank: int
    rendezvous: PairRendezvous | None = None

    @property
    def is_prefill(self) -> bool:
        return self.global_rank in self.prefill_ranks

    @property
    def tp_rank(self) -> int:
        ranks = self.prefill_ranks if self.is_prefill else self.decode_ranks
        return ranks.index(self.global_rank)

    def plan(self) -> tuple[Piece, ...]:
        return resharding_plan(self.num_heads, self.num_kv_heads, len(self.prefill_ranks), len(self.decode_ranks))

    def src_shard(self, rank: int) -> HeadShard:
        return head_shard(self.num_heads, self.num_kv_heads, len(self.prefill_ranks), rank)

    def dst_shard(self, rank: int) -> HeadShard:
        return head_shard(self.num_heads, self.num_kv_heads, len(self.decode_ranks), rank)


class TransferFailed(RuntimeError):
    """A transfer cut off (its peer died, or its pair group was abandoned): no KV was written."""


class Transfer(ABC):
    """A transfer in flight on this rank."""

    @abstractmethod
    def done(self) -> bool:
        """Non-blocking: has this rank's part completed (received data already in the cache)?"""

    @abstractmethod
    def wait(self) -> TransferStats:
        """Block until complete; the received KV is then in this rank's cache. Raises
        ``TransferFailed`` for a transfer that was cut off."""

    def discard(self) -> None:
        """Give the transfer up: a receive never writes into the cache, even if its data lands
        later (its blocks may be reused at once); its buffers go when the wire is done with them."""


class TransferBackend(ABC):
    """Moves KV blocks of ``kv_cache`` (``[layers, 2, blocks, block_size, kv_heads, head_dim]``)."""

    pulls: bool = False  # the decode side copies from the prefill pool (see the module docstring)

    def __init__(self, config: TransferConfig, topology: TransferTopology, kv_cache: torch.Tensor) -> None:
        self.config = config
        self.topology = topology
        self.kv_cache = kv_cache

    @abstractmethod
    def send(self, block_ids: list[int]) -> Transfer:
        """Prefill rank: send this rank's pieces of the KV in ``block_ids`` to every decode rank."""

    @abstractmethod
    def recv(self, block_ids: list[int], src_block_ids: list[int]) -> Transfer:
        """Decode rank: receive this rank's pieces into ``block_ids`` (its own numbering);
        ``src_block_ids``: the same blocks in the prefill group's numbering (pulling backends)."""

    @property
    @abstractmethod
    def staging_bytes(self) -> int:
        """Bytes of KV buffers this rank holds for transfers not yet complete: packed sends and
        posted receives."""

    def block_bytes(self) -> int:
        """Bytes one block of this rank's KV (all layers, K and V, all its heads) takes."""
        layers, _, _, block_size, heads, head_dim = self.kv_cache.shape
        return 2 * layers * block_size * heads * head_dim * self.kv_cache.element_size()

    def staged_block_bytes(self) -> int:
        """Bytes of buffers one block of a transfer takes on this rank while in flight (what
        ``staging_bytes`` grows by): by default this rank's KV of the block."""
        return self.block_bytes()

    def warm_up(self) -> None:
        """Open this rank's connections to its peers now, not on the first request (NCCL builds a
        communicator per rank pair lazily, slowly, at its first use). Every rank of both groups
        calls it."""

    def close(self) -> None:
        """Wait for whatever is still in flight."""

    def connected(self) -> bool:
        """Whether the pair can move KV now (a backend that forms its connections in the
        background says False until they are up)."""
        return True

    def abandon(self) -> None:
        """The peer group died: fail every transfer in flight without waiting for it."""


@dataclass(frozen=True)
class BackendTraits:
    """What the launcher checks of a backend before any rank runs it."""

    device: Literal["cpu", "cuda"]  # where the KV pools it moves between live
    blocking: bool = False  # a transfer holds its leader's loop until it completes (or its lease ends)
    same_host: bool = False  # both groups on one host (on GPUs: each pair of GPUs with peer access)
    shares_gpu: bool = True  # a prefill and a decode rank may be on one GPU


BackendFactory = Callable[[TransferConfig, TransferTopology, torch.Tensor], TransferBackend]
_REGISTRY: dict[str, tuple[BackendFactory, BackendTraits]] = {}


def register_backend(name: str, traits: BackendTraits) -> Callable[[BackendFactory], BackendFactory]:
    def wrap(factory: BackendFactory) -> BackendFactory:
        _REGISTRY[name] = (factory, traits)
        return factory

    return wrap


def _registry() -> dict[str, tuple[BackendFactory, BackendTraits]]:
    # The built-in backends register themselves when their module is imported; importing it
    # here (not at the top: it imports this module) spares every caller that step.
    from pdserve.kvtransfer import ipc, torch_dist  # noqa: F401

    return _REGISTRY


def available_backends() -> list[str]:
    """Names of the registered backends, the built-in ones included."""
    return sorted(_registry())


def backends_for(device: Literal["cpu", "cuda"], **wanted: bool) -> list[str]:
    """The registered backends for ``device`` whose traits have the ``wanted`` values."""
    return [
        name
        for name, (_, traits) in sorted(_registry().items())
        if traits.device == device and all(getattr(traits, trait) == value for trait, value in wanted.items())
    ]


def backend_traits(name: str) -> BackendTraits:
    if name == "auto":
        raise ValueError("resolve the 'auto' transfer backend first (TransferConfig.resolved)")
    return _registry()[name][1]


def create_backend(config: TransferConfig, topology: TransferTopology, kv_cache: torch.Tensor) -> TransferBackend:
    if config.backend == "auto":
        raise ValueError("resolve the 'auto' transfer backend first (TransferConfig.resolved)")
    return _registry()[config.backend][0](config, topology, kv_cache)
