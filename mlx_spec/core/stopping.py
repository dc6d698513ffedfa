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
        self.hit: str | None = None  # the stop string that ended the output

    def feed(self, segment: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self.held + segment
        hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            at, self.hit = min(hits, key=lambda hit: hit[0])
            self.stopped, self.held = True, ""
            return text[:at], True
        keep = partial_suffix(text, self.stops)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        text, self.held = ("" if self.stopped else self.held), ""
        return text


def partial_suffix(text: str, markers: list[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `markers` (text
    that may still grow into a marker, so it is held back)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
