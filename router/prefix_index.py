"""The router's view of each entry (or decode) group's prefix cache, kept from the groups' own
events.

Each group's leader reports every block its cache takes in or evicts as a block-hash chain
(``cluster.protocol.block_hash``, ``cache_events`` messages), so the set of hashes held here for a
group is the set of prefixes its cache holds, late only by the messages in flight. Besides, a
request dispatched to a group counts there as cached from dispatch until its first token (or
its end): its prompt's blocks are being computed there, and requests sharing its prefix that
arrive meanwhile should go there too. By its first token the group's insert events have
arrived: a leader sends them ahead of its tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable, Sequence

from pdserve.cluster.protocol import prefix_hashes


class PrefixIndex:
    """Per group (of the entry role, or decode): the block hashes its cache holds, and those of
    its prompts in flight."""

    def __init__(self, groups: Iterable[int], block_size: int) -> None:
        self.block_size = block_size
        self._cached: dict[int, set[int]] = {g: set() for g in groups}
        self._computing: dict[int, Counter[int]] = {g: Counter() for g in self._cached}
        self._in_flight: dict[str, tuple[int, list[int]]] = {}  # request -> (group, its prompt's hashes)

    def apply(self, group: int, hashes: Sequence[int]) -> None:
        """A group's cache events, in order: ``h`` inserted, ``-h`` evicted."""
        cached = self._cached.get(group)
        if cached is None:
            return
        for value in hashes:
            if value > 0:
                cached.add(value)
            else:
                cached.discard(-value)

    def add_group(self, group: int) -> None:
        """A group joined the cluster, its cache empty."""
        self._cached.setdefault(group, set())
        self._computing.setdefault(group, Counter())

    def remove_group(self, group: int) -> None:
        """A group left the cluster: no prompt goes there for its cache any more."""
        self._cached.pop(group, None)
        self._computing.pop(group, None)

    def reset(self, group: int) -> None:
        """The group (re)started: its cache is empty, and it computes no prompt of before."""
        if group in self._cached:
            self._cached[group].clear()
            self._computing[group].clear()
            for request_id in [r for r, (g, _) in self._in_flight.items() if g == group]:
                del self._in_flight[request_id]

    def sizes(self) -> dict[int, int]:
        """Blocks each group's cache holds, as its events said."""
        return {group: len(cached) for group, cached in self._cached.items()}

    def cached(self, group: int) -> set[int]:
        """The block hashes ``group``'s cache holds, as its events said (a copy)."""
        return set(self._cached[group])

    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        """The block hashes of ``token_ids``' full blocks."""
        return prefix_hashes(token_ids, self.block_size)

    def matched_tokens(self, hashes: Sequence[int]) -> dict[int, int]:
        """For each group, how many leading tokens of the prompt whose block hashes are
        ``hashes`` it holds or is computing."""
        out = {}
        for group, cached in self._cached.items():
            computing = self._computing[group]
            blocks = 0
            for value in hashes:
                if value not in cached and value not in computing:
                    break
                blocks += 1
            out[group] = blocks * self.block_size
        return out

    def lookup(
        self, hashes: Sequence[int], num_tokens: int, groups: Container[int]
    ) -> tuple[dict[int, int], dict[int, int]]:
        """A cache-aware policy's two mappings over ``groups``, for a prompt of ``num_tokens``
        tokens whose block hashes are ``hashes``: the leading tokens each group holds or is
        computing, and the blocks it holds in all. The engines compute a prompt's last token
        whatever they cache, so a block ending with it never counts."""
        matched = self.matched_tokens(hashes[: (num_tokens - 1) // self.block_size])
        cached = {g: n for g, n in matched.items() if g in groups}
        return cached, {g: n for g, n in self.sizes().items() if g in groups}

    def dispatched(self, request_id: str, group: int, hashes: list[int]) -> None:
        """``request_id``'s prompt (block hashes ``hashes``) is now computed in ``group``."""
        if group in self._computing and hashes:
            self._computing[group].update(hashes)
            self._in_flight[request_id] = (group, hashes)

    def settled(self, request_id: str) -> None:
        """``request_id``'s prompt is done (first token) or abandoned: its group's events tell
        the rest."""
        entry = self._in_flight.pop(request_id, None)
        if entry is not None and entry[0] in self._computing:
            group, hashes = entry
            computing = self._computing[group]
            for value in hashes:
                computing[value] -= 1
                if computing[value] <= 0:
                    del computing[value]
