"""The steps a model drafter's catch-up is spread over: what it feeds first after plain steps
it sat out is paid once, for the speculative steps it enables."""

from __future__ import annotations

from mlx_spec.decoding.batch_asks import UNTOLD_LEFT, RowAsk
from mlx_spec.decoding.batch_plans import MergedAsks
from mlx_spec.decoding.step_costs import Plan
from mlx_spec.decoding.step_runs import StepRuns


class CatchUpHorizon:
    """The speculative steps a catch-up of a drafter set is expected to serve: the steps its
    drafters went on drafting after their catch-ups (a decayed mean behind the prior
    `horizon`, weight 2), never more than the catching-up rows have left (`serves`).

    Args:
        horizon: the prior, and the most steps a catch-up is spread over.
        decay: each ended run weighs this much less per run after it.
        backlogging: the drafters that pile up a backlog while they sit out (model
            drafters); empty: every drafter.
    """

    def __init__(self, horizon: int, decay: float, backlogging: frozenset):
        self.horizon, self.backlogging = horizon, backlogging
        self.runs = StepRuns(decay)  # per backlogging drafter set, the runs after catch-ups

    def backlogged(self, arms: tuple) -> tuple:
        """The drafters of `arms` that pile up a backlog while they sit out."""
        known = self.backlogging
        return tuple(a for a in arms if a in known) if known else arms

    def steps(self, arms: tuple) -> float:
        """The speculative steps a catch-up of drafters `arms` is expected to serve, within
        1 .. `horizon`."""
        served = self.runs.ended.get(self.backlogged(arms))
        if served is None:
            return float(self.horizon)
        steps, runs = served
        mean = (2.0 * self.horizon + steps) / (2.0 + runs)
        return min(float(self.horizon), max(1.0, mean))

    def serves(self, asks: list[RowAsk], rows: Plan, shape: tuple, tokens: float) -> float:
        """The speculative steps a catch-up of the plan (`rows`, one (arm, k) per ask of
        `asks`; `shape` its step's, `tokens` its tokens) is spread over: `steps`, at most the
        steps its catching-up rows have left, their budgets (`RowAsk.left`) at the plan's
        tokens a row. A row near its end cannot repay a catch-up over many steps."""
        horizon = self.steps(shape[2])
        per_row = max(1.0, tokens / max(shape[0], 1))
        longest = 0
        for ask, (arm, k) in zip(asks, rows, strict=True):
            if arm is None or k <= 0 or arm not in ask.arms:
                continue
            backlog = ask.backlog[ask.arms.index(arm)] if ask.backlog else 0
            if backlog > k:
                longest = max(longest, ask.left or UNTOLD_LEFT)
        if not longest:
            return horizon
        return max(1.0, min(horizon, longest / per_row))

    def spread(self, merged: MergedAsks, plan: Plan, shape: tuple, tokens: float) -> float:
        """The catch-up per step of `plan` (per distinct ask of `merged`; `shape` its step's,
        `tokens` its tokens), spread over the steps it serves."""
        return merged.catch_up(plan) / self.serves(merged.distinct, plan, shape, tokens)

    def follow(self, arms: tuple, catch_up: int) -> None:
        """Count the steps drafters go on drafting after a catch-up: a step with a catch-up
        starts a run (ending the last), a step drafting with every drafter of the run and
        catching up none extends it, any other step ends it."""
        run, key = self.runs.current, self.backlogged(arms)
        if run is not None and not catch_up and key and set(run[0]) <= set(key):
            self.runs.extend()
            return
        self.runs.end()
        if catch_up and key:
            self.runs.start(key)
