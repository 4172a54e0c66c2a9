"""The wire protocol: typed, versioned messages and their one msgpack codec.

Every message is a msgpack map with ``type`` and ``version``; the other keys are the fields of
the ``msgspec.Struct`` registered for that type. msgspec decodes and type-checks a message in
one pass in C, which matters on the hot links (a step's tokens, a KV announce); this module
reads ``type`` and ``version`` first; a frame msgspec refuses is read again in Python
(``_explain``) to name its first error in this protocol's codes and order.
``decode`` never raises anything but ``ProtocolError`` (garbage bytes, wrong shape, unknown
type or field, wrong version, bad field types), so a process that reads a socket can answer bad
input with an error instead of dying. No pickles.

Client-facing messages are documented in ``docs/protocol.md``; the internal ones travel
between the router and the worker leaders, and between prefill and decode leaders.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import msgpack
import msgspec

from pdserve.engine.sampling import RequestError, SamplingParams
from pdserve.engine.timings import RequestTimings

PROTOCOL_VERSION = 1
MAX_REQUEST_ID_CHARS = 256  # an id is echoed on every reply: a longer one is refused, not echoed
# The router's limit on a client's message, in MiB, by default (--max-message-mib): one over it
# drops the client's connection unread, with every request on it.
DEFAULT_MAX_MESSAGE_MIB = 4.0


class ProtocolError(ValueError):
    """A message that cannot be decoded; ``code`` is the error code sent back."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


_TYPES: dict[str, type[Message]] = {}


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """A message's fields. On the wire a top-level message is the map of its fields plus ``type``
    and ``version``; one nested in another (a ``chunk`` in ``chunks``) is its fields alone."""

    type: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.type:
            _TYPES[cls.type] = cls


class _Envelope(msgspec.Struct):
    """What is read of every message before its fields: the rest is skipped, not checked."""

    type: object = None
    version: object = None
    request_id: object = None


@functools.cache
def _wire(cls: type[Message]) -> type[msgspec.Struct]:
    """``cls`` as it travels: ``type``, ``version``, then its fields (same types and defaults),
    unknown keys refused; msgspec checks every value's type while it decodes, in C."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [("type", str), ("version", int)]
    for f in msgspec.structs.fields(cls):
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, f.type))
    return msgspec.defstruct(cls.__name__, fields, forbid_unknown_fields=True)


@functools.cache
def _decoder(cls: type[Message]) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(_wire(cls))


def _plain(value: Any) -> Any:
    """A subclass of a builtin scalar (``numpy.float64``, a ``str`` subclass) as that builtin,
    as msgpack wrote them; msgspec calls this only for types it does not write itself."""
    for kind in (float, int, str):  # bool and enums never get here
        if isinstance(value, kind):
            return kind(value)
    raise TypeError(f"Encoding objects of type {type(value).__name__} is unsupported")


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_ENCODER = msgspec.msgpack.Encoder(enc_hook=_plain)


def encode(message: Message) -> bytes:
    cls = type(message)
    return _ENCODER.encode(_wire(cls)(cls.type, PROTOCOL_VERSION, *msgspec.structs.astuple(message)))


def decode(data: bytes) -> Message:
    try:
        envelope = _ENVELOPE.decode(data)
        kind, version, request_id = envelope.type, envelope.version, envelope.request_id
        cls = _TYPES.get(kind) if isinstance(kind, str) else None
        if (
            cls is not None
            and type(version) is int
            and version == PROTOCOL_VERSION
            and not (isinstance(request_id, str) and len(request_id) > MAX_REQUEST_ID_CHARS)
        ):
            wire = _decoder(cls).decode(data)
            return cls(*msgspec.structs.astuple(wire)[2:])
        refusal: Exception | None = None
    except Exception as e:  # msgspec refused it: garbage, or a bad field
        refusal = e
    raise _explain(data, refusal) from None


def _explain(data: bytes, refusal: Exception | None) -> ProtocolError:
    """Why ``data`` does not decode: the first error in the order the protocol reports them. The
    frame first (not msgpack, not a map, invalid UTF-8 or a map key that is not a string
    anywhere), then ``request_id``'s length, ``type``, ``version``, and in each map its unknown
    keys before its fields, those in their declared order. msgspec stops at the first error in
    byte order instead, and its messages hold the client's own key names, so a refused frame is
    read again here, in Python: a cold path that well-formed messages never take."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        if b" HTTP/1." in data[:1024]:  # a request line, its first bytes taken for ZMTP 1.0 framing
            why = "an HTTP request, not a msgpack message: this is the cluster's ZMQ port; --http-port serves HTTP"
            return ProtocolError("malformed", why)
        return ProtocolError("malformed", f"not a msgpack message: {type(e).__name__}")
    if not isinstance(body, dict):
        return ProtocolError("malformed", "a message must be a msgpack map")
    request_id = body.get("request_id") if isinstance(body.get("request_id"), str) else None
    if request_id is not None and len(request_id) > MAX_REQUEST_ID_CHARS:
        return ProtocolError("invalid_field", f"request_id: longer than {MAX_REQUEST_ID_CHARS} characters")
    kind = body.pop("type", None)
    version = body.pop("version", None)
    if not isinstance(kind, str) or kind not in _TYPES:
        return ProtocolError("unknown_type", f"unknown message type {kind!r}", request_id)
    if type(version) is not int or version != PROTOCOL_VERSION:
        why = f"protocol version {version!r} is not supported (this is {PROTOCOL_VERSION})"
        return ProtocolError("unsupported_version", why, request_id)
    try:
        _check_fields(_TYPES[kind], body, "", kind)
    except ProtocolError as e:
        e.request_id = request_id
        return e
    # Nothing found: msgspec refused what a plain read lets by (a key given twice, the first
    # value bad; nesting deeper than msgspec reads).
    if isinstance(refusal, msgspec.ValidationError):
        return ProtocolError("invalid_field", f"{kind}: {refusal}", request_id)
    return ProtocolError("malformed", f"not a msgpack message: {refusal}", request_id)


def _invalid(message: str) -> ProtocolError:
    return ProtocolError("invalid_field", message)


def _check_map(value: Any, what: str) -> None:
    """``value`` is a map whose keys are strings; ``what`` names it in an error."""
    if not isinstance(value, dict):
        raise _invalid(f"{what} must be a map")
    if not all(isinstance(key, str) for key in value):
        raise ProtocolError("malformed", f"map keys in {what} must be strings")


def _check_fields(cls: type[Message], body: Any, path: str, where: str) -> None:
    """``body`` against ``cls``'s fields; ``path`` names it in its message ("", "sampling",
    "chunks[0]"), ``where`` in an error (the type's name at the top)."""
    _check_map(body, repr(where))
    fields = msgspec.structs.fields(cls)
    names = {f.name for f in fields}
    if not body.keys() <= names:
        unknown = sorted(set(body) - names)
        raise ProtocolError("unknown_field", f"unknown field {unknown[0]!r} in {where}")
    for f in fields:
        if f.name in body:
            _check_value(f.type, body[f.name], f.name, f"{path}.{f.name}" if path else f.name)
        elif f.required:
            raise ProtocolError("missing_field", f"missing field {f.name!r} in {where}")


_TIMING_NAMES = frozenset(RequestTimings.__struct_fields__)


def _check_value(hint: Any, value: Any, name: str, path: str) -> None:
    """``value`` of field ``name`` (at ``path``) against its type, as msgspec checks it."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [option for option in typing.get_args(hint) if option is not type(None)]
        if value is None and len(options) < len(typing.get_args(hint)):
            return
        errors = []
        for option in options:
            try:
                return _check_value(option, value, name, path)
            except ProtocolError as e:
                errors.append(e)
        raise errors[0] if errors else _invalid(f"field {name!r} may not be null")
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            raise _invalid(f"field {name!r} must be a list")
        (item,) = typing.get_args(hint)
        if item is int:  # token ids, the long lists: one scan (bools are not ints here)
            if any(type(v) is not int for v in value):
                raise _invalid(f"field {name!r} must be an integer")
            return
        for i, v in enumerate(value):
            _check_value(item, v, name, f"{path}[{i}]")
    elif typing.get_origin(hint) is dict:
        _check_map(value, f"field {name!r}")
        _, item = typing.get_args(hint)
        for v in value.values():
            _check_value(item, v, name, f"{path}[*]")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _invalid(f"field {name!r} must be a number")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _invalid(f"field {name!r} must be an integer")
    elif hint in (str, bool):
        if not isinstance(value, hint):
            raise _invalid(f"field {name!r} must be {hint.__name__}")
    elif hint is RequestTimings:  # the map of the values that apply (``RequestTimings.as_dict``)
        _check_map(value, f"field {name!r}")
        if not value.keys() <= _TIMING_NAMES:
            unknown = sorted(value.keys() - _TIMING_NAMES)
            raise _invalid(f"unknown key {unknown[0]!r} in field {name!r}")
        if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in value.values()):
            raise _invalid(f"field {name!r} must map to numbers")
    elif isinstance(hint, type) and issubclass(hint, Message):
        _check_fields(hint, value, path, path)


# -- client <-> router -----------------------------------------------------------------------


class Sampling(Message):
    """Sampling parameters (``to_params`` checks their ranges)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] = msgspec.field(default_factory=dict)  # token id (as OpenAI's, a string) -> bias

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
            min_tokens=self.min_tokens,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=_logit_bias(self.logit_bias),
        )


def _logit_bias(biases: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` by token id: a token named twice ("7" and "007") is refused, not an entry
    that costs the message more bytes than its JSON did."""
    keys: dict[int, str] = {}  # each token's key
    for key in biases:
        token = _token_id(key)
        if token in keys:
            raise RequestError("logit_bias", f"keys {keys[token]!r} and {key!r} both name token {token}")
        keys[token] = key
    return tuple((token, biases[key]) for token, key in keys.items())


def _token_id(key: str) -> int:
    """A ``logit_bias`` key: a token id written in decimal digits."""
    shown = key if len(key) <= 24 else f"{key[:20]}... ({len(key)} characters)"
    if not (key.isascii() and key.isdigit()):
        raise RequestError("logit_bias", f"keys must be token ids, got {shown!r}")
    digits = key.lstrip("0") or "0"  # int() counts leading zeros against its 4300-digit limit
    if len(digits) > 19:  # past any vocabulary
        raise RequestError("logit_bias", f"key {shown!r} is no token id of this model")
    return int(digits)


class Generate(Message):
    """Client -> router. Exactly one of ``prompt`` (text) and ``token_ids``."""

    type: ClassVar[str] = "generate"
    request_id: str | None = None  # the client's id, echoed back; the router makes one if absent
    prompt: str | None = None
    token_ids: list[int] | None = None
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    stream: bool = True
    chat: bool = True  # apply the model's chat template to a text prompt
    batch_chunks: bool = False  # this request's chunks may come inside ``chunks`` messages
    skip_special_tokens: bool = True  # the text leaves special tokens out (vLLM's default)
    include_stop_str_in_output: bool = False  # the text keeps the stop token's (vLLM's name)


class Abort(Message):
    """Client -> router (and router -> workers): stop a request."""

    type: ClassVar[str] = "abort"
    request_id: str


class Logprobs(Message):
    """The log-probabilities of the tokens beside it (``token_ids``), one entry each: the
    token's, and the ids and log-probabilities of the likeliest tokens there, best first."""

    token_logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]

    @classmethod
    def of(cls, entries: Iterable[tuple[float, list[int], list[float]]]) -> Logprobs:
        """From the engine's entries (``sampler.TokenLogprobs``), one per token."""
        out = cls([], [], [])
        for logprob, top_ids, top_logprobs in entries:
            out.token_logprobs.append(logprob)
            out.top_token_ids.append(top_ids)
            out.top_logprobs.append(top_logprobs)
        return out

    def extend(self, other: Logprobs) -> None:
        self.token_logprobs.extend(other.token_logprobs)
        self.top_token_ids.extend(other.top_token_ids)
        self.top_logprobs.extend(other.top_logprobs)


class Chunk(Message):
    """Router -> client: new tokens of a streaming request, in order."""

    type: ClassVar[str] = "chunk"
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: Logprobs | None = None  # where the request asked for them (``sampling.logprobs``)
    # The first chunk's, where the request asked (``sampling.prompt_logprobs``): prompt token i + 1's at i.
    prompt_logprobs: Logprobs | None = None


class Chunks(Message):
    """Router -> client: the chunks of one worker step for this client's ``batch_chunks``
    requests, one message instead of one each."""

    type: ClassVar[str] = "chunks"
    chunks: list[Chunk]


class Final(Message):
    """Router -> client: the terminal message of a request that ran (finished or aborted)."""

    type: ClassVar[str] = "final"
    request_id: str
    finish_reason: str  # stop | length | abort
    token_ids: list[int]  # every generated token
    text: str
    usage: dict[str, int]  # prompt_tokens, completion_tokens
    timings: dict[str, float]  # RequestTimings.as_dict(): queue, prefill, transfer, ..., total
    logprobs: Logprobs | None = None  # of every generated token, where the request asked for them
    prompt_logprobs: Logprobs | None = None  # of every prompt token but the first, where asked


class StatsRequest(Message):
    """Client -> router: ask for the cluster's state."""

    type: ClassVar[str] = "stats_request"
    tag: int | None = None  # echoed on the reply: a client with several asks out tells them apart


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
    faults: dict[str, int] = msgspec.field(default_factory=dict)
    members: list[GroupInfo] = msgspec.field(default_factory=list)  # every group the router knows of
    tag: int | None = None  # the request's
    vocab_size: int = 0  # token ids are [0, vocab_size): a front end checks its model against it
    # Roles a request passes through with no ready group taking requests: empty while requests run
    # (some groups may be down).
    unserved_roles: list[str] = msgspec.field(default_factory=list)


class GroupInfo(Message):
    """One worker group as the router sees it (in ``stats``): where it runs and what it holds."""

    type: ClassVar[str] = "group_info"
    role: str
    group: int
    tp: int
    state: str  # starting | ready | draining | down
    address: str  # its leader's control endpoint (ipc:// on the router's node, tcp:// beyond it)
    devices: list[str]  # each TP rank's device, from its heartbeats ("cpu", "cuda:0")
    joined: bool  # joined at run time from a group node (not started by the router's node)
    requests: int  # requests it holds now
    load: int  # tokens those requests may still occupy it with (the dispatch policies' load)
    dispatched: int  # requests sent to it since the router started, cumulative
    # Seconds since its last ``worker_stats`` (None before the first): a leader reports between
    # engine steps, so during a long step its report in ``stats.groups`` is this old.
    stats_age: float | None = None


class Error(Message):
    """Router -> client: the terminal message of a request that failed, or a reply to bad input."""

    type: ClassVar[str] = "error"
    request_id: str | None
    code: str
    message: str


# -- router <-> workers, prefill <-> decode ----------------------------------------------------


class WorkRequest(Message):
    """Router -> prefill (or colocated) leader."""

    type: ClassVar[str] = "work"
    request_id: str
    token_ids: list[int]
    sampling: Sampling
    decode_group: int  # where the prefill group sends the KV (unused when colocated)
    # A moved request's: the last ``generated`` of ``token_ids`` are its output so far, which its
    # limits and penalties count as output, not prompt.
    generated: int = 0


class TokenOutput(Message):
    """Worker leader -> router: tokens of a request, ``index`` = position of the first one."""

    type: ClassVar[str] = "tokens"
    request_id: str
    index: int
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    timings: RequestTimings = msgspec.field(default_factory=RequestTimings)  # on the wire: the values that apply
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None  # with the first token (index 0)


class TokenOutputs(Message):
    """Worker leader -> router: every request's new tokens of one engine step, in one message."""

    type: ClassVar[str] = "token_outputs"
    outputs: list[TokenOutput]


class WorkerError(Message):
    """Worker leader -> router: a request the worker could not serve."""

    type: ClassVar[str] = "worker_error"
    request_id: str
    code: str
    message: str


class KVAnnounce(Message):
    """Prefill leader -> decode leader: a prefilled request whose KV is ready to move."""

    type: ClassVar[str] = "kv_announce"
    request_id: str
    prefill_group: int
    token_ids: list[int]  # the prompt
    first_token: int
    sampling: Sampling
    timings: RequestTimings = msgspec.field(default_factory=RequestTimings)  # measured by the prefill group's engine
    block_ids: list[int] = msgspec.field(default_factory=list)  # the prompt's KV blocks in the prefill pool
    generation: int = 0  # the prefill group's: a dead generation's announce, read late, is dropped
    generated: int = 0  # as the work request's: the last ones of ``token_ids`` are output


class KVReply(Message):
    """Decode leader -> prefill leader: ``accepted`` or refused (no room yet, a pair still
    forming, an aborted or stale announce: the prefill side asks again or frees). Accepted means the
    receive is posted (push backends) or, where the decode side pulls the KV, that the pull is
    complete: the prefill side may then free the blocks. The decode group's prefix cache held
    the KV of the announce's first ``cached_blocks`` blocks already: only the others move."""

    type: ClassVar[str] = "kv_reply"
    request_id: str
    accepted: bool
    cached_blocks: int = 0


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
    kv_refused: int  # prefill: announcements the decode side refused (back-pressure, a pair forming), cumulative
    # The prefix cache, cumulative (0 without one): prompt tokens looked up, those it held, and
    # blocks it evicted.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_evicted_blocks: int = 0
    kv_transfer_failures: int = 0  # KV transfers that did not deliver a usable KV, cumulative
    pairs_forming: int = 0  # groups of the other role whose KV pair with this one cannot move KV yet
    preemptions: int = 0  # sequences preempted for want of KV blocks (recomputed later), cumulative
    prefix_cached_blocks: int = 0  # blocks the prefix cache holds now, used by requests or evictable


class CacheEvents(Message):
    """Worker leader -> router: blocks the group's prefix cache took in or evicted since the
    last such message, in order, each named by its block hash (``block_hash``): ``h`` inserted,
    ``-h`` evicted. The router's view of which group holds which prefix."""

    type: ClassVar[str] = "cache_events"
    role: str
    group: int
    hashes: list[int]


class Ready(Message):
    """Worker leader -> router: the group is up."""

    type: ClassVar[str] = "ready"
    role: str
    group: int
    num_blocks: int
    tp: int = 0  # its TP degree (0: as the router's node started it)
    address: str = ""  # where its leader listens ("": where the router's node told it to)


class Shutdown(Message):
    """Router -> worker leaders: no more requests; drain and exit."""

    type: ClassVar[str] = "shutdown"


class Ping(Message):
    """Router -> client, while a request of the client waits for a group (``no_group`` pending):
    nothing to answer; clients drop it. Sent to learn whether the client is still there: the
    send to one that is gone fails, and the router aborts its requests at once instead of at
    the dispatch timeout."""

    type: ClassVar[str] = "ping"


class Heartbeat(Message):
    """Every worker rank -> router, every ``heartbeat_interval`` from a thread of its own: the
    rank's process is alive and running (neither dead nor stopped)."""

    type: ClassVar[str] = "heartbeat"
    role: str
    group: int
    tp_rank: int
    device: str = ""  # where the rank runs: "cpu", "cuda:0"


class Drain(Message):
    """Group node -> router: the node is stopping (SIGTERM). Send the group no more requests,
    let it finish those it holds, then shut it down and forget it."""

    type: ClassVar[str] = "drain"
    role: str
    group: int


class GroupFailed(Message):
    """Group node -> router: a rank of the node's joined group died; the node has ended the
    others. Remove the group now, rather than once its heartbeats are overdue."""

    type: ClassVar[str] = "group_failed"
    role: str
    group: int
    cause: str


class PeerFailed(Message):
    """Router -> leaders of the other role: group ``group`` of ``role`` failed (or left the
    cluster); give up every KV hand-off with it."""

    type: ClassVar[str] = "peer_failed"
    role: str
    group: int
    left: bool = False  # it drained and left (a group node stopped), rather than failed


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


def block_hash(parent: int, block: Sequence[int]) -> int:
    """The name of the prefix that ends with ``block`` (a full KV block's token ids) after the
    prefix named ``parent``: one number for the whole prefix, positive and below 2**63 so that
    its negation can mean an eviction.

    Python's tuple hash over ints, which is not salted (``PYTHONHASHSEED`` only affects str and
    bytes) and is one function on every 64-bit CPython since 3.8: the router and the leaders, on
    one machine or several, agree. A group node on another interpreter (32-bit, PyPy) would only
    mislead routing choices, as a collision can, never a result: the engines match token ids.
    """
    return (hash((parent, tuple(block))) & _HASH_MASK) or 1


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hashes of every full block of ``token_ids``, in order."""
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
