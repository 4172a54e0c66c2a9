"""Starting, serving, supervising and stopping a whole cluster: router in this process, ranks spawned.

Supervision: a group whose rank dies (process sentinel) or goes silent (the router's heartbeat
check) is failed: all its ranks are killed, the router moves its requests, and the group is
spawned again after a back-off as its next generation (a new TP world, new KV pair groups with
the survivors, who keep serving). A group that fails again after ``max_restarts`` restarts in a
row stays down (one that served a minute between failures starts its count afresh:
``RestartBudget``); when a role has no group left the cluster stops.
The HTTP front end, which holds no state, is started again at once, under the same budget.
With ``api_servers`` > 1 each of its processes is supervised alone, with its own restart count:
one that dies is restarted while the others serve the port on; they share a directory of the
run directory for their metrics (``router.metrics``).

Multi-node (``--master-addr``): this node is the router node. The rendezvous store listens on
``--master-addr:--master-port`` and holds what a group node needs to join (``cluster.join``): the
router's control endpoint, the cluster's settings, the model's shape, and a counter per role that
hands out group indices. The router and the groups started here take their control messages over
TCP on that address. A joined group is admitted by ``_admit`` (its index handed out by the store,
a TP degree the model allows) and is removed, never restarted, when its heartbeats stop: its own
node supervises it.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import zmq

from pdserve.cluster import reaper
from pdserve.cluster.auth import DEFAULT_CLIENT, check_client_keys, check_router_keys
from pdserve.cluster.config import API_KEY_ENV, Addresses, ClusterConfig, GroupLayout
from pdserve.cluster.group import (
    SAME_STOP_S,
    STOP_SIGNALS,
    RankProcesses,
    connect_store,
    die_with_parent,
    exit_words,
    free_port,
    group_specs,
    group_state_key,
    group_tp_key,
    stop_signals_held,
)
from pdserve.cluster.mps import MpsDaemon, MpsError
from pdserve.cluster.protocol import Ready
from pdserve.cluster.rank import WorkerSpec, worker_main
from pdserve.engine.config import EngineConfig, ModelConfig, flatten_config
from pdserve.engine.parallel import check_tp_size
from pdserve.engine.presets import check_model_spec, resolve_model
from pdserve.engine.tokenization import load_tokenizer
from pdserve.engine.weights import check_checkpoint
from pdserve.kvtransfer.base import TransferConfig, backends_for
from pdserve.router.metrics import MULTIPROC_DIR_ENV
from pdserve.router.router import Router
from pdserve.router.stats_log import StatsLog

logger = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    pass


class StoppedBeforeReady(ClusterError):
    """A stop signal came before the cluster was ready, and every process it started has ended:
    the stop asked for, not a failure (a service manager's stop during a slow start)."""


_MAX_BACKOFF_S = 30.0
_STABLE_S = 60.0  # a process that served this long before it fails starts its count afresh
_GIVE_UP_DRAIN_S = 10.0  # for the front ends to pass the error of a cluster that gives up to their clients


@dataclass
class RestartBudget:
    """The restarts of one supervised part (a group, a front end), as systemd's start limit: a
    back-off that doubles with each failure in a row, and ``max_restarts`` restarts in a row at
    most. A failure after ``_STABLE_S`` of serving starts the count afresh, so a service that
    fails now and then over weeks is never given up; one that fails again at once soon is."""

    max_restarts: int
    backoff: float
    failures_in_row: int = 0

    def failed(self, served: float | None) -> float | None:
        """A failure after ``served`` seconds of serving (None: it never got ready): the delay
        before the restart, or None when it stays down."""
        stable = served is not None and served >= _STABLE_S
        self.failures_in_row = 1 if stable else self.failures_in_row + 1
        if self.failures_in_row > self.max_restarts:
            return None
        doublings = min(self.failures_in_row - 1, 64)  # past the cap long before; 2**1024 is no float
        return min(self.backoff * 2**doublings, _MAX_BACKOFF_S)


@dataclass
class _Group:
    """One worker group under supervision: its processes (None while down) and its history."""

    role: str
    index: int
    tp: int
    devices: tuple[int, ...] | None
    budget: RestartBudget
    processes: RankProcesses | None = None
    generation: int = 0
    started: float = 0.0
    ready_since: float | None = None
    restart_at: float | None = None  # when down: when it is spawned again; None: for good

    @property
    def key(self) -> tuple[str, int]:
        return (self.role, self.index)


@dataclass
class _FrontEnd:
    """One HTTP front-end process under supervision, ``slot`` of ``api_servers`` (``process`` is
    None once it is down for good), and its restarts."""

    slot: int
    budget: RestartBudget
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0


class Cluster:
    """``start()`` spawns every rank and waits for the groups; ``serve()`` runs the router until
    SIGINT, SIGTERM or SIGHUP, then drains in-flight requests and stops every process."""

    def __init__(self, config: ClusterConfig, require_tokenizer: bool = False) -> None:
        self.config = config
        self.require_tokenizer = require_tokenizer
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-")
        self._reaper: subprocess.Popen[bytes] | None = None
        self.addresses = Addresses(self._tmp.name, f"tcp://{config.host}:{config.port}")
        self.groups: dict[tuple[str, int], _Group] = {}
        self.router: Router | None = None
        self.front_ends: list[_FrontEnd] = []
        self.mps: MpsDaemon | None = None
        self._stopping = False
        self._cut_drain = False  # a second stop signal: what is still in flight ends now
        self._first_stop_signal: float | None = None  # time.monotonic() of the first; None: none yet

    @property
    def endpoint(self) -> str:
        return self.addresses.client

    @property
    def stop_requested(self) -> bool:
        """A stop signal came (the cluster drains, or will once ``serve`` sees it)."""
        return self._first_stop_signal is not None

    def summary(self) -> str:
        c = self.config
        if c.mode == "colocated":
            groups = f"{c.colocated_groups} colocated group(s) x tp{c.colocated_tp}"
        else:
            groups = (
                f"{c.prefill_groups} prefill x tp{c.prefill_tp} -> {c.decode_groups} decode x tp{c.decode_tp}"
                f", transfer {self.transfer.backend}"
            )
        where = "GPUs " + ",".join(str(d) for p in self.placement for d in (p or ())) if self._on_gpu else "CPU"
        joins = f", groups join at {c.master_addr}:{c.master_port}" if c.master_addr is not None else ""
        return f"{Path(self.model_dir).name}: {groups} on {where}, dispatch {c.dispatch}{joins}"

    def start(self) -> None:
        """Check everything a user can get wrong, then spawn the ranks and wait until every group
        is ready. A mistake raises ``ValueError`` or ``ClusterError`` before any rank starts; a
        stop signal meanwhile ends what was started and raises ``ClusterError``."""
        # Loading can take minutes: a stop then must end the ranks here, not leave the interpreter
        # waiting for them at exit (multiprocessing joins its children), and SIGTERM as Ctrl-C does.
        interrupted = False

        def interrupt(signum: int, frame: object) -> None:
            nonlocal interrupted
            if interrupted:  # the same stop (timeout(1) signals the process group too): being undone
                return
            interrupted = True
            raise KeyboardInterrupt

        previous = {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS}
        try:
            self._start()
        except BaseException:
            # A library may turn the KeyboardInterrupt into an error of its own (transformers'
            # lazy imports report an import cut short as ModuleNotFoundError): the stop is the cause.
            if not interrupted:
                raise
            started = any(g.processes is not None for g in self.groups.values()) or bool(self._live_front_ends())
            self._abandon()
            ended = ": every process it started has ended" if started else " (no process had started)"
            raise StoppedBeforeReady(f"stopped before the cluster was ready{ended}") from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start(self) -> None:
        c = self.config
        warning = None if c.auth_keys is not None else exposure_warning(c.host)
        if warning is not None:
            logger.warning(warning)
        check_model_spec(c.engine.model)  # a mistyped name is the mistake to name, not a busy port
        if c.auth_keys is not None:
            _check_keys(c.auth_keys, front_end=c.http_port is not None)
        for port, flag in ((c.port, "--port"), (c.http_port, "--http-port")):
            if port is not None:
                _check_port_free(c.host, port, flag)
        if c.master_addr is not None:
            _check_port_free(c.master_addr, c.master_port, "--master-addr/--master-port")
            if not _is_loopback(c.master_addr):
                logger.warning(
                    "--master-addr %s: the rendezvous store and the control sockets of the router and the groups "
                    "listen there unauthenticated: keep it on a network only the cluster's machines reach",
                    c.master_addr,
                )
        # Devices first: a preset's random weights (gigabytes) are written only where they can run.
        visible = torch.cuda.device_count()
        self.placement = c.placement(visible)
        if c.devices and len(c.devices) > c.world_size:
            logger.warning(
                "--devices lists %d GPUs; the cluster's %d ranks use the first %d: %s",
                len(c.devices),
                c.world_size,
                c.world_size,
                ",".join(map(str, c.devices[: c.world_size])),
            )
        self.model_dir = str(resolve_model(c.engine.model))
        model = ModelConfig.from_pretrained(self.model_dir)
        check_checkpoint(Path(self.model_dir), model)  # bad weights: one line here, not a traceback from every rank
        on_gpu = self._on_gpu = any(p is not None for p in self.placement) or (not self.placement and visible > 0)
        c.check_model(model, on_gpu)
        self.transfer = resolve_transfer(c.transfer, on_gpu, _peer_access(c, self.placement), c.joinable)
        c.check_shared_gpus(self.placement, self.transfer.backend)
        c.check_watchdog(self.transfer)
        engine = c.engine_config(self.model_dir, model)
        tokenizer = load_tokenizer(self.model_dir)
        if tokenizer is None and self.require_tokenizer:
            raise ClusterError(
                f"{c.engine.model} has no tokenizer (random-weight presets have none), so it cannot "
                "answer text prompts; use --model demo or a Hugging Face directory with one"
            )
        if tokenizer is None and c.http_port is not None:  # as vLLM's --skip-tokenizer-init
            logger.warning(
                "%s has no tokenizer: the HTTP API takes prompts of token ids only (text prompts and chats get a 400)",
                c.engine.model,
            )
        if c.http_port is not None and c.generation_config == "auto":
            from pdserve.router.openai_api import generation_defaults  # pydantic: only for an HTTP API

            generation_defaults(self.model_dir)  # a bad generation_config.json: one line here, not a failed front end
        self._engine = engine
        self._model = model
        self._layout = GroupLayout.of(c)
        self._reaper = reaper.spawn(self._tmp.name)  # removes the run directory even if this process is killed
        # The rendezvous of every group's world and every KV pair group: served here, so that it
        # outlives any worker.
        if c.master_addr is None:
            self._store_address = f"tcp://127.0.0.1:{free_port()}"
        else:
            self._store_address = f"tcp://{_endpoint_host(c.master_addr)}:{c.master_port}"
            self.addresses = self.addresses.over_tcp(
                c.master_addr, ["router", *(f"{role}{index}" for role, index, _ in c.groups())]
            )
        self._store = connect_store(self._store_address, serve=True)
        if c.master_addr is not None:
            self._publish(engine, model)
        self._start_mps(on_gpu)
        for (role, index, tp), devices in zip(c.groups(), self.placement):
            self.groups[(role, index)] = _Group(
                role, index, tp, devices, RestartBudget(c.max_restarts, c.restart_backoff)
            )
        try:
            self.router = Router(
                c,
                self.addresses,
                tokenizer,
                model.vocab_size,
                engine.max_model_len,
                admit=self._admit if c.master_addr is not None else None,
            )
        except zmq.ZMQError as e:
            self._cleanup()
            # Free at the early check, taken since (a first start converting the demo model takes
            # a while): said as that check says it.
            raise _cannot_listen(c.host, c.port, e.errno, zmq.strerror(e.errno)) from None
        for group in self.groups.values():
            self._spawn(group)
        deadline = time.monotonic() + c.start_timeout
        while True:
            # Ready once every group is, and every KV pair between them can move KV: a pair forms
            # in the background (its first use may compile a kernel), and requests would wait for it.
            groups_ready = all(self.router.is_ready(key) for key in self.groups)
            forming = self.router.pairs_forming() if groups_ready else []
            if groups_ready and not forming:
                break
            self.router.poll(100)
            failure = next(
                (f"{g.role} group {g.index}: {f}" for g in self.groups.values() if (f := self._failure(g))), None
            )
            if failure is not None:
                self._abandon()
                raise ClusterError(f"a worker failed to start: {failure}")
            if time.monotonic() > deadline:
                self._abandon()
                if forming:
                    raise ClusterError(
                        f"the KV transfer pairs of {', '.join(forming)} did not connect in {c.start_timeout:.0f} s"
                    )
                raise ClusterError(f"workers not ready after {c.start_timeout:.0f} s")
        now = time.monotonic()
        for group in self.groups.values():
            group.ready_since = now
        if c.http_port is not None:
            self._start_http(c.http_port)

    def _publish(self, engine: EngineConfig, model: ModelConfig) -> None:
        """What a group node reads from the store to join (``cluster.join``)."""
        c = self.config
        settings = {k: list(v) if isinstance(v, tuple) else v for k, v in flatten_config(c).items()}
        for key in ("master_addr", "master_port", "api_key"):  # the router node's own (the key is a secret)
            settings.pop(key)
        # With no group here, each group node resolves auto for its own devices.
        settings["transfer"] = self.transfer.backend if c.groups() else c.transfer.backend
        settings["max_model_len"] = engine.max_model_len
        self._store.set("cluster/settings", json.dumps(settings))
        self._store.set("cluster/model", json.dumps(model_shape(model)))
        self._store.set("cluster/router", self.addresses.router)
        for role in ("prefill", "decode", "colocated"):
            self._store.add(f"next/{role}", sum(r == role for r, _, _ in c.groups()))
        for role, index, tp in c.groups():
            self._store.set(group_tp_key(role, index), str(tp))

    def _admit(self, ready: Ready) -> str | None:
        """Whether a group that says it is ready may join (None), or why not."""
        c = self.config
        roles = ("colocated",) if c.mode == "colocated" else ("prefill", "decode")
        if ready.role not in roles:
            return f"a {ready.role} group cannot join a {c.mode} cluster"
        first = sum(r == ready.role for r, _, _ in c.groups())
        if not first <= ready.group < int(self._store.add(f"next/{ready.role}", 0)):
            return f"this cluster's rendezvous never handed out {ready.role} group index {ready.group}"
        try:
            check_tp_size(self._model.num_heads, self._model.num_kv_heads, ready.tp)
        except ValueError as e:
            return f"TP {ready.tp}: {e}"
        key = group_tp_key(ready.role, ready.group)
        if not self._store.check([key]) or int(self._store.get(key)) != ready.tp:
            return f"TP {ready.tp} is not the one its node registered"
        if not ready.address.startswith("tcp://"):
            return f"its address {ready.address!r} is not a TCP endpoint"
        # The node may have stopped before its group got here: then the group stays out.
        state = self._store.compare_set(group_state_key(ready.role, ready.group), "starting", "joined")
        if state != b"joined":
            return "its node stopped before the group was ready"
        return None

    def _spawn(self, group: _Group) -> None:
        """Start every rank of a group as its current generation."""
        c = self.config
        generations = {
            role: [self.groups[(role, i)].generation for i in range(len(self._layout.ranks[role]))]
            for role in ("prefill", "decode")
        }
        sharing = max((c.groups_on(self.placement, d) for d in group.devices or ()), default=1)
        specs = [
            WorkerSpec(
                rank_spec,
                group.role,
                group.index,
                self.addresses,
                self._layout,
                self.transfer,
                env=self.mps.rank_env(c.sm_percent(group.role)) if self.mps is not None else {},
                generation=group.generation,
                generations=generations,
                timing=c.rank_timing(on_gpu=bool(group.devices)),
            )
            for rank_spec in group_specs(
                c.rank_engine(self._engine, group.role, sharing) if group.devices else self._engine,
                group.tp,
                self._store_address,
                group.devices,
                self.addresses.steps(group.role, group.index),
                store_prefix=f"tp/{group.role}{group.index}.g{group.generation}/",
            )
        ]
        with stop_signals_held():
            group.processes = RankProcesses(worker_main, [(spec,) for spec in specs])
        group.started = time.monotonic()
        group.ready_since = None
        group.restart_at = None

    def _failure(self, group: _Group) -> str | None:
        return None if group.processes is None else group.processes.failure()

    @property
    def http_url(self) -> str | None:
        return None if self.config.http_port is None else f"http://{self.config.host}:{self.config.http_port}"

    def _start_http(self, port: int) -> None:
        """The OpenAI-compatible front ends, each in its own process (so that none shares an
        interpreter lock with the router loop), returning once every one listens: each says so
        on a pipe of its own (several share the port, so connecting to it cannot tell)."""
        c = self.config
        if c.api_servers > 1:
            os.mkdir(self._metrics_dir)
        self.front_ends = [
            _FrontEnd(slot, RestartBudget(c.max_restarts, c.restart_backoff)) for slot in range(c.api_servers)
        ]
        waiting: dict[int, _FrontEnd] = {}
        for front_end in self.front_ends:
            read, write = os.pipe()
            waiting[read] = front_end
            try:
                self._spawn_http(front_end, ready_fd=write)
            finally:
                os.close(write)  # the child's copy is the only one: its exit ends the pipe
        deadline = time.monotonic() + c.start_timeout
        failed = False
        while waiting and not failed:
            self.router.poll(50)  # the front ends ask the router for its stats while they start
            readable, _, _ = select.select(list(waiting), [], [], 0)
            for fd in readable:
                failed |= not os.read(fd, 1)  # closed unsaid: it exited before it listened
                os.close(fd)
                del waiting[fd]
            failed |= time.monotonic() > deadline
        for fd in waiting:
            os.close(fd)
        if failed:
            self._abandon()
            raise ClusterError(f"the HTTP front end did not start on port {port} (its error is above)")

    @property
    def _metrics_dir(self) -> str:
        return os.path.join(self._tmp.name, "prometheus")

    def _http_name(self, front_end: _FrontEnd) -> str:
        if self.config.api_servers == 1:
            return "the HTTP front end"
        pid = f" (pid {front_end.process.pid})" if front_end.process is not None else ""
        return f"the HTTP front end {front_end.slot}{pid}"

    def _spawn_http(self, front_end: _FrontEnd, ready_fd: int | None = None) -> None:
        c = self.config
        assert c.http_port is not None and self.router is not None
        command = [
            sys.executable,
            "-m",
            "pdserve.router.openai_server",
            "--endpoint",
            self.endpoint,
            "--model",
            c.engine.model,
            *(["--served-model-name", c.served_model_name] if c.served_model_name is not None else []),
            "--host",
            c.host,
            "--port",
            str(c.http_port),
            "--drain-timeout",
            str(c.drain_timeout),
            "--log-level",
            "warning",
            "--max-message-mib",
            str(c.max_message_mib),
            "--max-prompt-chars",
            str(self.router.max_prompt_chars),
            "--send-timeout",
            str(c.send_timeout),
            *(["--auth-keys", c.auth_keys] if c.auth_keys is not None else []),
            *(["--allowed-origins", c.allowed_origins] if c.allowed_origins is not None else []),
            *(["--parse-special-tokens"] if c.parse_special_tokens else []),  # prompts read as the router reads them
            *(["--access-log"] if c.access_log else []),
            "--generation-config",
            c.generation_config,
            *(["--reuse-port"] if c.api_servers > 1 else []),
            *(["--ready-fd", str(ready_fd)] if ready_fd is not None else []),
        ]
        # A session of its own: Ctrl-C reaches the whole foreground process group, and a front
        # end that got it besides the launcher's SIGTERM would take the second signal as "exit now".
        env = dict(os.environ)  # PDSERVE_API_KEY there reaches the front end as it is
        if c.api_key is not None:  # in its environment: on its command line, ps would show it
            env[API_KEY_ENV] = c.api_key
        if c.api_servers > 1:
            env[MULTIPROC_DIR_ENV] = self._metrics_dir
        front_end.started = time.monotonic()
        front_end.process = subprocess.Popen(
            command,
            preexec_fn=die_with_parent,
            start_new_session=True,
            env=env,
            pass_fds=() if ready_fd is None else (ready_fd,),
        )

    def request_stop(self, *_: object) -> None:
        now, first = time.monotonic(), self._first_stop_signal
        if first is None:
            self._first_stop_signal = now
        # A drain that until() began (the demo's end) says "stop again" too: a signal then cuts it.
        # A repeat within SAME_STOP_S is the same stop: timeout(1) signals the launcher, then its
        # whole process group.
        again = self._stopping if first is None else now - first >= SAME_STOP_S
        if again and not self._cut_drain:
            # As uvicorn does: whoever signals twice will not wait for the drain. The requests
            # still end, each with its one terminal message, and every process still stops.
            logger.warning("stop signal again: requests still in flight end now (error 'shutdown')")
            self._cut_drain = True

    def serve(self, until: Callable[[], bool] | None = None, serving: Callable[[], None] | None = None) -> None:
        """Route requests until a stop is requested (signal, or ``until()`` returning True), then
        drain. ``serving()`` runs once the signal handlers are in place, so whoever it tells the
        endpoint to may stop the cluster at once. The handlers stay installed through the drain: a
        second signal ends the drain (``request_stop``), it must not kill the process while its
        requests and workers still have to be told."""
        assert self.router is not None
        previous = {sig: signal.signal(sig, self.request_stop) for sig in STOP_SIGNALS}
        try:
            if serving is not None:
                serving()
            stats_log = StatsLog(self.config.log_stats_interval, time.monotonic())
            while not self.stop_requested and not (until is not None and until()):
                self.router.poll(50)
                self._check_workers()
                now = time.monotonic()
                if stats_log.due(now):
                    r = self.router
                    line = stats_log.line(
                        now,
                        r.token_counts,
                        len(r.requests),
                        r.worker_stats,
                        r.entry_role,
                        len(r.parked),
                        r.group_states(),
                        {name: now - at for name, at in r.stats_time.items()},
                    )
                    if line is not None:
                        logger.info("%s", line)
            self.shutdown()
        except BaseException:
            # A fault of the launcher's own: its ranks, left running with no router, would hold
            # their GPUs, and the interpreter would wait for them at exit for ever.
            self._abandon()
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _check_workers(self) -> None:
        """Fail groups whose ranks died or went silent, restart those whose back-off is over."""
        assert self.router is not None
        c = self.config
        now = time.monotonic()
        for group in self.groups.values():
            if group.processes is None:
                if group.restart_at is not None and now >= group.restart_at:
                    self._restart(group)
                continue
            if group.ready_since is None and self.router.is_ready(group.key):
                group.ready_since = now
            failure = self._failure(group)
            if failure is None and group.ready_since is None and now - group.started > c.start_timeout:
                failure = f"not ready {c.start_timeout:.0f} s after its restart"
            if failure is not None:
                self._group_failed(group, failure)
        failures = self.router.reported_failures() + self.router.check_heartbeats(c.heartbeat_timeout)
        seen: set[tuple[str, int]] = set()
        for role, index, cause in failures:
            if (role, index) in seen:  # reported by its node and overdue in one pass: one failure
                continue
            seen.add((role, index))
            group = self.groups.get((role, index))
            if group is None:  # joined from another node, which supervises it: removed, not restarted
                if self.router.group_state((role, index)) == "down":
                    continue  # gone already (drained, or removed earlier in this pass)
                logger.error("%s group %d (joined at run time) failed: %s; it leaves the cluster", role, index, cause)
                self.router.group_failed(role, index, cause)
                self._store.set(group_state_key(role, index), "removed")  # if its node still runs, it stops it
            elif group.processes is not None:
                self._group_failed(group, cause)
        if self._stopping or self.stop_requested:
            return
        for front_end in self.front_ends:
            if front_end.process is not None and front_end.process.poll() is not None:
                self._http_failed(front_end)

    def _http_failed(self, front_end: _FrontEnd) -> None:
        """Start a front-end process again: it holds nothing but its own clients' connections,
        gone with it (the router aborts their requests); the others serve the port meanwhile.
        Past ``max_restarts`` in a row of its own it stays down, and the ZMQ endpoint serves on."""
        assert front_end.process is not None
        c = self.config
        name = self._http_name(front_end)
        logger.error("%s %s", name, exit_words(front_end.process.returncode))
        front_end.process = None
        budget = front_end.budget
        if budget.failed(time.monotonic() - front_end.started) is None:
            logger.error("%s: %d restarts in a row already, it stays down", name, budget.failures_in_row - 1)
            if all(f.process is None for f in self.front_ends):
                logger.error("no HTTP front end is left on port %d; the ZMQ endpoint serves on", c.http_port)
            return
        logger.warning("%s restarts (restart %d in a row, of at most %d)", name, budget.failures_in_row, c.max_restarts)
        self._spawn_http(front_end)

    def _group_failed(self, group: _Group, cause: str) -> None:
        """Kill what is left of a group, have the router move its requests, schedule its restart
        (or give it up past ``max_restarts``: the cluster stops when a role has no group left)."""
        assert self.router is not None and group.processes is not None
        c = self.config
        now = time.monotonic()
        group.processes.kill()
        group.processes = None
        delay = group.budget.failed(None if group.ready_since is None else now - group.ready_since)
        logger.error("%s group %d (generation %d) failed: %s", group.role, group.index, group.generation, cause)
        if delay is None:
            logger.error(
                "%s group %d stays down: it failed after %d restart(s) in a row (--max-restarts %d)",
                group.role,
                group.index,
                group.budget.failures_in_row - 1,
                c.max_restarts,
            )
            down = all(
                g.processes is None and g.restart_at is None for g in self.groups.values() if g.role == group.role
            )
            if down and not c.joinable:  # where groups join, one may yet come
                # Before the router moves the group's requests: they have nowhere to go.
                self._give_up(f"every {group.role} group failed for good (last: {cause})")
        self.router.group_failed(group.role, group.index, cause)
        if delay is None:
            return
        group.restart_at = now + delay
        logger.warning(
            "%s group %d restarts in %.1f s (restart %d in a row, of at most %d)",
            group.role,
            group.index,
            delay,
            group.budget.failures_in_row,
            c.max_restarts,
        )

    def _give_up(self, failure: str) -> NoReturn:
        """The cluster cannot serve: end every request with ``failure``, then stop. The front ends
        drain rather than die, so that their clients read the error, not a cut connection."""
        assert self.router is not None
        self.router.stop_accepting()  # a request that comes meanwhile is refused, not parked
        self.router.fail_all("worker_failed", failure)
        for front_end in self._live_front_ends():
            front_end.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _GIVE_UP_DRAIN_S
        while self._live_front_ends() and time.monotonic() < deadline:  # _abandon kills what is left
            self.router.poll(50)
        self._abandon()
        raise ClusterError(failure)

    def _restart(self, group: _Group) -> None:
        assert self.router is not None
        group.generation += 1
        self.router.faults["restarts"] += 1
        self.router.group_restarting(group.role, group.index, group.generation)
        self._spawn(group)
        logger.warning("%s group %d restarted as generation %d", group.role, group.index, group.generation)

    def shutdown(self) -> None:
        """Stop admitting, let in-flight requests finish (up to drain_timeout), stop the workers."""
        assert self.router is not None
        if self._stopping:  # idempotent: one drain, whoever asks again
            return
        self._stopping = True
        for front_end in self._live_front_ends():
            front_end.send_signal(signal.SIGTERM)  # it answers 503 from now on and drains its own requests
        self.router.stop_accepting()
        if self.router.requests:  # Ctrl-C may take a while to act: say why
            logger.info(
                "stopping: %d request(s) in flight finish first, for up to %g s (--drain-timeout; "
                "stop again to end them now)",
                len(self.router.requests),
                self.config.drain_timeout,
            )
        deadline = time.monotonic() + self.config.drain_timeout
        while self.router.requests and time.monotonic() < deadline and not self._cut_drain:
            self.router.poll(50)
            self._check_workers()
        if self.router.requests:
            why = "stopped again" if self._cut_drain else f"drain timeout {self.config.drain_timeout:.0f} s"
            self.router.fail_all("shutdown", f"the cluster shut down before this request finished ({why})")
        self.router.shutdown_workers()
        failures: list[str] = []
        try:
            # Every group and front end is waited for, whatever one of them did: one that fails
            # on its way out must not cut the others' teardown short.
            for group in self.groups.values():
                if group.processes is not None:
                    try:
                        group.processes.wait(timeout=60)
                    except (TimeoutError, RuntimeError) as e:
                        failures.append(f"{group.role} group {group.index}: {e}")
            for front_end in self.front_ends:
                if front_end.process is not None:
                    try:
                        front_end.process.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        front_end.process.kill()
                        front_end.process.wait()
                        failures.append(f"{self._http_name(front_end)}: still running after 60 s")
        finally:
            self.router.poll(0)
            self.router.close()
            self._cleanup()
        if failures:
            raise ClusterError("did not stop cleanly: " + "; ".join(failures))

    def _live_front_ends(self) -> list[subprocess.Popen[bytes]]:
        return [f.process for f in self.front_ends if f.process is not None and f.process.poll() is None]

    def _cleanup(self) -> None:
        if self.mps is not None:
            self.mps.stop()
        self._tmp.cleanup()
        if self._reaper is not None:
            reaper.stop(self._reaper)

    def _abandon(self) -> None:
        for front_end in self._live_front_ends():
            front_end.kill()
            front_end.wait()
        for group in self.groups.values():
            if group.processes is not None:
                group.processes.kill()
                group.processes = None
        if self.router is not None:
            self.router.close()
        self._cleanup()

    def _start_mps(self, on_gpu: bool) -> None:
        """CUDA MPS where roles share a GPU (without it their kernels take turns on the GPU in
        time slices, and decoding stalls while a prompt runs) or SM shares are asked for."""
        c = self.config
        shared = c.shared_gpus(self.placement)
        asked = c.prefill_sm_percent is not None or c.decode_sm_percent is not None
        if not on_gpu or not (shared or asked):
            return
        try:
            self.mps = MpsDaemon.ensure(self._tmp.name)
        except MpsError as e:
            if asked:
                self._cleanup()
                raise ClusterError(f"--prefill-sm-percent / --decode-sm-percent: {e}") from None
            logger.warning(
                "prefill and decode ranks share GPU %d without CUDA MPS (%s): their kernels take turns in time "
                "slices, so decoding stalls while a prompt runs",
                shared[0],
                e,
            )


def resolve_transfer(transfer: TransferConfig, on_gpu: bool, peer_access: bool, joinable: bool) -> TransferConfig:
    """The KV transfer backend for this node's groups: in a cluster that spans machines, one
    that crosses hosts (groups on other machines share no memory with these)."""
    if joinable and transfer.backend != "auto" and transfer.traits.same_host:
        gpus, cpus = (" or ".join(backends_for(device, same_host=False)) for device in ("cuda", "cpu"))
        raise ClusterError(
            f"--transfer {transfer.backend} moves KV within one host; groups on other machines need "
            f"{gpus} (GPUs), {cpus} (CPU)"
        )
    return transfer.resolved(on_gpu, peer_access and not joinable)


def _peer_access(config: ClusterConfig, placement: list[tuple[int, ...] | None]) -> bool:
    """Whether every GPU of a decode rank can map the memory of every GPU of a prefill rank."""
    prefill, decode = config.role_gpus(placement, "prefill"), config.role_gpus(placement, "decode")
    return all(p == d or torch.cuda.can_device_access_peer(d, p) for p in prefill for d in decode)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _endpoint_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def model_shape(model: ModelConfig) -> dict[str, object]:
    """What must match between the nodes' copies of the model (its path may differ)."""
    shape = dataclasses.asdict(model)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in shape.items()}


def exposure_warning(host: str) -> str | None:
    """What to tell an operator who binds the client endpoints beyond this machine; None for a
    loopback address."""
    if _is_loopback(host):
        return None
    return (
        f"--host {host}: the client endpoint (and the HTTP API, if on) can be reached from other machines, "
        "and clients are not authenticated: anyone who reaches it can use and stop requests"
    )


def _check_keys(directory: str, front_end: bool) -> None:
    """One line, before anything starts, for a key the router or its HTTP front end would miss."""
    try:
        check_router_keys(directory)
    except FileNotFoundError as e:
        raise ClusterError(f"--auth-keys: {e}") from None
    if front_end:
        try:
            check_client_keys(directory)
        except FileNotFoundError as e:
            raise ClusterError(
                f"--auth-keys with --http-port: the HTTP front end connects as {DEFAULT_CLIENT!r}: {e}"
            ) from None


def _check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """One clear line, before anything starts, when a port is taken (or the address is not this
    machine's)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds
        try:
            probe.bind((host, port))
        except OSError as e:
            raise _cannot_listen(host, port, e.errno or 0, e.strerror, flag) from None


def _cannot_listen(host: str, port: int, code: int, why: str, flag: str = "--port") -> ClusterError:
    """A port that cannot be listened on, with what to do where that is known."""
    hint = {
        errno.EADDRINUSE: f" (another pdserve running? choose another {flag})",
        errno.EADDRNOTAVAIL: f" ({host} is not an address of this machine)",
    }.get(code, "")
    return ClusterError(f"cannot listen on {host}:{port}: {why}{hint}")
