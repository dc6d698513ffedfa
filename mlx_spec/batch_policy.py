"""Choosing the draft length of each batched step from measured costs and acceptance.

Under batching one target pass serves every row, and verifying k drafts per row makes that pass
k + 1 tokens wide for all of them: where the pass is compute-bound (a CPU, a large batch) that
costs nearly k + 1 times a plain step, where it is memory-bound (a GPU, a small batch) nearly
nothing. So the batch, not each row, chooses K: each step the policy predicts, for K in 0..max,
the tokens the batch emits (per row, E(k) from its drafter's measured acceptance by position)
and the step's time (a linear model fitted online to the steps run: a fixed part, the tokens
the target is fed, and the passes and rows of each model drafter), and picks the K with the most
tokens per second; K = 0 is batched plain decoding. Speculation must beat plain decoding by a
margin to be taken up (half of it to be kept); while it loses, a probe step runs now and then,
less often the more a probe costs.

Rows with a fixed `num_draft` draft that many whatever K is; rows that may use several
drafters (a group) take the one with the most expected tokens per cost each step. The choice
depends on earlier steps only, so every row's output keeps the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_spec.policy import chain_acceptance, count_round, expected_tokens

import numpy as np


@dataclass
class RowAsk:
    """What a row may do this step.

    Attributes:
        arms: the drafters it may draft with (indices into the policy's arms); empty: none.
        fixed: a fixed k (None: the batch's K).
        limit: the most drafts its output budget and context allow.
        available: per arm in `arms`, drafts it can have now (None: any number).
    """

    arms: list[int]
    fixed: int | None = None
    limit: int = 0
    available: list[int | None] = field(default_factory=list)


class _Costs:
    """Step seconds as a linear function of the step's features, fitted by ridge regression on
    decayed sums; the prior weights stand in before the steps teach otherwise.

    Features: 1, rows, target tokens (rows x (K + 1)), and per model drafter its passes and its
    rows x passes."""

    def __init__(self, model_drafters: int, plain: float = 0.01, decay: float = 0.98):
        n = 3 + 2 * model_drafters
        self.decay = decay
        prior = np.zeros(n)
        prior[0], prior[2] = 0.7 * plain, 0.3 * plain  # a plain step of one row
        prior[3::2] = 0.2 * plain  # a drafter pass costs a fifth of a plain step
        self.prior = prior
        self.strength = np.full(n, 2.0)  # pseudo-observations behind each prior weight
        self.xtx = np.zeros((n, n))
        self.xty = np.zeros(n)
        self._weights = prior.copy()

    def observe(self, features: np.ndarray, seconds: float) -> None:
        self.xtx = self.decay * self.xtx + np.outer(features, features)
        self.xty = self.decay * self.xty + features * seconds
        scale = self.xtx.trace() / len(features) + 1e-12
        ridge = np.diag(self.strength) * scale * 1e-2
        self._weights = np.linalg.solve(self.xtx + ridge, self.xty + ridge @ self.prior)

    def seconds(self, features: np.ndarray) -> float:
        floor = 0.25 * self._weights[0] + 0.25 * self.prior[0]
        return max(float(features @ self._weights), floor, 1e-6)

    def rescale(self, features: np.ndarray, seconds: float) -> None:
        """Scale the prior to a measured step (before the fit has seen any)."""
        self.prior = self.prior * seconds / max(float(features @ self.prior), 1e-12)
        self._weights = self.prior.copy()


@dataclass
class BatchChoice:
    """K for the step and, per row, (arm or None, k)."""

    num_draft: int
    rows: list[tuple[int | None, int]]
    probe: bool = False


class BatchDraftPolicy:
    """Online choice of the batch's draft length (and each row's drafter).

    Args:
        arms: the drafters' names; `model_arms` those that run a model (their passes cost).
        max_draft: K at most.
        prior_accept, prior_weight, decay: the acceptance estimates, as `AdaptiveDraftLength`.
        margin: speculation must promise this much more than plain decoding to be taken up,
            and half as much to be kept.
        probe_min, probe_max, probe_budget: plain steps between probes while speculation loses:
            doubling from probe_min up to probe_max, or beyond where a probe's expected loss
            would exceed `probe_budget` of the time between probes.
    """

    def __init__(
        self,
        arms: list[str],
        model_arms: list[str],
        max_draft: int = 8,
        *,
        prior_accept: float = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.97,
        margin: float = 0.03,
        probe_min: int = 4,
        probe_max: int = 32,
        probe_budget: float = 0.01,
    ):
        self.arms, self.max_draft = list(arms), max_draft
        self._model_arm = {a: i for i, a in enumerate(model_arms)}
        self.hits = [[0.0] * max_draft for _ in arms]
        self.trials = [[0.0] * max_draft for _ in arms]
        self.prior_accept, self.prior_weight, self.decay = prior_accept, prior_weight, decay
        self.margin = margin
        self.probe_min, self.probe_max, self.probe_budget = probe_min, probe_max, probe_budget
        self.costs = _Costs(len(model_arms))
        self._plain_seen = 0  # plain steps measured (the first ones set the cost prior)
        self._speculating = False
        self._since_spec = 0
        self._probe_every = probe_min

    # --- estimates ---------------------------------------------------------------------------

    def acceptance(self, arm: int) -> list[float]:
        return chain_acceptance(
            self.hits[arm], self.trials[arm], self.prior_accept, self.prior_weight
        )

    def features(self, rows: list[tuple[int | None, int]]) -> np.ndarray:
        """The cost model's features of a step where row i drafts k_i with arm a_i."""
        width = 1 + max((k for _, k in rows), default=0)
        x = np.zeros(3 + 2 * len(self._model_arm))
        x[0], x[1], x[2] = 1.0, len(rows), len(rows) * width
        for name, j in self._model_arm.items():
            ks = [k for a, k in rows if a is not None and k and self.arms[a] == name]
            if ks:
                x[3 + 2 * j] = max(ks)
                x[4 + 2 * j] = len(ks) * max(ks)
        return x

    def _plan(self, asks: list[RowAsk], big_k: int, accept) -> tuple[list, float]:
        """Each row's (arm, k) at batch K = big_k, and the tokens the step would emit."""
        rows, tokens = [], 0.0
        for ask in asks:
            choice, gain, score = (None, 0), 1.0, 0.0
            target = ask.fixed if ask.fixed is not None else big_k
            for arm, avail in zip(ask.arms, ask.available, strict=True):
                k = min(target, ask.limit, self.max_draft if avail is None else avail)
                if k <= 0:
                    continue
                g = expected_tokens(accept[arm], k)
                s = g / (1.0 + self._draft_weight(arm) * k)  # per unit of the row's cost
                if choice[0] is None or s > score:
                    choice, gain, score = (arm, k), g, s
            rows.append(choice)
            tokens += gain
        return rows, tokens

    def _draft_weight(self, arm: int) -> float:
        """A model drafter's cost per draft of one row, in plain steps of one row."""
        j = self._model_arm.get(self.arms[arm])
        if j is None:
            return 0.0
        w = self.costs._weights
        plain = max(w[0] + w[1] + w[2], 1e-9)
        return max(0.0, (w[3 + 2 * j] + w[4 + 2 * j]) / plain)

    # --- choice ------------------------------------------------------------------------------

    def choose(self, asks: list[RowAsk]) -> BatchChoice:
        accept = [self.acceptance(a) for a in range(len(self.arms))]
        plain_rows, plain_tokens = self._plan(asks, 0, accept)
        plain_rate = plain_tokens / self.costs.seconds(self.features(plain_rows))
        if self._plain_seen < 2 or not any(a.arms for a in asks):
            return BatchChoice(0, plain_rows)
        best = None
        for big_k in range(1, self.max_draft + 1):
            rows, tokens = self._plan(asks, big_k, accept)
            rate = tokens / self.costs.seconds(self.features(rows))
            if best is None or rate > best[0]:
                best = (rate, big_k, rows)
        needed = self.margin / 2 if self._speculating else self.margin
        if best[0] > plain_rate * (1 + needed):
            self._speculating, self._since_spec, self._probe_every = True, 0, self.probe_min
            return BatchChoice(best[1], best[2])
        self._speculating = False
        if self._since_spec >= self._probe_every:
            self._since_spec = 0
            self._probe_every = self._next_probe(best[0], plain_rate)
            return BatchChoice(best[1], best[2], probe=True)
        return BatchChoice(0, plain_rows)

    def _next_probe(self, rate: float, plain_rate: float) -> int:
        """Steps before the next probe: twice the last interval, at least enough that a
        probe's expected loss (in plain steps) stays within `probe_budget` of them."""
        loss = max(0.0, plain_rate / max(rate, 1e-9) - 1.0)
        need = loss / self.probe_budget
        return int(min(max(2 * self._probe_every, np.ceil(need)), max(self.probe_max, 8 * need)))

    # --- observations ------------------------------------------------------------------------

    def observe(self, rows: list[tuple[int | None, int]], outcomes, seconds: float) -> None:
        """A step ran: row i drafted with `rows[i]` (arm, k asked); `outcomes[i]` = (drafted,
        accepted); it took `seconds`."""
        x = self.features([(a, d) for (a, _), (d, _) in zip(rows, outcomes, strict=True)])
        if not any(k for _, k in rows):
            self._since_spec += 1
            self._plain_seen += 1
            if self._plain_seen == 1:
                self.costs.rescale(x, seconds)
        self.costs.observe(x, seconds)
        for (arm, asked), (_, accepted) in zip(rows, outcomes, strict=True):
            if arm is None or asked <= 0:
                continue
            self.hits[arm] = [h * self.decay for h in self.hits[arm]]
            self.trials[arm] = [t * self.decay for t in self.trials[arm]]
            count_round(self.hits[arm], self.trials[arm], asked, accepted)
