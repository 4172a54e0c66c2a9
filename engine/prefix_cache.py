"""Prefix caching over full KV blocks: a radix tree keyed by token ids, one node per block.

A node stands for one full block of ``block_size`` token ids following its parent's prefix and
holds the physical block that stores their K/V. A partial last block is never shared: its
contents change as the request grows.

Ownership follows SGLang's two levels: blocks are owned by nodes, and nodes are locked by the
requests that use them. Locking a node locks its whole path to the root (a request reads every
block of its prefix), so a node's lock count is never below any child's, and only unlocked
leaves can be evicted, least recently used first. A block handed to :meth:`PrefixCache.insert`
belongs to the cache from then on, unless it is returned as a duplicate.

Every node created or evicted is reported to an optional listener, in order, so that another
process (a router) can mirror the tree from the events alone.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

ROOT_NODE_ID = 0


class CacheNode:
    """One cached block: the ``block_size`` token ids it holds and its physical block.

    Callers hold nodes only as handles (from :meth:`PrefixCache.match` or ``insert``) and pass
    them back; the attributes are public for reading.
    """

    __slots__ = ("node_id", "key", "block_id", "parent", "children", "lock_count", "last_access", "depth")

    def __init__(self, node_id: int, key: tuple[int, ...], block_id: int, parent: CacheNode | None) -> None:
        self.node_id = node_id
        self.key = key
        self.block_id = block_id
        self.parent = parent
        self.children: dict[tuple[int, ...], CacheNode] = {}
        self.lock_count = 0
        self.last_access = 0
        self.depth = 0 if parent is None else parent.depth + 1  # blocks from the root, this one included

    @property
    def is_root(self) -> bool:
        return self.node_id == ROOT_NODE_ID

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def path_to_root(self) -> Iterator[CacheNode]:
        """This node and its ancestors, the root excluded."""
        node: CacheNode | None = self
        while node is not None and not node.is_root:
            yield node
            node = node.parent


@dataclass(frozen=True)
class CacheEvent:
    """A node created (``insert``) or evicted (``evict``): enough to mirror the tree elsewhere."""

    kind: Literal["insert", "evict"]
    node_id: int
    parent_id: int  # ROOT_NODE_ID for a prompt's first block
    token_ids: tuple[int, ...]  # the block's own token ids


CacheListener = Callable[[CacheEvent], None]


class PrefixMatch(NamedTuple):
    """The longest cached prefix of full blocks: its blocks, and the node of the last one (the
    root when nothing matched) to lock while the blocks are in use."""

    block_ids: list[int]
    handle: CacheNode


class InsertResult(NamedTuple):
    """After an insert: the cached block of each full block inserted (the caller's own or one
    cached before), the caller's blocks the cache did not take because it already held those
    tokens (the caller frees them), and the node of the last full block."""

    block_ids: list[int]
    duplicates: list[int]
    handle: CacheNode


@dataclass(frozen=True)
class PrefixCacheStats:
    cached_blocks: int
    pinned_blocks: int  # cached blocks locked by at least one request
    hit_tokens: int  # tokens of match queries served from the cache
    miss_tokens: int  # tokens of match queries not served
    evicted_blocks: int

    @property
    def hit_rate(self) -> float:
        queried = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / queried if queried else 0.0


class PrefixCache:
    """A radix tree over full blocks of token ids. Holds no tensors: only block ids."""

    def __init__(self, block_size: int, listener: CacheListener | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.listener = listener
        self.root = CacheNode(ROOT_NODE_ID, (), -1, None)
        self._node_ids = itertools.count(ROOT_NODE_ID + 1)
        self._clock = itertools.count(1)  # LRU order: ticks, not wall time, so ties cannot reorder
        self._owner: dict[int, CacheNode] = {}  # block id -> the node holding it
        self._evictable_leaves: set[CacheNode] = set()
        # The evictable leaves by last access, for eviction in O(log n) a block. An entry goes
        # stale when its node is touched again, locked, given a child or evicted; stale entries
        # are skipped when popped, and dropped when they outnumber the live ones.
        self._lru: list[tuple[int, int, int, CacheNode]] = []  # (last access, node id, entry number, node)
        self._entries = itertools.count()  # so that equal entries never compare their nodes
        self._num_pinned = 0
        self.num_inserts = 0  # blocks ever cached: a match made before this changed may be shorter than one now
        self._hit_tokens = 0
        self._miss_tokens = 0
        self._evicted = 0

    # -- queries -------------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        return len(self._owner)

    @property
    def num_pinned_blocks(self) -> int:
        return self._num_pinned

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks that repeated evictions could free: every unlocked node, since the unlocked
        nodes below a locked one (or the root) become leaves one after another."""
        return len(self._owner) - self._num_pinned

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            cached_blocks=len(self._owner),
            pinned_blocks=self._num_pinned,
            hit_tokens=self._hit_tokens,
            miss_tokens=self._miss_tokens,
            evicted_blocks=self._evicted,
        )

    def owns(self, block_id: int) -> bool:
        return block_id in self._owner

    def match(self, token_ids: Sequence[int], count: bool = True) -> PrefixMatch:
        """The longest prefix of ``token_ids`` held in full cached blocks; marks it recently used
        and (``count``) counts its tokens as hits, the rest of ``token_ids`` as misses. Locks
        nothing."""
        tick = next(self._clock)
        node = self.root
        block_ids: list[int] = []
        for key in self._keys(token_ids):
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = tick
            block_ids.append(child.block_id)
            node = child
        self._queue_if_evictable(node)
        if count:
            self.count_query(len(block_ids) * self.block_size, len(token_ids))
        return PrefixMatch(block_ids, node)

    def count_query(self, hit_tokens: int, queried_tokens: int) -> None:
        """One request's query of the cache, in the hit and miss counts: each request is counted
        once (not a refused reservation's retries, nor a preempted sequence's return)."""
        self._hit_tokens += hit_tokens
        self._miss_tokens += queried_tokens - hit_tokens

    # -- updates -------------------------------------------------------------------------------

    def insert(
        self, token_ids: Sequence[int], block_ids: Sequence[int], parent: CacheNode | None = None
    ) -> InsertResult:
        """Cache the full blocks of ``token_ids``, whose K/V lie in ``block_ids`` in order.

        Only the first ``len(token_ids) // block_size`` blocks are considered; the caller keeps
        any block after them (a partial last block). Each block whose tokens were not cached
        yet becomes the cache's; one whose tokens were cached in another block is a duplicate,
        returned for the caller to free. Locks nothing.

        ``parent`` (the root by default): a live node whose path holds the tokens before
        ``token_ids``, as if they had been inserted with it; the result names only the blocks
        given. A request that already holds a cached prefix inserts only its new blocks.
        """
        parent = self.root if parent is None else parent
        self._check_attached(parent)
        num_full = len(token_ids) // self.block_size
        if len(block_ids) < num_full:
            raise ValueError(f"{len(token_ids)} tokens fill {num_full} blocks but only {len(block_ids)} were given")
        full_blocks = [int(b) for b in block_ids[:num_full]]  # plain ints, whatever the caller's array
        keys = list(self._keys(token_ids))  # built once: the check walks them too
        self._check_insertable(parent, keys, full_blocks)
        tick = next(self._clock)
        ancestor: CacheNode | None = parent
        while ancestor is not None and ancestor is not self.root:  # recently used, as a whole insert marks them
            ancestor.last_access = tick
            ancestor = ancestor.parent
        node = parent
        cached: list[int] = []
        duplicates: list[int] = []
        for key, block_id in zip(keys, full_blocks):
            child = node.children.get(key)
            if child is None:
                child = self._add_child(node, key, block_id)
            elif child.block_id != block_id:
                duplicates.append(block_id)
            child.last_access = tick
            cached.append(child.block_id)
            node = child
        self._queue_if_evictable(node)
        return InsertResult(cached, duplicates, node)

    def lock(self, handle: CacheNode) -> None:
        """Pin ``handle`` and its ancestors: none of them can be evicted until :meth:`unlock`."""
        self._check_attached(handle)
        self._lock_path(handle, self.root)

    def unlock(self, handle: CacheNode) -> None:
        """Undo one :meth:`lock` of ``handle``."""
        self._check_attached(handle)
        if not handle.is_root and handle.lock_count == 0:
            raise RuntimeError(f"unlocking node {handle.node_id}, which is not locked")
        root = self.root
        node: CacheNode | None = handle
        while node is not None and node is not root:  # path_to_root, without a generator's calls
            node.lock_count -= 1
            if node.lock_count == 0:
                self._num_pinned -= 1
                if not node.children:
                    self._evictable_leaves.add(node)
                    self._queue_if_evictable(node)
            node = node.parent

    def move_lock(self, handle: CacheNode, descendant: CacheNode) -> None:
        """``lock(descendant)`` then ``unlock(handle)``, where ``descendant`` is ``handle`` or a
        node below it: only the nodes between them change, not the whole shared path."""
        self._check_attached(descendant)
        if not handle.is_root and handle.lock_count == 0:
            raise RuntimeError(f"unlocking node {handle.node_id}, which is not locked")
        node = descendant
        while node.depth > handle.depth and node.parent is not None:
            node = node.parent
        if node is not handle:
            raise ValueError(f"node {descendant.node_id} is not below node {handle.node_id}")
        self._lock_path(descendant, handle)

    def _lock_path(self, node: CacheNode | None, stop: CacheNode) -> None:
        """Lock ``node`` and its ancestors up to ``stop`` (excluded), one of them or the root."""
        while node is not None and node is not stop:
            if node.lock_count == 0:
                self._num_pinned += 1
                self._evictable_leaves.discard(node)
            node.lock_count += 1
            node = node.parent

    def evict(self, num_blocks: int) -> list[int]:
        """Free up to ``num_blocks`` blocks, evicting unlocked leaves least recently used first
        (a parent left childless joins the candidates). Returns the freed block ids."""
        freed: list[int] = []
        while self._lru and len(freed) < num_blocks:
            last_access, _, _, node = heapq.heappop(self._lru)
            if node in self._evictable_leaves and last_access == node.last_access:
                self._remove_leaf(node)
                freed.append(node.block_id)
        return freed

    # -- internals -----------------------------------------------------------------------------

    def _keys(self, token_ids: Sequence[int]) -> Iterator[tuple[int, ...]]:
        """The tuples of ``token_ids``' full blocks, in order (a partial last block has none).
        ``zip`` over one shared iterator builds each tuple in C, without a slice per block."""
        return zip(*[iter(token_ids)] * self.block_size)

    def _check_insertable(self, parent: CacheNode, keys: list[tuple[int, ...]], block_ids: Sequence[int]) -> None:
        """Raise before changing anything if a block would get a second owner."""
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"a block id appears twice in {list(block_ids)}")
        node: CacheNode | None = parent
        for key, block_id in zip(keys, block_ids):
            node = node.children.get(key) if node is not None else None
            owner = self._owner.get(block_id)
            if owner is not None and owner is not node:
                raise ValueError(f"block {block_id} is already cached under other tokens")

    def _add_child(self, parent: CacheNode, key: tuple[int, ...], block_id: int) -> CacheNode:
        child = CacheNode(next(self._node_ids), key, block_id, parent)
        self.num_inserts += 1
        parent.children[key] = child
        self._owner[block_id] = child
        self._evictable_leaves.discard(parent)
        self._evictable_leaves.add(child)
        self._emit("insert", child, parent)
        return child

    def _remove_leaf(self, node: CacheNode) -> None:
        parent = node.parent
        assert parent is not None and node.is_leaf and node.lock_count == 0
        del parent.children[node.key]
        del self._owner[node.block_id]
        self._evictable_leaves.discard(node)
        node.parent = None
        if not parent.is_root and parent.is_leaf and parent.lock_count == 0:
            self._evictable_leaves.add(parent)
            self._queue_if_evictable(parent)
        self._evicted += 1
        self._emit("evict", node, parent)

    def _queue_if_evictable(self, node: CacheNode) -> None:
        """Queue ``node`` for eviction at its current last access, if it is an evictable leaf."""
        if node not in self._evictable_leaves:
            return
        heapq.heappush(self._lru, (node.last_access, node.node_id, next(self._entries), node))
        if len(self._lru) > 2 * len(self._evictable_leaves) + 64:
            self._lru = [(n.last_access, n.node_id, next(self._entries), n) for n in self._evictable_leaves]
            heapq.heapify(self._lru)

    def _check_attached(self, handle: CacheNode) -> None:
        if handle.parent is None and not handle.is_root:
            raise ValueError(f"node {handle.node_id} was evicted; match again for a live handle")

    def _emit(self, kind: Literal["insert", "evict"], node: CacheNode, parent: CacheNode) -> None:
        """Report ``node`` to the listener; the event is built only when there is one."""
        if self.listener is not None:
            self.listener(CacheEvent(kind, node.node_id, parent.node_id, node.key))
