"""Dispatch policies: which group of a role serves the next request."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping


class DispatchPolicy(ABC):
    """Picks one group index given each group's outstanding tokens (prompt + tokens to come of
    the requests it holds; a prefill group holds one until its first token) and, for policies
    that use them, how many leading tokens of the prompt each group's prefix cache holds
    (``cached``) and how many blocks it holds in all (``cache_sizes``); groups absent from
    either hold none."""

    uses_cache: bool = False  # whether ``pick`` reads the cache mappings: the router skips them otherwise

    @abstractmethod
    def pick(
        self,
        outstanding: Mapping[int, int],
        cached: Mapping[int, int] | None = None,
        cache_sizes: Mapping[int, int] | None = None,
    ) -> int: ...


_POLICIES: dict[str, Callable[[int], DispatchPolicy]] = {}


def register_policy(name: str) -> Callable:
    """Register a policy class; its constructor takes the cache-aware margin in tokens."""

    def wrap(cls: Callable[[int], DispatchPolicy]) -> Callable[[int], DispatchPolicy]:
        _POLICIES[name] = cls
        return cls

    return wrap


def policy_names() -> list[str]:
    """The registered policies (``--dispatch`` offers the names ``cluster.config`` lists)."""
    return sorted(_POLICIES)


def create_policy(name: str, cache_margin_tokens: int) -> DispatchPolicy:
    """Policy ``name``; ``cache_margin_tokens``: the cluster's ``cache_aware_margin``."""
    if name not in _POLICIES:
        raise ValueError(f"unknown dispatch policy {name!r}; available: {sorted(_POLICIES)}")
    return _POLICIES[name](cache_margin_tokens)


@register_policy("round-robin")
class RoundRobin(DispatchPolicy):
    def __init__(self, cache_margin_tokens: int = 0) -> None:
        self._turn = 0

    def pick(
        self,
        outstanding: Mapping[int, int],
        cached: Mapping[int, int] | None = None,
        cache_sizes: Mapping[int, int] | None = None,
    ) -> int:
        groups = sorted(outstanding)
        choice = groups[self._turn % len(groups)]
        self._turn += 1
        return choice


@register_policy("least-tokens")
class LeastOutstandingTokens(DispatchPolicy):
    """The group with the fewest tokens still to process; ties go to the lowest index."""

    def __init__(self, cache_margin_tokens: int = 0) -> None:
        pass

    def pick(
        self,
        outstanding: Mapping[int, int],
        cached: Mapping[int, int] | None = None,
        cache_sizes: Mapping[int, int] | None = None,
    ) -> int:
        return min(sorted(outstanding), key=lambda g: outstanding[g])


@register_policy("cache-aware")
class CacheAware(DispatchPolicy):
    """The group whose cache holds the longest prefix of the prompt, among the groups whose
    outstanding tokens exceed the least-loaded group's by at most ``margin`` tokens; ties (no
    group holding any of it included) go to the least loaded, then to the smallest cache, then
    to the lowest index.

    SGLang's cache-aware router idea: a hit saves the prefix's prefill, but a hot prefix must
    not pile every request onto one group; past the margin, load wins, and the less loaded
    group then caches the prefix too. The smallest cache breaks ties so that new prefixes
    spread over idle groups instead of all starting in the first.
    """

    uses_cache = True

    def __init__(self, cache_margin_tokens: int) -> None:
        if cache_margin_tokens < 0:
            raise ValueError(f"the cache-aware margin must be >= 0 tokens, got {cache_margin_tokens}")
        self.margin = cache_margin_tokens

    def pick(
        self,
        outstanding: Mapping[int, int],
        cached: Mapping[int, int] | None = None,
        cache_sizes: Mapping[int, int] | None = None,
    ) -> int:
        cached, sizes = cached or {}, cache_sizes or {}
        ceiling = min(outstanding.values()) + self.margin
        candidates = [g for g in sorted(outstanding) if outstanding[g] <= ceiling]
        return min(candidates, key=lambda g: (-cached.get(g, 0), outstanding[g], sizes.get(g, 0)))
