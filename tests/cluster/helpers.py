"""What the cluster tests share beside their fixtures (tests/cluster/conftest.py)."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.soak import descendants
from pdserve.cluster.client import Chunk, Client, Final
from pdserve.cluster.protocol import Logprobs, WorkerError, decode
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams

# Every test cluster's --max-model-len: short, so that the CPU's KV pools stay small.
MAX_MODEL_LEN = 512


def worker_errors(router_inbox: Any) -> list[tuple[str, str]]:
    """The (request, code) of every ``WorkerError`` a leader sent the router's inbox (a bound
    PULL socket) so far."""
    errors = []
    while router_inbox.poll(200):
        message = decode(router_inbox.recv())
        if isinstance(message, WorkerError):
            errors.append((message.request_id, message.code))
    return errors


def front_end_pids(launcher_pid: int) -> list[int]:
    """The pids of the HTTP front ends the launcher runs (its processes running openai_server)."""
    return sorted(p for p in descendants(launcher_pid) if "pdserve.router.openai_server" in cmdline(p))


def cmdline(pid: int) -> list[str]:
    """A process's arguments (none once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return []


def wait_until_idle(
    client: Client, timeout: float = 60.0, also: Callable[[dict[str, dict[str, int]]], bool] = lambda groups: True
) -> dict[str, dict[str, int]]:
    """Poll stats until nothing is in flight, every group's blocks are all free again and ``also``
    holds. Groups report their stats periodically, so a reply can predate the last request."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        groups = stats.groups
        if (
            stats.requests_in_flight == 0
            and groups
            and all(g["free_blocks"] == g["num_blocks"] and g["kv_held"] == 0 for g in groups.values())
            and also(groups)
        ):
            return groups
        assert time.monotonic() < deadline, f"cluster not idle: {stats}"
        time.sleep(0.3)


def oracle_engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(model_dir), device="cpu", max_model_len=MAX_MODEL_LEN, cache=CacheConfig(num_blocks=256))
    )


def oracle(model_dir: Path, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return oracle_engine(model_dir).generate(prompts, params)


def oracle_logprobs(model_dir: Path, prompts: list[list[int]], params: list[SamplingParams]) -> list[Logprobs | None]:
    """The single engine's log-probabilities of each request's tokens, as a final carries them."""
    engine = oracle_engine(model_dir)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    entries: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    for outputs in engine.drain():
        for out in outputs:
            entries[out.request_id] += out.logprobs or []
    return [Logprobs.of(entries[str(i)]) if p.logprobs is not None else None for i, p in enumerate(params)]


def oracle_prompt_logprobs(
    model_dir: Path, prompts: list[list[int]], params: list[SamplingParams]
) -> list[Logprobs | None]:
    """The single engine's prompt log-probabilities of each request, as a final carries them."""
    engine = oracle_engine(model_dir)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    entries: dict[str, Logprobs] = {}
    for outputs in engine.drain():
        for out in outputs:
            if out.prompt_logprobs is not None:
                entries[out.request_id] = Logprobs.of(out.prompt_logprobs)
    return [entries.get(str(i)) for i in range(len(prompts))]


def assert_logprobs_close(got: Logprobs | None, expected: Logprobs | None, tolerance: float = 1e-4) -> None:
    """Equal within ``tolerance``; alternatives whose log-probabilities lie that close to a
    neighbour's may come in either order (other batch shapes round otherwise)."""
    assert (got is None) == (expected is None)
    if got is None or expected is None:
        return
    assert got.token_logprobs == pytest.approx(expected.token_logprobs, abs=tolerance)
    for ids, values, want_ids, want_values in zip(
        got.top_token_ids, got.top_logprobs, expected.top_token_ids, expected.top_logprobs, strict=True
    ):
        assert values == pytest.approx(want_values, abs=tolerance)
        for k, (token, want) in enumerate(zip(ids, want_ids, strict=True)):
            near = [v for j, v in enumerate(want_values) if j != k and abs(v - want_values[k]) <= 2 * tolerance]
            assert token == want or near, (ids, want_ids)


def mixed_requests(vocab: int, n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """``n`` prompts of 1-90 tokens and their sampling, most greedy, for a cluster to serve and
    the single engine to check."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.choice([1, 5, 16, 17, 40, 90]))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 30), temperature=0.0, ignore_eos=True) for _ in range(n)]
    # Every fourth samples with a seed: its noise depends on its seed and each token's position
    # only, so prefill's first token and decode's next ones draw as the single engine does.
    for i in range(0, n, 4):
        params[i] = dataclasses.replace(params[i], temperature=0.8, top_k=50, seed=rng.randrange(2**63))
    # Penalties count the prompt and every token so far, wherever each was sampled.
    for i in range(1, n, 3):
        params[i] = dataclasses.replace(params[i], repetition_penalty=1.3, frequency_penalty=0.4)
    for i in range(0, n, 5):
        params[i] = dataclasses.replace(params[i], presence_penalty=0.6, min_p=0.05)
    for i in range(2, n, 3):
        params[i] = dataclasses.replace(params[i], logprobs=i % 4)
    for i in range(3, n, 4):
        bias = ((rng.randrange(vocab), 5.0), (rng.randrange(vocab), -100.0))
        params[i] = dataclasses.replace(params[i], logit_bias=bias)
    # The prompt's own log-probabilities come with the first token, from the entry group.
    for i in range(0, n, 6):
        params[i] = dataclasses.replace(params[i], prompt_logprobs=i % 4)
    # Half the vocabulary stops these, but not within their first tokens: prefill's first token
    # and decode's next ones must both hold them back, and the first allowed one likely stops.
    for i in range(1, n, 4):
        p = params[i]
        params[i] = dataclasses.replace(p, stop_token_ids=tuple(range(0, vocab, 2)), min_tokens=min(3, p.max_tokens))
    return prompts, params


def wire_sampling(params: SamplingParams) -> dict[str, Any]:
    """``params`` as the client's sampling keywords."""
    fields = dataclasses.asdict(params)
    return {**fields, "stop_token_ids": list(fields["stop_token_ids"]), "logit_bias": dict(fields["logit_bias"])}


def run_concurrently(client: Client, prompts: list[list[int]], params: list[SamplingParams]) -> list[Final]:
    """Submit every request at once (streaming), then check each stream and return its Final."""
    ids = [client.submit(token_ids=p, stream=True, **wire_sampling(sp)) for p, sp in zip(prompts, params)]
    finals = []
    for request_id in ids:
        chunks: list[Chunk] = []
        for message in client.chunks(request_id):
            if isinstance(message, Chunk):
                chunks.append(message)
            else:
                assert [t for c in chunks for t in c.token_ids] == message.token_ids, "chunks out of order"
                assert "".join(c.text for c in chunks) == message.text
                if message.logprobs is None:
                    assert all(c.logprobs is None for c in chunks)
                else:
                    assert all(
                        c.logprobs is not None and len(c.logprobs.token_logprobs) == len(c.token_ids) for c in chunks
                    )
                    joined = Logprobs([], [], [])
                    for c in chunks:
                        joined.extend(c.logprobs)  # type: ignore[arg-type]
                    assert joined == message.logprobs
                finals.append(message)
    return finals


def abort_mid_stream(client: Client, token_ids: list[int]) -> Final:
    """Stream a long greedy answer to ``token_ids``, abort it after two chunks, and check that
    the stream ends with an "abort" final, which it returns."""
    request_id = client.submit(token_ids=token_ids, stream=True, max_tokens=400, temperature=0.0, ignore_eos=True)
    chunks = client.chunks(request_id)
    next(chunks)
    next(chunks)
    client.abort(request_id)
    tail = list(chunks)
    assert isinstance(tail[-1], Final) and tail[-1].finish_reason == "abort"
    return tail[-1]
