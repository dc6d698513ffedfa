"""Prompt lookup: propose the continuation of the longest recent n-gram match (no model)."""

from __future__ import annotations

from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.drafters.base import Draft, Drafter

import mlx.core as mx
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def find_continuation(history: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> np.ndarray:
    """Continuation (up to k ids) of the most recent earlier occurrence of the longest suffix
    n-gram of `history`, trying n = max_ngram down to min_ngram; empty if none matches."""
    length = history.size
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = history[length - n :]
        windows = sliding_window_view(history[: length - 1], n)  # starts 0 .. length-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = hits[-1] + n
            return history[start : start + k]
    return history[:0]


# New positions from which `NgramIndex` indexes each n's n-grams in one pass over columns of
# the history (C-level zips, where the token-by-token loop builds each tuple in Python; for a
# token or two the loop's fewer calls win).
BULK = 8


class NgramIndex:
    """A growing history with its n-grams indexed: the same answers as `find_continuation`
    in time independent of the history's length (a batch of rows looks up every step).

    For each n in min_ngram .. max_ngram it keeps the latest start of every n-gram that ends
    before the history's last token, brought up to date as tokens are appended.
    """

    def __init__(self, tokens, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[int] = []
        self._latest: dict[int, dict[tuple, int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self._indexed = 0  # n-grams ending at positions < this are in `_latest`
        self.extend(tokens)

    def extend(self, tokens) -> None:
        self.history += [int(t) for t in tokens]

    def _update(self) -> None:
        history, end = self.history, len(self.history) - 1  # n-grams must end before `end`
        if end - self._indexed < BULK:
            for p in range(self._indexed, end):
                for n, latest in self._latest.items():
                    if p + 1 >= n:
                        latest[tuple(history[p + 1 - n : p + 1])] = p + 1 - n
        else:  # a prompt, or many tokens since the last lookup: each n's n-grams at once
            for n, latest in self._latest.items():
                first = max(self._indexed, n - 1)  # the first end position to index
                if first < end:
                    start = first + 1 - n
                    columns = [history[start + j : end + 1 - n + j] for j in range(n)]
                    grams = zip(*columns, strict=True)
                    latest.update(zip(grams, range(start, end + 1 - n), strict=True))  # later wins
        self._indexed = max(self._indexed, end)

    def continuation(self, k: int) -> np.ndarray:
        """Up to k ids after the most recent earlier occurrence of the longest suffix n-gram
        (empty if none)."""
        self._update()
        history, length = self.history, len(self.history)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            start = self._latest[n].get(tuple(history[length - n :]))
            if start is not None:
                return np.asarray(history[start + n : start + n + k], dtype=np.int64)
        return np.zeros(0, np.int64)


class NgramDrafter(Drafter):
    """Drafter-free speculation from the prompt and the output so far.

    Args:
        max_ngram: longest suffix to match.
        min_ngram: shortest suffix to match.
    """

    name = "ngram"

    @property
    def identity(self):
        return (self.name, self.max_ngram, self.min_ngram)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._buf = np.zeros(0, np.int64)
        self._len = 0
        self._found: tuple[int, np.ndarray] | None = None  # (k, lookup) for the current history

    def begin(self, prompt: list[int], vocab_size: int, hidden=None) -> None:
        self._buf = np.zeros(max(1024, 2 * len(prompt)), np.int64)
        self._len = 0
        self._extend(prompt)

    def extend(self, prompt, common, vocab_size, hidden=None, hidden_start=0) -> bool:
        """Keep the shared prefix of the history and append the rest of the new prompt."""
        self._len = min(self._len, common)
        self._extend(prompt[self._len :])
        return True

    def _extend(self, tokens: list[int]) -> None:
        self._found = None  # the history changes
        if self._len + len(tokens) > self._buf.size:
            grown = np.zeros(2 * (self._len + len(tokens)), np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : self._len + len(tokens)] = tokens
        self._len += len(tokens)

    def _lookup(self, k: int) -> np.ndarray:
        """The continuation for up to k drafts; one search per history serves every k up to the
        largest asked (a shorter k takes the first tokens of the same match)."""
        if self._found is None or self._found[0] < k:
            history = self._buf[: self._len]
            self._found = (k, find_continuation(history, k, self.max_ngram, self.min_ngram))
        return self._found[1][:k]

    def available(self, k: int) -> int:
        return int(self._lookup(k).size) if k > 0 else 0

    def draft(self, k: int, sampling: SamplingConfig) -> Draft:
        if k <= 0:
            return Draft.empty()
        return Draft(mx.array(self._lookup(k).astype(np.uint32)))

    def accept(self, num_accepted: int, emitted: list[int], hidden=None) -> None:
        self._extend(emitted)
