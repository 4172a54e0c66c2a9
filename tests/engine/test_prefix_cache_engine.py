"""Prefix caching in the engine (fp32, CPU): greedy output is token-identical with the cache on
and off, cached prompt tokens are skipped (and counted), and a request whose cached prefix is
evicted while it waits recomputes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.cluster.config import ClusterConfig
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.sampling import SamplingParams
from pdserve.tests.engine import helpers

BLOCK = CacheConfig().block_size
PREFIX_LENGTHS = [0, 5, BLOCK, BLOCK + 1, 2 * BLOCK, 3 * BLOCK - 1, 4 * BLOCK, 5 * BLOCK + 3]


def make_engine(
    model_dir: Path, prefix_cache: bool, num_blocks: int = 128, overlap: bool = True, **sched: object
) -> LLMEngine:
    """``helpers.make_engine`` of 128-token requests (blocks of ``BLOCK``, the default size)."""
    return helpers.make_engine(
        model_dir, num_blocks, max_model_len=128, overlap=overlap, prefix_cache=prefix_cache, **sched
    )


def random_tokens(n: int, seed: int, vocab: int = 500) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def shared_prefix_prompts() -> list[list[int]]:
    """Prompts over one 83-token base: each of its prefixes (block-aligned and not) with its own
    suffix, the base itself, a repeat of the base (cached whole), and a block-aligned prompt that
    is entirely a prefix of the others."""
    base = random_tokens(5 * BLOCK + 3, seed=1)
    prompts = [base[:n] + random_tokens(7 + n % 5, seed=100 + n) for n in PREFIX_LENGTHS]
    return prompts + [base, list(base), base[: 2 * BLOCK]]


def run(engine: LLMEngine, waves: list[list[list[int]]], params: SamplingParams) -> list[RequestOutput]:
    """Each wave's prompts added together, the next wave after the last one has finished; the
    final output of every request, in order."""
    finals: list[RequestOutput] = []
    tokens: dict[str, list[int]] = {}
    for w, wave in enumerate(waves):
        ids = [f"w{w}-{i}" for i in range(len(wave))]
        for request_id, prompt in zip(ids, wave):
            engine.add_request(request_id, prompt, params)
            tokens[request_id] = []
        done: dict[str, RequestOutput] = {}
        for outputs in engine.drain():
            for out in outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    out.new_token_ids = tokens[out.request_id]
                    done[out.request_id] = out
        finals += [done[i] for i in ids]
    return finals


def drain_all(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, RequestOutput]]:
    """Step ``engine`` until idle: each request's tokens, and its final output."""
    tokens: dict[str, list[int]] = {}
    finals: dict[str, RequestOutput] = {}
    for step in engine.drain():
        for out in step:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    return tokens, finals


@pytest.mark.parametrize(
    ("name", "overlap", "num_blocks", "sched"),
    [
        ("tiny-qwen2", True, 128, {}),
        ("tiny-llama-odd", False, 128, {}),
        ("tiny-qwen2", True, 128, {"max_num_batched_tokens": 24, "max_num_seqs": 4}),
        ("tiny-qwen2", False, 128, {"enable_chunked_prefill": False, "max_num_batched_tokens": 128, "max_num_seqs": 8}),
        ("tiny-llama-odd", True, 12, {}),  # a tight pool: evictions and preemptions
    ],
    ids=["default", "sync-odd", "small-chunks", "unchunked", "tight-pool"],
)
def test_greedy_output_is_identical_with_the_cache_on_and_off(
    tiny_model_dirs: dict[str, Path], name: str, overlap: bool, num_blocks: int, sched: dict
) -> None:
    prompts = shared_prefix_prompts()
    # The first wave caches the base; the second, all at once, shares its prefixes (and, where
    # steps are small, the prompts of its own that finish their prefill first).
    waves = [prompts[-3:-2], prompts]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    off = run(make_engine(tiny_model_dirs[name], False, num_blocks, overlap, **sched), waves, params)
    engine = make_engine(tiny_model_dirs[name], True, num_blocks, overlap, **sched)
    on = run(engine, waves, params)
    assert [o.new_token_ids for o in on] == [o.new_token_ids for o in off]
    assert [o.finish_reason for o in on] == ["length"] * (len(prompts) + 1)
    assert all(o.timings.cached_tokens is None for o in off)
    cached = [int(o.timings.cached_tokens or 0) for o in on]
    assert all(c % BLOCK == 0 and c < len(p) for c, p in zip(cached, prompts[-3:-2] + prompts))
    stats = engine.stats()
    # Each request's first admission is its one query of the cache: a preempted one's return is not.
    assert stats.prefix_cache is not None and stats.prefix_cache.hit_tokens == sum(cached) > 0
    queried = stats.prefix_cache.hit_tokens + stats.prefix_cache.miss_tokens
    assert queried == sum(len(p) - 1 for p in prompts[-3:-2] + prompts)
    assert stats.prefix_cache.pinned_blocks == 0
    assert stats.free_blocks == num_blocks  # cached blocks that no request uses count as free
    if num_blocks == 12:
        assert stats.prefix_cache.evicted_blocks > 0 and engine.stats().preemptions > 0


def test_cached_tokens_are_the_longest_cached_prefix(tiny_model_dirs: dict[str, Path]) -> None:
    """Requests one after another: each is served the longest block-aligned prefix it shares
    with the tokens an earlier request computed (its prompt and all its output but the last),
    always leaving its last prompt token to compute."""
    engine = make_engine(tiny_model_dirs["tiny-qwen2"], True)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    computed: list[list[int]] = []
    answers: list[list[int]] = []
    prompts = shared_prefix_prompts()
    for prompt in [*prompts, None]:
        if prompt is None:  # a second turn: the last conversation, answer included, and more
            prompt = prompts[-1] + answers[-1] + random_tokens(4, seed=9)
        [final] = run(engine, [[prompt]], params)
        shared = max((helpers.common_prefix_len(prompt, c) for c in computed), default=0)
        assert final.timings.cached_tokens == min(shared, len(prompt) - 1) // BLOCK * BLOCK
        computed.append(prompt + final.new_token_ids[:-1])
        answers.append(final.new_token_ids)
    stats = engine.stats().prefix_cache
    assert stats is not None and 0 < stats.hit_rate < 1


@pytest.mark.parametrize(
    ("other_tokens", "expected_cached"),
    [(60, 3 * BLOCK), (100, 0)],
    ids=["last-block-evicted", "all-evicted"],
)
def test_a_request_whose_prefix_is_evicted_while_it_waits_completes(
    tiny_model_dirs: dict[str, Path], other_tokens: int, expected_cached: int
) -> None:
    """A 64-token prefix is cached; a request sharing it waits (one sequence at a time) behind
    another whose growth evicts the prefix's last block, or all of it, from an 8-block pool. It
    runs from what is left of the prefix and decodes as without the cache."""
    model_dir = tiny_model_dirs["tiny-llama"]
    prefix = random_tokens(4 * BLOCK, seed=3)
    first, other, waiting = prefix + [7], random_tokens(20, seed=4), prefix + random_tokens(5, seed=5)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=other_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    for prefix_cache in (False, True):
        engine = make_engine(model_dir, prefix_cache, num_blocks=8, max_num_seqs=1)
        run(engine, [[first]], short)
        if prefix_cache:
            assert engine.stats().prefix_cache.cached_blocks == 4  # type: ignore[union-attr]
        engine.add_request("other", other, long)
        engine.add_request("waiting", waiting, short)
        outputs, finals = drain_all(engine)
        assert [finals[r].finish_reason for r in ("other", "waiting")] == ["length", "length"]
        results[prefix_cache] = outputs
        if prefix_cache:
            stats = engine.stats().prefix_cache
            assert stats is not None and stats.evicted_blocks >= 4 - expected_cached // BLOCK
            assert finals["waiting"].timings.cached_tokens == expected_cached
    assert results[True] == results[False]


def test_a_request_stuck_at_the_head_uses_blocks_cached_while_it_waited(tiny_model_dirs: dict[str, Path]) -> None:
    """Two requests share a 64-token prefix and arrive together; the first takes all 8 blocks of
    the pool, so the second reaches the head of the queue before the first's prompt is cached
    and waits there for blocks. When it runs it starts after the prefix cached meanwhile, and
    decodes as without the cache."""
    model_dir = tiny_model_dirs["tiny-llama"]
    prefix = random_tokens(4 * BLOCK, seed=11)
    prompts = {"first": prefix + random_tokens(57, seed=12), "second": prefix + random_tokens(5, seed=13)}
    max_tokens = {"first": 7, "second": 8}  # the first fills its 8 blocks, 128 tokens
    results = {}
    for prefix_cache in (False, True):
        engine = make_engine(model_dir, prefix_cache, num_blocks=8)
        for request_id, prompt in prompts.items():
            params = SamplingParams(max_tokens=max_tokens[request_id], temperature=0.0, ignore_eos=True)
            engine.add_request(request_id, prompt, params)
        results[prefix_cache], finals = drain_all(engine)
        if prefix_cache:
            assert finals["second"].timings.cached_tokens == 4 * BLOCK
            stats = engine.stats().prefix_cache
            assert stats is not None and stats.hit_tokens == 4 * BLOCK
            assert stats.hit_tokens + stats.miss_tokens == sum(len(p) - 1 for p in prompts.values())
    assert results[True] == results[False]


def test_a_request_for_prompt_logprobs_leaves_its_prompt_cached(tiny_model_dirs: dict[str, Path]) -> None:
    """A request that asks for its prompt's log-probabilities computes every prompt token (none
    come from the cache), and its prompt's blocks serve the next request that shares them."""
    engine = make_engine(tiny_model_dirs["tiny-qwen2"], True)
    prompt = random_tokens(3 * BLOCK + 2, seed=13)
    engine.add_request("a", prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
    [a] = [o for step in engine.drain() for o in step if o.finished]
    assert not a.timings.cached_tokens
    engine.add_request("b", prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
    [b] = [o for step in engine.drain() for o in step if o.finished]
    assert not b.timings.cached_tokens
    [c] = run(engine, [[prompt]], SamplingParams(max_tokens=2, temperature=0.0))
    assert c.timings.cached_tokens == 3 * BLOCK
    stats = engine.stats().prefix_cache
    assert stats is not None and stats.pinned_blocks == 0 and stats.cached_blocks == 3


def test_prefilled_requests_hand_over_cached_blocks(tiny_model_dirs: dict[str, Path]) -> None:
    """Prefill role: a prefilled request's KV blocks start with the cached ones it shares, which
    stay locked (never evicted) until ``release``; released, they stay cached for the next."""
    engine = make_engine(tiny_model_dirs["tiny-qwen2"], True, num_blocks=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = random_tokens(3 * BLOCK + 2, seed=6)
    engine.add_request("a", prompt, params, prefill_only=True)
    [a] = [o for step in engine.drain() for o in step]
    engine.add_request("b", prompt[:-1] + [1, 2], params, prefill_only=True)
    [b] = [o for step in engine.drain() for o in step]
    assert a.kv_block_ids is not None and b.kv_block_ids is not None
    assert b.kv_block_ids[:3] == a.kv_block_ids[:3] and b.timings.cached_tokens == 3 * BLOCK
    assert set(b.kv_block_ids[3:]).isdisjoint(a.kv_block_ids)
    # Both hold the three shared blocks and one of their own.
    assert engine.stats().free_blocks == 16 - 5
    engine.release("a")
    engine.release("b")
    assert engine.stats().free_blocks == 16
    engine.add_request("c", prompt, params, prefill_only=True)
    [c] = [o for step in engine.drain() for o in step]
    assert c.kv_block_ids is not None and c.kv_block_ids[:3] == a.kv_block_ids[:3]
    assert c.new_token_ids == a.new_token_ids


def test_the_cache_is_a_setting_on_by_default() -> None:
    from pdserve.launch import main

    model = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=4096)
    assert ClusterConfig().engine_config("m", model).cache.enable_prefix_caching
    off = ClusterConfig.from_settings({"prefix_cache": False}).engine_config("m", model)
    assert not off.cache.enable_prefix_caching
    assert any("--no-prefix-cache" in p.secondary_opts for p in main.params)


def _hand_off(
    prefill: LLMEngine, decode: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> tuple[RequestOutput, int]:
    """One disaggregated request in one process: ``prefill`` computes the prompt, ``decode``
    reserves it, gets only the blocks its cache lacks (copied pool to pool, as a transfer
    would) and decodes it. Its final output (every token) and the blocks that did not move."""
    prefill.add_request(request_id, prompt, params, prefill_only=True)
    [prefilled] = [o for step in prefill.drain() for o in step]
    assert prefilled.finish_reason == "prefilled" and prefilled.kv_block_ids is not None
    first = prefilled.new_token_ids[0]
    reservation = decode.reserve(request_id, prompt, first, params)
    assert reservation is not None
    cached = reservation.num_cached_blocks
    src, dst = prefilled.kv_block_ids[cached:], reservation.block_ids[cached:]
    decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, src]
    prefill.release(request_id)
    decode.admit(request_id)
    [final] = run_admitted(decode, request_id)
    final.new_token_ids = [first, *final.new_token_ids]
    return final, cached


def run_admitted(engine: LLMEngine, request_id: str) -> list[RequestOutput]:
    tokens: list[int] = []
    finals = []
    for outputs in engine.drain():
        for out in outputs:
            assert out.request_id == request_id
            tokens += out.new_token_ids
            if out.finished:
                out.new_token_ids = tokens
                finals.append(out)
    return finals


@pytest.mark.parametrize(
    ("first_len", "new_len"),
    [(2 * BLOCK, BLOCK // 2), (2 * BLOCK + 5, 3)],
    ids=["block-aligned", "unaligned"],
)
def test_decode_role_keeps_finished_requests_kv_and_receives_only_the_rest(
    tiny_model_dirs: dict[str, Path], first_len: int, new_len: int
) -> None:
    """A chat's turns through a prefill engine and a decode engine: each turn's prompt is the
    last one, its answer and a few new tokens. The decode engine's reservation starts with the
    longest prefix of full blocks it computed for an earlier turn (prompt and answer but its
    last token; the prompt's last token left out), only the other blocks are copied from the
    prefill pool, and the greedy tokens are the single engine's without any cache."""
    model_dir = tiny_model_dirs["tiny-llama-odd"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prefill = make_engine(model_dir, False)
    decode = make_engine(model_dir, True, num_blocks=32)
    oracle = make_engine(model_dir, False)
    prompt = random_tokens(first_len, seed=20)
    computed: list[int] = []  # what the decode engine computed for the previous turn
    for turn in range(4):
        final, cached = _hand_off(prefill, decode, f"t{turn}", prompt, params)
        assert final.new_token_ids == oracle.generate([prompt], params)[0]
        expected = min(helpers.common_prefix_len(prompt, computed), len(prompt) - 1) // BLOCK
        assert cached == expected and (turn == 0 or cached > 0)
        assert final.timings.cached_tokens == cached * BLOCK
        computed = prompt + final.new_token_ids[:-1]
        prompt = prompt + final.new_token_ids + random_tokens(new_len, seed=21 + turn)
    stats = decode.stats()
    assert stats.free_blocks == 32 and stats.prefix_cache is not None and stats.prefix_cache.pinned_blocks == 0


def test_a_decode_engine_shares_a_received_prompt_from_its_first_step(tiny_model_dirs: dict[str, Path]) -> None:
    """Requests with one system prompt reach a decode engine while the first still decodes: from
    the first one's first step, its received blocks are in the prefix cache, so the next one's
    reservation holds them and only its own blocks move. Greedy tokens stay the single engine's."""
    model_dir = tiny_model_dirs["tiny-llama-odd"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prefill = make_engine(model_dir, False)
    decode = make_engine(model_dir, True, num_blocks=32)
    oracle = make_engine(model_dir, False)
    system = random_tokens(3 * BLOCK, seed=40)
    prompts = [system + random_tokens(5, seed=41 + i) for i in range(2)]
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(str(i), prompt, params, prefill_only=True)
        [prefilled] = [out for step in prefill.drain() for out in step]
        assert prefilled.kv_block_ids is not None
        reservation = decode.reserve(str(i), prompt, prefilled.new_token_ids[0], params)
        assert reservation is not None
        assert reservation.num_cached_blocks == (0 if i == 0 else 3)  # the first request's, still running
        cached = reservation.num_cached_blocks
        dst, src = reservation.block_ids[cached:], prefilled.kv_block_ids[cached:]
        decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, src]
        prefill.release(str(i))
        decode.admit(str(i))
        tokens[str(i)] = list(prefilled.new_token_ids)
        for out in decode.step():  # its first step
            tokens[out.request_id] += out.new_token_ids
    for step in decode.drain():
        for out in step:
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[str(i)] for i in range(2)] == oracle.generate(prompts, params)
    stats = decode.stats()
    assert stats.free_blocks == 32 and stats.prefix_cache is not None and stats.prefix_cache.pinned_blocks == 0


def test_a_decode_reservation_given_up_caches_only_what_it_held(tiny_model_dirs: dict[str, Path]) -> None:
    """A reservation refused (too few blocks) or aborted before its KV arrived gives back every
    block, and the prefix cache keeps only the blocks it held before: KV that was still arriving
    is never cached."""
    engine = make_engine(tiny_model_dirs["tiny-qwen2"], True, num_blocks=8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = random_tokens(3 * BLOCK + 2, seed=30)
    engine.add_request("a", prompt, params)
    run_admitted(engine, "a")
    cache = engine.stats().prefix_cache
    assert cache is not None and cache.cached_blocks == 3  # the full blocks of its 53 computed tokens
    longer = prompt + random_tokens(3 * BLOCK, seed=31)  # 7 blocks, the first 3 cached
    reservation = engine.reserve("b", longer, 1, params)
    assert reservation is not None and reservation.num_cached_blocks == 3 and len(reservation.block_ids) == 7
    assert engine.stats().free_blocks == 1
    granted = engine.stats().prefix_cache
    assert granted is not None  # the granted reservation is one query: its 3 blocks hit, the rest missed
    assert granted.hit_tokens - cache.hit_tokens == 3 * BLOCK
    assert granted.miss_tokens - cache.miss_tokens == len(longer) - 1 - 3 * BLOCK
    for _ in range(3):  # the prefill side retries a refused reservation
        assert engine.reserve("c", prompt + [5], 1, params) is None  # needs 1 block beyond the cached 3, + headroom
    stats = engine.stats()
    assert stats.free_blocks == 1 and stats.prefix_cache is not None and stats.prefix_cache.pinned_blocks == 3
    assert (stats.prefix_cache.hit_tokens, stats.prefix_cache.miss_tokens) == (granted.hit_tokens, granted.miss_tokens)
    engine.abort("b")
    stats = engine.stats()
    assert stats.free_blocks == 8 and stats.prefix_cache is not None
    assert stats.prefix_cache.cached_blocks == 3 and stats.prefix_cache.pinned_blocks == 0
