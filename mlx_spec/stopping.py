"""Stop sequences on streamed text: hold back what could still become a stop string."""

from __future__ import annotations


class StopMatcher:
    """Feed text segments; get back the text that is safe to show and whether a stop was hit.

    Args:
        stops: stop strings; the output ends right before the first one that appears.
    """

    def __init__(self, stops: tuple[str, ...] | list[str] = ()):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, segment: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self.held + segment
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[: min(hits)], True
        keep = self._partial_suffix(text)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        text, self.held = ("" if self.stopped else self.held), ""
        return text
