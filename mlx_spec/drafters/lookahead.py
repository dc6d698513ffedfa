"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding"): no drafter model; the target guesses ahead of itself.

Every tree round's pass carries, beside the verification tree, a lookahead branch: a 2D window
of N - 1 levels by W columns of Jacobi-iteration guesses. Level l, column i (i = 1..W) sits
i + l positions after the pending token and sees the root, level 0's columns 1..i and its own
column's levels 1..l: a causal sequence of positions 1..i + l. The target's argmax after the
last level of column i ends an N-gram along that column (level 0's token, the column's newer
levels, the new token), which goes to the pool under its first token; the window then moves
up a level, the new tokens becoming its last level. The verification branch is a tree of the
pool's most recent N-grams that start with the pending token (at most G, merged where they
share a start), verified with the lossless tree rule (their tokens are chosen, so one-hot
for the verifier). The pool also holds the N-grams of the prompt and of the output so far
(prompt lookup), which serve from the first round on.
"""

from __future__ import annotations

import random

from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.core.tree_verify import TokenTree
from mlx_spec.decoding.tree import SideBranch, TreeDrafter

import mlx.core as mx
import numpy as np


class LookaheadDrafter(TreeDrafter):
    """Lookahead decoding as a tree drafter.

    Args:
        window: W, columns of the lookahead window.
        ngram: N, the n-gram size (N - 1 levels; candidates of N - 1 tokens).
        candidates: G, n-grams verified per round at most.
        seed: the window's first guesses (tokens of the prompt) are drawn with this seed.
    """

    name = "lookahead"

    def __init__(self, window: int = 4, ngram: int = 3, candidates: int = 4, seed: int = 0):
        if window < 1 or ngram < 2 or candidates < 1:
            raise ValueError(
                f"lookahead needs --window >= 1, --ngram-size >= 2 and --candidates >= 1; got "
                f"{window}, {ngram}, {candidates}"
            )
        self.window, self.ngram, self.candidates, self.seed = window, ngram, candidates, seed
        self.max_depth = ngram - 1
        self._depths, self._visible = _window_shape(window, ngram - 1)
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.levels: list[list[int]] = []
        self.seq: list[int] = []
        self._indexed = 0  # tokens of `seq` whose n-grams are in the pool

    # --- the pool ------------------------------------------------------------------------------

    def _add(self, gram: tuple[int, ...]) -> None:
        """Keep an n-gram (most recent first, each once, at most 4 G per first token)."""
        key, rest = gram[0], gram[1:]
        kept = self.pool.setdefault(key, [])
        if rest in kept:
            kept.remove(rest)
        kept.insert(0, rest)
        del kept[4 * self.candidates :]

    def _index_sequence(self) -> None:
        """The n-grams of the sequence that ended since the last call (prompt lookup)."""
        n = self.ngram
        for start in range(max(0, self._indexed - n + 1), len(self.seq) - n + 1):
            self._add(tuple(self.seq[start : start + n]))
        self._indexed = len(self.seq)

    # --- the drafter interface -----------------------------------------------------------------

    def begin(self, prompt: list[int], hidden) -> None:
        self.seq, self.pool, self._indexed = list(prompt), {}, 0
        rng = random.Random(self.seed)
        self.levels = [
            [rng.choice(self.seq) for _ in range(self.window)] for _ in range(self.ngram - 1)
        ]
        self._index_sequence()

    def accept(self, tokens: list[int], hidden) -> None:
        self.seq += tokens
        self._index_sequence()

    def draft_tree(self, depth: int, vocab_size: int, sampling: SamplingConfig) -> TokenTree:
        found = self.pool.get(self.seq[-1], [])[: self.candidates]
        return trie([gram[:depth] for gram in found])

    def side_branch(self) -> SideBranch:
        """The window: level l, column i at depth i + 1 + l (columns counted from 0 here)."""
        tokens = [token for level in self.levels for token in level]
        return SideBranch(tokens, self._depths, self._visible)

    def observe_side(self, best: mx.array) -> None:
        """New n-grams along the columns; the window moves up a level."""
        best = np.array(best).tolist()
        width = self.window
        newest = best[(len(self.levels) - 1) * width :]  # after the last level's nodes
        for i in range(width):
            self._add(tuple(level[i] for level in self.levels) + (newest[i],))
        self.levels = self.levels[1:] + [newest]


def _window_shape(width: int, levels: int) -> tuple[list[int], np.ndarray]:
    """Depths and visibility of the window's nodes (level-major): level l, column i sees
    level 0's columns 0..i and its own column's levels 1..l."""
    index = {(lv, i): lv * width + i for lv in range(levels) for i in range(width)}
    visible = np.zeros((levels * width, levels * width), dtype=bool)
    for (lv, i), j in index.items():
        visible[j, [index[(0, c)] for c in range(i + 1)]] = True
        visible[j, [index[(u, i)] for u in range(1, lv + 1)]] = True
    depths = [i + 1 + lv for lv in range(levels) for i in range(width)]
    return depths, visible


def trie(grams: list[tuple[int, ...]]) -> TokenTree:
    """Token sequences under one root, merged where they share a start, breadth first."""
    nodes: dict[tuple[int, ...], int] = {}
    order: list[tuple[int, ...]] = []
    for gram in grams:
        for d in range(1, len(gram) + 1):
            prefix = tuple(gram[:d])
            if prefix not in nodes:
                nodes[prefix] = len(order)
                order.append(prefix)
    order.sort(key=lambda p: (len(p), nodes[p]))
    index = {p: i for i, p in enumerate(order)}
    return TokenTree([p[-1] for p in order], [index[p[:-1]] if len(p) > 1 else -1 for p in order])
