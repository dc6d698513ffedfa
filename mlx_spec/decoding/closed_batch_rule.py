"""The rule of a closed batch (every slot taken, nothing waiting to join): it serves its own
rows alone, so it takes a plan only where every row, its unluckiest included, is expected to
gain by it, and a plan that puts rows in step out of step is charged the ends it puts apart."""

from __future__ import annotations

import math
from collections import Counter

from mlx_spec.decoding.batch_asks import UNTOLD_LEFT, RowAsk
from mlx_spec.decoding.batch_plans import MergedAsks
from mlx_spec.decoding.catch_ups import CatchUpHorizon
from mlx_spec.decoding.plan_search import Candidate
from mlx_spec.decoding.row_gains import Gains, largest_normal
from mlx_spec.decoding.step_costs import Plan, StepCosts
from mlx_spec.decoding.step_runs import StepRuns


class ClosedBatchRule:
    """Which plan a closed batch may take (`pick`), and whether a drafter set no step has used
    is worth a probe there (`may_bear`). It counts the batch's runs of speculative steps
    (`follow`): what repays the ends a plan puts apart (`desync`)."""

    def __init__(self, costs: StepCosts, catch_ups: CatchUpHorizon, decay: float):
        self.costs, self.catch_ups = costs, catch_ups
        self.runs = StepRuns(decay)  # a closed batch's runs of speculative steps

    def pick(
        self, merged: MergedAsks, plans: dict[int, Candidate], gains: Gains, needed: float
    ) -> int | None:
        """The K of the best plan by rate (of each K's best, `plans`) that every row is
        expected to gain by, by more than `needed` (`slowest`); None where none does."""
        borne = []
        for big_k, candidate in plans.items():
            plan, shape = candidate.plan, candidate.shape
            spread = self._spread(merged, plan, shape, gains)
            if self.slowest(merged, plan, shape, spread, gains) > 1 + needed:
                borne.append((candidate.rate, big_k))
        return max(borne)[1] if borne else None

    def may_bear(self, merged: MergedAsks, plan: Plan, gains: Gains, margin: float) -> bool:
        """Whether the batch could take `plan`, of a drafter set no step has used, at the
        least its step may cost (`StepCosts.hope`, and no less than `StepCosts.floor`)."""
        shape = merged.shape(plan)
        spread = self._spread(merged, plan, shape, gains)
        least = self.costs.hope(*shape, spread) or self.costs.seconds(*shape, spread)
        floor = self.costs.floor(shape[0], shape[1])
        least = least if floor is None else max(least, floor)
        return self.slowest(merged, plan, shape, spread, gains, least) > 1 + margin

    def _spread(self, merged: MergedAsks, plan: Plan, shape: tuple, gains: Gains) -> float:
        return self.catch_ups.spread(merged, plan, shape, merged.tokens(plan, gains))

    def slowest(
        self,
        merged: MergedAsks,
        plan: Plan,
        shape: tuple,
        spread: float,
        gains: Gains,
        seconds: float | None = None,
    ) -> float:
        """What the batch's steps drafted as `plan` (per distinct ask) gain its unluckiest
        row over the rows' lives: tokens per second over a plain step's.

        Rows in step end together, as late as the one that kept the fewest drafts. Per row,
        a step's mean and variance (`row_moments`); over the m steps its shortest-lived row
        has left, the least of B rows' tokens is about the least mean less z_B deviations
        (z_B the expected largest of B standard normals): per step, min mean - z_B
        sqrt(max variance / m). Every row pays the plan's step (`seconds`; default: its
        price) and the ends it puts apart (`desync`)."""
        if seconds is None:
            seconds = self.costs.seconds(*shape, spread)
        plain = self.costs.plain_seconds(shape[0])
        least, wide, life = math.inf, 0.0, math.inf
        for ask, i in zip(merged.asks, merged.of_row, strict=True):
            mean, variance = row_moments(ask, merged.distinct[i], plan[i], shape[1], gains)
            least, wide = min(least, mean), max(wide, variance)
            life = min(life, (ask.left or UNTOLD_LEFT) / mean)
        deficit = largest_normal(merged.size) * math.sqrt(wide / max(life, 1.0))
        seconds += self.desync(merged, plan, shape, life)
        return (least - deficit) * plain / seconds

    def desync(self, merged: MergedAsks, plan: Plan, shape: tuple, life: float) -> float:
        """Seconds a speculative step of `plan` is charged for the rows it puts out of step
        (`ends_put_apart`). A row put ahead ends alone and its client's next request is
        prefilled alone: each such end costs a step's turnover
        (`StepCosts.turnover_seconds`) and a lone row's plain pass, once, spread over the
        run of speculative steps the plan starts, as long as the batch's runs with its
        drafters last, at most the rows' `life`. Nothing before such a run was measured."""
        runs = self.runs.ended.get(shape[2])
        ends = 0 if runs is None else ends_put_apart(merged, plan)
        if not ends:
            return 0.0
        each = self.costs.turnover_seconds(shape[0]) + self.costs.plain_seconds(1)
        return ends * each / max(1.0, min(life, runs[0] / runs[1]))

    def follow(self, closed: bool, shape: tuple) -> None:
        """Count the batch's runs of speculative steps: a speculative step of a batch under
        the rule (`closed`) starts a run (with its drafters) or extends it; any other step
        ends it."""
        if closed and shape[1]:
            if self.runs.current is None:
                self.runs.start(shape[2])
            else:
                self.runs.extend()
            return
        self.runs.end()


def row_moments(
    ask: RowAsk, distinct: RowAsk, choice: tuple[int | None, int], big_k: int, gains: Gains
) -> tuple[float, float]:
    """The mean and variance of the tokens a step gives a row drafting `choice` (its ask and
    the distinct ask it merged into) at the batch's K = `big_k`. It drafts at its share d of
    the steps (`RowAsk.share`; a row with no drafts now is priced at its drafter's E(k) for
    when it has), so a step gives it 1 + d (E(k) - 1) tokens, with variance d V(k) +
    d (1 - d) (E(k) - 1)^2 (at its acceptance level: `Gains.moments`); with no drafter, 1."""
    arm, k = choice
    if arm is None or k <= 0:  # none to be had now: its drafter's at K later
        k = min(big_k, distinct.limit) if distinct.fixed is None else 0
        levels = {a: distinct.level(a) for a in distinct.arms}
        arm = max(levels, key=lambda a: gains.of(a, levels[a])[k], default=None)
    if arm is None or k <= 0:
        return 1.0, 0.0
    tokens, spread_k = gains.moments(arm, distinct.level(arm), k)
    share = ask.share(arm)
    mean = 1.0 + share * (tokens - 1.0)
    variance = share * spread_k + share * (1.0 - share) * (tokens - 1.0) ** 2
    return mean, variance


def ends_put_apart(merged: MergedAsks, plan: Plan) -> int:
    """The ends `plan` may put apart in a batch in step: at least three quarters of its rows
    with the same budget left (`RowAsk.left`, none 0) end on one step, and a plan puts out of
    that step the rows of them that draft, but one where all of them do. Rows that share a
    budget by chance among others that do not would end apart anyway."""
    cohorts = Counter(ask.left for ask in merged.asks)
    left, size = cohorts.most_common(1)[0]
    if left == 0 or 4 * size < 3 * merged.size:
        return 0
    drafting = sum(
        1
        for ask, (arm, k) in zip(merged.asks, merged.rows(plan), strict=True)
        if ask.left == left and arm is not None and k > 0
    )
    return min(size - 1, drafting)
