"""A worker rank process, and the leader loop every role shares.

The leader (TP rank 0 of a group) owns the engine and the group's control sockets: a PULL
inbox bound at its address (the router and the other role's leaders push to it) and PUSH
sockets to the router and to other leaders. Peers run ``ModelRunner.run_peer``.

``Leader`` is the colocated ("pd") role: the engine serves whole requests. The prefill and
decode roles subclass it (``prefill_worker``, ``decode_worker``).
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from pdserve.cluster.config import Addresses, GroupLayout
from pdserve.cluster.group import RankSpec, init_distributed
from pdserve.cluster.protocol import (
    Abort,
    Message,
    ProtocolError,
    Ready,
    Shutdown,
    TokenOutput,
    TokenOutputs,
    WorkerError,
    WorkerStats,
    WorkRequest,
    decode,
    encode,
)
from pdserve.engine.config import ModelConfig
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.sampling import RequestError
from pdserve.kvtransfer.agent import CommandChannel, KVTransferAgent, connect_groups
from pdserve.kvtransfer.base import TransferConfig

logger = logging.getLogger(__name__)

_STATS_INTERVAL_S = 0.2


@dataclass(frozen=True)
class WorkerSpec:
    rank: RankSpec
    role: str  # prefill | decode | colocated
    group: int
    addresses: Addresses
    layout: GroupLayout
    transfer: TransferConfig


class Leader:
    """The colocated role, and the socket plumbing and loop of every role."""

    role = "colocated"

    def __init__(self, spec: WorkerSpec, engine: LLMEngine, agent: KVTransferAgent | None) -> None:
        self.spec = spec
        self.engine = engine
        self.agent = agent
        self.ctx = zmq.Context.instance()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(spec.addresses.leader(self.role, spec.group))
        self.to_router = self._push(spec.addresses.router)
        self._leaders: dict[tuple[str, int], zmq.Socket] = {}
        self.next_index: dict[str, int] = {}  # request -> index of its next output token
        self.stopping = False
        self.kv_refused = 0
        self._outputs: list[TokenOutput] = []

    def _push(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(address)
        return sock

    def send_router(self, message: Message) -> None:
        self.to_router.send(encode(message))

    def send_leader(self, role: str, group: int, message: Message) -> None:
        key = (role, group)
        if key not in self._leaders:
            self._leaders[key] = self._push(self.spec.addresses.leader(role, group))
        self._leaders[key].send(encode(message))

    # -- loop ----------------------------------------------------------------------------

    def run(self) -> None:
        self.send_router(Ready(self.role, self.spec.group, self.engine.stats().num_blocks))
        next_stats = 0.0
        try:
            while not self.stopping or self.transfers_pending():
                timeout = 0 if self.busy() else 20
                while self.inbox.poll(timeout):
                    self._dispatch(self.inbox.recv())
                    timeout = 0
                self.background()
                if self.engine.has_unfinished() and not self.stopping:
                    self.send_outputs(self.engine.step(emit=self.send_outputs))
                if time.monotonic() >= next_stats:
                    self.send_router(self.stats())
                    next_stats = time.monotonic() + _STATS_INTERVAL_S
        finally:
            self.close()

    def stats(self) -> WorkerStats:
        s = self.engine.stats()
        return WorkerStats(self.role, self.spec.group, s.num_blocks, s.free_blocks, s.running, s.waiting, s.kv_held,
                           self.kv_refused)

    def busy(self) -> bool:
        return self.engine.has_unfinished() or self.transfers_pending()

    def transfers_pending(self) -> bool:
        """KV handed to or from another group and not yet settled (must finish before exit)."""
        return False

    def background(self) -> None:
        """Work between steps that is not a message (transfers to poll, retries)."""

    def _dispatch(self, data: bytes) -> None:
        try:
            message = decode(data)
        except ProtocolError as e:  # internal sockets: log and carry on
            logger.error("%s%d: dropped a bad internal message: %s", self.role, self.spec.group, e)
            return
        self.handle(message)

    def handle(self, message: Message) -> None:
        if isinstance(message, WorkRequest):
            self.add(message)
        elif isinstance(message, Abort):
            self.abort(message.request_id)
        elif isinstance(message, Shutdown):
            self.stopping = True
        else:
            logger.error("%s%d: unexpected %s", self.role, self.spec.group, message.type)

    def add(self, request: WorkRequest, prefill_only: bool = False) -> bool:
        """Queue a request in the engine; a refused one gets a terminal error at the router."""
        try:
            self.engine.add_request(request.request_id, request.token_ids, request.sampling.to_params(),
                                    prefill_only=prefill_only)
        except RequestError as e:
            self.send_router(WorkerError(request.request_id, "invalid_request", str(e)))
            return False
        self.next_index[request.request_id] = 0
        return True

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.next_index.pop(request_id, None)

    def on_output(self, out: RequestOutput) -> None:
        self.emit(out, out.timings)

    def emit(self, out: RequestOutput, timings: dict[str, float]) -> None:
        """Queue a request's new tokens for the router (sent once per step, ``flush_outputs``)."""
        index = self.next_index.get(out.request_id, 0)
        self._outputs.append(TokenOutput(out.request_id, index, out.new_token_ids, out.finished, out.finish_reason,
                                         timings if out.finished else {}))
        if out.finished:
            self.next_index.pop(out.request_id, None)
        else:
            self.next_index[out.request_id] = index + len(out.new_token_ids)

    def send_outputs(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to the router now (also those the engine read back ahead of an eager
        step, before its launch)."""
        for out in outputs:
            self.on_output(out)
        self.flush_outputs()

    def flush_outputs(self) -> None:
        """One message per step for every request's tokens: per-request messages cost more than
        the decode step itself at large batch sizes."""
        if self._outputs:
            self.send_router(TokenOutputs(self._outputs))
            self._outputs = []

    def close(self) -> None:
        self.engine.abort_all()
        if self.agent is not None:
            self.agent.close()
        self.engine.close()  # releases the TP peers and the CUDA graphs before the group goes
        for sock in (self.inbox, self.to_router, *self._leaders.values()):
            sock.close()


def _agent(spec: WorkerSpec, kv_cache: torch.Tensor, model: ModelConfig,
           channel: CommandChannel | None = None) -> KVTransferAgent | None:
    """Backends to every group of the other role (prefill -> each decode group, and back)."""
    if spec.role == "colocated":
        return None
    other = "decode" if spec.role == "prefill" else "prefill"
    return connect_groups(spec.transfer, kv_cache, model.num_heads, model.num_kv_heads,
                          spec.layout.ranks[spec.role][spec.group], spec.layout.ranks[other],
                          spec.role == "prefill", spec.rank.global_rank, channel)


def _die_with_launcher() -> None:
    """Linux: have the kernel SIGKILL this rank if the launcher dies, so no rank is orphaned."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_PR_SET_PDEATHSIG = 1


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a rank process: join the world, build the engine, serve until shutdown."""
    from pdserve.decode_worker.worker import DecodeLeader
    from pdserve.prefill_worker.worker import PrefillLeader

    _die_with_launcher()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher drives shutdown, not Ctrl-C
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec.role}{spec.group}.{spec.rank.engine.parallel.tp_rank} %(levelname)s %(message)s")
    tp: TensorParallel = init_distributed(spec.rank)
    try:
        config = spec.rank.engine
        if config.parallel.is_leader:
            engine = LLMEngine(config, tp)
            agent = _agent(spec, engine.kv_cache, engine.model_config, engine.step_channel)
            leader_cls = {"prefill": PrefillLeader, "decode": DecodeLeader, "colocated": Leader}[spec.role]
            leader_cls(spec, engine, agent).run()
        else:
            model = ModelConfig.from_pretrained(config.model)
            runner = ModelRunner(config, model, tp)
            runner.run_peer(_agent(spec, runner.kv_cache, model))
    finally:
        dist.destroy_process_group()
