"""Pearson's chi-square goodness-of-fit test without scipy (test-only helper)."""

from __future__ import annotations

import math
from collections import Counter


def _upper_gamma_regularized(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a), by series (x < a+1) or continued fraction."""
    if x <= 0:
        return 1.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / n
            total += term
        return 1.0 - total * math.exp(log_prefactor)
    # Lentz's continued fraction for Q.
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_prefactor) * h


def chisquare_pvalue(samples: list, expected: dict, min_expected: float = 5.0) -> float:
    """p-value that `samples` were drawn from the distribution `expected` (outcome -> prob).

    Outcomes with expected count below `min_expected` are pooled into one bin. A sample outside
    the support of `expected` gives p = 0.
    """
    n = len(samples)
    counts = Counter(samples)
    if any(expected.get(outcome, 0.0) <= 0 for outcome in counts):
        return 0.0
    stat, bins, pooled_obs, pooled_exp = 0.0, 0, 0, 0.0
    for outcome, prob in expected.items():
        exp_count = n * prob
        if exp_count < min_expected:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += exp_count
            continue
        stat += (counts.get(outcome, 0) - exp_count) ** 2 / exp_count
        bins += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    return _upper_gamma_regularized((bins - 1) / 2, stat / 2) if bins > 1 else 1.0
