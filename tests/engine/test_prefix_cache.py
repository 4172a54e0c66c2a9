"""The prefix cache's radix tree: unit tests, and a property test of random request traffic
(shared prefixes, aborts, eviction pressure) against a brute-force model of the same cache."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from pdserve.engine.prefix_cache import ROOT_NODE_ID, CacheEvent, CacheNode, PrefixCache

BS = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_empty_cache_matches_nothing_and_counts_misses() -> None:
    cache = PrefixCache(BS)
    block_ids, handle = cache.match(tokens(10))
    assert block_ids == []
    assert handle is cache.root
    assert cache.stats().miss_tokens == 10 and cache.stats().hit_tokens == 0


def test_match_returns_only_full_blocks() -> None:
    cache = PrefixCache(BS)
    result = cache.insert(tokens(11), [7, 8, 9])  # two full blocks; block 9 holds a partial block
    assert result.block_ids == [7, 8] and result.duplicates == []
    assert cache.num_cached_blocks == 2 and not cache.owns(9)
    assert cache.match(tokens(11)).block_ids == [7, 8]
    assert cache.match(tokens(7)).block_ids == [7]  # 7 tokens: one full block of them
    assert cache.match(tokens(3)).block_ids == []
    assert cache.match([0, 1, 2, 99, 4, 5, 6, 7]).block_ids == []  # differs inside the first block
    assert cache.match(tokens(4) + [99, 5, 6, 7]).block_ids == [7]
    stats = cache.stats()
    assert (stats.hit_tokens, stats.miss_tokens) == (8 + 4 + 0 + 0 + 4, 3 + 3 + 3 + 8 + 4)


def test_insert_returns_duplicates_and_shares_common_blocks() -> None:
    cache = PrefixCache(BS)
    cache.insert(tokens(8), [0, 1])
    again = cache.insert(tokens(8), [2, 3])
    assert again.block_ids == [0, 1] and again.duplicates == [2, 3]
    branch = cache.insert(tokens(4) + tokens(4, start=50), [4, 5])
    assert branch.block_ids == [0, 5] and branch.duplicates == [4]
    assert cache.num_cached_blocks == 3
    assert branch.handle.parent is cache.match(tokens(4)).handle
    assert cache.insert(tokens(8), [0, 1]).duplicates == []  # a request's own cached blocks


def test_insert_rejects_missing_blocks_and_blocks_cached_elsewhere() -> None:
    cache = PrefixCache(BS)
    with pytest.raises(ValueError, match="fill 2 blocks"):
        cache.insert(tokens(9), [0])
    cache.insert(tokens(4), [0])
    with pytest.raises(ValueError, match="already cached"):
        cache.insert(tokens(4, start=20), [0])
    with pytest.raises(ValueError, match="already cached"):
        cache.insert(tokens(4) + tokens(4, start=9), [5, 0])  # block 0 holds the first block's tokens
    with pytest.raises(ValueError, match="appears twice"):
        cache.insert(tokens(8, start=20), [6, 6])
    # A rejected insert changes nothing.
    assert cache.num_cached_blocks == 1 and cache.match(tokens(8, start=20)).block_ids == []


def test_lock_pins_the_path_to_the_root() -> None:
    cache = PrefixCache(BS)
    cache.insert(tokens(12), [0, 1, 2])
    cache.insert(tokens(4) + tokens(4, start=30), [0, 3])
    handle = cache.match(tokens(8)).handle
    cache.lock(handle)
    cache.lock(handle)
    assert cache.num_pinned_blocks == 2 and cache.num_evictable_blocks == 2
    # Only the leaves off the pinned path go, whatever is asked.
    assert sorted(cache.evict(10)) == [2, 3]
    assert cache.evict(10) == []
    cache.unlock(handle)
    assert cache.evict(10) == []  # still locked once
    cache.unlock(handle)
    assert cache.num_pinned_blocks == 0
    assert cache.evict(10) == [1, 0]  # leaf first, then its parent, left a leaf


def test_evict_takes_least_recently_used_leaves_first() -> None:
    cache = PrefixCache(BS)
    cache.insert(tokens(8, start=0), [0, 1])
    cache.insert(tokens(8, start=100), [2, 3])
    cache.insert(tokens(8, start=200), [4, 5])
    cache.match(tokens(8, start=0))  # now the most recently used
    assert cache.evict(1) == [3]
    assert cache.evict(2) == [2, 5]  # 2 became a leaf and is older than 5
    cache.match(tokens(4, start=200))
    assert cache.evict(1) == [1]  # a match touches every block it returns
    assert cache.stats().evicted_blocks == 4


def test_lock_and_unlock_errors() -> None:
    cache = PrefixCache(BS)
    handle = cache.insert(tokens(4), [0]).handle
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(handle)
    assert cache.evict(1) == [0]
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(handle)
    cache.lock(cache.root)  # locking the empty match is a no-op
    cache.unlock(cache.root)
    assert cache.num_pinned_blocks == 0
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(0)


def test_insert_below_a_node_and_move_its_lock() -> None:
    cache = PrefixCache(BS)
    first = cache.insert(tokens(8), [0, 1]).handle
    cache.lock(first)
    below = cache.insert(tokens(8, start=8), [2, 3], parent=first)
    assert below.block_ids == [2, 3] and below.duplicates == []
    assert cache.match(tokens(16)).block_ids == [0, 1, 2, 3]  # as if inserted whole
    again = cache.insert(tokens(4, start=8), [5], parent=first)
    assert again.block_ids == [2] and again.duplicates == [5]
    with pytest.raises(ValueError, match="already cached"):
        cache.insert(tokens(4, start=30), [0], parent=first)  # block 0 already holds tokens 0..3
    cache.move_lock(first, below.handle)
    assert cache.num_pinned_blocks == 4 and first.lock_count == below.handle.lock_count == 1
    with pytest.raises(ValueError, match="not below"):
        cache.move_lock(below.handle, first)
    cache.move_lock(below.handle, below.handle)  # the same node: nothing changes
    cache.unlock(below.handle)
    assert cache.num_pinned_blocks == 0
    with pytest.raises(RuntimeError, match="not locked"):
        cache.move_lock(first, below.handle)
    assert sorted(cache.evict(4)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="evicted"):
        cache.insert(tokens(4, start=40), [6], parent=first)


def test_events_let_a_listener_mirror_the_tree() -> None:
    events: list[CacheEvent] = []
    cache = PrefixCache(BS, listener=events.append)
    cache.insert(tokens(8), [0, 1])
    cache.insert(tokens(4) + tokens(4, start=40), [2, 3])
    cache.evict(1)
    kinds = [(e.kind, e.token_ids) for e in events]
    assert kinds == [
        ("insert", (0, 1, 2, 3)),
        ("insert", (4, 5, 6, 7)),
        ("insert", (40, 41, 42, 43)),
        ("evict", (4, 5, 6, 7)),
    ]
    assert events[0].parent_id == ROOT_NODE_ID
    assert events[1].parent_id == events[2].parent_id == events[0].node_id
    assert events[3].node_id == events[1].node_id


# -- property test: random traffic against a brute-force model ---------------------------------

NUM_BLOCKS = 32
FAMILIES = [[f * 1000 + i for i in range(26)] for f in range(3)]  # shared prefixes, 6.5 blocks long
MIN_STEPS = 2000


class CacheModel:
    """The oracle: the cache as a flat map from block-aligned token prefixes to blocks, with the
    same recency clock (one tick per match or insert), searched by brute force."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[int, ...], int] = {}
        self.last_access: dict[tuple[int, ...], int] = {}
        self.locks: dict[tuple[int, ...], int] = {}
        self.clock = 0

    @staticmethod
    def prefixes(token_ids: list[int]) -> list[tuple[int, ...]]:
        return [tuple(token_ids[: k * BS]) for k in range(1, len(token_ids) // BS + 1)]

    def match(self, token_ids: list[int]) -> tuple[list[int], tuple[int, ...]]:
        self.clock += 1
        matched: list[int] = []
        key: tuple[int, ...] = ()
        for prefix in self.prefixes(token_ids):
            if prefix not in self.blocks:
                break
            self.last_access[prefix] = self.clock
            matched.append(self.blocks[prefix])
            key = prefix
        return matched, key

    def insert(self, token_ids: list[int], block_ids: list[int]) -> list[int]:
        self.clock += 1
        duplicates = []
        for prefix, block in zip(self.prefixes(token_ids), block_ids):
            if prefix in self.blocks:
                if self.blocks[prefix] != block:
                    duplicates.append(block)
            else:
                self.blocks[prefix] = block
            self.last_access[prefix] = self.clock
        return duplicates

    def lock(self, key: tuple[int, ...], delta: int) -> None:
        for prefix in self.prefixes(list(key)):
            self.locks[prefix] = self.locks.get(prefix, 0) + delta
            assert self.locks[prefix] >= 0

    def evict(self, n: int) -> list[int]:
        freed = []
        while len(freed) < n:
            leaves = [
                p
                for p in self.blocks
                if not self.locks.get(p) and not any(len(q) > len(p) and q[: len(p)] == p for q in self.blocks)
            ]
            if not leaves:
                break
            oldest = min(leaves, key=self.last_access.__getitem__)
            assert sum(self.last_access[p] == self.last_access[oldest] for p in leaves) == 1, "LRU tie"
            freed.append(self.blocks.pop(oldest))
        return freed


@dataclass
class Request:
    token_ids: list[int]
    block_table: list[int]
    num_shared: int  # leading blocks the cache owns, locked through ``handle``
    handle: CacheNode
    key: tuple[int, ...]  # the model's name for ``handle``: the shared blocks' tokens


class PrefixCacheTraffic(RuleBasedStateMachine):
    """An engine's use of the cache: admit (match, lock, allocate, evicting when short), grow by
    decode tokens (preempted when no block is left), cache a prefill's blocks while running,
    finish (insert, unlock, free what the cache did not take), abort, and eviction pressure."""

    steps_run = 0

    def __init__(self) -> None:
        super().__init__()
        self.mirror: dict[int, tuple[int, tuple[int, ...]]] = {}  # node id -> (parent id, tokens)
        self.cache = PrefixCache(BS, listener=self._on_event)
        self.model = CacheModel()
        self.free = list(range(NUM_BLOCKS))
        self.requests: list[Request] = []

    def _on_event(self, event: CacheEvent) -> None:
        if event.kind == "insert":
            assert event.node_id not in self.mirror
            assert event.parent_id == ROOT_NODE_ID or event.parent_id in self.mirror
            self.mirror[event.node_id] = (event.parent_id, event.token_ids)
        else:
            assert all(parent != event.node_id for parent, _ in self.mirror.values()), "evicted an interior node"
            assert self.mirror.pop(event.node_id) == (event.parent_id, event.token_ids)

    # -- the engine's side ---------------------------------------------------------------------

    def _evict(self, n: int) -> None:
        pinned = {node.block_id for node in self._nodes() if node.lock_count > 0}
        freed = self.cache.evict(n)
        assert freed == self.model.evict(n)
        assert not set(freed) & pinned
        self.free.extend(freed)

    def _take_blocks(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            self._evict(n - len(self.free))
        if len(self.free) < n:
            return None
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def _unlock(self, req: Request) -> None:
        self.cache.unlock(req.handle)
        self.model.lock(req.key, -1)

    def _abort(self, req: Request) -> None:
        self._unlock(req)
        self.free.extend(req.block_table[req.num_shared :])
        self.requests.remove(req)

    def _finish(self, req: Request) -> None:
        result = self.cache.insert(req.token_ids, req.block_table)
        assert result.duplicates == self.model.insert(req.token_ids, req.block_table)
        assert result.block_ids == [self.model.blocks[p] for p in CacheModel.prefixes(req.token_ids)]
        self._unlock(req)
        self.free.extend(result.duplicates + req.block_table[len(result.block_ids) :])
        self.requests.remove(req)

    # -- reading the tree without touching it (a match would move the LRU clock) ---------------

    def _nodes(self) -> list[CacheNode]:
        out, stack = [], list(self.cache.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _tokens_of(self, node: CacheNode) -> tuple[int, ...]:
        return tuple(t for n in reversed(list(node.path_to_root())) for t in n.key)

    # -- rules ---------------------------------------------------------------------------------

    @rule(
        family=st.integers(0, len(FAMILIES) - 1),
        prefix_len=st.one_of(st.sampled_from([0, BS, 2 * BS, 4 * BS, 6 * BS]), st.integers(0, 26)),
        suffix=st.lists(st.integers(0, 3), min_size=1, max_size=10),
    )
    def admit(self, family: int, prefix_len: int, suffix: list[int]) -> None:
        type(self).steps_run += 1
        token_ids = FAMILIES[family][:prefix_len] + suffix
        # An engine leaves the last prompt token to compute: its logits give the first token.
        block_ids, handle = self.cache.match(token_ids[:-1])
        expected_blocks, key = self.model.match(token_ids[:-1])
        assert block_ids == expected_blocks
        assert len(block_ids) * BS <= len(token_ids) - 1  # never a partial block
        assert self._tokens_of(handle) == key
        self.cache.lock(handle)
        self.model.lock(key, +1)
        req = Request(token_ids, block_ids, len(block_ids), handle, key)
        self.requests.append(req)
        new = self._take_blocks(-(-len(token_ids) // BS) - len(block_ids))
        if new is None:  # no room even after eviction: the request gives up its place
            self._abort(req)
        else:
            req.block_table += new

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 1000), count=st.integers(1, 6), token=st.integers(0, 3))
    def decode(self, index: int, count: int, token: int) -> None:
        type(self).steps_run += 1
        req = self.requests[index % len(self.requests)]
        req.token_ids += [token] * count
        new = self._take_blocks(-(-len(req.token_ids) // BS) - len(req.block_table))
        if new is None:  # preempted: everything it held goes back
            self._abort(req)
        else:
            req.block_table += new

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 1000), below=st.booleans())
    def cache_while_running(self, index: int, below: bool) -> None:
        """After a prefill: cache the request's full blocks and move its lock to the new path,
        using the cached copy of any block another request cached meanwhile. ``below``: as the
        block manager does, insert only the blocks after the shared ones, below the request's
        node, and move its lock there; the model does the whole-prompt insert either way."""
        type(self).steps_run += 1
        req = self.requests[index % len(self.requests)]
        expected_duplicates = self.model.insert(req.token_ids, req.block_table)
        if below:
            start = req.num_shared
            result = self.cache.insert(req.token_ids[start * BS :], req.block_table[start:], parent=req.handle)
            block_ids = req.block_table[:start] + result.block_ids
        else:
            result = self.cache.insert(req.token_ids, req.block_table)
            block_ids = result.block_ids
        assert result.duplicates == expected_duplicates
        full = len(block_ids)
        new_key = tuple(req.token_ids[: full * BS])
        assert full == len(req.token_ids) // BS and self._tokens_of(result.handle) == new_key
        if below:
            self.cache.move_lock(req.handle, result.handle)
            self.model.lock(new_key, +1)
            self.model.lock(req.key, -1)
        else:
            self.cache.lock(result.handle)
            self.model.lock(new_key, +1)
            self._unlock(req)
        self.free.extend(result.duplicates)
        req.block_table[:full] = block_ids
        req.num_shared, req.handle, req.key = full, result.handle, new_key

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 1000))
    def finish(self, index: int) -> None:
        type(self).steps_run += 1
        self._finish(self.requests[index % len(self.requests)])

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 1000))
    def abort(self, index: int) -> None:
        type(self).steps_run += 1
        self._abort(self.requests[index % len(self.requests)])

    @rule(n=st.integers(1, 8))
    def pressure(self, n: int) -> None:
        type(self).steps_run += 1
        self._evict(n)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def tree_matches_model(self) -> None:
        nodes = self._nodes()
        for node in nodes:
            assert len(node.key) == BS
            assert node.parent is not None and node.parent.children[node.key] is node
            if not node.parent.is_root:
                assert node.parent.lock_count >= node.lock_count  # a pinned node's ancestors are pinned
        tree = {self._tokens_of(node): node for node in nodes}
        assert {k: n.block_id for k, n in tree.items()} == self.model.blocks
        assert {k: n.lock_count for k, n in tree.items()} == {k: self.model.locks.get(k, 0) for k in tree}
        assert all(count == 0 for k, count in self.model.locks.items() if k not in tree)
        stats = self.cache.stats()
        assert stats.cached_blocks == len(nodes)
        assert stats.pinned_blocks == sum(n.lock_count > 0 for n in nodes)
        assert self.cache.num_evictable_blocks == sum(n.lock_count == 0 for n in nodes)
        assert self.mirror == {n.node_id: (n.parent.node_id, n.key) for n in nodes if n.parent is not None}

    @invariant()
    def every_block_has_one_owner(self) -> None:
        owned = list(self.free) + [n.block_id for n in self._nodes()]
        for req in self.requests:
            assert len(req.block_table) * BS >= len(req.token_ids)
            shared = req.block_table[: req.num_shared]
            assert shared == [self.model.blocks[p] for p in CacheModel.prefixes(list(req.key))]
            assert all(self.model.locks[p] > 0 for p in CacheModel.prefixes(list(req.key)))
            owned += req.block_table[req.num_shared :]
        assert sorted(owned) == list(range(NUM_BLOCKS))

    def teardown(self) -> None:
        for i, req in enumerate(list(self.requests)):
            (self._finish if i % 2 else self._abort)(req)
        assert self.cache.num_pinned_blocks == 0
        assert all(node.lock_count == 0 for node in self._nodes())
        assert sorted(self.free + [n.block_id for n in self._nodes()]) == list(range(NUM_BLOCKS))
        self._evict(NUM_BLOCKS)
        assert sorted(self.free) == list(range(NUM_BLOCKS)) and not self.mirror


def test_random_traffic_keeps_the_cache_consistent() -> None:
    PrefixCacheTraffic.steps_run = 0
    run_state_machine_as_test(
        PrefixCacheTraffic,
        settings=settings(max_examples=60, stateful_step_count=60, deadline=None, database=None),
    )
    assert PrefixCacheTraffic.steps_run >= MIN_STEPS
