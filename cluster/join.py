"""A group node: one worker group on this machine that joins a running cluster, and leaves it.

The router node (``launch.py --master-addr``) serves a TCPStore, torch.distributed's rendezvous,
with what a group needs to join (``Cluster._publish``). This node reads it there, takes the next
index of its role from the store's counter (``add``), records its TP degree, and spawns its ranks:
they form the group's world in the same store (``tp/<role><index>.g0/``), its leader listens on
TCP at ``--advertise-addr`` and registers with the router through the ready message. The router
admits it and introduces it to every group of the other role, with which it forms a KV pair
group in that store as a restarted group would: nothing else restarts.

Leaving: SIGTERM (or Ctrl-C) sends the router ``drain``; the router stops giving the group
requests, shuts it down once it holds none, and the ranks exit. A node that stops before its
group was admitted says so in the store (``compare_set``) and the group never joins. A node
killed outright takes its ranks with it (they die with their parent); the router removes the
group when its heartbeats stop, and marks it ``removed`` in the store: a node that still runs
(its heartbeats lost on the way) then stops its ranks.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq

from pdserve.cluster import reaper
from pdserve.cluster.config import ROLES, Addresses, ClusterConfig, GroupLayout, cluster_settings, split_host_port
from pdserve.cluster.group import (
    SAME_STOP_S,
    STOP_SIGNALS,
    RankProcesses,
    connect_store,
    free_port,
    group_specs,
    group_state_key,
    group_tp_key,
    stop_signals_held,
)
from pdserve.cluster.launcher import ClusterError, model_shape, resolve_transfer
from pdserve.cluster.protocol import Drain, GroupFailed, Message, encode
from pdserve.cluster.rank import WorkerSpec, worker_main
from pdserve.engine.config import ModelConfig
from pdserve.engine.parallel import check_tp_size
from pdserve.engine.presets import resolve_model
from pdserve.engine.weights import check_checkpoint

logger = logging.getLogger(__name__)

# Settings a group node may set for itself; the rest are the cluster's, from the router node.
NODE_SETTINGS = frozenset(
    {
        "join",
        "role",
        "tp",
        "advertise_addr",
        "join_timeout",
        "model",
        "devices",
        "num_blocks",
        "gpu_memory_utilization",
        "prefill_gpu_memory_utilization",
        "decode_gpu_memory_utilization",
    }
)
# The router node's own GPUs: the devices, and the memory shares of its roles where they share one.
_ROUTER_NODE_GPUS = frozenset({"devices", "prefill_gpu_memory_utilization", "decode_gpu_memory_utilization"})
_POLL_S = 0.2
_STORE_CHECK_S = 2.0
_SHUTDOWN_GRACE_S = 10.0
_GREETING_WAIT_S = 0.3  # a ZMQ socket greets at once; the store never does


def _wait_listening(host: str, port: int, timeout: float, stopped: Callable[[], bool] = lambda: False) -> bool:
    """Wait until something accepts connections at ``host:port`` (the router node may start
    after this one), at most ``timeout`` seconds; False if ``stopped()`` first. Probed here, not
    by torch's store, which logs every failed try with a C++ stack and takes two of its timeouts
    to give up."""
    deadline = time.monotonic() + timeout
    said = False
    while not stopped():
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, left))):
                return True
        except OSError:
            if left <= 0:
                raise TimeoutError(f"nothing accepts connections at {host}:{port}") from None
            if not said:  # a node started first would otherwise wait without a word
                logger.info("waiting for the router node at %s:%d (up to %g s, --join-timeout)", host, port, timeout)
                said = True
            time.sleep(min(0.2, max(0.0, left)))
    return False


def node_settings(cluster: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The settings a group node runs with: the cluster's (as its router node publishes them),
    less those of the router node's own GPUs (this machine has its own, which its group does not
    share with the other role), then those typed on this node."""
    settings = {key: value for key, value in cluster.items() if key not in _ROUTER_NODE_GPUS}
    settings.update(given)
    return settings


class GroupNode:
    """``start()`` joins the cluster at ``join``; ``serve()`` runs until SIGTERM, SIGINT or SIGHUP, then drains."""

    def __init__(self, given: dict[str, Any]) -> None:
        """``given``: the settings typed on this node's command line (flat keys)."""
        foreign = sorted(k for k in given if k not in NODE_SETTINGS)
        if foreign:
            own = ", ".join("--" + k.replace("_", "-") for k in sorted(NODE_SETTINGS))
            raise ValueError(
                f"--{foreign[0].replace('_', '-')} is a setting of the router node: a group node (--join) "
                f"takes the cluster's; it may set only {own}"
            )
        self.given = given
        self.join = str(given["join"])
        self.role = str(given["role"])
        defaults = {spec.key: spec.default for spec in cluster_settings() if spec.key in ("tp", "join_timeout")}
        self.tp = int(given.get("tp", defaults["tp"]))
        self.join_timeout = float(given.get("join_timeout", defaults["join_timeout"]))
        self.index = -1
        self.processes: RankProcesses | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-node-")
        self._reaper: subprocess.Popen[bytes] | None = None
        self._stop_requested = False
        self._first_stop: float | None = None
        self._leave_now = False  # stopped again while it drained: the group leaves without waiting
        self._handlers: dict[int, Any] = {}

    @property
    def name(self) -> str:
        return f"{self.role} group {self.index}"

    def start(self) -> None:
        """Read the cluster's settings from its rendezvous, check this node can serve them, take
        an index and spawn the ranks. Every mistake raises ``ValueError`` or ``ClusterError``
        with one line, before any rank starts."""
        # From here a stop is a request that ``serve`` honours: the ranks must not be orphaned half-way.
        self._handlers = {sig: signal.signal(sig, self.request_stop) for sig in STOP_SIGNALS}
        host, port = split_host_port(self.join, "--join")
        self._store_address = f"tcp://{f'[{host}]' if ':' in host else host}:{port}"
        try:
            if not _wait_listening(host, port, self.join_timeout, lambda: self._stop_requested):
                return  # stopped while it waited for the router node: nothing to undo
            if (what := _not_a_store(host, port)) is not None:
                raise ClusterError(
                    f"{self.join} is {what}, not a router node's rendezvous: --join takes its "
                    "--master-addr:--master-port"
                )
            self.store = connect_store(self._store_address, timeout_s=self.join_timeout)
            settings = json.loads(self.store.get("cluster/settings"))
            shape = json.loads(self.store.get("cluster/model"))
            router = self.store.get("cluster/router").decode()
        except ClusterError:  # a RuntimeError too, but its own one line
            raise
        except (RuntimeError, ValueError, TimeoutError) as e:  # torch's store errors are RuntimeErrors
            raise ClusterError(
                f"no pdserve router node answers at {self.join} within {self.join_timeout:g} s "
                f"(its --master-addr:--master-port?): {str(e).splitlines()[0]}"
            ) from None
        config = ClusterConfig.from_settings(node_settings(settings, self.given), origin=f"the cluster at {self.join}")
        roles = ("colocated",) if config.mode == "colocated" else ("prefill", "decode")
        if self.role not in roles:
            raise ValueError(f"--role {self.role}: the cluster at {self.join} runs --mode {config.mode}, roles {roles}")
        self.config = config
        model_dir = str(resolve_model(config.engine.model))
        model = ModelConfig.from_pretrained(model_dir)
        check_checkpoint(Path(model_dir), model)  # bad weights: one line here, not a traceback from every rank
        if model_shape(model) != shape:
            raise ValueError(f"--model {config.engine.model}: not the model the cluster at {self.join} serves")
        try:
            check_tp_size(model.num_heads, model.num_kv_heads, self.tp)
        except ValueError as e:
            raise ValueError(f"--tp {self.tp}: {e}") from None
        devices = self._devices(config)
        on_gpu = devices is not None
        config.check_model(model, on_gpu)  # this node's own --num-blocks, the cluster's --kernels on its devices
        transfer = resolve_transfer(config.transfer, on_gpu, peer_access=False, joinable=True)
        config.check_watchdog(transfer)
        engine = config.engine_config(model_dir, model)
        if on_gpu:
            engine = config.rank_engine(engine, self.role, 1)
        advertise = config.advertise_addr or _route_to(host, port)
        try:  # before an index is taken: a refusal here leaves the cluster as it was
            leader_port = free_port(advertise)
        except OSError as e:
            raise ClusterError(f"--advertise-addr {advertise}: not an address of this machine ({e.strerror})") from None
        if self._stop_requested:  # stopped while it waited for the router node: nothing to undo
            return
        self.index = int(self.store.add(f"next/{self.role}", 1)) - 1
        self.store.set(group_tp_key(self.role, self.index), str(self.tp))
        self.store.set(group_state_key(self.role, self.index), "starting")
        name = f"{self.role}{self.index}"
        endpoint_host = f"[{advertise}]" if ":" in advertise else advertise
        addresses = Addresses(self._tmp.name, "", {"router": router, name: f"tcp://{endpoint_host}:{leader_port}"})
        self.address = addresses.leader(self.role, self.index)
        self._reaper = reaper.spawn(self._tmp.name)
        self._router = router
        specs = [
            WorkerSpec(
                rank_spec,
                self.role,
                self.index,
                addresses,
                GroupLayout({role: [] for role in ROLES}),  # peers come as the router introduces them
                transfer,
                timing=config.rank_timing(on_gpu),
                generations={role: [] for role in ROLES},
            )
            for rank_spec in group_specs(
                engine,
                self.tp,
                self._store_address,
                devices,
                addresses.steps(self.role, self.index),
                store_prefix=f"tp/{name}.g0/",
            )
        ]
        with stop_signals_held():
            self.processes = RankProcesses(worker_main, [(spec,) for spec in specs])
        where = "CPU" if devices is None else "GPUs " + ",".join(map(str, devices))
        logger.info("%s starting on %s, listening on %s, transfer %s", self.name, where, self.address, transfer.backend)

    def _devices(self, config: ClusterConfig) -> tuple[int, ...] | None:
        visible = torch.cuda.device_count()
        if visible == 0 or config.devices == ():  # no GPU, or --devices cpu
            if config.devices:
                raise ValueError(f"--devices {','.join(map(str, config.devices))} given but no GPU is visible")
            return None
        devices = tuple(config.devices) if config.devices is not None else tuple(range(visible))
        if any(not 0 <= d < visible for d in devices):
            raise ValueError(f"--devices {','.join(map(str, devices))}: {visible} GPU(s) visible")
        if len(set(devices[: self.tp])) < self.tp:
            raise ValueError(f"--tp {self.tp} needs {self.tp} distinct GPUs, --devices gives {len(set(devices))}")
        return devices[: self.tp]

    def request_stop(self, *_: object) -> None:
        now = time.monotonic()
        if self._first_stop is None:
            self._first_stop = now
        elif now - self._first_stop >= SAME_STOP_S and not self._leave_now:
            # As the launcher: whoever signals twice will not wait for the drain.
            logger.warning("stop signal again: the group leaves now, its requests move to other groups")
            self._leave_now = True
        self._stop_requested = True

    def serve(self, joined: Callable[[], None] | None = None) -> int:
        """Supervise the ranks until a stop is requested, then leave the cluster; the exit status.
        ``joined()`` runs once the router has admitted the group."""
        if self.processes is None:  # stopped before it spawned anything
            self._cleanup()
            return 0
        admitted = False
        next_check = 0.0
        try:
            while not self._stop_requested:
                failure = self.processes.failure()
                if failure is not None:
                    self._tell_router(GroupFailed(self.role, self.index, failure))  # its requests move now
                    return self._abandon(f"{self.name} failed: {failure}; the router removes it")
                if not self.processes.alive():  # every rank exited 0: the router shut the cluster down
                    logger.info("%s stopped: the cluster shut down", self.name)
                    return 0
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + (_POLL_S if not admitted else _STORE_CHECK_S)
                    if not self._store_listens():
                        return self._router_gone()
                    try:
                        state = self.store.get(group_state_key(self.role, self.index))
                    except RuntimeError:
                        return self._router_gone()
                    if state == b"removed":
                        return self._abandon(f"the router removed {self.name}: its heartbeats stopped reaching it")
                    if not admitted and state == b"joined":
                        admitted = True
                        if joined is not None:
                            joined()
                time.sleep(_POLL_S)
            return self._leave()
        finally:
            self._cleanup()

    def _leave(self) -> int:
        """Drain the group through the router, or, if it was never admitted, keep it out."""
        assert self.processes is not None
        key = group_state_key(self.role, self.index)
        try:
            state = self.store.compare_set(key, "starting", "left") if self._store_listens() else None
        except RuntimeError:
            state = None
        if state is None:
            return self._abandon(f"the router node at {self.join} is gone")
        if state != b"joined":
            self.processes.kill()
            logger.info("%s stopped before it joined", self.name)
            return 0
        logger.info("%s drains: the router sends it no new requests and stops it once it holds none", self.name)
        self._tell_router(Drain(self.role, self.index))
        deadline = time.monotonic() + self.config.drain_timeout + 60
        while True:
            ended = not self.processes.alive()  # before the failures: a rank that ends between is among them
            if (failure := self.processes.failure()) is not None:
                return self._abandon(f"{self.name} did not leave cleanly: {failure}")
            if ended:
                logger.info("%s left the cluster", self.name)
                return 0
            if self._leave_now:  # the router moves its requests, as for a failed group
                self._tell_router(GroupFailed(self.role, self.index, "its node was stopped again while it drained"))
                self.processes.kill()
                logger.info("%s left the cluster at once", self.name)
                return 0
            if time.monotonic() > deadline:
                return self._abandon(f"{self.name} did not leave within --drain-timeout + 60 s")
            time.sleep(_POLL_S)

    def _store_listens(self) -> bool:
        """Whether the router node's store still takes connections. Asked before each use of the
        store: torch's client logs a C++ stack when its server closed the connection under it."""
        host, port = split_host_port(self.join, "--join")
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            return False

    def _tell_router(self, message: Message) -> None:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)  # a router that is gone does not hold this node up
        sock.connect(self._router)
        sock.send(encode(message))
        sock.close()

    def _router_gone(self) -> int:
        """The store went away with the router node: if it shut the cluster down, the group was
        told to stop and its ranks exit on their own; if it died, they would wait for ever."""
        assert self.processes is not None
        try:
            self.processes.wait(timeout=_SHUTDOWN_GRACE_S)
        except (TimeoutError, RuntimeError):
            return self._abandon(f"the router node at {self.join} is gone")
        logger.info("%s stopped: the cluster shut down", self.name)
        return 0

    def _abandon(self, why: str) -> int:
        logger.error(why)
        if self.processes is not None:
            self.processes.kill()
        return 1

    def _cleanup(self) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._tmp.cleanup()
        if self._reaper is not None:
            reaper.stop(self._reaper)


def _not_a_store(host: str, port: int) -> str | None:
    """What listens at ``host:port`` if it is plainly not torch's store, which waits for its
    client to speak first; checked before the store's client, which would log a C++ stack for
    each of its tries."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as probe:
            probe.settimeout(_GREETING_WAIT_S)
            greeting = probe.recv(16)
    except TimeoutError:
        return None  # silent, as the store is
    except OSError:
        return None  # gone again: the store's client says so
    if greeting[:1] == b"\xff" and greeting[9:10] == b"\x7f":
        return "a ZMQ socket (a cluster's client --port?)"
    return "a service that speaks first" if greeting else None


def _route_to(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent: a UDP connect only
    picks the source address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])
