"""Dispatch policies against hand-built loads and cache states, and the router's per-group
prefix index against a real engine's cache under eviction pressure."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.cluster.config import DISPATCH_POLICIES, ClusterConfig
from pdserve.cluster.leader import CacheEventHashes
from pdserve.cluster.protocol import (
    Generate,
    Sampling,
    TokenOutput,
    TokenOutputs,
    WorkRequest,
    block_hash,
    encode,
    prefix_hashes,
)
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.router.policy import CacheAware, create_policy, policy_names
from pdserve.router.prefix_index import PrefixIndex
from pdserve.tests.router.helpers import RouterRig, router_rig

BLOCK = 4


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


def inserted(prompt: list[int]) -> list[int]:
    """The cache events of a group that cached every full block of ``prompt``."""
    return prefix_hashes(prompt, BLOCK)


def test_prefix_hashes_name_the_whole_prefix() -> None:
    a, b = tokens(12, 1), tokens(12, 2)
    assert prefix_hashes(a, BLOCK) == prefix_hashes(a + [7, 7], BLOCK)  # a partial block adds nothing
    assert len(prefix_hashes(a, BLOCK)) == 3
    # The same block after different prefixes has different names.
    assert prefix_hashes(a[:4] + b[4:8], BLOCK)[1] != prefix_hashes(b[:8], BLOCK)[1]
    assert all(0 < h < 2**63 for h in prefix_hashes(a + b, BLOCK))
    assert block_hash(0, a[:4]) == prefix_hashes(a, BLOCK)[0]


def test_cache_aware_picks_the_longest_cached_prefix_within_the_margin() -> None:
    index = PrefixIndex([0, 1, 2], BLOCK)
    system = tokens(16, 1)
    index.apply(1, inserted(system[:8]))  # group 1 holds 2 blocks of it
    index.apply(2, inserted(system))  # group 2 holds all 4
    policy = CacheAware(cache_margin_tokens=100)
    prompt = system + tokens(5, 2)
    cached = index.matched_tokens(index.hashes(prompt))
    assert cached == {0: 0, 1: 8, 2: 16}
    assert policy.pick({0: 0, 1: 0, 2: 0}, cached) == 2
    assert policy.pick({0: 0, 1: 50, 2: 100}, cached) == 2  # exactly at the margin: still the cache
    assert policy.pick({0: 0, 1: 50, 2: 101}, cached) == 1  # past it: the next longest within it
    assert policy.pick({0: 0, 1: 101, 2: 101}, cached) == 0  # only the least loaded is left
    # A miss everywhere at equal loads: the group whose cache holds least, so new prefixes spread.
    assert index.sizes() == {0: 0, 1: 2, 2: 4}
    missed = index.matched_tokens(index.hashes(tokens(20, 4)))
    assert policy.pick({0: 5, 1: 5, 2: 5}, missed, {0: 9, 1: 2, 2: 4}) == 1
    assert policy.pick({0: 5, 1: 6, 2: 5}, missed, {0: 9, 1: 2, 2: 4}) == 2  # load before cache size
    # Nothing cached anywhere: the least loaded, ties to the lowest index.
    other = index.matched_tokens(index.hashes(tokens(20, 3)))
    assert other == {0: 0, 1: 0, 2: 0}
    assert policy.pick({0: 30, 1: 10, 2: 10}, other) == 1
    # Equal prefixes: the less loaded of them.
    index.apply(0, inserted(system))
    cached = index.matched_tokens(index.hashes(prompt))
    assert policy.pick({0: 40, 1: 0, 2: 20}, cached) == 2


def test_the_index_follows_evictions_restarts_and_prompts_in_flight() -> None:
    index = PrefixIndex([0, 1], BLOCK)
    system = tokens(12, 1)
    prompt = system + [5]
    hashes = index.hashes(prompt)
    index.apply(0, inserted(system))
    assert index.matched_tokens(hashes) == {0: 12, 1: 0}
    # The group evicts its last block (a leaf), then the one before: the claim shrinks with it.
    index.apply(0, [-hashes[2]])
    assert index.matched_tokens(hashes) == {0: 8, 1: 0}
    index.apply(0, [-hashes[1], hashes[1], -hashes[1]])  # in order: evicted, back, evicted again
    assert index.matched_tokens(hashes) == {0: 4, 1: 0}
    # A request dispatched to group 1 counts there until it is settled (first token or end).
    index.dispatched("r1", 1, hashes)
    index.dispatched("r2", 1, hashes[:2])
    assert index.matched_tokens(hashes) == {0: 4, 1: 12}
    index.settled("r1")
    assert index.matched_tokens(hashes) == {0: 4, 1: 8}
    index.settled("r2")
    index.settled("r2")  # settling twice (first token, then the end) changes nothing
    assert index.matched_tokens(hashes) == {0: 4, 1: 0}
    index.reset(0)  # the group restarted
    assert index.matched_tokens(hashes) == {0: 0, 1: 0}
    index.dispatched("r3", 1, hashes)
    index.reset(1)  # restarted with a prompt in flight: it computes that one no more
    assert index.matched_tokens(hashes) == {0: 0, 1: 0}
    index.dispatched("r4", 1, hashes[:1])
    index.settled("r3")  # settled after the restart: the later claim stays whole
    assert index.matched_tokens(hashes) == {0: 0, 1: 4}
    index.apply(7, inserted(system))  # a group the index does not route to: ignored
    assert index.cached(0) == set() and index.cached(1) == set()


def test_lookup_gives_a_policy_both_mappings_over_the_groups_it_may_pick() -> None:
    """What dispatch hands a cache-aware policy, for the entry groups or the decode groups: the
    cached prefix in each (a block ending with the prompt's last token never counts: the
    engines compute that token whatever they hold) and each cache's size, for the groups asked."""
    index = PrefixIndex([0, 1, 2], BLOCK)
    system = tokens(12, 1)
    index.apply(1, inserted(system))
    index.apply(2, inserted(system[:4]))
    cached, sizes = index.lookup(index.hashes(system), len(system), {1, 2})
    assert cached == {1: 8, 2: 4} and sizes == {1: 3, 2: 1}
    cached, sizes = index.lookup(index.hashes(system + [9]), len(system) + 1, {0, 1})
    assert cached == {0: 0, 1: 12} and sizes == {0: 0, 1: 3}


def test_the_registry_holds_the_policies_the_config_offers() -> None:
    assert policy_names() == sorted(DISPATCH_POLICIES)


@pytest.mark.parametrize("name", DISPATCH_POLICIES)
def test_every_policy_picks_a_group_without_cache_information(name: str) -> None:
    policy = create_policy(name, ClusterConfig().cache_aware_margin)
    picks = [policy.pick({0: 5, 1: 0}) for _ in range(4)]
    assert set(picks) <= {0, 1}
    if name != "round-robin":
        assert picks == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="unknown dispatch policy"):
        create_policy("random", 0)


def tree_hashes(engine: LLMEngine) -> set[int]:
    """The block hashes of every node of the engine's prefix cache, read from the tree itself."""
    cache = engine.block_manager.prefix_cache
    assert cache is not None
    out, stack = set(), [(cache.root, 0)]
    while stack:
        node, parent_hash = stack.pop()
        for key, child in node.children.items():
            value = block_hash(parent_hash, key)
            out.add(value)
            stack.append((child, value))
    return out


def test_the_router_index_stays_in_step_with_an_engine_under_eviction_pressure(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """Shared and distinct prompts through an engine whose pool holds a fraction of them: after
    every step the index built from the engine's events holds exactly the prefixes of its tree,
    so an evicted prefix is never claimed."""
    block = 16
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dirs["tiny-llama"]),
            dtype="float32",
            device="cpu",
            max_model_len=128,
            cache=CacheConfig(block_size=block, num_blocks=24),
        )
    )
    events = CacheEventHashes()
    assert engine.set_cache_listener(events)
    index = PrefixIndex([0], block)
    rng = random.Random(0)
    systems = [tokens(48, seed) for seed in range(4)]
    evicted_prefixes = 0
    for wave in range(8):
        for i in range(3):
            prompt = rng.choice(systems)[: rng.choice([16, 33, 48])] + tokens(rng.randrange(1, 40), 100 * wave + i)
            engine.add_request(f"{wave}-{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0))
        while engine.has_unfinished():
            engine.step()
            before = index.cached(0)
            index.apply(0, events.take())
            evicted_prefixes += len(before - index.cached(0))
            assert index.cached(0) == tree_hashes(engine)
        for system in systems:  # what the router would claim for each system prompt is what the tree holds
            held = tree_hashes(engine)
            expected = 0
            for value in prefix_hashes(system, block):
                if value not in held:
                    break
                expected += block
            assert index.matched_tokens(prefix_hashes(system, block)) == {0: expected}
    stats = engine.stats().prefix_cache
    assert stats is not None and stats.evicted_blocks > 0 and evicted_prefixes > 0  # the pressure was real


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_a_prefill_group_is_idle_again_once_it_returned_the_first_token(tmp_path: Path, mode: str) -> None:
    """Least-tokens over two entry groups: a request with a long output whose first token came
    back leaves its prefill group idle (it decodes elsewhere), so the next request goes there; a
    colocated group still decodes it, so the next one goes to the other group. The prefill
    group used to carry every request's whole output budget until the request ended."""
    entry = "prefill" if mode == "disagg" else "colocated"
    settings: dict[str, object] = {"mode": mode, "dispatch": "least-tokens", f"{entry}_groups": 2}
    with router_rig(tmp_path, settings, RouterRig) as rig:
        rig.client.send(encode(Generate(request_id="long", token_ids=[5, 6, 7], sampling=Sampling(max_tokens=250))))
        (work,) = rig.received(entry, 0)
        assert isinstance(work, WorkRequest)
        rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11])]))
        rig.client.send(encode(Generate(request_id="next", token_ids=list(range(1, 201)), sampling=Sampling())))
        expected = 0 if mode == "disagg" else 1
        assert [type(m) for m in rig.received(entry, expected)] == [WorkRequest]
        loads = {g.group: g.load for g in rig.router.members() if g.role == entry}
        assert loads[1 - expected] == (0 if mode == "disagg" else 3 + 250)
