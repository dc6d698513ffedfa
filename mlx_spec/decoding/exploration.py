"""Probes and exploring steps: when they run, and what they measure (the widths and drafters
the cost model cannot price from the steps the policy chose for their rate)."""

from __future__ import annotations

from collections.abc import Callable

from mlx_spec.decoding.batch_plans import MergedAsks
from mlx_spec.decoding.plan_search import Candidate
from mlx_spec.decoding.step_costs import Plan

import numpy as np


def least_known_width(best: int, plans: dict[int, Candidate], cells: dict) -> int:
    """The K an exploring step runs: of 1 .. best + 1 (best excluded), the one whose own cost
    is least known (its cell, of `StepCosts.cells`, has the least weight; the nearest to
    `best` among equals). The line alone can price a width wrongly for good: a width it
    prices dear never runs, so never corrects it. `plans`: each K's plan."""
    candidates = [k for k in range(1, best + 2) if k != best and k in plans]
    if not candidates:
        return best

    def known(big_k: int) -> tuple[float, int]:
        b, k, arms = plans[big_k].shape
        cell = cells.get((arms, b, k))
        return (0.0 if cell is None else cell[1], abs(big_k - best))

    return min(candidates, key=known)


def untried_drafter(
    merged: MergedAsks,
    best: Candidate,
    rounds: list[float],
    thin: float,
    forced: Callable[[int], Plan],
) -> int | None:
    """Of the drafters rows may choose between (a group), the least tried one (`rounds`: per
    arm, the rounds behind its first draft) that the best plan leaves out and that is worth a
    step to measure, or None: one with fewer than `thin` rounds (its acceptance a guess), or
    one whose plan forced on the rows (`forced(arm)`) drafts without catching up first. An
    arm never run is never measured, and a model drafter forced in once its acceptance is
    known feeds its backlog for every row and measures nothing new."""
    used = {arm for arm, k in merged.rows(best.plan) if arm is not None and k > 0}
    group = {arm for ask in merged.distinct if len(ask.arms) > 1 for arm in ask.arms}
    eligible = []
    for arm in group - used:
        if rounds[arm] >= thin and merged.catch_up(forced(arm)) > 0:
            continue
        eligible.append(arm)
    if not eligible:
        return None
    return min(eligible, key=lambda arm: (rounds[arm], arm))


def next_probe_interval(last: int, rate: float, plain_rate: float, budget: float, most: int) -> int:
    """Steps before the next probe: twice the `last` interval, at least enough that a probe's
    expected loss (in plain steps; the probe promising `rate` against plain decoding's
    `plain_rate`) stays within `budget` of them, beyond `most` only by that."""
    loss = max(0.0, plain_rate / max(rate, 1e-9) - 1.0)
    need = loss / budget
    return int(min(max(2 * last, np.ceil(need)), max(most, 8 * need)))


class ProbeSchedule:
    """When the policy probes, explores, and repeats a plain answer.

    Args:
        probe_min, probe_max, probe_budget, explore_every, recheck: as `BatchDraftPolicy`'s.

    Attributes:
        speculating: the last choice speculated (speculation is kept at half the margin).
        since_spec: plain steps since the last speculative one.
        probe_every: plain steps from one probe to the next while speculation loses.
        steps: speculative steps chosen for their rate.
        quiet: [the asks' signature, plain steps the last plain answer still answers].
    """

    def __init__(
        self, probe_min: int, probe_max: int, probe_budget: float, explore_every: int, recheck
    ):
        self.probe_min, self.probe_max, self.probe_budget = probe_min, probe_max, probe_budget
        self.explore_every, self.recheck = explore_every, recheck
        self.speculating = False
        self.since_spec = 0
        self.probe_every = probe_min
        self.steps = 0
        self.quiet: list | None = None

    def probe_due(self) -> bool:
        return self.since_spec >= self.probe_every

    def exploring(self) -> bool:
        """Whether the step may probe or explore (only those run a width for its hope)."""
        return self.probe_due() or (self.steps + 1) % self.explore_every == 0

    def repeats_plain(self, signature: tuple | None) -> bool:
        """Whether the last plain answer stands: the asks unchanged (`signature`), its
        `recheck` steps not run out, and no probe due."""
        quiet = self.quiet
        if quiet is not None and quiet[0] == signature and quiet[1] > 0:
            if not self.probe_due():
                quiet[1] -= 1
                return True
        self.quiet = None
        return False

    def hold_plain(self, signature: tuple | None) -> None:
        """A plain answer for asks of `signature` (None: not repeated), held `recheck` steps."""
        if signature is not None:
            self.quiet = [signature, self.recheck - 1]

    def speculated(self) -> bool:
        """A speculative step was chosen; True where it is an exploring one."""
        self.speculating, self.since_spec, self.probe_every = True, 0, self.probe_min
        self.steps += 1
        return self.steps % self.explore_every == 0

    def tries_drafter(self) -> bool:
        """Whether this exploring step is one for an untried drafter (every other one)."""
        return bool((self.steps // self.explore_every) % 2)

    def probed(self, rate: float, plain_rate: float, thin: bool) -> None:
        """A probe promising `rate` against plain decoding's `plain_rate` runs: the next waits
        as long as its price asks (`next_probe_interval`), at most `probe_max` steps while
        a drafter's acceptance is a guess (`thin`)."""
        self.since_spec = 0
        self.probe_every = next_probe_interval(
            self.probe_every, rate, plain_rate, self.probe_budget, self.probe_max
        )
        if thin:
            self.probe_every = min(self.probe_every, self.probe_max)

    def observed(self, speculative: bool) -> None:
        if speculative:
            self.quiet = None  # acceptance and costs of speculation moved
        else:
            self.since_spec += 1
