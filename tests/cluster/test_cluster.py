"""The real multi-process cluster on CPU (gloo), against the single-process engine.

Each fixture starts ``python launch.py ...`` as a subprocess (router + every rank), talks to it
through the client library only, and stops it with SIGTERM, checking that it exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
import time
from pathlib import Path

import msgpack
import pytest

from pdserve.bench.soak import descendants
from pdserve.cluster.client import Client, ClusterError, Final
from pdserve.cluster.group import free_port
from pdserve.engine.sampling import SamplingParams
from pdserve.tests.cluster.helpers import (
    MAX_MODEL_LEN,
    abort_mid_stream,
    assert_logprobs_close,
    cmdline,
    mixed_requests,
    oracle,
    oracle_logprobs,
    oracle_prompt_logprobs,
    run_concurrently,
    wait_until_idle,
)


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["gloo", "gloo-async", "shm"])
def test_2p1d_matches_single_process_then_survives_bad_input_and_aborts(
    cluster_factory, tiny_model_dirs: dict[str, Path], transfer: str
) -> None:
    model_dir = tiny_model_dirs["tiny-llama-odd"]  # 9 query / 3 KV heads: tp 2 splits them unevenly
    cluster = cluster_factory(
        "--model",
        str(model_dir),
        "--prefill-tp",
        "2",
        "--decode-tp",
        "1",
        "--transfer",
        transfer,
        "--num-blocks",
        "200",
    )
    with Client(cluster.endpoint, timeout=120) as client:  # at once: the endpoint means every pair formed
        groups = client.stats().groups
    assert sorted(groups) == ["decode0", "prefill0"], groups
    assert all(group["pairs_forming"] == 0 for group in groups.values()), groups
    prompts, params = mixed_requests(500, 16, seed=1)
    expected = oracle(model_dir, prompts, params)
    with Client(cluster.endpoint, timeout=120) as client:
        finals = run_concurrently(client, prompts, params)
        assert [f.token_ids for f in finals] == expected
        for final, logprobs in zip(finals, oracle_logprobs(model_dir, prompts, params)):
            assert_logprobs_close(final.logprobs, logprobs)
        for final, logprobs in zip(finals, oracle_prompt_logprobs(model_dir, prompts, params), strict=True):
            assert_logprobs_close(final.prompt_logprobs, logprobs)
        assert sum(f.prompt_logprobs is not None for f in finals) == 3
        # The rows that half the vocabulary stops end at a stop id, the rest at their length.
        assert [f.finish_reason for f in finals] == [
            "stop" if f.token_ids[-1] in p.stop_token_ids else "length" for f, p in zip(finals, params)
        ]
        assert any(f.finish_reason == "stop" and len(f.token_ids) > p.min_tokens > 1 for f, p in zip(finals, params))
        decoded = next(f for f in finals if len(f.token_ids) > 1)  # went through both groups
        keys = {"queue", "prefill", "transfer", "transfer_bytes", "decode", "first_token", "total", "cached_tokens"}
        assert keys <= set(decoded.timings)

        # Abort mid-stream: the client gets an "abort" final; every block on both sides comes back.
        aborted = abort_mid_stream(client, prompts[5])
        # Its prompt ran before: the prefill group's prefix cache held its full blocks (16 tokens)
        # but for the last token. The router wrote the abort final: the prefill group's timings
        # came with the first token.
        hits = (len(prompts[5]) - 1) // 16 * 16
        assert hits > 0
        assert aborted.timings["cached_tokens"] == hits
        assert {"queue", "prefill", "decode", "total"} <= set(aborted.timings)
        groups = wait_until_idle(client, also=lambda groups: groups["prefill0"]["prefix_hit_tokens"] >= hits)
        assert set(groups) == {"prefill0", "decode0"}

        # Bad input at the socket: each gets an error naming the problem; a request beside them completes.
        good = client.submit(token_ids=prompts[3], stream=False, max_tokens=8, temperature=0.0, ignore_eos=True)
        bad_inputs = {
            b"\xff\x00garbage": "malformed",
            msgpack.packb([1, 2, 3]): "malformed",
            msgpack.packb({"type": "teleport", "version": 1}): "unknown_type",
            msgpack.packb({"type": "generate", "version": 99, "token_ids": [1]}): "unsupported_version",
            msgpack.packb({"type": "generate", "version": 1, "token_ids": [1], "colour": "red"}): "unknown_field",
            msgpack.packb({"type": "generate", "version": 1, "token_ids": "abc"}): "invalid_field",
        }
        for data, code in bad_inputs.items():
            client.send_raw(data)
            reply = client.receive()
            while getattr(reply, "request_id", None) == good:  # the good request's reply may come first
                client._buffered.setdefault(good, []).append(reply)
                reply = client.receive()
            assert reply.type == "error" and reply.code == code, (data, reply)
        invalid = {
            "token_ids": {"token_ids": [1, 2, 10_000]},
            "max_tokens": {"token_ids": list(range(100)), "max_tokens": MAX_MODEL_LEN},
            "temperature": {"token_ids": [1], "temperature": -1.0},
            "top_p": {"token_ids": [1], "top_p": 0.0},
            "top_k": {"token_ids": [1], "top_k": 0},
            "prompt": {"prompt": "text needs a tokenizer"},
        }
        for field, kwargs in invalid.items():
            with pytest.raises(ClusterError) as info:
                client.generate(**kwargs)
            assert info.value.code == "invalid_request" and field in str(info.value)
        assert (
            client.result(good).token_ids
            == oracle(model_dir, [prompts[3]], [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])[0]
        )
        wait_until_idle(client)
    assert cluster.stop() == 0, cluster.output()[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["gloo-async", "shm"])
def test_decode_back_pressure_makes_prefill_wait(
    cluster_factory, tiny_model_dirs: dict[str, Path], transfer: str
) -> None:
    """A decode pool of 32 blocks (512 tokens) cannot take 16 requests of up to 210 tokens at once,
    and with a 16 KiB bound on KV buffers in flight (a request's KV is 12-170 KiB a rank) each rank
    moves one request's KV at a time while two prefill groups announce to one decode group: the
    decode side refuses, the prefill side keeps the KV and retries, and every request completes.
    The shm backend stages nothing (the decode leader copies pool to pool): only blocks refuse."""
    model_dir = tiny_model_dirs["tiny-qwen2"]
    cluster = cluster_factory(
        "--model",
        str(model_dir),
        "--prefill-tp",
        "1",
        "--prefill-groups",
        "2",
        "--decode-tp",
        "2",
        "--transfer",
        transfer,
        "--num-blocks",
        "32",
        "--transfer-staging-mib",
        "0.015625",
    )
    prompts, params = mixed_requests(512, 16, seed=2)
    params = [SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)] * 16
    expected = oracle(model_dir, prompts, params)
    with Client(cluster.endpoint, timeout=120) as client:
        finals = run_concurrently(client, prompts, params)
        assert [f.token_ids for f in finals] == expected
        groups = wait_until_idle(client)
        refused = groups["prefill0"]["kv_refused"] + groups["prefill1"]["kv_refused"]
        assert refused > 0, "the decode side never refused: no back-pressure tested"
    assert cluster.stop() == 0, cluster.output()[-4000:]


@pytest.mark.slow
def test_cache_aware_dispatch_sends_a_shared_prefix_to_the_group_that_caches_it(
    cluster_factory, tiny_model_dirs: dict[str, Path]
) -> None:
    """Two prefill groups, cache-aware dispatch: two system prompts sent together start one in
    each group; every later request goes to the group whose cache holds its system prompt (it is
    looked up there and nowhere else, and hits its full blocks), and the tokens are the single
    engine's. Round-robin would send half of them to the other group."""
    model_dir = tiny_model_dirs["tiny-llama"]
    cluster = cluster_factory(
        "--model", str(model_dir), "--prefill-groups", "2", "--dispatch", "cache-aware", "--num-blocks", "200"
    )
    rng = random.Random(3)
    systems = [[rng.randrange(500) for _ in range(40)] for _ in range(2)]  # two full blocks and 8 tokens each

    def prompt(system: int) -> list[int]:
        return systems[system] + [rng.randrange(500) for _ in range(rng.randrange(3, 12))]

    first = [prompt(0), prompt(1)]
    later_systems = [0, 0, 1, 1, 0, 1]
    later = [prompt(s) for s in later_systems]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = oracle(model_dir, first + later, [params] * 8)
    # Group 0 gets the first request (no load, no cache anywhere), group 1 the second (less load).
    looked_up = {f"prefill{g}": len(first[g]) - 1 for g in (0, 1)}
    hits = {"prefill0": 0, "prefill1": 0}
    for system, p in zip(later_systems, later):
        looked_up[f"prefill{system}"] += len(p) - 1
        hits[f"prefill{system}"] += 32
    with Client(cluster.endpoint, timeout=120) as client:
        finals = run_concurrently(client, first, [params] * 2)
        wait_until_idle(client)
        for p in later:  # one at a time: the load is even, only the caches differ
            finals += run_concurrently(client, [p], [params])
        assert [f.token_ids for f in finals] == expected
        groups = wait_until_idle(
            client,
            also=lambda g: sum(g[name]["prefix_queried_tokens"] for name in looked_up) >= sum(looked_up.values()),
        )
        assert {name: groups[name]["prefix_queried_tokens"] for name in looked_up} == looked_up
        assert {name: groups[name]["prefix_hit_tokens"] for name in hits} == hits
    assert cluster.stop() == 0, cluster.output()[-4000:]


@pytest.mark.slow
def test_demo_model_text_prompts_and_colocated_mode_agree(cluster_factory, demo_model_dir: Path) -> None:
    """Text in, text out, on the real demo model: disaggregated (2p1d, async) and colocated
    (chunked prefill) give the single-process engine's greedy tokens."""
    from transformers import AutoTokenizer

    from pdserve.engine.tokenization import encode_prompt

    questions = ["What is the capital of France?", "Name a colour.", "Count to five.", "Say hi. ☃ 日本"] * 4
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    prompts = [encode_prompt(tokenizer, q) for q in questions]
    params = [SamplingParams(max_tokens=12, temperature=0.0)] * len(prompts)
    expected = oracle(demo_model_dir, prompts, params)
    for mode_args in (
        ["--prefill-tp", "2", "--decode-tp", "1", "--transfer", "gloo-async"],
        ["--mode", "colocated", "--colocated-groups", "1", "--max-num-seqs", "8"],
    ):
        cluster = cluster_factory("--model", "demo", "--num-blocks", "400", *mode_args)
        with Client(cluster.endpoint, timeout=120) as client:
            ids = [client.submit(q, stream=True, max_tokens=12, temperature=0.0) for q in questions]
            finals = [client.result(i) for i in ids]
            assert [f.token_ids for f in finals] == expected, mode_args
            assert [f.text for f in finals] == [tokenizer.decode(t, skip_special_tokens=True) for t in expected]
            wait_until_idle(client)
        assert cluster.stop() == 0, cluster.output()[-4000:]


@pytest.mark.slow
def test_sigterm_under_load_ends_every_request_and_exits_zero(cluster_factory) -> None:
    """SIGTERM drains: requests that finish within --drain-timeout end normally, the rest end
    with a "shutdown" error naming the timeout, and the launcher exits 0. The long requests
    (500 tokens of the demo model on CPUs) cannot finish within it."""
    cluster = cluster_factory(
        "--model",
        "demo",
        "--prefill-tp",
        "1",
        "--decode-tp",
        "1",
        "--drain-timeout",
        "1",
        "--num-blocks",
        "200",
    )
    client = Client(cluster.endpoint, timeout=60)
    short = [client.submit(token_ids=[1, 2, 3], max_tokens=5, temperature=0.0, ignore_eos=True) for _ in range(4)]
    endless = [client.submit(token_ids=[4, 5, 6], max_tokens=500, temperature=0.0, ignore_eos=True) for _ in range(4)]
    time.sleep(1.0)
    cluster.proc.send_signal(signal.SIGTERM)
    for request_id in short:
        assert len(client.result(request_id).token_ids) == 5
    errors = []
    for request_id in endless:
        with pytest.raises(ClusterError) as e:
            client.result(request_id)
        errors.append((e.value.code, str(e.value)))
    assert all(code == "shutdown" and "(drain timeout 1 s)" in message for code, message in errors), errors
    cluster.proc.wait(timeout=90)
    assert cluster.proc.returncode == 0
    client.close()


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_a_stop_sent_to_the_whole_job_drains_like_sigterm_to_the_launcher(
    cluster_factory, tiny_model_dirs: dict[str, Path], sig: signal.Signals
) -> None:
    """Closing the terminal sends SIGHUP to every process of its foreground job; `timeout`,
    `kill -- -PGID` and systemd send SIGTERM to every process of theirs. The launcher drains
    (its requests finish) and exits 0; its ranks, which the signal's default action would kill,
    and the reaper ignore it: no group fails, none restarts, and the run directory goes."""
    cluster = cluster_factory("--model", str(tiny_model_dirs["tiny-llama"]), "--prefill-tp", "1", "--decode-tp", "1")
    client = Client(cluster.endpoint, timeout=60)
    running = [client.submit(token_ids=[1, 2, 3], max_tokens=40, temperature=0.0, ignore_eos=True) for _ in range(3)]
    time.sleep(1.0)
    job = [cluster.proc.pid, *descendants(cluster.proc.pid)]
    (run_dir,) = {cmd[-1] for cmd in map(cmdline, job) if "pdserve.cluster.reaper" in cmd}
    # What ps -o comm, top and `pgrep pdserve` show of the launcher and the ranks.
    assert {"pdserve-launch", "pdserve-p0.0", "pdserve-d0.0"} <= {
        Path(f"/proc/{p}/comm").read_text().strip() for p in job
    }
    for pid in job:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    for request_id in running:
        assert len(client.result(request_id).token_ids) == 40
    cluster.proc.wait(timeout=90)
    log = cluster.output()
    assert cluster.proc.returncode == 0, log
    assert "Traceback" not in log and "failed:" not in log and "restart" not in log, log
    deadline = time.monotonic() + 10
    while Path(run_dir).exists():
        assert time.monotonic() < deadline, f"{run_dir} is left behind"
        time.sleep(0.1)
    client.close()


def test_client_reports_a_missing_cluster_clearly() -> None:
    from pdserve.cluster.client import ClusterUnavailable

    with (
        Client(f"tcp://127.0.0.1:{free_port()}", timeout=0.5) as client,
        pytest.raises(ClusterUnavailable, match="is it running"),
    ):
        client.generate(token_ids=[1, 2, 3], max_tokens=2)


def test_client_cli_says_at_once_that_nothing_listens() -> None:
    """``pdserve-client`` against a port nothing listens on: the hint within seconds, not after
    its 60 s reply timeout."""
    import subprocess
    import sys

    cli = [sys.executable, "-m", "pdserve.cluster.client", "hi", "--endpoint", str(free_port())]
    started = time.monotonic()
    result = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "is it running?" in result.stderr, result.stderr
    assert time.monotonic() - started < 30


def test_client_tells_a_silent_cluster_from_a_missing_one() -> None:
    """A router that holds the request past the timeout (a long prompt on a slow machine) is not
    reported as missing: the hint is to wait longer, not to start a cluster."""
    import asyncio

    import zmq

    from pdserve.cluster.client import AsyncClient, ClusterUnavailable

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with (
            Client(f"tcp://127.0.0.1:{port}", timeout=1) as client,
            pytest.raises(ClusterUnavailable, match="is up but sent nothing within 1 s") as silent,
        ):
            client.generate(token_ids=[1, 2, 3], max_tokens=2)
        assert "is it running" not in str(silent.value)

        async def run() -> None:
            client = AsyncClient(f"tcp://127.0.0.1:{port}", timeout=1)
            try:
                with pytest.raises(ClusterUnavailable, match="is up but sent nothing"):
                    await client.generate(token_ids=[1], max_tokens=1)
            finally:
                client.close()

        asyncio.run(run())
    finally:
        router.close()


def test_a_client_that_gives_up_aborts_its_request_as_it_closes() -> None:
    """pdserve-client timing out on a long prompt: the router hears the abort at once, not once
    the client's heartbeats stop, while the cluster would go on computing the prompt."""
    import zmq

    from pdserve.cluster.client import ClusterUnavailable
    from pdserve.cluster.protocol import Abort, Generate, decode

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=0.5) as client, pytest.raises(ClusterUnavailable):
            client.generate(token_ids=[1, 2, 3], max_tokens=2)
        got = []
        while router.poll(1000):
            got.append(decode(router.recv_multipart()[-1]))
        assert [type(m) for m in got] == [Generate, Abort], got
        assert got[1].request_id == got[0].request_id
    finally:
        router.close()


def test_the_client_drops_the_routers_pings() -> None:
    """A ping (the router's, to learn whether a client of a waiting request is still there)
    never reaches the caller of ``receive``, the blocking client's or the asyncio one's."""
    import zmq

    from pdserve.cluster.client import AsyncClient
    from pdserve.cluster.protocol import Generate, Ping, decode, encode

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        answered = 0
        while answered < 2:
            identity, frame = router.recv_multipart()
            message = decode(frame)
            if isinstance(message, Generate):  # not the abort a closing client sends
                router.send_multipart([identity, encode(Ping())])
                final = Final(message.request_id, "stop", [7], "Paris.", {}, {})
                router.send_multipart([identity, encode(final)])
                answered += 1

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()

    async def async_result() -> Final:
        async with AsyncClient(f"tcp://127.0.0.1:{port}", timeout=30) as client:
            return await client.generate(token_ids=[1, 2], max_tokens=1)

    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=30) as client:
            rid = client.submit(token_ids=[1, 2], max_tokens=1)
            final = client.receive()
            assert isinstance(final, Final) and final.request_id == rid
        assert asyncio.run(async_result()).text == "Paris."
    finally:
        thread.join(10)
        router.close()


def test_client_cli_ends_the_answer_on_stdout_and_reports_on_stderr() -> None:
    """``pdserve-client ... > answer.txt``: the file holds the answer as one finished line; the
    counts and timings go to stderr in words."""
    import subprocess
    import sys
    import threading

    import zmq

    from pdserve.cluster.protocol import Chunk, decode, encode

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        identity, frame = router.recv_multipart()
        rid = decode(frame).request_id
        router.send_multipart([identity, encode(Chunk(rid, [7], "Paris."))])
        usage, timings = {"prompt_tokens": 37, "completion_tokens": 1}, {"first_token": 0.25, "total": 0.5}
        router.send_multipart([identity, encode(Final(rid, "stop", [7], "Paris.", usage, timings))])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        cli = [sys.executable, "-m", "pdserve.cluster.client", "hi", "--endpoint", f"tcp://127.0.0.1:{port}"]
        result = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    finally:
        thread.join(10)
        router.close()
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Paris.\n"
    assert result.stderr == "[37 prompt + 1 generated, stop] TTFT 250.0 ms, total 500.0 ms\n"


@pytest.mark.parametrize(
    ("why", "expected"),
    [
        ("max_tokens: must be an integer >= 1, got 0", "--max-tokens must be an integer >= 1, got 0"),
        (  # the field named again in the reason: named as typed there, not glued on before it
            "max_tokens: prompt (31 tokens) + max_tokens (9000) = 9031 exceeds the maximum model length 8192",
            "prompt (31 tokens) + --max-tokens (9000) = 9031 exceeds the maximum model length 8192",
        ),
    ],
)
def test_client_cli_names_the_option_behind_a_refused_field(why: str, expected: str) -> None:
    """The router refuses a request field by its wire name; the user typed the option."""
    import subprocess
    import sys
    import threading

    import zmq

    from pdserve.cluster.protocol import Error, decode, encode

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def refuse() -> None:
        identity, frame = router.recv_multipart()
        router.send_multipart([identity, encode(Error(decode(frame).request_id, "invalid_request", why))])

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    try:
        cli = [sys.executable, "-m", "pdserve.cluster.client", "hi", "--max-tokens", "0", "--endpoint", str(port)]
        result = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    finally:
        thread.join(10)
        router.close()
    assert result.returncode == 1
    assert result.stderr == f"Error: invalid_request: {expected}\n", result.stderr


def test_async_client_send_that_cannot_queue_times_out() -> None:
    """A router that takes nothing (gone, or never there) fills the socket's send queue; a send
    past it waits the client's timeout, then ClusterUnavailable, instead of forever."""
    import asyncio

    import zmq

    from pdserve.cluster.client import AsyncClient, ClusterUnavailable
    from pdserve.cluster.group import free_port

    ctx = zmq.Context.instance()
    ctx.setsockopt(zmq.SNDHWM, 1)  # the client's socket, made next, queues one message
    try:
        client = AsyncClient(f"tcp://127.0.0.1:{free_port()}", timeout=0.5)
    finally:
        ctx.setsockopt(zmq.SNDHWM, 1000)

    async def run() -> None:
        try:
            with pytest.raises(ClusterUnavailable, match=r"within 0\.5 s"):
                for i in range(3):
                    await asyncio.wait_for(client.abort(f"r{i}"), 10)  # 10 s: fail, not hang
        finally:
            client.close()

    asyncio.run(run())


def test_async_client_skips_an_undecodable_frame_and_gets_its_final() -> None:
    import asyncio

    import zmq

    from pdserve.cluster.client import AsyncClient
    from pdserve.cluster.protocol import encode

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def run() -> Final:
        client = AsyncClient(f"tcp://127.0.0.1:{port}", timeout=10)
        task = asyncio.create_task(client.generate(token_ids=[1, 2], request_id="r1", max_tokens=1))
        identity, _ = await asyncio.to_thread(router.recv_multipart)
        router.send_multipart([identity, b"\xff not msgpack"])
        router.send_multipart([identity, encode(Final("r1", "length", [7], "", {}, {}))])
        try:
            return await task
        finally:
            client.close()

    try:
        assert asyncio.run(run()).token_ids == [7]
    finally:
        router.close()


def test_async_client_stats_match_replies_by_tag_beside_a_stream() -> None:
    """Each stats reply goes to the ``stats()`` whose tag it echoes, and a stream's messages on
    the same socket are not taken for them; no reply is ClusterUnavailable, and a reply that never
    came (or comes too late) leaves the later ones to their own askers."""
    import asyncio

    import zmq

    from pdserve.cluster.client import AsyncClient, ClusterUnavailable
    from pdserve.cluster.protocol import Stats, StatsRequest, decode, encode

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def run() -> tuple[list[Stats], Final]:
        client = AsyncClient(f"tcp://127.0.0.1:{port}", timeout=10)
        try:
            stream = asyncio.create_task(client.generate(token_ids=[1], request_id="r1", max_tokens=1))
            identity, frame = await asyncio.to_thread(router.recv_multipart)
            assert decode(frame).type == "generate"
            first, second = (asyncio.create_task(client.stats()) for _ in range(2))
            asks = [decode((await asyncio.to_thread(router.recv_multipart))[1]) for _ in range(2)]
            assert all(isinstance(ask, StatsRequest) for ask in asks)
            router.send_multipart([identity, encode(Stats(1, {}, ready=False, max_model_len=64, tag=asks[0].tag))])
            router.send_multipart([identity, encode(Final("r1", "length", [7], "", {}, {}))])
            router.send_multipart([identity, encode(Stats(0, {}, ready=True, max_model_len=64, tag=asks[1].tag))])
            replies = [await first, await second]
            with pytest.raises(ClusterUnavailable):
                await client.stats(timeout=0.2)
            lost = decode((await asyncio.to_thread(router.recv_multipart))[1])  # its reply never comes
            for in_flight in (3, 4):
                later = asyncio.create_task(client.stats(timeout=10))
                ask = decode((await asyncio.to_thread(router.recv_multipart))[1])
                router.send_multipart([identity, encode(Stats(in_flight, {}, tag=ask.tag))])
                replies.append(await later)
                router.send_multipart([identity, encode(Stats(5, {}, tag=lost.tag))])  # then comes, too late
            return replies, await stream
        finally:
            client.close()

    try:
        replies, final = asyncio.run(run())
    finally:
        router.close()
    assert [(s.requests_in_flight, s.ready) for s in replies] == [(1, False), (0, True), (3, False), (4, False)]
    assert final.token_ids == [7]


def test_client_stats_skip_the_late_reply_to_an_ask_that_timed_out() -> None:
    """The blocking client's ``stats()`` answers with its own reply, not an older one that came
    after its asker gave up."""
    import zmq

    from pdserve.cluster.client import ClusterUnavailable
    from pdserve.cluster.protocol import Stats, decode, encode

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=0.5) as client:
            with pytest.raises(ClusterUnavailable):
                client.stats()
            identity, late = router.recv_multipart()
            router.send_multipart([identity, encode(Stats(5, {}, tag=decode(late).tag))])  # after the timeout
            answered = threading.Thread(target=lambda: replies.append(client.stats()))
            replies: list[Stats] = []
            answered.start()
            identity, ask = router.recv_multipart()
            router.send_multipart([identity, encode(Stats(3, {}, tag=decode(ask).tag))])
            answered.join(10)
        assert [s.requests_in_flight for s in replies] == [3]
    finally:
        router.close()


def test_async_client_refuses_a_request_at_once_once_the_connection_broke() -> None:
    """A front end whose cluster stopped: the connection is known to be gone, so a new request
    or stats request raises ClusterGone at once (a 503) instead of waiting out the client's
    timeout (600 s in the HTTP front end); once a router is back on the endpoint, stats are
    answered again."""
    import asyncio

    import zmq

    from pdserve.cluster.client import AsyncClient, ClusterGone
    from pdserve.cluster.protocol import Stats, decode, encode

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def run() -> None:
        client = AsyncClient(f"tcp://127.0.0.1:{port}", timeout=60)
        try:
            task = asyncio.create_task(client.generate(token_ids=[1, 2], request_id="r1", max_tokens=1))
            identity, _ = await asyncio.to_thread(router.recv_multipart)
            router.send_multipart([identity, encode(Final("r1", "length", [7], "", {}, {}))])
            assert (await task).token_ids == [7]
            router.close()
            await asyncio.sleep(2.0)  # the monitor reports the disconnect
            started = time.monotonic()
            with pytest.raises(ClusterGone):
                await asyncio.wait_for(client.generate(token_ids=[1, 2], max_tokens=1), 10)
            with pytest.raises(ClusterGone):
                await asyncio.wait_for(client.stats(), 10)
            assert time.monotonic() - started < 1.0
            back = zmq.Context.instance().socket(zmq.ROUTER)
            back.setsockopt(zmq.LINGER, 0)
            back.bind(f"tcp://127.0.0.1:{port}")
            try:
                await asyncio.sleep(2.0)  # the client reconnects
                reply = asyncio.create_task(client.stats(timeout=10))
                identity, frame = await asyncio.to_thread(back.recv_multipart)
                back.send_multipart([identity, encode(Stats(0, {}, tag=decode(frame).tag))])
                assert (await reply).requests_in_flight == 0
            finally:
                back.close()
        finally:
            client.close()

    asyncio.run(run())
