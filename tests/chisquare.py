"""Goodness of fit of sampled token sequences to a target's exact distribution (test-only)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
from scipy.stats import chisquare


def chisquare_pvalue(samples: list, expected: dict, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square test that `samples` were drawn from `expected`
    (outcome -> probability), from scipy.

    Outcomes with expected count below `min_expected` are pooled into one bin. A sample outside
    the support of `expected` gives p = 0.
    """
    n = len(samples)
    counts = Counter(samples)
    if any(expected.get(outcome, 0.0) <= 0 for outcome in counts):
        return 0.0
    observed, wanted = [], []
    pooled_obs, pooled_exp = 0, 0.0
    for outcome, prob in expected.items():
        if n * prob < min_expected:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += n * prob
        else:
            observed.append(counts.get(outcome, 0))
            wanted.append(n * prob)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        wanted.append(pooled_exp)
    if len(observed) < 2:
        return 1.0
    wanted = np.asarray(wanted) * (n / np.sum(wanted))  # exact sums for scipy's check
    return float(chisquare(observed, wanted).pvalue)


def exact_sequences(
    next_probs: Callable[[list[int]], np.ndarray], prompt: Sequence[int], length: int
) -> dict:
    """P(t_1 .. t_length | prompt) for every sequence of nonzero probability, by enumeration;
    `next_probs(ids)` is the target's sampling distribution after `ids`."""
    out = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, prob in out.items():
            for token, p in enumerate(next_probs(list(prompt) + list(seq))):
                if p > 0:
                    grown[seq + (token,)] = prob * float(p)
        out = grown
    return out


def reference_probs(logits: np.ndarray, config) -> np.ndarray:
    """The sampling distribution in numpy, independent of mlx_spec.core.sampling: softmax at the
    temperature, then top-k, top-p (the smallest most-likely prefix reaching top_p), min-p."""
    z = logits.astype(np.float64) / config.temperature
    if config.top_k:
        z = np.where(z < np.sort(z)[-config.top_k], -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if config.top_p < 1.0:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        keep = np.zeros_like(p, dtype=bool)
        keep[order[before < config.top_p]] = True
        p = np.where(keep, p, 0.0)
    if config.min_p:
        p = np.where(p < config.min_p * p.max(), 0.0, p)
    return p / p.sum()


def first_tokens(model, tok, prompt, drafter, config, runs: int, num_draft: int = 2) -> list:
    """The first three tokens of `runs` seeded generations with `drafter` (k = `num_draft`)
    at the sampling settings of `config` (temperature and top-k)."""
    import mlx_spec

    return [
        tuple(
            mlx_spec.generate(
                model, tok, prompt, drafter=drafter, num_draft=num_draft, max_tokens=3,
                temperature=config.temperature, top_k=config.top_k, seed=s,
            ).tokens
        )
        for s in range(runs)
    ]  # fmt: skip


def exact_first_tokens(model, prompt, config, vocab: int) -> dict:
    """The target's exact distribution of its first three sampled tokens after `prompt`."""
    import mlx.core as mx

    def next_probs(ids):
        return reference_probs(np.array(model(mx.array([ids]))[0, -1, :vocab]), config)

    return exact_sequences(next_probs, prompt, 3)
