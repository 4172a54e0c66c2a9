"""Several HTTP front-end processes on one port (``launch.py --api-servers 2``) in front of a real
CPU cluster on the demo model: each answers as the single front end does (the ZMQ client's greedy
text, the API key, CORS, /health, aborts), /metrics sums their counters whichever process a
scrape reaches, one killed is restarted alone while the other serves on, and SIGTERM drains
them all. The module's last test drains the cluster, so the tests run in file order.

Which process served what is read from the metrics' own files in the run directory
(prometheus_client's multiprocess mode keeps one per process, named by its pid). Linux spreads
connections by a hash of their addresses: that all of ``FRESH`` fresh connections reach the same
one of two processes has odds of 2 in 2**16.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.compare import LaunchedCluster
from pdserve.cluster.client import Client
from pdserve.cluster.group import free_port
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.tokenization import encode_prompt
from pdserve.tests.cluster.helpers import front_end_pids, oracle, wait_until_idle

MODEL = "demo"
KEY = "sk-several"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://ui.example"
PROMPT = "The three primary colours are"
QUESTION = "What is the capital of France?"
FRESH = 16  # requests on connections of their own, to reach both processes
SUCCESS = "pdserve:request_success_total"
TTFT_COUNT = "pdserve:time_to_first_token_seconds_count"


@dataclass
class Served:
    cluster: LaunchedCluster
    base_url: str
    run_dir: Path
    zmq: Client

    def pids(self) -> list[int]:
        return front_end_pids(self.cluster.proc.pid)


@pytest.fixture(scope="module")
def served(cluster_factory: Callable[..., LaunchedCluster]) -> Iterator[Served]:
    port = free_port()
    cluster = cluster_factory(
        "--model",
        MODEL,
        "--http-port",
        str(port),
        "--api-servers",
        "2",
        "--api-key",
        KEY,
        "--allowed-origins",
        ORIGIN,
    )
    found = re.search(r"run directory (\S+)", cluster.output())
    assert found is not None, cluster.output()[-2000:]
    with Client(cluster.endpoint, timeout=120) as zmq:
        yield Served(cluster, f"http://127.0.0.1:{port}", Path(found.group(1)), zmq)


def fresh(served: Served, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One request on a connection of its own (httpx's module functions open one each)."""
    return httpx.request(method, served.base_url + path, timeout=60, **kwargs)


def scraped(served: Served, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples with ``labels`` in a scrape of /metrics (a connection of its own)."""
    response = fresh(served, "GET", "/metrics")
    assert response.status_code == 200
    return sum(
        s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def per_process(served: Served, name: str, **labels: str) -> dict[int, float]:
    """The sum of ``name``'s samples with ``labels`` in each front-end process's own file, by pid
    (processes that have exited included)."""
    kind = "histogram" if name.endswith(("_count", "_sum", "_bucket")) else "counter"
    out = {}
    for path in (served.run_dir / "prometheus").glob(f"{kind}_*.db"):
        pid = int(path.stem.split("_")[1])
        out[pid] = sum(
            s.value
            for metric in MultiProcessCollector.merge([str(path)])
            for s in metric.samples
            if s.name == name and labels.items() <= s.labels.items()
        )
    return out


def grew_on_each(pids: list[int], before: dict[int, float], after: dict[int, float]) -> bool:
    return all(after.get(pid, 0) > before.get(pid, 0) for pid in pids)


def wait_for(condition: Callable[[], bool], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.2)


def streams_on_every_process(served: Served, stack: contextlib.ExitStack, max_tokens: int) -> list[Iterator[str]]:
    """Streams of ``max_tokens`` opened one at a time, each on a connection of its own, each read
    to its first event, until every front-end process serves at least one (its own TTFT count
    says so); the lines still to come of each. Leaving ``stack`` disconnects them."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    pids = served.pids()
    before = per_process(served, TTFT_COUNT)
    streams = []
    for _ in range(FRESH):
        http = stack.enter_context(httpx.Client(base_url=served.base_url, headers=AUTH, timeout=60))
        response = stack.enter_context(http.stream("POST", "/v1/completions", json={**body, "stream": True}))
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        streams.append(lines)
        if grew_on_each(pids, before, per_process(served, TTFT_COUNT)):
            return streams
    raise AssertionError(f"{FRESH} connections never reached every process {pids}: {per_process(served, TTFT_COUNT)}")


@pytest.mark.slow
def test_both_processes_serve_the_zmq_clients_greedy_text_and_metrics_sum_them(
    served: Served, demo_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    pids = served.pids()
    assert len(pids) == 2, pids
    raw = served.zmq.generate(PROMPT, chat=False, max_tokens=8, temperature=0.0)
    chat = served.zmq.generate(QUESTION, chat=True, max_tokens=8, temperature=0.0)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    prompts = [encode_prompt(tokenizer, PROMPT, chat=False), encode_prompt(tokenizer, QUESTION)]
    expected = oracle(demo_model_dir, prompts, [SamplingParams(max_tokens=8, temperature=0.0)] * 2)
    assert [raw.token_ids, chat.token_ids] == expected  # the single engine's
    assert raw.text and chat.text
    before, ttft_before = scraped(served, SUCCESS), scraped(served, TTFT_COUNT)
    for i in range(FRESH):
        # a client of its own: a connection of its own, which the kernel gives either process
        with openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=KEY, max_retries=0) as client:
            if i % 2:
                reply = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0
                )
                assert reply.choices[0].message.content == chat.text
            else:
                completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
                assert completion.choices[0].text == raw.text
    served_by = per_process(served, SUCCESS)
    assert set(served_by) == set(pids) and all(served_by[pid] > 0 for pid in pids), served_by
    # Whichever process a scrape reaches, it counts every process's requests.
    for _ in range(6):
        assert scraped(served, SUCCESS) == before + FRESH == sum(served_by.values())
        assert scraped(served, TTFT_COUNT) == ttft_before + FRESH
        assert scraped(served, "pdserve:cluster_ready") == 1


@pytest.mark.slow
def test_every_process_wants_the_key_allows_the_origin_and_answers_health(served: Served) -> None:
    pids = served.pids()
    before = per_process(served, "pdserve:request_error_total", reason="invalid_api_key")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    for _ in range(FRESH):
        refused = fresh(served, "POST", "/v1/completions", json=body, headers={"Origin": ORIGIN})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.headers["access-control-allow-origin"] == ORIGIN
        health = fresh(served, "GET", "/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert grew_on_each(pids, before, per_process(served, "pdserve:request_error_total", reason="invalid_api_key"))


@pytest.mark.slow
def test_clients_that_go_away_are_aborted_through_either_process(served: Served) -> None:
    pids = served.pids()
    before = per_process(served, SUCCESS, finished_reason="abort")
    scraped_before = scraped(served, SUCCESS, finished_reason="abort")
    with contextlib.ExitStack() as stack:
        streams = streams_on_every_process(served, stack, max_tokens=480)  # far from done when left
        assert served.zmq.stats().requests_in_flight == len(streams)
    wait_until_idle(served.zmq)  # every request aborted, its KV freed on both sides
    assert grew_on_each(pids, before, per_process(served, SUCCESS, finished_reason="abort"))
    assert scraped(served, SUCCESS, finished_reason="abort") == scraped_before + len(streams)


@pytest.mark.slow
def test_a_killed_process_is_restarted_alone_while_the_other_serves_on(served: Served) -> None:
    killed, survivor = served.pids()
    before = scraped(served, SUCCESS)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    os.kill(killed, signal.SIGKILL)
    died = re.compile(rf"the HTTP front end \d \(pid {killed}\) was killed by SIGKILL")
    wait_for(lambda: died.search(served.cluster.output()) is not None, 30, "the launcher never noticed the kill")
    sent = 0
    for _ in range(FRESH // 2):  # the port serves on meanwhile
        assert fresh(served, "POST", "/v1/completions", json=body, headers=AUTH).status_code == 200
        sent += 1
    restarts = re.compile(rf"the HTTP front end \d \(pid {killed}\) restarts \(restart 1 in a row, of at most 10\)")
    assert restarts.search(served.cluster.output()), served.cluster.output()[-3000:]
    wait_for(lambda: len(served.pids()) == 2, 60, "no front end took the killed one's place")
    (restarted,) = set(served.pids()) - {survivor}
    # Until the new process listens, the survivor takes every connection: send until both served.
    served_before = per_process(served, SUCCESS)
    deadline = time.monotonic() + 60
    while not grew_on_each([restarted, survivor], served_before, served_by := per_process(served, SUCCESS)):
        assert time.monotonic() < deadline, f"the restarted process {restarted} never served: {served_by}"
        assert fresh(served, "POST", "/v1/completions", json=body, headers=AUTH).status_code == 200
        sent += 1
    # The killed process's requests still count: the totals never go back.
    assert scraped(served, SUCCESS) == before + sent == sum(served_by.values())


@pytest.mark.slow
def test_sigterm_drains_every_process(served: Served) -> None:
    """Last in the module: SIGTERM to the launcher. Each process, holding a stream, refuses new
    requests with 503 while its stream runs to its end; everything exits 0 and the run
    directory, the metrics' files with it, is removed."""
    pids = served.pids()
    with contextlib.ExitStack() as stack:
        streams = streams_on_every_process(served, stack, max_tokens=100)
        before = per_process(served, "pdserve:request_error_total", reason="shutting_down")
        served.cluster.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: fresh(served, "GET", "/health").status_code == 503, 30, "health stayed 200 while draining")
        for _ in range(FRESH):
            response = fresh(served, "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=AUTH)
            assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
        # read while the processes still run: the run directory goes with the launcher
        assert grew_on_each(pids, before, per_process(served, "pdserve:request_error_total", reason="shutting_down"))
        for lines in streams:
            events = [line for line in lines if line]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert served.cluster.proc.wait(timeout=120) == 0, served.cluster.output()[-4000:]
    assert not served.run_dir.exists()
