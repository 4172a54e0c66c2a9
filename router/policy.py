"""Dispatch policies: which group of a role serves the next request."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping


class DispatchPolicy(ABC):
    """Picks one group index given each group's outstanding tokens (prompt + tokens to come)."""

    @abstractmethod
    def pick(self, outstanding: Mapping[int, int]) -> int: ...


_POLICIES: dict[str, Callable[[], DispatchPolicy]] = {}


def register_policy(name: str) -> Callable:
    def wrap(cls: Callable[[], DispatchPolicy]) -> Callable[[], DispatchPolicy]:
        _POLICIES[name] = cls
        return cls

    return wrap


def create_policy(name: str) -> DispatchPolicy:
    if name not in _POLICIES:
        raise ValueError(f"unknown dispatch policy {name!r}; available: {sorted(_POLICIES)}")
    return _POLICIES[name]()


@register_policy("round-robin")
class RoundRobin(DispatchPolicy):
    def __init__(self) -> None:
        self._turn = 0

    def pick(self, outstanding: Mapping[int, int]) -> int:
        groups = sorted(outstanding)
        choice = groups[self._turn % len(groups)]
        self._turn += 1
        return choice


@register_policy("least-tokens")
class LeastOutstandingTokens(DispatchPolicy):
    """The group with the fewest tokens still to process; ties go to the lowest index."""

    def pick(self, outstanding: Mapping[int, int]) -> int:
        return min(sorted(outstanding), key=lambda g: outstanding[g])
