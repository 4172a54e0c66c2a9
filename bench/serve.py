"""End-to-end serving benchmark: streaming load from ``AsyncClient`` against a running cluster,
or the same load over HTTP against any OpenAI-compatible server.

    python -m pdserve.bench.serve --endpoint tcp://127.0.0.1:5555 --workload random --input-len 512 \\
        --output-len 128 --len-dist uniform --rates 1,2,4,8 --num-requests 200 --out run.json --plot-dir plots
    python -m pdserve.bench.serve --workload mixed --rate 4 --slo-ttft-ms 500 --slo-tpot-ms 50
    python -m pdserve.bench.serve --workload text --num-requests 20 --concurrency 4      # the demo model
    python -m pdserve.bench.serve --backend openai --base-url http://127.0.0.1:8000 --workload text

Backends: ``zmq`` (the default) streams through ``AsyncClient``; ``openai`` streams server-sent
events from ``--base-url``: ``/v1/completions`` with the token ids for token workloads,
``/v1/chat/completions`` with one user message for ``text`` (the template the ZMQ path applies
in the router), ``--model-name`` or else the first of ``/v1/models``, ``stream_options.include_usage``
for the token counts, ``OPENAI_API_KEY`` (if set) as the bearer token, as vLLM's ``bench serve``
sends it. Each event that carries text (none, or several tokens) is one chunk of one token, as
vLLM's ``bench serve`` counts them; the server's phase timings (and so the mean
KV transfer) are only known over ZMQ.

Load: ``--rate R`` sends requests as a Poisson process of R req/s (``inf``: all at once),
``--rates`` runs several rates in turn on the same arrival pattern (scaled), each on requests of
its own drawn alike (another seed: a rate must not find in the prefix cache what an earlier one
left there; ``--workload text`` prompts repeat, as the file holds them),
``--concurrency N`` keeps at most N in flight (alone: a closed loop of N clients; with a rate:
a cap). ``--warmup`` requests run once, all at once (within the cap), before the first rate
and are left out of the metrics. Every request streams, greedy (temperature 0); token workloads set
``ignore_eos`` so every output is exactly as long as asked.

Workloads (token ids drawn uniformly from ``[0, --vocab-size)``):

* ``random``: ``--input-len`` / ``--output-len`` tokens, ``--len-dist`` fixed, uniform on
  [L/2, 3L/2], or lognormal of mean L (sigma 0.5, capped at 4L).
* ``mixed``: short chats as ``random``, except a ``--long-fraction`` of the requests whose
  prompts are uniform in ``--long-len`` (default 4096-8192 tokens): long prefills arriving while
  the short ones decode, the interference disaggregation removes.
* ``shared-prefix``: ``--num-prefixes`` system prompts of ``--prefix-len`` tokens, each request
  one of them followed by a question of ``--input-len`` tokens, prefixes interleaved.
* ``multi-turn``: chat sessions of ``--num-turns`` turns: a session's first prompt is
  ``--prefix-len`` tokens of its own, each later one the previous prompt, the answer it got and
  ``--input-len`` new tokens. Sessions interleave (request ``i`` is turn ``i // S`` of session
  ``i % S``); a turn is sent at its arrival time or when its session's previous turn ends,
  whichever is later (ZMQ backend only: it needs the answers' token ids).
* ``text``: prompts from ``--prompts-file`` (``bench/prompts.txt``), sent as text (chat
  template applied by the router), stopping at the model's end of sequence or after a length
  drawn as ``random``'s output lengths are (``--output-len``, ``--len-dist``).

Metric definitions are in ``bench/metrics.py``; ``xfer KiB`` is the mean KV a request moved
from its prefill group to its decode group, ``hit %`` the share of prompt tokens the prefill
(or colocated) group's prefix cache served (the final messages' ``cached_tokens``), ``dec hit %``
the share whose KV the decode group's cache held, so that it did not move
(``decode_cached_tokens``); ``-`` where nothing reports it (the cache off, colocated). Run a
multi-turn workload against a cluster with the prefix cache and one with ``--no-prefix-cache``
to see the KV a chat's later turns no longer move. The JSON
(``--out``) holds the config, each rate's metrics (also per request kind when there are several)
and every request's record. Each point also carries vLLM ``bench serve``'s flat keys
(``request_throughput``, ``mean_ttft_ms``, ``median_itl_ms``, ``std_e2el_ms``, ``p99_tpot_ms``,
...: see :func:`vllm_keys`), and so does the document itself when it has one point, so that
tools reading vLLM's result files read it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from pdserve.bench.common import format_table, log_axis, pyplot, save_figure, write_json
from pdserve.bench.metrics import RequestRecord, compute_metrics, duration, e2e, itls, percentile, tpot, ttft
from pdserve.cluster.client import (
    DEFAULT_ENDPOINT,
    AsyncClient,
    Client,
    ClusterError,
    ClusterUnavailable,
    endpoint_option,
)
from pdserve.cluster.habits import hinted
from pdserve.cluster.protocol import Chunk

WORKLOADS = ("random", "mixed", "shared-prefix", "multi-turn", "text")
BACKENDS = ("zmq", "openai")
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
LEN_DISTS = ("fixed", "uniform", "lognormal")
PROMPTS_FILE = Path(__file__).resolve().with_name("prompts.txt")
DEFAULT_VOCAB_SIZE = 32000  # Llama-2's: below every supported model's vocabulary
LOGNORMAL_SIGMA = 0.5


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: token ids or a text prompt, and its output budget."""

    kind: str
    max_tokens: int
    token_ids: list[int] | None = None  # multi-turn: this turn's new tokens, after the session's history
    prompt: str | None = None
    session: int | None = None  # multi-turn: the chat session it continues

    @property
    def ignore_eos(self) -> bool:
        # Token workloads must produce exactly max_tokens; text prompts end as the model decides.
        return self.token_ids is not None


def _option(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


@dataclass(frozen=True)
class BenchConfig:
    """What to send and how fast (every field is a CLI option of the same name)."""

    workload: str = "random"
    num_requests: int = 100
    warmup: int = 2
    seed: int = 0
    rates: tuple[float | None, ...] = (None,)  # req/s of each point; None: all at once
    concurrency: int | None = None
    input_len: int = 128
    output_len: int = 128
    len_dist: str = "fixed"
    long_fraction: float = 0.1
    long_len: tuple[int, int] = (4096, 8192)
    num_prefixes: int = 4
    prefix_len: int = 1024
    num_turns: int = 4
    prompts_file: str = str(PROMPTS_FILE)
    vocab_size: int = DEFAULT_VOCAB_SIZE
    max_model_len: int | None = None  # cut prompts so that prompt + output fits
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout: float = 600.0  # longest wait for any one reply message

    def __post_init__(self) -> None:
        # Errors name the CLI option (each field's, by the class docstring).
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.len_dist not in LEN_DISTS:
            raise ValueError(f"--len-dist must be one of {', '.join(LEN_DISTS)}, got {self.len_dist!r}")
        for name in (
            "num_requests",
            "input_len",
            "output_len",
            "num_prefixes",
            "prefix_len",
            "num_turns",
            "vocab_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{_option(name)} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.rates or any(r is not None and not r > 0 for r in self.rates):
            given = ", ".join("inf" if r is None else f"{r:g}" for r in self.rates)
            raise ValueError(f"--rate/--rates must be positive (or inf), got {given}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"--long-fraction must be in [0, 1], got {self.long_fraction}")
        if not 1 <= self.long_len[0] <= self.long_len[1]:
            raise ValueError(f"--long-len must be LOW-HIGH with 1 <= LOW <= HIGH, got {self.long_len}")
        for name in ("slo_ttft_ms", "slo_tpot_ms", "timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{_option(name)} must be > 0, got {value}")
        if self.max_model_len is not None and self.max_model_len <= self.max_output_len:
            raise ValueError(
                f"--max-model-len {self.max_model_len} leaves no room for a prompt "
                f"before {self.max_output_len} output tokens"
            )

    @property
    def max_output_len(self) -> int:
        return longest(self.output_len, self.len_dist)


# -- workloads ------------------------------------------------------------------------------


def longest(mean: int, dist: str) -> int:
    """The largest length :func:`draw_length` can return."""
    return {"fixed": mean, "uniform": mean + mean // 2, "lognormal": 4 * mean}[dist]


def draw_length(rng: random.Random, mean: int, dist: str) -> int:
    """A length of mean ``mean`` (lognormal: before the cap at 4x)."""
    if dist == "fixed":
        return mean
    if dist == "uniform":
        return rng.randint(max(1, mean // 2), longest(mean, dist))
    # mu chosen so that the mean is `mean`: E = exp(mu + sigma^2 / 2)
    value = rng.lognormvariate(math.log(mean) - LOGNORMAL_SIGMA**2 / 2, LOGNORMAL_SIGMA)
    return min(max(1, round(value)), longest(mean, dist))


def read_prompts(path: str | Path) -> list[str]:
    prompts = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def build_requests(config: BenchConfig, count: int) -> list[RequestSpec]:
    """``count`` requests of ``config.workload``, the same for the same seed."""
    rng = random.Random(config.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(config.vocab_size) for _ in range(n)]

    def output_len() -> int:
        return draw_length(rng, config.output_len, config.len_dist)

    def input_len() -> int:
        return draw_length(rng, config.input_len, config.len_dist)

    if config.workload == "text":
        prompts = read_prompts(config.prompts_file)
        order = [prompts[i % len(prompts)] for i in range(count)]
        rng.shuffle(order)
        return [RequestSpec("text", output_len(), prompt=p) for p in order]

    specs: list[RequestSpec] = []
    if config.workload == "shared-prefix":
        prefixes = [tokens(config.prefix_len) for _ in range(config.num_prefixes)]
        groups = [i % config.num_prefixes for i in range(count)]
        rng.shuffle(groups)
        for group in groups:
            question = tokens(input_len())
            specs.append(RequestSpec("shared-prefix", output_len(), token_ids=prefixes[group] + question))
    elif config.workload == "multi-turn":
        sessions = -(-count // config.num_turns)
        for i in range(count):
            turn = i // sessions
            new = tokens(config.prefix_len if turn == 0 else input_len())
            specs.append(
                RequestSpec("first turn" if turn == 0 else "later turn", output_len(), new, session=i % sessions)
            )
        return specs  # cut to max_model_len when sent, with the session's history
    elif config.workload == "mixed":
        long = set(rng.sample(range(count), round(count * config.long_fraction)))
        for i in range(count):
            if i in long:
                specs.append(RequestSpec("long", output_len(), token_ids=tokens(rng.randint(*config.long_len))))
            else:
                specs.append(RequestSpec("short", output_len(), token_ids=tokens(input_len())))
    else:
        specs = [RequestSpec("random", output_len(), token_ids=tokens(input_len())) for _ in range(count)]
    if config.max_model_len is not None:
        limit = config.max_model_len
        specs = [dataclasses.replace(s, token_ids=s.token_ids[: limit - s.max_tokens]) for s in specs]
    return specs


def workload_requests(config: BenchConfig) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """The warm-up requests and the first rate's. The warm-up draws from a seed of its own: cut
    from one longer draw, the first rate would differ from every later one (mixed's share of long
    prompts) and find what the warm-up left in the prefix cache (shared-prefix's system prompts;
    a multi-turn session split between the two would lose its history)."""
    if not config.warmup:
        return [], build_requests(config, config.num_requests)
    warmup = build_requests(dataclasses.replace(config, seed=derived_seed(config.seed, "warmup")), config.warmup)
    return warmup, build_requests(config, config.num_requests)


def derived_seed(seed: int, purpose: str) -> int:
    """A seed of its own for ``purpose`` (the warm-up, a sweep's later rate), from a hash: ``seed``
    plus a small step would be what a user tries next (--seed 1 after --seed 0), replaying the
    warm-up's prompts into a run meant to find nothing cached."""
    digest = hashlib.sha256(f"pdserve.bench.serve/{seed}/{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def point_requests(config: BenchConfig, measured: list[RequestSpec], index: int) -> list[RequestSpec]:
    """The requests of the sweep's ``index``-th rate: ``measured`` for the first, then requests
    drawn alike with a seed of their own, so that no rate replays prompts (or multi-turn
    sessions) an earlier rate left in the prefix caches."""
    if index == 0:
        return measured
    return build_requests(dataclasses.replace(config, seed=derived_seed(config.seed, f"rate {index}")), len(measured))


def arrival_times(count: int, rate: float | None, seed: int) -> list[float]:
    """Send times (s) of a Poisson process of ``rate`` req/s, the first at 0; all 0 if None.

    The same seed gives the same exponential draws at every rate, so a sweep replays one
    arrival pattern compressed or stretched."""
    if rate is None:
        return [0.0] * count
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


# -- load generation ------------------------------------------------------------------------


async def stream_one(client: AsyncClient, spec: RequestSpec, record: RequestRecord, start: float) -> list[int]:
    """Send one request and fill ``record`` with what arrives, timestamped on arrival; returns
    the generated token ids."""
    output: list[int] = []
    record.sent = time.perf_counter() - start
    try:
        async for message in client.stream(
            spec.prompt,
            token_ids=spec.token_ids,
            request_id=record.request_id,
            max_tokens=spec.max_tokens,
            temperature=0.0,
            ignore_eos=spec.ignore_eos,
        ):
            now = time.perf_counter() - start
            if isinstance(message, Chunk):
                record.chunk_times.append(now)
                record.chunk_tokens.append(len(message.token_ids))
            else:
                record.finished = now
                record.finish_reason = message.finish_reason
                record.prompt_tokens = message.usage.get("prompt_tokens")
                record.output_tokens = len(message.token_ids)
                record.timings = dict(message.timings)
                output = message.token_ids
    except (ClusterError, ClusterUnavailable) as e:
        record.finished = time.perf_counter() - start
        record.error = str(e)
    return output


class OpenAIBackend:
    """Streams requests to an OpenAI-compatible server (see the module's docstring)."""

    def __init__(self, base_url: str, model: str | None, timeout: float) -> None:
        # aiohttp (the bench extra's; the ZMQ path does without it), as vLLM's ``bench serve``:
        # its client costs less per request than httpx's, and the load generator's own time
        # counts in every TTFT it measures.
        try:
            import aiohttp
        except ImportError:
            raise click.ClickException(
                "--backend openai needs aiohttp: pip install -e '.[bench]' (or pip install aiohttp)"
            ) from None

        self.aiohttp = aiohttp
        # The server's root; the base URL an OpenAI client is given (ending /v1) works too.
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.timeout = timeout
        self.model = model
        self._session: Any = None  # made in the event loop, on first use

    @property
    def http(self) -> Any:
        """The session: no connection limit, as every request in flight holds its own stream;
        ``timeout`` bounds connecting and each read, not a whole stream."""
        if self._session is None:
            aiohttp = self.aiohttp
            key = os.environ.get("OPENAI_API_KEY")
            self._session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {key}"} if key else None,
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.timeout, sock_read=self.timeout),
                read_bufsize=2**20,  # the longest line (one event) it reads
            )
        return self._session

    async def model_name(self) -> str:
        if self.model is None:
            async with self.http.get(f"{self.base_url}/v1/models") as response:
                response.raise_for_status()
                self.model = str((await response.json())["data"][0]["id"])
        return self.model

    def request(self, spec: RequestSpec, model: str) -> tuple[str, dict[str, Any]]:
        common = {
            "model": model,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if spec.token_ids is not None:
            return "/v1/completions", {**common, "prompt": spec.token_ids, "ignore_eos": spec.ignore_eos}
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": spec.prompt}]}

    async def stream_one(self, spec: RequestSpec, record: RequestRecord, start: float) -> None:
        """As :func:`stream_one`, over HTTP: one chunk of one token per event with text."""
        path, body = self.request(spec, await self.model_name())
        record.sent = time.perf_counter() - start
        try:
            async with self.http.post(self.base_url + path, json=body) as response:
                if response.status != 200:
                    record.error = f"HTTP {response.status}: {(await response.read())[:500].decode(errors='replace')}"
                done = False
                async for line in response.content:  # to the body's end: a connection left mid-body is closed
                    if done or not line.startswith(b"data:") or record.error is not None:
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    self._on_event(json.loads(data), record, time.perf_counter() - start)
            record.finished = time.perf_counter() - start
        except (self.aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            record.finished = time.perf_counter() - start
            record.error = f"{type(e).__name__}: {e}"
        if record.error is None and record.finish_reason is not None and not record.output_tokens:
            record.output_tokens = len(record.chunk_times)  # a server that sent no usage

    @staticmethod
    def _on_event(event: dict[str, Any], record: RequestRecord, now: float) -> None:
        if "error" in event:
            record.error = str(event["error"].get("message", event["error"]))
            return
        if usage := event.get("usage"):
            record.prompt_tokens = usage.get("prompt_tokens")
            record.output_tokens = usage.get("completion_tokens") or 0
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:  # the prefix cache's share, as the ZMQ finals' timings give it
                record.timings["cached_tokens"] = float(cached)
        for choice in event.get("choices") or ():
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text:
                record.chunk_times.append(now)
                record.chunk_tokens.append(1)
            if choice.get("finish_reason") is not None:
                record.finish_reason = choice["finish_reason"]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def run_requests(
    client: AsyncClient | OpenAIBackend,
    specs: Sequence[RequestSpec],
    rate: float | None,
    concurrency: int | None,
    seed: int,
    tag: str,
    warmup: bool = False,
    max_model_len: int | None = None,
) -> list[RequestRecord]:
    """Send ``specs`` at ``rate`` (at most ``concurrency`` in flight); wait for every one to end.
    A multi-turn request waits for its session's previous turn and is sent after its history
    (the previous prompt and answer), the history's end cut so that its own new tokens and its
    output fit ``max_model_len`` if given."""
    slots: Any = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    history: dict[int, list[int]] = {}  # session -> its last prompt and answer
    turn_done: list[asyncio.Event] = [asyncio.Event() for _ in specs]
    previous_turn: list[int | None] = []
    last: dict[int, int] = {}
    for i, spec in enumerate(specs):
        previous_turn.append(last.get(spec.session) if spec.session is not None else None)
        if spec.session is not None:
            last[spec.session] = i
    records = [
        RequestRecord(
            f"{tag}/{i}",
            spec.kind,
            spec.max_tokens,
            scheduled=at,
            sent=at,
            prompt_len=len(spec.token_ids) if spec.token_ids is not None else None,
            warmup=warmup,
        )
        for i, (spec, at) in enumerate(zip(specs, arrival_times(len(specs), rate, seed)))
    ]
    start = time.perf_counter()
    with tqdm(total=len(specs), desc=tag, unit="req", file=sys.stderr, dynamic_ncols=True) as progress:

        async def one(i: int, spec: RequestSpec, record: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, record.scheduled - (time.perf_counter() - start)))
            before = previous_turn[i]
            if before is not None:
                await turn_done[before].wait()
            if spec.session is not None:
                new = spec.token_ids or []
                history_kept = history.get(spec.session, [])
                if max_model_len is not None:  # the history's end goes: a turn always asks its own question
                    history_kept = history_kept[: max(0, max_model_len - spec.max_tokens - len(new))]
                prompt = (history_kept + new)[: None if max_model_len is None else max_model_len - spec.max_tokens]
                spec = dataclasses.replace(spec, token_ids=prompt)
                record.prompt_len = len(prompt)
            async with slots:
                if isinstance(client, OpenAIBackend):
                    await client.stream_one(spec, record, start)
                else:
                    answer = await stream_one(client, spec, record, start)
                    if spec.session is not None:
                        history[spec.session] = (spec.token_ids or []) + answer
            turn_done[i].set()
            progress.update()

        await asyncio.gather(*(one(i, spec, record) for i, (spec, record) in enumerate(zip(specs, records))))
    return records


def point_result(rate: float | None, config: BenchConfig, records: list[RequestRecord]) -> dict[str, Any]:
    """One load point: its metrics (overall and per request kind) and every record."""

    wall = duration([r for r in records if not r.warmup])  # every kind's rates are over the run's time

    def metrics(subset: list[RequestRecord]) -> dict[str, Any]:
        return compute_metrics(subset, config.slo_ttft_ms, config.slo_tpot_ms, wall)

    kinds = sorted({r.kind for r in records})
    return {
        "rate": rate,
        "concurrency": config.concurrency,
        "metrics": metrics(records),
        "by_kind": {k: metrics([r for r in records if r.kind == k]) for k in kinds} if len(kinds) > 1 else {},
        **vllm_keys(rate, config, records),
        "records": [_record_json(r) for r in records],
    }


VLLM_PERCENTILES = (50, 90, 99)


def vllm_keys(rate: float | None, config: BenchConfig, records: Sequence[RequestRecord]) -> dict[str, Any]:
    """vLLM ``bench serve``'s flat result keys over the measured records (ms; a statistic of no
    values is None). Its definitions are this module's: ITL one sample per token, which is
    vLLM's one per chunk when chunks carry one token; std is the population's, as numpy's."""
    measured = [r for r in records if not r.warmup]
    done = [r for r in measured if r.ok]
    wall = duration(measured)
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = compute_metrics(measured, config.slo_ttft_ms, config.slo_tpot_ms)["goodput"]
    out: dict[str, Any] = {
        "request_rate": "inf" if rate is None else rate,
        "max_concurrency": config.concurrency,
        "num_prompts": len(measured),
        "completed": len(done),
        "failed": len(measured) - len(done),
        "duration": wall,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / wall if wall > 0 else 0.0,
        "request_goodput": good,
        "output_throughput": output_tokens / wall if wall > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / wall if wall > 0 else 0.0,
    }
    samples = {
        "ttft": [ttft(r) for r in done],
        "tpot": [t for t in map(tpot, done) if t is not None],
        "itl": [gap for r in done for gap in itls(r)],
        "e2el": [e2e(r) for r in done],
    }
    for name, values in samples.items():
        ms = [v * 1e3 for v in values]
        out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else None
        out[f"median_{name}_ms"] = statistics.median(ms) if ms else None
        out[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else None
        for q in VLLM_PERCENTILES:
            out[f"p{q}_{name}_ms"] = percentile(ms, q) if ms else None
    return out


def _record_json(record: RequestRecord) -> dict[str, Any]:
    """A record for the results file, its times to the microsecond: full float digits make a
    file that holds every chunk's arrival half as large again, past what a GPU host's files may
    be to come back."""
    out = dataclasses.asdict(record)
    for key in ("scheduled", "sent", "finished"):
        if out[key] is not None:
            out[key] = round(out[key], 6)
    out["chunk_times"] = [round(t, 6) for t in record.chunk_times]
    return out


_CONNECT_S = 5.0  # how long the server has to answer before any request is sent


class ServerUnreachable(RuntimeError):
    """Nothing answered at the benchmark's endpoint or URL."""


async def _check_server(client: AsyncClient | OpenAIBackend) -> None:
    """Say at once that nothing answers, not after every request's timeout."""
    if isinstance(client, AsyncClient):
        try:
            await client.stats(timeout=min(client.timeout, _CONNECT_S))
        except ClusterUnavailable as e:
            raise ServerUnreachable(str(e)) from None
        return
    try:
        await asyncio.wait_for(client.model_name(), _CONNECT_S)
    except (client.aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as e:
        raise ServerUnreachable(
            f"no OpenAI-compatible server answered GET {client.base_url}/v1/models within {_CONNECT_S:.0f} s "
            f"({type(e).__name__}: {e or 'timed out'}); start one with: python launch.py --http-port PORT"
        ) from None


@dataclass
class BenchRun:
    """What a run has measured so far: all of it once ``run_benchmark`` returns; the warm-up and
    the rates that finished when it is stopped (Ctrl-C) before the end."""

    config: BenchConfig
    backend: str
    target: str  # the endpoint or URL the requests went to
    warmup: list[RequestRecord] = dataclasses.field(default_factory=list)
    points: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    model_id: str | None = None  # the openai backend's served model

    @classmethod
    def to(cls, config: BenchConfig, backend: str, endpoint: str, base_url: str | None) -> BenchRun:
        """A run yet to start, of ``config`` to ``base_url`` (openai) or ``endpoint`` (zmq)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        return cls(config, backend, (base_url or DEFAULT_BASE_URL) if backend == "openai" else endpoint)

    @property
    def complete(self) -> bool:
        return len(self.points) == len(self.config.rates)

    def document(self) -> dict[str, Any]:
        """The results document; with one rate, its summary also flat at the top, as vLLM's."""
        points = self.points
        flat = {k: v for k, v in points[0].items() if k not in ("rate", "concurrency", "metrics", "by_kind", "records")}
        return {
            "meta": {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "host": platform.node(),
                "command": shlex.join(sys.orig_argv),
                "backend": self.backend,
                "endpoint": self.target,
                "model_id": self.model_id,
                "complete": self.complete,
            },
            **(flat if len(points) == 1 else {}),
            "config": dataclasses.asdict(self.config),
            "warmup": [dataclasses.asdict(r) for r in self.warmup],
            "points": points,
        }


async def run_benchmark(
    config: BenchConfig,
    endpoint: str,
    backend: str = "zmq",
    base_url: str | None = None,
    model_name: str | None = None,
    run: BenchRun | None = None,
) -> dict[str, Any]:
    """Warm-up, then every rate in turn, each on requests of its own (``point_requests``); returns
    the results document. ``run``, if given, holds what is measured as it comes.
    ``backend`` "openai" sends them to ``base_url`` (``endpoint`` is then unused)."""
    run = run or BenchRun.to(config, backend, endpoint, base_url)
    warmup, measured = workload_requests(config)
    client: AsyncClient | OpenAIBackend
    if backend == "openai":
        client = OpenAIBackend(run.target, model_name, config.timeout)
    else:
        client = AsyncClient(endpoint, timeout=config.timeout)
    try:
        await _check_server(client)
        if isinstance(client, OpenAIBackend):
            run.model_id = client.model
        run.warmup = await run_requests(
            client,
            warmup,
            None,
            config.concurrency,
            config.seed,
            "warmup",
            warmup=True,
            max_model_len=config.max_model_len,
        )
        for index, rate in enumerate(config.rates):
            records = await run_requests(
                client,
                point_requests(config, measured, index),
                rate,
                config.concurrency,
                config.seed,
                f"rate {rate_label(rate, config.concurrency)}",
                max_model_len=config.max_model_len,
            )
            run.points.append(point_result(rate, config, records))
    finally:
        if isinstance(client, OpenAIBackend):
            await client.close()
        else:
            client.close()
    return run.document()


# -- reporting ------------------------------------------------------------------------------

TABLE_HEADERS = (
    "rate",
    "failed",
    "req/s",
    "out tok/s",
    "TTFT p50",
    "TTFT p99",
    "TPOT p50",
    "TPOT p99",
    "ITL p50",
    "ITL p99",
    "E2E p50",
    "E2E p99",
    "goodput",
    "xfer mean",
    "xfer KiB",
    "hit %",
    "dec hit %",
)


def rate_label(rate: float | None, concurrency: int | None = None) -> str:
    label = "inf" if rate is None else f"{rate:g}"
    return label if concurrency is None else f"{label} c={concurrency}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def metrics_row(metrics: dict[str, Any]) -> list[str]:
    """The table cells after the first column: failed requests, throughputs (completed requests,
    output tokens), latency percentiles (ms), goodput."""
    latencies = [
        _num(metrics[f"{name}_ms"][stat]) for name in ("ttft", "tpot", "itl", "e2e") for stat in ("p50", "p99")
    ]
    return [
        str(metrics["failed"]),
        _num(metrics["request_throughput"], 2),
        _num(metrics["output_throughput"]),
        *latencies,
        _num(metrics["goodput"], 2),
        _num(metrics["transfer_ms"]["mean"], 2),
        _num(None if metrics["transfer_bytes"] is None else metrics["transfer_bytes"] / 1024),
        _num(None if metrics["prefix_hit_rate"] is None else 100 * metrics["prefix_hit_rate"]),
        _num(None if metrics["decode_prefix_hit_rate"] is None else 100 * metrics["decode_prefix_hit_rate"]),
    ]


def point_row(point: dict[str, Any]) -> list[str]:
    return [rate_label(point["rate"], point["concurrency"]), *metrics_row(point["metrics"])]


def results_table(points: Sequence[dict[str, Any]]) -> str:
    return format_table(TABLE_HEADERS, [point_row(p) for p in points])


def kinds_table(points: Sequence[dict[str, Any]]) -> str | None:
    """Each load point's metrics per request kind (a multi-turn chat's first and later turns,
    mixed's short and long); None for a workload of one kind."""
    rows = [
        [rate_label(p["rate"], p["concurrency"]), kind, *metrics_row(metrics)]
        for p in points
        for kind, metrics in p["by_kind"].items()
    ]
    return format_table((TABLE_HEADERS[0], "kind", *TABLE_HEADERS[1:]), rows, labels=2) if rows else None


def failure_summary(points: Sequence[dict[str, Any]], warmup: Sequence[dict[str, Any]] = ()) -> list[str]:
    """A line for the warm-up and for each load point with failed requests, naming the first error."""
    runs = [("warm-up", warmup)] if warmup else []
    runs += [(f"rate {rate_label(p['rate'], p['concurrency'])}", p["records"]) for p in points]
    lines = []
    for name, records in runs:
        failed = [r for r in records if not RequestRecord(**r).ok]
        if failed:
            example = failed[0]["error"] or failed[0]["finish_reason"]
            lines.append(f"{name}: {len(failed)} of {len(records)} requests failed, e.g. {example}")
    return lines


def x_value(point: dict[str, Any]) -> float:
    """A point's place on a rate axis: its offered rate, or the rate it reached if unpaced."""
    return point["rate"] if point["rate"] is not None else point["metrics"]["request_throughput"]


def itl_samples_ms(point: dict[str, Any]) -> list[float]:
    records = [RequestRecord(**r) for r in point["records"]]
    return sorted(gap * 1e3 for r in records if r.ok and not r.warmup for gap in itls(r))


def write_plots(series: dict[str, Sequence[dict[str, Any]]], plot_dir: Path) -> list[Path]:
    """PNG plots of one or more runs (``series``: label -> load points, same rates in each):
    ITL CDF, TTFT p50/p99 and ITL p99 versus rate, goodput versus rate. Returns the files
    written; none, with a warning, when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return []
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = [
        _plot_itl_cdf(plt, series, plot_dir / "itl_cdf.png"),
        _plot_latency(plt, series, plot_dir / "latency_vs_rate.png"),
    ]
    if any(p["metrics"]["goodput"] is not None for points in series.values() for p in points):
        written.append(_plot_goodput(plt, series, plot_dir / "goodput_vs_rate.png"))
    return written


def _plot_itl_cdf(plt: Any, series: dict[str, Sequence[dict[str, Any]]], path: Path) -> Path:
    # One run: a curve per rate on one panel. Several: a panel per rate, a curve per run.
    names = list(series)
    first = series[names[0]]
    if len(names) == 1:
        panels = [(names[0], [(f"rate {rate_label(p['rate'], p['concurrency'])}", p) for p in first])]
    else:
        panels = [
            (f"rate {rate_label(p['rate'], p['concurrency'])}", [(n, series[n][i]) for n in names])
            for i, p in enumerate(first)
        ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False, sharey=True)
    for ax, (title, curves) in zip(axes[0], panels):
        for label, point in curves:
            samples = itl_samples_ms(point)
            if samples:
                ax.step(samples, [(i + 1) / len(samples) for i in range(len(samples))], where="post", label=label)
        log_axis(ax, ax.xaxis)  # prefill stalls sit orders of magnitude above the typical step
        ax.set_xlabel("inter-token latency (ms)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("fraction of tokens")
    return save_figure(plt, fig, path)


def _by_rate(points: Sequence[dict[str, Any]], get: Callable[[dict[str, Any]], float | None]) -> tuple[list, list]:
    pairs = sorted(((x_value(p), get(p["metrics"])) for p in points), key=lambda pair: pair[0])
    return [x for x, y in pairs if y is not None], [y for _, y in pairs if y is not None]


def _plot_latency(plt: Any, series: dict[str, Sequence[dict[str, Any]]], path: Path) -> Path:
    fig, (ttft_ax, itl_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, points) in enumerate(series.items()):
        color = f"C{i}"
        ttft_ax.plot(
            *_by_rate(points, lambda m: m["ttft_ms"]["p50"]),
            "o--",
            color=color,
            markerfacecolor="none",
            label=f"{name} p50",
        )
        ttft_ax.plot(*_by_rate(points, lambda m: m["ttft_ms"]["p99"]), "o-", color=color, label=f"{name} p99")
        itl_ax.plot(*_by_rate(points, lambda m: m["itl_ms"]["p99"]), "o-", color=color, label=f"{name} p99")
    for ax, what in ((ttft_ax, "TTFT"), (itl_ax, "inter-token latency")):
        log_axis(ax, ax.yaxis)  # overload multiplies latencies: a linear axis flattens the rest
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{what} (ms)")
        ax.set_title(f"{what} versus rate")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    return save_figure(plt, fig, path)


def _plot_goodput(plt: Any, series: dict[str, Sequence[dict[str, Any]]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, points) in enumerate(series.items()):
        ax.plot(*_by_rate(points, lambda m: m["goodput"]), "o-", color=f"C{i}", label=name)
    metrics = next(iter(series.values()))[0]["metrics"]
    slo = ", ".join(
        f"{k} <= {metrics[f'slo_{k.lower()}_ms']:.4g} ms"
        for k in ("TTFT", "TPOT")
        if metrics[f"slo_{k.lower()}_ms"] is not None
    )
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput (req/s)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"goodput ({slo})", fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return save_figure(plt, fig, path)


# -- command line ---------------------------------------------------------------------------


def parse_rates(text: str) -> tuple[float | None, ...]:
    """``"1,2,inf"`` -> ``(1.0, 2.0, None)``."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"--rate/--rates {text}: give requests a second, e.g. 4 or 1,2,4 ('inf': all at once)"
        ) from None
    return tuple(None if math.isinf(r) else r for r in rates)


def parse_range(text: str) -> tuple[int, int]:
    """``"4096-8192"`` -> ``(4096, 8192)``; ``"4096"`` -> ``(4096, 4096)``."""
    low, _, high = text.partition("-")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise ValueError(f"--long-len {text}: give LOW-HIGH in tokens, e.g. 4096-8192") from None


def vocab_size_of(model_dir: Path | None, endpoint: str | None = None) -> int:
    """``vocab_size`` of ``model_dir``'s config.json; without a directory, that of the cluster at
    ``endpoint`` (its stats say; ServerUnreachable if nothing answers), else the default."""
    if model_dir is not None:
        return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    if endpoint is not None:
        try:
            with Client(endpoint, timeout=_CONNECT_S) as client:
                served = client.stats().vocab_size
        except ClusterUnavailable as e:
            raise ServerUnreachable(str(e)) from None
        if served > 0:
            return served
    return DEFAULT_VOCAB_SIZE


LOAD_OPTIONS = (
    click.option(
        "--workload",
        type=click.Choice(WORKLOADS),
        default="random",
        help="random: token ids of --input-len/--output-len; mixed: with a --long-fraction of long prompts; "
        "shared-prefix: --num-prefixes system prompts; multi-turn: chats of --num-turns; text: prompts.txt "
        "(the module's docstring says more).",
    ),
    click.option("--num-requests", type=int, default=100, help="Requests per rate (warm-up not included)."),
    click.option("--warmup", type=int, default=2, help="Requests sent before the first rate, not measured."),
    click.option(
        "--seed",
        type=int,
        default=0,
        help="Seed of the prompts, lengths and arrivals. The same seed sends the same prompts: a second run "
        "against a server that kept its prefix cache finds them cached (use another seed, or restart it).",
    ),
    click.option(
        "--rate",
        default=None,
        help="Poisson arrivals of this many req/s ('inf', the default without --rates: all at once).",
    ),
    click.option("--rates", default=None, help="A sweep: comma-separated rates, run in turn (e.g. 1,2,4,8)."),
    click.option("--concurrency", type=int, default=None, help="Most requests in flight."),
    click.option(
        "--input-len",
        type=int,
        default=128,
        help="Prompt tokens (mean) of random/short requests; shared-prefix: the question after the prefix; "
        "multi-turn: each later turn's new tokens.",
    ),
    click.option(
        "--output-len", type=int, default=128, help="Output tokens (mean; text: the mean of each request's most)."
    ),
    click.option(
        "--len-dist",
        type=click.Choice(LEN_DISTS),
        default="fixed",
        help="Distribution of input and output lengths around their means.",
    ),
    click.option("--long-fraction", type=float, default=0.1, help="mixed: fraction of long-prompt requests."),
    click.option("--long-len", default="4096-8192", help="mixed: long prompt length range in tokens (LOW-HIGH)."),
    click.option("--num-prefixes", type=int, default=4, help="shared-prefix: number of system prompts."),
    click.option(
        "--prefix-len", type=int, default=1024, help="shared-prefix: system prompt tokens; multi-turn: first prompt's."
    ),
    click.option("--num-turns", type=int, default=4, help="multi-turn: turns of each chat session."),
    click.option(
        "--prompts-file",
        type=click.Path(exists=True, dir_okay=False),
        default=str(PROMPTS_FILE),
        help="text: one prompt per line.",
    ),
    click.option("--max-model-len", type=int, default=None, help="Cut prompts so that prompt + output fits."),
    click.option("--slo-ttft-ms", type=float, default=None, help="Goodput: TTFT objective."),
    click.option("--slo-tpot-ms", type=float, default=None, help="Goodput: TPOT objective."),
    click.option("--timeout", type=float, default=600.0, help="Seconds to wait for any one reply."),
)


def load_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add the workload and load options (shared with bench.compare)."""
    for option in reversed(LOAD_OPTIONS):
        command = option(command)
    return command


def config_from_options(rate: str | None, rates: str | None, long_len: str, **options: Any) -> BenchConfig:
    """A BenchConfig from the options of :func:`load_options` (plus ``vocab_size``)."""
    if rate is not None and rates is not None:
        raise click.UsageError("give --rate or --rates, not both")
    try:
        return BenchConfig(rates=parse_rates(rates or rate or "inf"), long_len=parse_range(long_len), **options)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


# ``vllm bench serve``'s options by habit, and what this command calls them.
_VLLM_BENCH_HABITS = {
    "--goodput": "vLLM's --goodput ttft:MS tpot:MS is --slo-ttft-ms MS --slo-tpot-ms MS here.",
    "--num-prompts": "vLLM's --num-prompts is --num-requests here.",
    "--request-rate": "vLLM's --request-rate is --rate here (a sweep: --rates 1,2,4).",
    "--max-concurrency": "vLLM's --max-concurrency is --concurrency here.",
    "--dataset-name": "The workload is --workload here (random, mixed, shared-prefix, multi-turn, text).",
    "--random-input-len": "vLLM's --random-input-len is --input-len here.",
    "--random-output-len": "vLLM's --random-output-len is --output-len here.",
}


@click.command(
    cls=hinted(_VLLM_BENCH_HABITS), context_settings={"show_default": True, "help_option_names": ["-h", "--help"]}
)
@click.option(
    "--backend",
    type=click.Choice(BACKENDS),
    default="zmq",
    help="zmq: the cluster's own protocol at --endpoint; openai: an OpenAI-compatible server at --base-url.",
)
@click.option("--endpoint", default=DEFAULT_ENDPOINT, callback=endpoint_option, help="The cluster's client endpoint.")
@click.option("--base-url", default=DEFAULT_BASE_URL, help="openai: the server's URL (with or without /v1).")
@click.option(
    "--model-name", default=None, help="openai: the 'model' of each request [default: the first of /v1/models]."
)
@load_options
@click.option(
    "--model-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="The served model's directory: its config.json gives the vocabulary size.",
)
@click.option(
    "--vocab-size",
    type=int,
    default=None,
    help="Token ids are drawn below this [default: from --model-dir, else the cluster's (zmq), "
    f"else {DEFAULT_VOCAB_SIZE}].",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the results JSON (config, metrics, every request's record) here.",
)
@click.option(
    "--plot-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write PNG plots here (needs matplotlib).",
)
def main(
    backend: str,
    endpoint: str,
    base_url: str,
    model_name: str | None,
    model_dir: Path | None,
    vocab_size: int | None,
    out: Path | None,
    plot_dir: Path | None,
    **options: Any,
) -> None:
    """Stream a workload at a cluster (or an OpenAI-compatible server) at one or more request rates
    and report its latencies."""
    given = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
    config = config_from_options(vocab_size=given, **options)  # usage errors before the cluster is asked
    if backend == "openai" and config.workload == "multi-turn":
        raise click.UsageError("multi-turn needs --backend zmq: a turn's prompt holds the previous answer's token ids")
    if vocab_size is None:
        try:
            served = vocab_size_of(model_dir, endpoint if backend == "zmq" else None)
        except ServerUnreachable as e:
            raise click.ClickException(str(e)) from None
        config = dataclasses.replace(config, vocab_size=served)
    run = BenchRun.to(config, backend, endpoint, base_url)
    try:
        asyncio.run(run_benchmark(config, endpoint, backend, base_url, model_name, run))
    except ServerUnreachable as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        # What finished is still a measurement: report it, and exit as an interrupted command does.
        finished = f"{len(run.points)} of {len(config.rates)} rates finished"
        click.echo(f"stopped: {finished} (the one running is left out)", err=True)
        if not run.points:
            sys.exit(130)
    results = run.document()
    click.echo(
        f"{config.workload}, {config.num_requests} requests per rate, latencies in ms, req/s = completed "
        f"requests a second, out tok/s = their output tokens a second, goodput in req/s, xfer = mean KV "
        f"transfer (ms, KiB), hit = prompt tokens the prefix cache served, dec hit = prompt tokens whose KV "
        f"the decode group held"
    )
    click.echo(results_table(results["points"]))
    by_kind = kinds_table(results["points"])
    if by_kind is not None:
        click.echo(by_kind)
    for line in failure_summary(results["points"], results["warmup"]):
        click.echo(f"warning: {line}", err=True)
    write_json(results, out)  # says where
    if plot_dir is not None:
        for path in write_plots({config.workload: results["points"]}, plot_dir):
            click.echo(f"plot: {path}")
    if not run.complete:
        sys.exit(130)
    if not any(RequestRecord(**r).ok for point in results["points"] for r in point["records"]):
        raise click.ClickException("every request failed: no result measures the server")  # a script must see it


if __name__ == "__main__":
    main()
