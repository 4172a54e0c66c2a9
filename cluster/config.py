"""The cluster spec: one tree of settings (topology, engine, KV transfer), validated once.

``ClusterConfig`` nests the engine's and the transfer's own configs; every user-facing field
is a ``setting`` with one flat key (``max_model_len``), which is both its YAML key and, with
dashes, its ``launch.py`` flag (``--max-model-len``). See ``pdserve.engine.config.settings_of``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import yaml

from pdserve.cluster.group import free_port
from pdserve.cluster.protocol import DEFAULT_MAX_MESSAGE_MIB
from pdserve.engine.config import (
    EngineConfig,
    ModelConfig,
    SettingSpec,
    build_config,
    flatten_config,
    setting,
    settings_of,
    subtree,
)
from pdserve.engine.parallel import check_tp_size, head_shard
from pdserve.kvtransfer.base import TransferConfig, backend_traits, backends_for

# The cluster presets shipped with the package (``--config NAME``).
CLUSTER_PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs"
ROLES = ("prefill", "decode", "colocated")
MODES = ("disagg", "colocated")
DISPATCH_POLICIES = ("round-robin", "least-tokens", "cache-aware")
GENERATION_CONFIGS = ("auto", "none")
_DISAGG_ONLY = ("prefill_tp", "decode_tp", "prefill_groups", "decode_groups")
_DISAGG_GPU = (
    "prefill_gpu_memory_utilization",
    "decode_gpu_memory_utilization",
    "prefill_sm_percent",
    "decode_sm_percent",
)
_COLOCATED_ONLY = ("colocated_tp", "colocated_groups")
# ZMQ keeps a heartbeat's TTL in deciseconds in 16 bits: 6553.5 s at most.
_MAX_CLIENT_HEARTBEAT_TIMEOUT = 6553.5
# Long enough to bridge the gaps between requests under load, short enough that an idle cluster
# soon frees its cores.
_GPU_LEADER_SPIN_MS = 100.0
# The environment variable the HTTP front end reads its api_key from (vLLM's is VLLM_API_KEY).
API_KEY_ENV = "PDSERVE_API_KEY"
# The default limit on a text prompt's characters: room for a prompt as long as the model takes
# (English text averages about 4 characters a token, code and CJK fewer), and never below the
# limit that bounds the router's stall on one prompt at small models' lengths.
CHARS_PER_TOKEN = 8
MIN_PROMPT_CHARS = 100_000


def prompt_chars_limit(max_prompt_chars: int | None, max_model_len: int) -> int:
    """The longest text prompt accepted, in characters: ``max_prompt_chars`` where it is set."""
    if max_prompt_chars is not None:
        return max_prompt_chars
    return max(MIN_PROMPT_CHARS, CHARS_PER_TOKEN * max_model_len)


def model_names(served_model_name: str) -> list[str]:
    """The names of a ``served_model_name`` setting ("qwen, gpt-4o"); raises ValueError for an
    empty or repeated one."""
    names = [name.strip() for name in served_model_name.split(",")]
    if not all(names):
        raise ValueError(f"served_model_name holds an empty name: {served_model_name!r}")
    if len(set(names)) < len(names):
        raise ValueError(f"served_model_name names a model twice: {served_model_name!r}")
    return names


def origins(allowed: str) -> list[str]:
    """The origins of an ``allowed_origins`` setting ("https://a.example, https://b.example")."""
    return [origin.strip() for origin in allowed.split(",") if origin.strip()]


def _topology(default: int, help: str) -> Any:
    return setting(default, help=help, section="Topology")


@dataclass(frozen=True)
class ClusterConfig:
    """How many groups of which role, their TP degrees and devices, the client endpoint, the
    engine every rank runs and how KV moves between groups."""

    mode: str = setting(
        "disagg",
        help="disagg: separate prefill and decode groups; colocated: groups that serve whole requests.",
        section="Topology",
        choices=MODES,
    )
    prefill_tp: int = _topology(1, "Tensor-parallel degree of each prefill group (disagg).")
    decode_tp: int = _topology(1, "Tensor-parallel degree of each decode group (disagg).")
    prefill_groups: int = _topology(1, "Number of prefill groups on this node (disagg; 0 allowed with --master-addr).")
    decode_groups: int = _topology(1, "Number of decode groups on this node (disagg; 0 allowed with --master-addr).")
    colocated_tp: int = _topology(1, "Tensor-parallel degree of each colocated group (colocated).")
    colocated_groups: int = _topology(
        1, "Number of colocated groups on this node (colocated; 0 allowed with --master-addr)."
    )
    devices: tuple[int, ...] | None = setting(
        None,
        help="Comma-separated GPU ids, one per rank in group order; a prefill and a decode rank may "
        "share one (e.g. 0,0 for 1p1d on one GPU). cpu: every rank on the CPU, GPUs or not.",
        section="GPU",
        default_text="all visible GPUs; CPU when there are none",
    )
    prefill_gpu_memory_utilization: float | None = setting(
        None,
        help="Fraction of a GPU's memory each prefill rank may use (weights and KV) (disagg).",
        section="GPU",
        default_text="gpu_memory_utilization, split evenly among the groups sharing a GPU",
    )
    decode_gpu_memory_utilization: float | None = setting(
        None,
        help="Fraction of a GPU's memory each decode rank may use (weights and KV) (disagg).",
        section="GPU",
        default_text="gpu_memory_utilization, split evenly among the groups sharing a GPU",
    )
    prefill_sm_percent: int | None = setting(
        None,
        help="Percent of a GPU's SMs each prefill rank may use, through CUDA MPS (disagg). Ranks of both "
        "roles on one GPU run under MPS anyway: the launcher starts a control daemon if none runs.",
        section="GPU",
        default_text="all",
    )
    decode_sm_percent: int | None = setting(
        None,
        help="Percent of a GPU's SMs each decode rank may use, through CUDA MPS (disagg).",
        section="GPU",
        default_text="all",
    )
    host: str = setting("127.0.0.1", help="Address the client endpoint binds.", section="Serving")
    port: int = setting(5555, help="TCP port of the client endpoint (ZMQ).", section="Serving")
    http_port: int | None = setting(
        None,
        help="Also serve the OpenAI-compatible HTTP API (and /health, /metrics) on this port, on --host.",
        section="Serving",
        default_text="off",
    )
    api_servers: int = setting(
        1,
        help="HTTP front-end processes serving --http-port together (vLLM's --api-server-count): each binds the "
        "port with SO_REUSEPORT, so the kernel spreads connections among them, and has its own connection to the "
        "router; /metrics sums their counters whichever one a scrape reaches.",
        section="Serving",
    )
    api_key: str | None = setting(
        None,
        help="Require this key of the HTTP API's clients (Authorization: Bearer KEY, as OpenAI's clients send "
        "their api_key) on every /v1 route, /tokenize and /detokenize; /health, /metrics and /version stay "
        f"open. The environment variable {API_KEY_ENV} sets it too, out of sight of other users' ps.",
        section="Serving",
        default_text="off: no key",
    )
    served_model_name: str | None = setting(
        None,
        help="The model name the HTTP API answers to: what its clients give as 'model' and /v1/models lists; "
        "several, comma-separated, are aliases, the first one named in responses (vLLM's).",
        section="Serving",
        default_text="--model as given",
    )
    allowed_origins: str | None = setting(
        None,
        help="Web origins whose pages may call the HTTP API from a browser (CORS), comma-separated, "
        "or * for any (vLLM's default; every page the browser opens could then use the API).",
        section="Serving",
        default_text="none: browsers refuse cross-origin calls",
    )
    dispatch: str = setting(
        "cache-aware",
        help="How the router picks a group for each request. cache-aware: the prefill (or colocated) group "
        "whose prefix cache holds most of the prompt, within --cache-aware-margin of the least loaded, and the "
        "decode group likewise (its cache holds the requests it decoded: a chat's earlier turns).",
        section="Serving",
        choices=DISPATCH_POLICIES,
    )
    cache_aware_margin: int = setting(
        4096,
        help="cache-aware: outstanding tokens the group caching a prompt's longest prefix may carry beyond "
        "the least-loaded group and still get the request.",
        section="Serving",
    )
    send_timeout: float = setting(
        60.0,
        help="Seconds an HTTP client may leave its stream unread (the front end's buffers for it full) before "
        "its request is aborted and its connection closed, as nginx's send_timeout.",
        section="Serving",
    )
    max_message_mib: float = setting(
        DEFAULT_MAX_MESSAGE_MIB,
        help="Largest message a client may send, in MiB: a bigger one drops its connection unread "
        "(decoding one at the limit holds up every other client: docs/protocol.md states for how long).",
        section="Serving",
    )
    max_prompt_chars: int | None = setting(
        None,
        help="Longest text prompt, in characters (tokenizing one at the limit holds up every other client: "
        "docs/protocol.md states for how long).",
        default_text=f"{CHARS_PER_TOKEN} a token of the maximum model length, at least {MIN_PROMPT_CHARS:,}",
        section="Serving",
    )
    max_requests_per_client: int = setting(
        4096,
        help="Requests one client connection may have in flight; more get the error overloaded.",
        section="Serving",
    )
    max_requests: int = setting(
        16384, help="Requests in flight over all clients; more get the error overloaded.", section="Serving"
    )
    auth_keys: str | None = setting(
        None,
        help="Key directory (python -m pdserve.cluster.auth DIR): clients must hold one of its client keys.",
        section="Serving",
        default_text="off: no authentication",
    )
    parse_special_tokens: bool = setting(
        False,
        help="Read special-token text in prompts (e.g. <|im_start|>) as control tokens; off: as plain text.",
        section="Serving",
    )
    generation_config: str = setting(
        "auto",
        help="Defaults of the HTTP API's sampling fields that a request leaves out: auto, those the model's "
        "generation_config.json recommends (temperature, top_p, top_k, min_p, repetition_penalty; as vLLM's "
        "default); none, OpenAI's.",
        section="Serving",
        choices=GENERATION_CONFIGS,
    )
    access_log: bool = setting(
        False,
        help="Log each HTTP request of the OpenAI API (uvicorn's access log: client, method, path, status), "
        "as vLLM does by default; off here, where a line a request would fill the launcher's output.",
        section="Serving",
    )
    drain_timeout: float = setting(30.0, help="Seconds to finish in-flight requests on shutdown.", section="Serving")
    log_stats_interval: float = setting(
        10.0,
        help="Seconds between the launcher's log lines of token throughput, requests and each group's load and "
        "KV use, while the cluster works (vLLM's stats line). 0: none.",
        section="Serving",
    )
    leader_spin_ms: float | None = setting(
        None,
        help="Milliseconds a group leader busy-polls its inbox after its last work before it sleeps: a request "
        "that comes sooner (a KV hand-off, a new prompt) does not wait for the process to wake up, at the price "
        "of a busy core meanwhile. 0: sleep at once.",
        section="Serving",
        default_text=f"{_GPU_LEADER_SPIN_MS:g} for a group on GPUs, 0 on CPUs (whose cores the ranks need)",
    )
    start_timeout: float = setting(600.0, help="Seconds the groups may take to become ready.", section="Serving")
    heartbeat_interval: float = setting(
        0.5,
        help="Seconds between the heartbeats each rank (leader or peer) sends the router.",
        section="Fault tolerance",
    )
    heartbeat_timeout: float = setting(
        10.0,
        help="A ready group whose leader or any rank sends no heartbeat for this long (hung, stopped) is "
        "failed and restarted; a rank that dies is noticed at once.",
        section="Fault tolerance",
    )
    max_restarts: int = setting(
        10,
        help="Restarts in a row of one group (or of one HTTP front-end process: each of --api-servers has its "
        "own count) before the cluster gives up on it; one that served 60 s before it failed starts afresh.",
        section="Fault tolerance",
    )
    restart_backoff: float = setting(
        1.0,
        help="Seconds before a failed group restarts; doubles with each failure in a row (up to 30 s).",
        section="Fault tolerance",
    )
    migration_limit: int = setting(
        3,
        help="Times a request moves to another group after a failure (prefilled again with its tokens so "
        "far) before it ends with worker_failed; 0: it ends at the first failure.",
        section="Fault tolerance",
    )
    kv_lease_timeout: float = setting(
        30.0,
        help="Seconds KV may wait for its hand-off: prefilled KV no decode group accepts, blocks reserved "
        "for a transfer that does not arrive; then it is freed and the request moves.",
        section="Fault tolerance",
    )
    watchdog_timeout: float = setting(
        300.0,
        help="A rank whose serve loop makes no progress for this long while its process runs (a hung "
        "collective or kernel, a deadlock) writes its threads' stacks to the log and exits; its group is "
        "restarted. Must exceed the longest step (a long prompt's prefill on a CPU) and, with a blocking KV "
        "transfer (gloo, nccl), --kv-lease-timeout; inf: never.",
        section="Fault tolerance",
    )
    dispatch_timeout: float = setting(
        120.0,
        help="Seconds a request may wait for a ready group of a role it needs (every group of the role "
        "restarting, or none joined yet); then it ends with the error no_group.",
        section="Fault tolerance",
    )
    client_heartbeat_timeout: float = setting(
        10.0,
        help="A client connection silent this long (ZMQ heartbeats) is closed and its requests aborted; "
        "clients learn of a dead router within their own heartbeat timeout.",
        section="Fault tolerance",
    )
    master_addr: str | None = setting(
        None,
        help="Router node of a cluster that spans machines: this machine's address as the others reach it. "
        "The rendezvous store listens on it (--master-port), and the router and the groups here take their "
        "control messages over TCP on it, so that groups on other machines can join (--join).",
        section="Multi-node",
        default_text="off: one machine, ipc sockets",
    )
    master_port: int = setting(
        29500, help="Router node: TCP port of the rendezvous store on --master-addr.", section="Multi-node"
    )
    join: str | None = setting(
        None,
        help="Group node: run one worker group on this machine that joins the cluster whose router node serves "
        "its rendezvous at HOST:PORT (its --master-addr:--master-port); the other settings come from the router "
        "node. SIGTERM drains the group and removes it from the cluster.",
        section="Multi-node",
        default_text="off",
    )
    join_role: str | None = setting(
        None,
        help="Group node: the role of its group (prefill or decode; colocated in a colocated cluster).",
        section="Multi-node",
        key="role",
        choices=ROLES,
        default_text="none",
    )
    join_tp: int = setting(
        1, help="Group node: the tensor-parallel degree of its group.", section="Multi-node", key="tp"
    )
    join_timeout: float = setting(
        60.0,
        help="Group node: seconds to wait for the router node's rendezvous to answer (it may start later).",
        section="Multi-node",
    )
    advertise_addr: str | None = setting(
        None,
        help="Group node: the address its group listens on, as the other machines reach it.",
        section="Multi-node",
        default_text="this machine's address on the route to the router node",
    )
    engine: EngineConfig = subtree(EngineConfig)
    transfer: TransferConfig = subtree(TransferConfig, prefix="transfer_")

    def _changed(self, which: Callable[[SettingSpec], bool]) -> SettingSpec | None:
        """The first setting ``which`` picks whose value is not its default, if any."""
        given = flatten_config(self)
        return next((s for s in cluster_settings() if which(s) and given[s.key] != s.default), None)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.dispatch not in DISPATCH_POLICIES:
            raise ValueError(f"dispatch must be one of {', '.join(DISPATCH_POLICIES)}, got {self.dispatch!r}")
        if self.cache_aware_margin < 0:
            raise ValueError(f"cache_aware_margin must be >= 0, got {self.cache_aware_margin}")
        if self.dispatch != "cache-aware" and (margin := self._changed(lambda s: s.key == "cache_aware_margin")):
            raise ValueError(f"{margin.flag} applies to --dispatch cache-aware, not --dispatch {self.dispatch}")
        # ZMQ would fail to parse tcp://::1:5555 with "No such device", blamed on --host:--port.
        for name, where in (("host", " (0.0.0.0: every interface)"), ("master_addr", ""), ("advertise_addr", "")):
            address = getattr(self, name)
            if address is not None and ":" in address:
                raise ValueError(
                    f"{name} must be an IPv4 address or name{where}, got {address!r}: IPv6 is not supported"
                )
        for name in (*_DISAGG_ONLY, *_COLOCATED_ONLY):
            # Groups may all live on other machines when they can join.
            least = 0 if name.endswith("_groups") and self.joinable else 1
            if getattr(self, name) < least:
                joinable = " (0 only where groups may join: with master_addr)" if name.endswith("_groups") else ""
                raise ValueError(f"{name} must be >= {least}{joinable}, got {getattr(self, name)}")
        self._check_multi_node()
        # A flag of the other mode would be silently ignored: say so instead.
        unused = _COLOCATED_ONLY if self.mode == "disagg" else _DISAGG_ONLY
        for name in unused:
            if getattr(self, name) != 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} applies to --mode {'colocated' if self.mode == 'disagg' else 'disagg'}, "
                    f"not --mode {self.mode}"
                )
        if self.mode == "colocated" and (transfer := self._changed(lambda s: s.path[0] == "transfer")):
            raise ValueError(
                f"{transfer.flag} applies to --mode disagg (KV moves between groups), not --mode colocated"
            )
        for name in _DISAGG_GPU:
            value = getattr(self, name)
            if value is None:
                continue
            if self.mode != "disagg":
                raise ValueError(f"--{name.replace('_', '-')} applies to --mode disagg, not --mode {self.mode}")
            if name.endswith("sm_percent") and not 1 <= value <= 100:
                raise ValueError(f"{name} must be in 1..100, got {value}")
            if name.endswith("utilization") and not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        for name in ("port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 65536:
                raise ValueError(f"{name} must be in 1..65535, got {value}")
        if self.http_port == self.port:
            raise ValueError(f"--http-port and --port must differ, both are {self.port}")
        if self.api_servers < 1:
            raise ValueError(f"api_servers must be >= 1, got {self.api_servers}")
        if self.served_model_name is not None:
            model_names(self.served_model_name)
        if self.served_model_name is not None and self.http_port is None:
            raise ValueError("--served-model-name names the model of the HTTP API: give --http-port too")
        if self.access_log and self.http_port is None:
            raise ValueError("--access-log logs the HTTP API's requests: give --http-port too")
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(
                f"generation_config must be one of {', '.join(GENERATION_CONFIGS)}, got {self.generation_config!r}"
            )
        if self.generation_config != "auto" and self.http_port is None:
            raise ValueError("--generation-config applies to the HTTP API: give --http-port too")
        if self.api_servers > 1 and self.http_port is None:
            raise ValueError(f"--api-servers {self.api_servers} runs HTTP front ends: give --http-port too")
        if self.api_key is not None and (self.http_port is None or not self.api_key.strip()):
            why = "guards the HTTP API: give --http-port too" if self.api_key.strip() else "must not be empty"
            raise ValueError(f"--api-key {why}")
        if self.allowed_origins is not None and (self.http_port is None or not origins(self.allowed_origins)):
            why = "applies to the HTTP API: give --http-port too" if origins(self.allowed_origins) else "names none"
            raise ValueError(f"--allowed-origins {why}")
        if self.http_port is None and (timeout := self._changed(lambda s: s.key == "send_timeout")):
            raise ValueError(f"{timeout.flag} applies to the HTTP API: give --http-port too")
        for name in ("max_message_mib", "max_prompt_chars", "max_requests_per_client", "max_requests", "send_timeout"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        # NaN passes every comparison below unnoticed, and infinity fails later, in a conversion to
        # an integer (ZMQ options, timedeltas) with a traceback or in a rank: only the watchdog may be inf.
        for spec in cluster_settings():
            value = getattr(self, spec.path[-1]) if len(spec.path) == 1 else None
            if isinstance(value, float) and not math.isfinite(value) and spec.key != "watchdog_timeout":
                raise ValueError(f"{spec.key} must be a finite number, got {value}")
        if math.isnan(self.watchdog_timeout):
            raise ValueError("watchdog_timeout must be a number (inf: never), got nan")
        if self.client_heartbeat_timeout > _MAX_CLIENT_HEARTBEAT_TIMEOUT:
            raise ValueError(
                f"client_heartbeat_timeout must be at most {_MAX_CLIENT_HEARTBEAT_TIMEOUT:g} s (ZMQ's limit), "
                f"got {self.client_heartbeat_timeout:g}"
            )
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.log_stats_interval != 0 and self.log_stats_interval < 1:
            raise ValueError(f"log_stats_interval must be 0 (no line) or at least 1 s, got {self.log_stats_interval}")
        if self.leader_spin_ms is not None and self.leader_spin_ms < 0:
            raise ValueError(f"leader_spin_ms must be >= 0, got {self.leader_spin_ms}")
        for name in (
            "start_timeout",
            "heartbeat_interval",
            "heartbeat_timeout",
            "restart_backoff",
            "kv_lease_timeout",
            "watchdog_timeout",
            "dispatch_timeout",
            "client_heartbeat_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must exceed "
                f"heartbeat_interval ({self.heartbeat_interval})"
            )
        for name in ("max_restarts", "migration_limit"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def joinable(self) -> bool:
        """Whether groups may join at run time: on the router node of a multi-node cluster, or
        on a group node (whose copy of the cluster's settings may count no local group)."""
        return self.master_addr is not None or self.join is not None

    def _check_multi_node(self) -> None:
        if self.master_addr is not None and self.join is not None:
            raise ValueError("--master-addr (a router node) and --join (a group node) exclude each other")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if self.master_addr is None and (port := self._changed(lambda s: s.key == "master_port")):
            raise ValueError(f"{port.flag} applies to a router node (--master-addr)")
        if self.join is None:
            for flag, value, default in (
                ("--role", self.join_role, None),
                ("--tp", self.join_tp, 1),
                ("--advertise-addr", self.advertise_addr, None),
                ("--join-timeout", self.join_timeout, 60.0),
            ):
                if value != default:
                    raise ValueError(f"{flag} applies to a group node (--join HOST:PORT)")
            return
        split_host_port(self.join, "--join")
        if self.join_role is None:
            raise ValueError("--join needs --role (prefill or decode; colocated in a colocated cluster)")
        if self.join_tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.join_tp}")
        if not self.join_timeout > 0:
            raise ValueError(f"--join-timeout must be positive, got {self.join_timeout}")

    @classmethod
    def from_settings(cls, settings: dict[str, Any], origin: str = "settings") -> ClusterConfig:
        """Built from flat ``{key: value}`` settings (see the module docstring)."""
        settings = {k.replace("-", "_"): v for k, v in settings.items()}
        if settings.get("devices") is not None:
            settings["devices"] = parse_devices(settings["devices"])
        return build_config(cls, settings, origin)

    @classmethod
    def from_preset(cls, name_or_path: str, **overrides: Any) -> ClusterConfig:
        """A YAML preset by path, or by the name of one shipped in ``configs/`` (``2p1d``), then the
        given overrides."""
        path = Path(name_or_path)
        if path.is_dir():
            raise ValueError(f"--config {name_or_path}: a directory, not a YAML file")
        if not path.is_file():
            shipped = CLUSTER_PRESETS_DIR / f"{path.name.removesuffix('.yaml')}.yaml"
            if path.parent != Path(".") or not shipped.is_file():
                names = ", ".join(sorted(p.stem for p in CLUSTER_PRESETS_DIR.glob("*.yaml")))
                raise ValueError(f"--config {name_or_path}: no such file, nor a preset of that name ({names})")
            path = shipped
        return cls.from_yaml(path, **overrides)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> ClusterConfig:
        """A YAML preset (flat keys as in ``--help``, dashes allowed), then the given overrides."""
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            raise ValueError(f"{path}: not valid YAML: {getattr(e, 'problem', None) or e}{where}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a cluster preset must be a mapping of settings")
        if named_otherwise := [k for k in data if not isinstance(k, str)]:  # YAML reads `on:` as True
            raise ValueError(f"{path}: setting names are strings, got {named_otherwise[0]!r}")
        given = {k: v for k, v in overrides.items() if v is not None}
        from_file = {str(k).replace("-", "_") for k in data} - set(given)
        data.update(given)
        try:
            return cls.from_settings(data, origin=str(path))
        except ValueError as e:
            # A check names the setting, which the user may never have typed: say where it is set.
            named = [
                key
                for key in sorted(from_file)
                if re.search(rf"(?<![\w-])({key}|--{key.replace('_', '-')})(?![\w-])", str(e))
            ]
            if not named or str(e).startswith(str(path)):
                raise
            raise ValueError(f"{e} ({', '.join(named)}: set in {path})") from None

    def groups(self) -> list[tuple[str, int, int]]:
        """``(role, group index, tp)`` of every worker group, in global-rank order."""
        if self.mode == "colocated":
            return [("colocated", g, self.colocated_tp) for g in range(self.colocated_groups)]
        return [("prefill", g, self.prefill_tp) for g in range(self.prefill_groups)] + [
            ("decode", g, self.decode_tp) for g in range(self.decode_groups)
        ]

    @property
    def world_size(self) -> int:
        return sum(tp for _, _, tp in self.groups())

    def check_model(self, model: ModelConfig, on_gpu: bool = False) -> None:
        """Refuse, before any rank starts, what the model cannot run: a TP degree its heads do
        not allow, a max_model_len beyond its positions, a fixed KV pool (or on CPU, the pool
        cpu_kv_cache_bytes holds) too small for one sequence of max_model_len tokens, or Triton
        kernels without a GPU."""
        if not on_gpu and self.engine.kernels == "triton":
            raise ValueError("--kernels triton needs GPUs: on CPU the kernels are torch's (--kernels auto or torch)")
        for role, tp in sorted({(role, tp) for role, _, tp in self.groups()}):
            try:
                check_tp_size(model.num_heads, model.num_kv_heads, tp)
            except ValueError as e:
                raise ValueError(f"--{role}-tp {tp}: {e}") from None
        max_model_len = self.engine.resolved_max_model_len(model)
        cache = self.engine.cache
        if cache.num_blocks is not None and cache.num_blocks * cache.block_size < max_model_len:
            raise ValueError(
                f"--num-blocks {cache.num_blocks} holds {cache.num_blocks * cache.block_size} tokens, fewer than "
                f"max_model_len {max_model_len}: raise --num-blocks or lower --max-model-len"
            )
        if cache.num_blocks is None and not on_gpu:
            # As a rank sizes its pool (ModelRunner), for the rank holding the most KV heads.
            dtype = self.engine.resolved_dtype() if self.engine.dtype != "auto" else torch.float32
            head_block_bytes = model.kv_bytes_per_token(dtype) // model.num_kv_heads * cache.block_size
            for role, tp in sorted({(role, tp) for role, _, tp in self.groups()}):
                heads = max(head_shard(model.num_heads, model.num_kv_heads, tp, r).num_kv_heads for r in range(tp))
                tokens = max(1, cache.cpu_kv_cache_bytes // (head_block_bytes * heads)) * cache.block_size
                if tokens < max_model_len:
                    raise ValueError(
                        f"--cpu-kv-cache-bytes {cache.cpu_kv_cache_bytes} holds {tokens} tokens on a {role} rank, "
                        f"fewer than max_model_len {max_model_len}: raise --cpu-kv-cache-bytes or lower --max-model-len"
                    )

    def engine_config(self, model_dir: str, model: ModelConfig) -> EngineConfig:
        """The engine config every rank starts from: the resolved model directory and length,
        and without chunked prefill a step budget that holds a whole prompt."""
        max_model_len = self.engine.resolved_max_model_len(model)
        scheduler = self.engine.scheduler
        if not scheduler.enable_chunked_prefill:
            budget = max(scheduler.max_num_batched_tokens, max_model_len)
            scheduler = dataclasses.replace(scheduler, max_num_batched_tokens=budget)
        return dataclasses.replace(self.engine, model=model_dir, max_model_len=max_model_len, scheduler=scheduler)

    def placement(self, visible_gpus: int) -> list[tuple[int, ...] | None]:
        """CUDA devices of each group's ranks (in ``groups()`` order); None entries run on CPU."""
        groups = self.groups()
        if visible_gpus == 0 or self.devices == ():  # no GPU, or --devices cpu
            if self.devices:
                raise ValueError(f"--devices {','.join(map(str, self.devices))} given but no GPU is visible")
            return [None] * len(groups)
        devices = list(self.devices) if self.devices is not None else list(range(visible_gpus))
        bad = [d for d in devices if not 0 <= d < visible_gpus]
        if bad:
            raise ValueError(f"GPU {bad[0]} does not exist ({visible_gpus} visible)")
        if len(devices) < self.world_size:
            raise ValueError(
                f"{self.world_size} ranks need {self.world_size} GPUs, {len(devices)} available: "
                f"{', '.join(f'{r}{g} x tp{t}' for r, g, t in groups)}. One GPU holds a prefill and a decode "
                "rank (--devices 0,0 with TP 1 each); --devices cpu runs every rank on the CPU"
            )
        out, next_device = [], 0
        for role, group, tp in groups:
            placed = tuple(devices[next_device : next_device + tp])
            if len(set(placed)) < tp:
                raise ValueError(
                    f"{role}{group}'s {tp} ranks would share a GPU ({','.join(map(str, placed))}): the ranks of one "
                    "tensor-parallel group need a GPU each (NCCL refuses two on one)"
                )
            out.append(placed)
            next_device += tp
        load: dict[int, float] = {}
        for (role, _, _), placed in zip(groups, out):
            for device in placed:
                load[device] = load.get(device, 0.0) + self.memory_utilization(role, self.groups_on(out, device))
        for device, total in sorted(load.items()):
            if total > 1.0 + 1e-9:
                raise ValueError(
                    f"the ranks on GPU {device} may use {total:.2f} of its memory together: lower "
                    "--prefill-gpu-memory-utilization / --decode-gpu-memory-utilization"
                )
        return out

    def role_gpus(self, placement: list[tuple[int, ...] | None], role: str) -> set[int]:
        """The GPUs that ranks of ``role`` run on."""
        return {d for (r, _, _), placed in zip(self.groups(), placement) if r == role for d in placed or ()}

    def shared_gpus(self, placement: list[tuple[int, ...] | None]) -> list[int]:
        """The GPUs that run both prefill and decode ranks."""
        return sorted(self.role_gpus(placement, "prefill") & self.role_gpus(placement, "decode"))

    def check_watchdog(self, transfer: TransferConfig) -> None:
        """Refuse a watchdog that would end a leader waiting, within its lease, on a blocking
        KV transfer (``transfer`` resolved: ``auto`` is gloo on CPUs)."""
        traits = transfer.traits
        if traits.blocking and self.watchdog_timeout <= self.kv_lease_timeout:
            unblocking = " or ".join(backends_for(traits.device, blocking=False))
            raise ValueError(
                f"--watchdog-timeout {self.watchdog_timeout:g} must exceed --kv-lease-timeout "
                f"{self.kv_lease_timeout:g} with --transfer {transfer.backend}: a blocking KV transfer holds its "
                f"leader's loop up to its lease (or pick a backend that does not block: {unblocking})"
            )

    def check_shared_gpus(self, placement: list[tuple[int, ...] | None], backend: str) -> None:
        """Refuse a prefill and a decode rank on one GPU with a backend that cannot connect them."""
        shared = self.shared_gpus(placement)
        if shared and not backend_traits(backend).shares_gpu:
            raise ValueError(
                f"prefill and decode ranks share GPU {shared[0]}, and --transfer {backend} cannot connect two "
                f"ranks on one GPU: use --transfer {' or '.join(backends_for('cuda', shares_gpu=True))} "
                "(auto picks cuda-ipc)"
            )

    @staticmethod
    def groups_on(placement: list[tuple[int, ...] | None], device: int) -> int:
        """How many groups have a rank on GPU ``device``."""
        return sum(device in (placed or ()) for placed in placement)

    def memory_utilization(self, role: str, groups_on_gpu: int) -> float:
        """The fraction of a GPU's memory a rank of ``role`` may use, on a GPU where
        ``groups_on_gpu`` groups have a rank."""
        own = {"prefill": self.prefill_gpu_memory_utilization, "decode": self.decode_gpu_memory_utilization}.get(role)
        return own if own is not None else self.engine.cache.gpu_memory_utilization / groups_on_gpu

    def leader_spin_s(self, on_gpu: bool) -> float:
        """Seconds the leader of a group on GPUs (or CPUs) busy-polls after its last work."""
        if self.leader_spin_ms is not None:
            return self.leader_spin_ms / 1e3
        return _GPU_LEADER_SPIN_MS / 1e3 if on_gpu else 0.0

    def rank_timing(self, on_gpu: bool) -> RankTiming:
        """The clocks of a rank on GPUs (or CPUs), the same on the router's node and on a group node."""
        return RankTiming(
            heartbeat_interval=self.heartbeat_interval,
            rendezvous_timeout=self.start_timeout,
            kv_lease_timeout=self.kv_lease_timeout,
            watchdog_timeout=self.watchdog_timeout,
            leader_spin_s=self.leader_spin_s(on_gpu),
        )

    def sm_percent(self, role: str) -> int | None:
        """The percent of a GPU's SMs a rank of ``role`` may use (None: no limit)."""
        return {"prefill": self.prefill_sm_percent, "decode": self.decode_sm_percent}.get(role)

    def rank_engine(self, engine: EngineConfig, role: str, groups_on_gpu: int) -> EngineConfig:
        """``engine`` with the memory budget of a rank of ``role`` on a GPU where
        ``groups_on_gpu`` groups have a rank."""
        cache = dataclasses.replace(
            engine.cache,
            gpu_memory_utilization=self.memory_utilization(role, groups_on_gpu),
            gpu_shared=groups_on_gpu > 1,
        )
        return dataclasses.replace(engine, cache=cache)


def parse_devices(value: str | int | Iterable[int]) -> tuple[int, ...]:
    """GPU ids as ``--devices`` takes them (``0,1``), or as a YAML preset may give them: one id
    (``devices: 0``) or a list (``devices: [0, 1]``). ``cpu`` (or nothing) is no GPU: ``()``."""
    try:
        if isinstance(value, str):
            if value.strip().lower() == "cpu":
                return ()
            return tuple(int(d) for d in value.split(",") if d.strip())
        if isinstance(value, int) and not isinstance(value, bool):
            return (value,)
        if isinstance(value, Iterable) and all(isinstance(d, int) and not isinstance(d, bool) for d in value):
            return tuple(value)
    except ValueError:
        pass
    raise ValueError(f"devices: expected comma-separated GPU ids such as 0,1, or cpu, got {value!r}")


def cluster_settings() -> list[SettingSpec]:
    """Every setting of the cluster spec: its key, flag, type, default, help and section."""
    return settings_of(ClusterConfig)


def split_host_port(address: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``tcp://HOST:PORT``, ``[v6]:PORT``) as a pair; a clear error otherwise."""
    url = urlparse(address if "://" in address else f"tcp://{address}")
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme != "tcp" or not url.hostname or port is None or not 0 < port < 65536:
        raise ValueError(f"{what} {address!r}: expected HOST:PORT, such as 10.0.0.1:29500")
    return url.hostname, port


@dataclass(frozen=True)
class RankTiming:
    """The clocks a worker rank keeps, from the cluster's settings (``ClusterConfig.rank_timing``)."""

    heartbeat_interval: float
    rendezvous_timeout: float  # a pair group waits this long for a group that loads its model
    kv_lease_timeout: float
    watchdog_timeout: float  # a serve loop stuck this long ends its rank (cluster.watchdog)
    leader_spin_s: float  # the leader busy-polls this long after its last work (cluster.inbox)


@dataclass(frozen=True)
class Addresses:
    """ZMQ endpoints of one node's part of a cluster run: ipc sockets in the node's own run
    directory, plus the client port. Endpoints named in ``tcp`` (``router``, ``prefill0``...)
    are TCP instead: those other machines must reach, in a cluster that spans them. A group's
    step channel (leader to TP peers) always stays on its node."""

    run_dir: str
    client: str
    tcp: dict[str, str] = field(default_factory=dict)

    @property
    def router(self) -> str:
        return self.tcp.get("router", f"ipc://{self.run_dir}/router")

    def leader(self, role: str, group: int) -> str:
        return self.tcp.get(f"{role}{group}", f"ipc://{self.run_dir}/{role}{group}")

    def steps(self, role: str, group: int) -> str:
        return f"ipc://{self.run_dir}/{role}{group}-steps"

    def over_tcp(self, host: str, names: Iterable[str]) -> Addresses:
        """These addresses with ``names`` (``router``, ``decode1``) on TCP ports of ``host`` that
        are free now."""
        tcp = dict(self.tcp)
        for name in names:
            endpoint_host = f"[{host}]" if ":" in host else host
            tcp[name] = f"tcp://{endpoint_host}:{free_port(host)}"
        return dataclasses.replace(self, tcp=tcp)


@dataclass(frozen=True)
class GroupLayout:
    """Global ranks of every group, known to every rank (to build subgroups and transfers)."""

    ranks: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)  # role -> per group

    @classmethod
    def of(cls, config: ClusterConfig) -> GroupLayout:
        ranks: dict[str, list[tuple[int, ...]]] = {role: [] for role in ROLES}
        first = 0
        for role, _, tp in config.groups():
            ranks[role].append(tuple(range(first, first + tp)))
            first += tp
        return cls(ranks)
