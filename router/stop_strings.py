"""Stop strings over streamed text: the cluster stops on token ids only, so the front end finds
OpenAI's ``stop`` strings in the text as it arrives, truncates before the first match and holds
back the end of the text while it could still become one, so no byte of a stop string ever reaches the client."""

from __future__ import annotations


class StopStringMatcher:
    """Feed text deltas in order; ``add`` returns the text that is safe to send and whether a
    stop string ended the output; ``flush`` releases what is held back once the stream ends.

    ``include``: the output ends after the stop string instead of before it (vLLM's
    ``include_stop_str_in_output``), so nothing need be held back."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        # Per stop string, how much of its start the text ends with: kept up to date a character
        # at a time (Knuth-Morris-Pratt), so that the held-back tail costs each delta its own
        # length, not the held text's times the stop strings'.
        self._borders = [] if include else [_borders(s) for s in self.stops]
        self._open = [0] * len(self._borders)
        self.text = ""  # the output so far (cut at the stop string once one is found)
        self.sent = 0  # characters of ``text`` already returned
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the output

    def add(self, delta: str, may_stop: bool = True) -> tuple[str, bool]:
        """``may_stop`` false (vLLM's ``min_tokens`` not yet reached): no stop string may end in
        this delta; one that starts here and ends in a later delta still counts."""
        if self.stopped:
            return "", True
        end_of_old = len(self.text)
        self.text += delta
        self._advance(delta)
        if may_stop:
            # Only matches that end in the delta: earlier text was searched, or could not stop.
            found = [
                (i, i + len(s), s)
                for s in self.stops
                if (i := self.text.find(s, max(0, end_of_old - len(s) + 1))) != -1
            ]
            if found:
                start, end, self.matched = min(found)
                self.text = self.text[: end if self.include else start]
                self.stopped = True
                return self.flush(), True
        end = max(self.sent, len(self.text) - self._open_tail())
        out, self.sent = self.text[self.sent : end], end
        return out, False

    def _advance(self, delta: str) -> None:
        for i, (stop, borders) in enumerate(zip(self.stops, self._borders)):
            k = self._open[i]
            for ch in delta:
                while k and stop[k] != ch:
                    k = borders[k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):  # a whole match (one that may not stop yet): keep its open end
                    k = borders[k - 1]
            self._open[i] = k

    def _open_tail(self) -> int:
        """Length of the longest end of the text that a stop string starts with."""
        return max(self._open, default=0)

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


def _borders(s: str) -> list[int]:
    """``b[i]``: the length of the longest proper prefix of ``s[: i + 1]`` that is also its suffix."""
    b = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = b[k - 1]
        if s[i] == s[k]:
            k += 1
        b[i] = k
    return b
