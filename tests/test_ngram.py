"""Prompt lookup: the batch's incremental n-gram index answers as the full search does."""

from __future__ import annotations

import random

from mlx_spec.drafters.ngram import NgramIndex, find_continuation

import numpy as np
import pytest


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_index_answers_as_the_full_search(max_ngram, min_ngram):
    """Histories over a small vocabulary (many repeats), grown by a few tokens at a time: after
    every growth the index's continuation equals `find_continuation`'s for every k."""
    rng = random.Random(max_ngram * 10 + min_ngram)
    for _ in range(20):
        tokens = [rng.randrange(4) for _ in range(rng.choice([1, 3, 5, 12, 40]))]
        index = NgramIndex(tokens, max_ngram, min_ngram)
        for _ in range(30):
            history = np.asarray(tokens, dtype=np.int64)
            for k in (1, 3, 8):
                want = find_continuation(history, k, max_ngram, min_ngram)
                assert index.continuation(k).tolist() == want.tolist(), (tokens, k)
            new = [rng.randrange(4) for _ in range(rng.choice([1, 2, 3, 9, 20]))]  # (bulk too)
            tokens += new
            index.extend(new)


def test_index_finds_the_most_recent_occurrence():
    index = NgramIndex([5, 1, 2, 7, 1, 2, 9, 8, 1, 2], 2, 1)
    assert index.continuation(2).tolist() == [9, 8]  # "1 2" last seen before the end at 4
    index.extend([3])
    assert index.continuation(3).tolist() == []  # "2 3", "3": never seen before
    assert NgramIndex([4], 3, 1).continuation(2).tolist() == []
