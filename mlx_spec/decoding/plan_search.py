"""The search over K of a choice: each plan weighed as it is priced, the best by rate kept,
and beside it what an exploring step or a probe would measure."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from mlx_spec.decoding.batch_plans import MergedAsks
from mlx_spec.decoding.catch_ups import CatchUpHorizon
from mlx_spec.decoding.row_gains import Gains
from mlx_spec.decoding.step_costs import Plan, StepCosts

PlanOf = Callable[[int, int | None], tuple[Plan, float]]  # (K, only) -> (plan, tokens)


class Candidate(NamedTuple):
    """A plan weighed: its rate (tokens per second, as the cost model prices it), its K, its
    (arm, k) per distinct ask, the one drafter a group's rows draft with (None: each its
    best), and its step's shape."""

    rate: float
    big_k: int
    plan: Plan
    only: int | None
    shape: tuple


class PlanSearch:
    """The plans of a choice over K (`run`), weighed in the order they are priced against plain
    decoding (`plain_rate` tokens per second; a plain step's seconds, `plain_seconds`).

    Args:
        merged: the step's asks.
        accept: E(k) per drafter (`Gains`).
        hopes: E(k) at hopeful acceptance where the step may explore (None: it may not).
        costs, catch_ups: the step costs and a catch-up's horizon, to price each plan.
        plain_rate, margin: plain decoding's rate, and the margin a plan must beat it by.

    Attributes:
        best: the plan with the best rate (None: every plan would slow a row behind its pace).
        held: the best plan that would slow a row behind its pace (`MergedAsks.slows`).
        plans: per K, its best plan; `calm`: per K, its best plan that no drafter catches up
            in (a step with a catch-up measures no width).
        unmeasured: the best plan of a drafter set no step has used.
        hopeful: the plan whose hope (what it may do: a width never run at its least
            possible cost, a drafter with few rounds at hopeful acceptance) is the highest
            that beats `contender`; read it through `worth_measuring`.
        contender: what a hope must promise to be tried: the margin over the best of plain
            decoding and the best plan so far.
    """

    def __init__(
        self,
        merged: MergedAsks,
        accept: Gains,
        hopes: Gains | None,
        costs: StepCosts,
        catch_ups: CatchUpHorizon,
        plain_rate: float,
        margin: float,
    ):
        self.merged, self.accept, self.hopes = merged, accept, hopes
        self.costs, self.catch_ups = costs, catch_ups
        self.plain_rate, self.margin = plain_rate, margin
        self.plain_seconds = costs.plain_seconds(merged.size)
        self.best: Candidate | None = None
        self.held: Candidate | None = None
        self.plans: dict[int, Candidate] = {}
        self.calm: dict[int, Candidate] = {}
        self.unmeasured: Candidate | None = None
        self.hopeful: Candidate | None = None
        self.hoped = 0.0
        self.contender = (1 + margin) * plain_rate

    def run(self, plan_of: PlanOf, widest: int, untried: list[int], stop_below: float):
        """Weigh the plans of every K from 1 to `widest` (`plan_of(K, only)`: a plan per
        distinct ask and its tokens), past the best K and the one above it only while a K's
        plans may promise `stop_below` of the best rate: tokens grow ever slower with K, a
        step's cost no slower. Returns the search."""
        for big_k in range(1, widest + 1):
            reach = self._weigh_width(plan_of, big_k, untried)
            best = self.best
            if best is not None and big_k >= best.big_k + 2 and reach < stop_below * best.rate:
                break
        return self

    def _weigh_width(self, plan_of: PlanOf, big_k: int, untried: list[int]) -> float:
        """Weigh the plans of K = `big_k`: each row with its best drafter; each drafter alone
        where those mix drafters (a step pays for every drafter its rows use); each group
        drafter no step has used alone (`untried`). Returns the most this K may promise."""
        merged, variants, reach = self.merged, [None, *untried], 0.0
        for only in variants:  # grows while it runs
            plan, tokens = plan_of(big_k, only)
            shape = merged.shape(plan)
            if only is None and len(shape[2]) > 1:
                variants += [arm for arm in shape[2] if arm not in variants]
            spread = self.catch_ups.spread(merged, plan, shape, tokens)
            seconds = self.costs.seconds(*shape, spread)
            candidate = Candidate(tokens / seconds, big_k, plan, only, shape)
            if merged.slows(plan, self.accept, seconds, self.plain_seconds):
                self._hold(candidate)  # not for a row behind its pace (but by a probe)
                continue
            hope = self._hope(candidate, spread, seconds)
            measured = shape[2] in self.costs.fits
            reach = max(reach, self._weigh(candidate, hope, not spread, measured))
        return reach

    def _hope(self, candidate: Candidate, spread: float, seconds: float) -> float:
        """What a plan may do (0 where the step may not explore): its tokens at hopeful
        acceptance over its step's least possible cost (`StepCosts.hope`)."""
        if self.hopes is None:
            return 0.0
        least = self.costs.hope(*candidate.shape, spread) or seconds
        return self.merged.tokens(candidate.plan, self.hopes) / least

    def _hold(self, candidate: Candidate) -> None:
        """A plan that would slow a row behind its pace: a probe alone may run it."""
        if self.held is None or candidate.rate > self.held.rate:
            self.held = candidate

    def _weigh(self, candidate: Candidate, hope: float, calm: bool, measured: bool) -> float:
        """Count a plan (`hope`: what it may do, 0 where not exploring; `calm`: no drafter
        catches up in it; `measured`: a step has used its drafter set). Returns the most it
        may promise: its rate, or its hope where that would make it the one to measure."""
        reach = 0.0
        if hope > self.contender:
            reach = hope
            if hope > self.hoped:
                self.hopeful, self.hoped = candidate, hope
        reach = max(reach, candidate.rate)
        self._keep_per_width(candidate, calm)
        if self.best is None or candidate.rate > self.best.rate:
            self.best = candidate
            self.contender = (1 + self.margin) * max(candidate.rate, self.plain_rate)
        if not measured and (self.unmeasured is None or candidate.rate > self.unmeasured.rate):
            self.unmeasured = candidate
        return reach

    def _keep_per_width(self, candidate: Candidate, calm: bool) -> None:
        big_k, rate = candidate.big_k, candidate.rate
        if big_k not in self.plans or rate > self.plans[big_k].rate:
            self.plans[big_k] = candidate
        if calm and (big_k not in self.calm or rate > self.calm[big_k].rate):
            self.calm[big_k] = candidate

    def worth_measuring(self) -> Candidate | None:
        """The hopeful plan, where its hope beats the best plan found by the margin."""
        return self.hopeful if self.hoped > self.contender else None

    def exploring_plans(self) -> dict[int, Candidate]:
        """Per K, the plan an exploring step of that width runs: one without a catch-up where
        it has one (a step with a catch-up measures no width)."""
        return {k: self.calm.get(k, candidate) for k, candidate in self.plans.items()}
