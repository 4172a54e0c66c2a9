"""The wire protocol: typed, versioned messages and their one msgpack codec.

Every message is a msgpack map with ``type`` and ``version``; the other keys are the fields of
the dataclass registered for that type. ``decode`` never raises anything but ``ProtocolError``
(garbage bytes, wrong shape, unknown type or field, wrong version, bad field types), so a
process that reads a socket can answer bad input with an error instead of dying. No pickles.

Client-facing messages are documented in ``docs/protocol.md``; the internal ones travel
between the router and the worker leaders, and between prefill and decode leaders.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from pdserve.engine.sampling import SamplingParams
from pdserve.engine.timings import RequestTimings

PROTOCOL_VERSION = 1
MAX_REQUEST_ID_CHARS = 256  # an id is echoed on every reply: a longer one is refused, not echoed


class ProtocolError(ValueError):
    """A message that cannot be decoded; ``code`` is the error code sent back."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


_TYPES: dict[str, type[Message]] = {}


@dataclass
class Message:
    type: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.type:
            _TYPES[cls.type] = cls


Checker = typing.Callable[[Any, str], Any]


@dataclass(frozen=True)
class _Spec:
    """What the codec needs of a message class, resolved once per class (hot path)."""

    fields: tuple[tuple[str, Checker, bool], ...]  # (name, checker, required) in field order
    names: tuple[str, ...]
    name_set: frozenset[str]
    nested: tuple[str, ...]  # fields whose type may hold messages (alone or in a list) or timings


@functools.cache
def _spec(cls: type[Message]) -> _Spec:
    hints = typing.get_type_hints(cls)
    fields = tuple(
        (f.name, _checker(hints[f.name]), f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
    )
    names = tuple(name for name, _, _ in fields)
    return _Spec(fields, names, frozenset(names), tuple(n for n in names if _nested(hints[n])))


def _nested(hint: Any) -> bool:
    """Whether a field of this type may hold a value the codec turns into a map."""
    if isinstance(hint, type):
        return issubclass(hint, (Message, RequestTimings))
    return any(_nested(arg) for arg in typing.get_args(hint))


def _plain(message: Message) -> dict[str, Any]:
    """Fields as a shallow dict; nested messages (alone or in a list) become dicts too, and
    timings the map of the values that apply."""
    spec = _spec(type(message))
    out = {name: getattr(message, name) for name in spec.names}
    for name in spec.nested:
        value = out[name]
        if isinstance(value, Message):
            out[name] = _plain(value)
        elif isinstance(value, RequestTimings):
            out[name] = value.as_dict()
        elif isinstance(value, list):
            out[name] = [_plain(v) if isinstance(v, Message) else v for v in value]
    return out


def encode(message: Message) -> bytes:
    body = {"type": message.type, "version": PROTOCOL_VERSION}
    body.update(_plain(message))
    return msgpack.packb(body, use_bin_type=True)


def _invalid(message: str) -> ProtocolError:
    return ProtocolError("invalid_field", message)


@functools.cache
def _checker(hint: Any) -> Checker:
    """A function ``(value, field name) -> value`` that validates (and lightly normalises) a
    decoded value against the type hint ``hint``, raising ProtocolError; built once per hint."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        nullable = type(None) in options
        checks = [_checker(o) for o in options if o is not type(None)]
        if nullable and len(checks) == 1:  # ``X | None``, the common case
            (check_value,) = checks
            return lambda value, name: None if value is None else check_value(value, name)

        def check_union(value: Any, name: str) -> Any:
            if value is None and nullable:
                return None
            errors = []
            for check in checks:
                try:
                    return check(value, name)
                except ProtocolError as e:
                    errors.append(e.message)
            raise _invalid(errors[0] if errors else f"field {name!r} may not be null")

        return check_union
    if hint is Any:
        return lambda value, name: value
    if origin is list:
        (item,) = typing.get_args(hint)
        check_item = _checker(item)

        def check_list(value: Any, name: str) -> Any:
            if not isinstance(value, (list, tuple)):
                raise _invalid(f"field {name!r} must be a list")
            # Token ids, the common and long case: one type scan in C (bools are not ints here).
            if item is int and set(map(type, value)) <= {int}:
                return value if isinstance(value, list) else list(value)
            return [check_item(v, name) for v in value]

        return check_list
    if origin is dict:

        def check_map(value: Any, name: str) -> Any:
            if not isinstance(value, dict):
                raise _invalid(f"field {name!r} must be a map")
            return value

        return check_map
    if hint is float:

        def check_number(value: Any, name: str) -> Any:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _invalid(f"field {name!r} must be a number")
            return float(value)

        return check_number
    if hint is int:

        def check_int(value: Any, name: str) -> Any:
            if isinstance(value, bool) or not isinstance(value, int):
                raise _invalid(f"field {name!r} must be an integer")
            return value

        return check_int
    if hint in (str, bool, bytes):

        def check_plain(value: Any, name: str) -> Any:
            if not isinstance(value, hint):
                raise _invalid(f"field {name!r} must be {hint.__name__}")
            return value

        return check_plain
    if isinstance(hint, type) and issubclass(hint, Message):
        return lambda value, name: _from_fields(hint, value, name)
    if hint is RequestTimings:
        return _check_timings
    return lambda value, name: value


_TIMING_NAMES = frozenset(f.name for f in dataclasses.fields(RequestTimings))


def _check_timings(value: Any, name: str) -> RequestTimings:
    """Timings travel as the map of the values that apply (``RequestTimings.as_dict``)."""
    if not isinstance(value, dict):
        raise _invalid(f"field {name!r} must be a map")
    if not value.keys() <= _TIMING_NAMES:
        unknown = sorted(str(key) for key in value.keys() - _TIMING_NAMES)
        raise _invalid(f"unknown key {unknown[0]!r} in field {name!r}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
        raise _invalid(f"field {name!r} must map to numbers")
    return RequestTimings(**{key: float(v) for key, v in value.items()})


def _from_fields(cls: type[Message], body: Any, where: str) -> Message:
    if not isinstance(body, dict):
        raise ProtocolError("invalid_field", f"{where!r} must be a map")
    spec = _spec(cls)
    if not body.keys() <= spec.name_set:  # field names are strings: so, then, are the keys
        if not all(isinstance(key, str) for key in body):
            raise ProtocolError("malformed", f"map keys in {where!r} must be strings")
        unknown = sorted(set(body) - spec.name_set)
        raise ProtocolError("unknown_field", f"unknown field {unknown[0]!r} in {cls.type or where}")
    kwargs = {}
    for name, check, required in spec.fields:
        if name in body:
            kwargs[name] = check(body[name], name)
        elif required:
            raise ProtocolError("missing_field", f"missing field {name!r} in {cls.type or where}")
    return cls(**kwargs)


def decode(data: bytes) -> Message:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError("malformed", f"not a msgpack message: {type(e).__name__}") from None
    if not isinstance(body, dict):
        raise ProtocolError("malformed", "a message must be a msgpack map")
    request_id = body.get("request_id") if isinstance(body.get("request_id"), str) else None
    if request_id is not None and len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ProtocolError("invalid_field", f"request_id: longer than {MAX_REQUEST_ID_CHARS} characters")
    kind = body.pop("type", None)
    version = body.pop("version", None)
    if not isinstance(kind, str) or kind not in _TYPES:
        raise ProtocolError("unknown_type", f"unknown message type {kind!r}", request_id)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            "unsupported_version",
            f"protocol version {version!r} is not supported (this is {PROTOCOL_VERSION})",
            request_id,
        )
    try:
        return _from_fields(_TYPES[kind], body, kind)
    except ProtocolError as e:
        e.request_id = request_id
        raise


# -- client <-> router -----------------------------------------------------------------------


@dataclass
class Sampling(Message):
    """Sampling parameters (``to_params`` checks their ranges)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def to_params(self) -> SamplingParams:
        """The engine's parameters; raises ``RequestError`` naming a field out of range."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )


@dataclass
class Generate(Message):
    """Client -> router. Exactly one of ``prompt`` (text) and ``token_ids``."""

    type: ClassVar[str] = "generate"
    request_id: str | None = None  # the client's id, echoed back; the router makes one if absent
    prompt: str | None = None
    token_ids: list[int] | None = None
    sampling: Sampling = field(default_factory=Sampling)
    stream: bool = True
    chat: bool = True  # apply the model's chat template to a text prompt
    batch_chunks: bool = False  # this request's chunks may come inside ``chunks`` messages


@dataclass
class Abort(Message):
    """Client -> router (and router -> workers): stop a request."""

    type: ClassVar[str] = "abort"
    request_id: str


@dataclass
class Chunk(Message):
    """Router -> client: new tokens of a streaming request, in order."""

    type: ClassVar[str] = "chunk"
    request_id: str
    token_ids: list[int]
    text: str


@dataclass
class Chunks(Message):
    """Router -> client: the chunks of one worker step for this client's ``batch_chunks``
    requests, one message instead of one each."""

    type: ClassVar[str] = "chunks"
    chunks: list[Chunk]


@dataclass
class Final(Message):
    """Router -> client: the terminal message of a request that ran (finished or aborted)."""

    type: ClassVar[str] = "final"
    request_id: str
    finish_reason: str  # stop | length | abort
    token_ids: list[int]  # every generated token
    text: str
    usage: dict[str, int]  # prompt_tokens, completion_tokens
    timings: dict[str, float]  # RequestTimings.as_dict(): queue, prefill, transfer, ..., total


@dataclass
class StatsRequest(Message):
    """Client -> router: ask for the cluster's state."""

    type: ClassVar[str] = "stats_request"
    tag: int | None = None  # echoed on the reply: a client with several asks out tells them apart


@dataclass
class Stats(Message):
    """Router -> client: requests in flight, and each group's latest report (``worker_stats``)."""

    type: ClassVar[str] = "stats"
    requests_in_flight: int
    groups: dict[str, dict[str, int]]  # "prefill0" -> WorkerStats fields
    # What a front end (an HTTP server) needs besides: health, and the default output budget.
    ready: bool = False  # every group has reported ready
    accepting: bool = True  # False once the cluster drains for shutdown
    max_model_len: int = 0  # prompt + output tokens a request may hold
    # Since start: group_failures, restarts, migrated (request moves), worker_failed (requests
    # ended past the migration limit).
    faults: dict[str, int] = field(default_factory=dict)
    members: list[GroupInfo] = field(default_factory=list)  # every group the router knows of
    tag: int | None = None  # the request's


@dataclass
class GroupInfo(Message):
    """One worker group as the router sees it (in ``stats``): where it runs and what it holds."""

    type: ClassVar[str] = "group_info"
    role: str
    group: int
    tp: int
    state: str  # starting | ready | draining
    address: str  # its leader's control endpoint (ipc:// on the router's node, tcp:// beyond it)
    devices: list[str]  # each TP rank's device, from its heartbeats ("cpu", "cuda:0")
    joined: bool  # joined at run time from a group node (not started by the router's node)
    requests: int  # requests it holds now
    load: int  # tokens those requests may still occupy it with (the dispatch policies' load)
    dispatched: int  # requests sent to it since it became ready, cumulative
    # Seconds since its last ``worker_stats`` (None before the first): a leader reports between
    # engine steps, so during a long step its report in ``stats.groups`` is this old.
    stats_age: float | None = None


@dataclass
class Error(Message):
    """Router -> client: the terminal message of a request that failed, or a reply to bad input."""

    type: ClassVar[str] = "error"
    request_id: str | None
    code: str
    message: str


# -- router <-> workers, prefill <-> decode ----------------------------------------------------


@dataclass
class WorkRequest(Message):
    """Router -> prefill (or colocated) leader."""

    type: ClassVar[str] = "work"
    request_id: str
    token_ids: list[int]
    sampling: Sampling
    decode_group: int  # where the prefill group sends the KV (unused when colocated)


@dataclass
class TokenOutput(Message):
    """Worker leader -> router: tokens of a request, ``index`` = position of the first one."""

    type: ClassVar[str] = "tokens"
    request_id: str
    index: int
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)  # on the wire: the values that apply


@dataclass
class TokenOutputs(Message):
    """Worker leader -> router: every request's new tokens of one engine step, in one message."""

    type: ClassVar[str] = "token_outputs"
    outputs: list[TokenOutput]


@dataclass
class WorkerError(Message):
    """Worker leader -> router: a request the worker could not serve."""

    type: ClassVar[str] = "worker_error"
    request_id: str
    code: str
    message: str


@dataclass
class KVAnnounce(Message):
    """Prefill leader -> decode leader: a prefilled request whose KV is ready to move."""

    type: ClassVar[str] = "kv_announce"
    request_id: str
    prefill_group: int
    token_ids: list[int]  # the prompt
    first_token: int
    sampling: Sampling
    timings: RequestTimings = field(default_factory=RequestTimings)  # measured by the prefill group's engine
    block_ids: list[int] = field(default_factory=list)  # the prompt's KV blocks in the prefill pool
    generation: int = 0  # the prefill group's: a dead generation's announce, read late, is dropped


@dataclass
class KVReply(Message):
    """Decode leader -> prefill leader: ``accepted`` or refused (no blocks). Accepted means the
    receive is posted (push backends) or, where the decode side pulls the KV, that the pull is
    complete: the prefill side may then free the blocks. The decode group's prefix cache held
    the KV of the announce's first ``cached_blocks`` blocks already: only the others move."""

    type: ClassVar[str] = "kv_reply"
    request_id: str
    accepted: bool
    cached_blocks: int = 0


@dataclass
class WorkerStats(Message):
    """Worker leader -> router, periodically: the group's KV pool and queues."""

    type: ClassVar[str] = "worker_stats"
    role: str
    group: int
    num_blocks: int
    free_blocks: int
    running: int
    waiting: int
    kv_held: int  # prefill: prefilled requests keeping their KV; decode: receives in flight
    kv_refused: int  # prefill: announcements the decode side refused (back-pressure), cumulative
    # The prefix cache, cumulative (0 without one): prompt tokens looked up, those it held, and
    # blocks it evicted.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_evicted_blocks: int = 0
    kv_transfer_failures: int = 0  # KV transfers that did not deliver a usable KV, cumulative


@dataclass
class CacheEvents(Message):
    """Worker leader -> router: blocks the group's prefix cache took in or evicted since the
    last such message, in order, each named by its block hash (``block_hash``): ``h`` inserted,
    ``-h`` evicted. The router's view of which group holds which prefix."""

    type: ClassVar[str] = "cache_events"
    role: str
    group: int
    hashes: list[int]


@dataclass
class Ready(Message):
    """Worker leader -> router: the group is up."""

    type: ClassVar[str] = "ready"
    role: str
    group: int
    num_blocks: int
    tp: int = 0  # its TP degree (0: as the router's node started it)
    address: str = ""  # where its leader listens ("": where the router's node told it to)


@dataclass
class Shutdown(Message):
    """Router -> worker leaders: no more requests; drain and exit."""

    type: ClassVar[str] = "shutdown"


@dataclass
class Heartbeat(Message):
    """Every worker rank -> router, every ``heartbeat_interval`` from a thread of its own: the
    rank's process is alive and running (neither dead nor stopped)."""

    type: ClassVar[str] = "heartbeat"
    role: str
    group: int
    tp_rank: int
    device: str = ""  # where the rank runs: "cpu", "cuda:0"


@dataclass
class Drain(Message):
    """Group node -> router: the node is stopping (SIGTERM). Send the group no more requests,
    let it finish those it holds, then shut it down and forget it."""

    type: ClassVar[str] = "drain"
    role: str
    group: int


@dataclass
class PeerFailed(Message):
    """Router -> leaders of the other role: group ``group`` of ``role`` failed (or left the
    cluster); give up every KV hand-off with it."""

    type: ClassVar[str] = "peer_failed"
    role: str
    group: int


@dataclass
class PeerRestarted(Message):
    """Router -> leaders of the other role: group ``group`` of ``role`` was restarted as
    ``generation``, or joined the cluster; form a new KV pair group with it."""

    type: ClassVar[str] = "peer_restarted"
    role: str
    group: int
    generation: int
    address: str = ""  # where its leader listens ("": the address the receiver's node knows)


# -- block hashes: the names of cached prefixes in ``cache_events`` ----------------------------

_HASH_MASK = (1 << 63) - 1
ROOT_HASH = 0  # the empty prefix; never the hash of a block


def block_hash(parent: int, block: typing.Sequence[int]) -> int:
    """The name of the prefix that ends with ``block`` (a full KV block's token ids) after the
    prefix named ``parent``: one number for the whole prefix, positive and below 2**63 so that
    its negation can mean an eviction.

    Python's tuple hash over ints, which is not salted (``PYTHONHASHSEED`` only affects str and
    bytes) and is one function on every 64-bit CPython since 3.8: the router and the leaders, on
    one machine or several, agree. A group node on another interpreter (32-bit, PyPy) would only
    mislead routing choices, as a collision can, never a result: the engines match token ids.
    """
    return (hash((parent, tuple(block))) & _HASH_MASK) or 1


def prefix_hashes(token_ids: typing.Sequence[int], block_size: int) -> list[int]:
    """The hashes of every full block of ``token_ids``, in order."""
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
