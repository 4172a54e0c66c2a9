"""Stop strings over streamed text: the cluster stops on token ids only, so the front end finds
OpenAI's ``stop`` strings in the text as it arrives, truncates before the first match and holds
back the end of the text while it could still become one, so no byte of a stop string ever reaches the client."""

from __future__ import annotations


class StopStringMatcher:
    """Feed text deltas in order; ``add`` returns the text that is safe to send and whether a
    stop string ended the output; ``flush`` releases what is held back once the stream ends."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        # A stop string that started in earlier text ends at most this many characters into a delta.
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # the output so far (cut before the stop string once one is found)
        self.sent = 0  # characters of ``text`` already returned
        self.stopped = False

    def add(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        start = max(0, len(self.text) - self.hold)  # earlier text was already searched
        self.text += delta
        matches = [i for i in (self.text.find(s, start) for s in self.stops) if i != -1]
        if matches:
            self.text = self.text[: min(matches)]
            self.stopped = True
            return self.flush(), True
        end = max(self.sent, len(self.text) - self._open_tail())
        out, self.sent = self.text[self.sent : end], end
        return out, False

    def _open_tail(self) -> int:
        """Length of the longest end of the text that a stop string starts with."""
        for k in range(min(self.hold, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
