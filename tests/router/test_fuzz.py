"""Property-based fuzzing of the router's client socket, on a real cluster (``launch.py`` on CPU).

Random bytes, random msgpack values and valid messages with one field mutated, one frame at a
time: the router answers each with exactly one well-formed reply (an ``error`` with a documented
code, or for a frame that turns out valid its ``final`` or ``stats``), and never dies.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.bench.compare import LaunchedCluster
from pdserve.cluster.client import Client, ClusterUnavailable

FRAMES = 10_000
ERROR_CODES = {
    "malformed", "unknown_type", "unsupported_version", "unknown_field", "missing_field", "invalid_field",
    "unexpected_type", "invalid_request", "duplicate_request_id", "unknown_request", "overloaded",
}  # fmt: skip
VALID = [
    {"type": "generate", "version": 1, "request_id": "r", "token_ids": [1, 2, 3], "stream": False,
     "sampling": {"max_tokens": 2, "temperature": 0.0}},
    {"type": "generate", "version": 1, "prompt": "hi", "stream": False},
    {"type": "abort", "version": 1, "request_id": "nothing-running"},
    {"type": "stats_request", "version": 1},
]  # fmt: skip

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), st.floats(),
    st.text(max_size=40), st.binary(max_size=40),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.one_of(st.text(max_size=12), scalars), inner, max_size=6)
    ),
    max_leaves=20,
)


def _packed(value: Any) -> bytes | None:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):  # a map key msgpack cannot write
        return None


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid message with one key dropped, added or given another value."""
    message = dict(draw(st.sampled_from(VALID)))
    key = draw(st.sampled_from([*message, "sampling.max_tokens", "extra"]))
    action = draw(st.sampled_from(["drop", "replace"]))
    if key == "sampling.max_tokens" and isinstance(message.get("sampling"), dict):
        message["sampling"] = {**message["sampling"], "max_tokens": draw(values)}
    elif action == "drop":
        message.pop(key, None)
    else:
        message[key] = draw(values)
    return _packed(message) or b"\xc1"


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "value", "mutated", "truncated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "value":
        return _packed(draw(values)) or b"\xc1"
    frame = draw(mutated())
    return frame[: draw(st.integers(0, len(frame)))] if kind == "truncated" else frame


@pytest.fixture(scope="module")
def fuzz_client(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    log = tmp_path_factory.mktemp("fuzz") / "launch.log"
    cluster = LaunchedCluster(
        ["--model", str(tiny_model_dirs["tiny-llama"]), "--max-model-len", "128", "--num-blocks", "64"],
        log,
        start_timeout=300,
    )
    try:
        with Client(cluster.endpoint, timeout=60) as client:
            yield client
            # Exactly one reply a frame (each test reads only its frame's): none is left over.
            client.timeout = 1.0
            with pytest.raises(ClusterUnavailable):
                leftover = client.receive()
                pytest.fail(f"a reply no frame was waiting for: {leftover}")
            assert client.stats().type == "stats"
        assert cluster.stop() == 0, cluster.output()[-4000:]
    finally:
        cluster.kill()


@pytest.mark.slow
@settings(max_examples=FRAMES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(frame=frames())
def test_every_frame_gets_one_well_formed_reply(fuzz_client: Client, frame: bytes) -> None:
    fuzz_client.send_raw(frame)
    while True:
        reply = fuzz_client.receive()  # decodes: a malformed reply raises here
        if reply.type == "chunk":  # a mutation that left a valid streaming request
            continue
        break
    if reply.type == "error":
        assert reply.code in ERROR_CODES and isinstance(reply.message, str) and reply.message, reply
    else:
        assert reply.type in ("final", "stats"), reply
