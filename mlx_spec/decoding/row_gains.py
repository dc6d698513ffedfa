"""The tokens a row is expected to emit on a step: E(k) of its drafter's acceptance by draft
position (learnt over all rows), scaled to the row's own acceptance level."""

from __future__ import annotations

import math
from statistics import NormalDist

from mlx_spec.decoding.batch_asks import RowAsk
from mlx_spec.decoding.policy import chain_acceptance, count_round, expected_tokens

LEVELS = 4  # acceptance levels per doubling (`Gains.of`)


def largest_normal(n: int) -> float:
    """The expected largest of `n` standard normal draws (Blom's approximation; 0 for one)."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


class Gains(list):
    """E(k) for k = 0..max_draft per arm (`gains[arm][k]`), and `of(arm, level)`: the same
    for a row whose acceptance at every position is the arm's times 2^(level / LEVELS) (at
    most 0.98)."""

    def __init__(self, acceptance: list[list[float]], max_draft: int):
        super().__init__([expected_tokens(a, k) for k in range(max_draft + 1)] for a in acceptance)
        self.acceptance = acceptance
        self._scaled: dict[tuple[int, int], list[float]] = {}

    def of(self, arm: int, level: int = 0) -> list[float]:
        if not level:
            return self[arm]
        key = (arm, level)
        if key not in self._scaled:
            accept = self._accept(arm, level)
            self._scaled[key] = [expected_tokens(accept, k) for k in range(len(self[arm]))]
        return self._scaled[key]

    def moments(self, arm: int, level: int, k: int) -> tuple[float, float]:
        """The mean and variance of the tokens a step drafting `k` gives a row at `level`:
        with P(A >= j) the chance its first j drafts are kept, E = 1 + sum_j P(A >= j) and
        E[(1 + A)^2] = 1 + sum_j (2j + 1) P(A >= j)."""
        accept = self._accept(arm, level) if level else self.acceptance[arm]
        mean, square, keep = 1.0, 1.0, 1.0
        for j, a in enumerate(accept[:k], start=1):
            keep *= a
            mean += keep
            square += (2 * j + 1) * keep
        return mean, max(square - mean * mean, 0.0)

    def _accept(self, arm: int, level: int) -> list[float]:
        scale = 2.0 ** (level / LEVELS)
        return [min(0.98, a * scale) for a in self.acceptance[arm]]


def row_gain(choice: tuple[int | None, int], ask: RowAsk, gains: Gains) -> float:
    """E(k) of a row drafting `choice` (arm, k) at its acceptance level (1: no drafts)."""
    arm, k = choice
    return 1.0 if arm is None or k <= 0 else gains.of(arm, ask.level(arm))[k]


def acceptance_level(own, acceptance: list[float], own_weight: float) -> int:
    """A row's acceptance level for a drafter (`Gains.of`) from its own (kept, reached) counts
    (`RowAsk.own`): its kept drafts against what the drafter's acceptance over all rows
    (`acceptance`, by position) expects of the positions it reached, behind `own_weight`
    pseudo-drafts kept as expected; their ratio rounded to `LEVELS` steps per doubling (rows
    alike then ask alike and merge: `MergedAsks`), from an eighth to twice."""
    if not own_weight:
        return 0
    hits, trials = own
    expected = sum(t * a for t, a in zip(trials, acceptance, strict=False))
    ratio = (sum(hits) + own_weight) / (expected + own_weight)
    return int(max(-3 * LEVELS, min(LEVELS, round(LEVELS * math.log2(ratio)))))


def hopeful_acceptance(
    acceptance: list[float], trials: list[float], prior_weight: float
) -> list[float]:
    """Each position's acceptance plus 1 / sqrt(rounds that reached it + the prior's weight),
    at most 0.95: what a few unlucky rounds may hide."""
    return [
        max(a, min(0.95, a + (t + prior_weight) ** -0.5))
        for a, t in zip(acceptance, trials, strict=True)
    ]


class DrafterAcceptance:
    """Each drafter's acceptance by draft position over all rows: decayed (kept, reached)
    counts (`hits`, `trials`) behind a prior of `prior_accept` at weight `prior_weight`,
    each round weighing `decay` times the next."""

    def __init__(
        self, arms: int, max_draft: int, prior_accept: float, prior_weight: float, decay: float
    ):
        self.max_draft = max_draft
        self.prior_accept, self.prior_weight, self.decay = prior_accept, prior_weight, decay
        self.hits = [[0.0] * max_draft for _ in range(arms)]
        self.trials = [[0.0] * max_draft for _ in range(arms)]

    def of(self, arm: int) -> list[float]:
        return chain_acceptance(
            self.hits[arm], self.trials[arm], self.prior_accept, self.prior_weight
        )

    def gains(self, thin: float | None = None) -> Gains:
        """E(k) for k = 0..max_draft per arm; `thin` given: for an arm with fewer than `thin`
        rounds behind its first draft, at `hopeful_acceptance`."""
        out = []
        for arm in range(len(self.hits)):
            acceptance = self.of(arm)
            if thin is not None and self.trials[arm][0] < thin:
                acceptance = hopeful_acceptance(acceptance, self.trials[arm], self.prior_weight)
            out.append(acceptance)
        return Gains(out, self.max_draft)

    def thin(self, arms, least: float) -> bool:
        """Whether a drafter of `arms` has fewer than `least` rounds behind its first draft."""
        return any(self.trials[arm][0] < least for arm in arms)

    def set_levels(self, asks: list[RowAsk], own_weight: float) -> None:
        """Each row's acceptance levels (`RowAsk.levels`, `acceptance_level`); each
        drafter's acceptance is worked out once for all the rows."""
        acceptance: dict[int, list[float]] = {}
        for ask in asks:
            if not ask.own:
                continue
            levels = []
            for arm, own in zip(ask.arms, ask.own, strict=True):
                if own is None:
                    levels.append(0)
                    continue
                if arm not in acceptance:
                    acceptance[arm] = self.of(arm)
                levels.append(acceptance_level(own, acceptance[arm], own_weight))
            ask.levels = levels

    def count(self, rows: list[tuple[int | None, int]], outcomes) -> None:
        """A step's rounds: row i asked `rows[i]` (arm, k) and kept `outcomes[i][1]`."""
        for (arm, asked), (_, accepted) in zip(rows, outcomes, strict=True):
            if arm is None or asked <= 0:
                continue
            self.hits[arm] = [h * self.decay for h in self.hits[arm]]
            self.trials[arm] = [t * self.decay for t in self.trials[arm]]
            count_round(self.hits[arm], self.trials[arm], asked, accepted)
