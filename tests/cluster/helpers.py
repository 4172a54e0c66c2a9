"""What the cluster tests share beside their fixtures (tests/cluster/conftest.py)."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.bench.soak import descendants
from pdserve.cluster.client import Chunk, Client, Final
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams

# Every test cluster's --max-model-len: short, so that the CPU's KV pools stay small.
MAX_MODEL_LEN = 512


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


def oracle(model_dir: Path, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), device="cpu", max_model_len=MAX_MODEL_LEN, cache=CacheConfig(num_blocks=256))
    )
    return engine.generate(prompts, params)


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
    return prompts, params


def wire_sampling(params: SamplingParams) -> dict[str, Any]:
    """``params`` as the client's sampling keywords."""
    fields = dataclasses.asdict(params)
    return {**fields, "stop_token_ids": list(fields["stop_token_ids"])}


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
