"""The cost model of a batched step: its seconds by shape (B rows, K drafts a row, the drafter
set drafting) and catch-up, learnt online from the steps run."""

from __future__ import annotations

from mlx_spec.decoding.policy import ema

import numpy as np

Plan = list[tuple[int | None, int]]  # per row (or per distinct ask): (arm or None, k)


def step_shape(rows: Plan) -> tuple[int, int, tuple]:
    """(B, K, drafters drafting) of a step where row i drafts k_i with arm a_i."""
    big_k = max((k for _, k in rows), default=0)
    arms = tuple(sorted({a for a, k in rows if a is not None and k > 0}))
    return len(rows), big_k, arms


def catch_up_tokens(groups: list[tuple[tuple[int | None, int], int, dict[int, int]]]) -> int:
    """W of a step over groups of rows that draft alike (per group: its (arm, k), its rows and,
    per arm, its longest backlog): per model drafter, its drafting rows times how far the
    longest backlog among them exceeds the step's K (a speculative step's own emitted tokens
    are no catch-up; the first pass is as wide as its longest row)."""
    big_k = max((k for (_, k), _, _ in groups), default=0)
    rows: dict[int, int] = {}
    widest: dict[int, int] = {}
    for (arm, k), count, backlogs in groups:
        if arm is not None and k > 0:
            rows[arm] = rows.get(arm, 0) + count
            widest[arm] = max(widest.get(arm, 0), backlogs.get(arm, 0))
    return sum(n * max(0, widest[arm] - big_k) for arm, n in rows.items())


class StepCosts:
    """Seconds of a step. A plain step of B rows: a running average per B (the nearest B
    stands in for one not seen). A step where a set of drafters drafts up to K per row: the
    plain step of its B plus c0 + K (c1 + c2 B) + c3 W: a switch out of the pipelined plain
    steps, then per draft position a drafter pass and B more tokens in the target's pass, and
    per catch-up token (W: what the model drafters feed first beyond a speculative step's
    own, after plain steps) its share of their first pass. c0 .. c3 are fitted per drafter
    set by least squares over the steps run (decayed, all batch sizes pooled), behind a prior
    of a few steps' weight: 0.05, 0.1, 0.1 and 0.01 of a one-row plain step.

    A pass's cost is not linear in its width everywhere (a CPU's matrix kernels run some
    widths much faster than their neighbours), so each (drafter set, B, K) also keeps the
    average of its own steps' cost beyond the plain step (steps without a catch-up), and
    the prediction leans on it over the line (a step of its own weighs as much as the line).

    Two costs belong to no width. The switch out of plain decoding (the first speculative
    step after plain ones) goes to a running average per drafter set (`switch`), spread over
    the `horizon` steps a speculative step chosen after plain ones is expected to start.
    Turnover (rows joined or left just before a step) is learnt per batch size from the
    plain steps that carried it (`turnover`) and taken off the speculative steps that did:
    the few probes that price speculation would otherwise carry it for long.

    The first step of a shape that costs over twice its price (MLX building its kernels on
    first use) is set aside, and the next one of its shape prices it."""

    def __init__(
        self, decay: float = 0.97, alpha: float = 0.2, prior_weight: float = 3.0, horizon=8
    ):
        self.decay, self.alpha, self.prior_weight = decay, alpha, prior_weight
        self.horizon = horizon
        self.switch: dict[tuple, float] = {}  # arms -> a switch step's cost beyond its width's
        self.turnover: dict[int, float] = {}  # B -> a step's cost of rows joining or leaving
        self.switching = True  # the last step observed was plain: speculation pays a switch
        self.seen: set[tuple] = set()  # (arms, B, K) of the speculative steps observed
        self.plain: dict[int, float] = {}
        self.fits: dict[tuple, list] = {}  # arms -> [x^T x (4x4), x^T y (4)]
        self._solved: dict[tuple, np.ndarray] = {}  # arms -> (c0, c1, c2, c3), until a step
        self.cells: dict[tuple, list[float]] = {}  # (arms, B, K) -> [decayed sum, weight]
        # (arms, B) -> seconds a draft position of chained drafters took (their passes)
        self.drafting: dict[tuple, float] = {}
        self._memo: dict[tuple, float] = {}  # predictions since the last step observed

    # --- prices ------------------------------------------------------------------------------

    def plain_seconds(self, rows: int) -> float:
        if rows in self.plain:
            return self.plain[rows]
        if not self.plain:
            return 1.0
        below = [b for b in self.plain if b < rows]
        above = [b for b in self.plain if b > rows]
        if below and above:  # between two sizes seen: the line through them
            lo, hi = max(below), min(above)
            share = (rows - lo) / (hi - lo)
            return self.plain[lo] + share * (self.plain[hi] - self.plain[lo])
        near = max(below) if below else min(above)
        return self.plain[near]

    def weights(self, arms: tuple) -> np.ndarray:
        if arms not in self._solved:
            self._solved[arms] = self._solve(arms)
        return self._solved[arms]

    def _solve(self, arms: tuple) -> np.ndarray:
        base = self.plain_seconds(1)
        prior = np.array([0.05, 0.1, 0.1, 0.01]) * base
        ridge = self.prior_weight * np.diag([1.0, 1.0, 16.0, 16.0])  # a few small steps
        xtx, xty = self.fits.get(arms, (np.zeros((4, 4)), np.zeros(4)))
        weights = np.linalg.solve(xtx + ridge, xty + ridge @ prior)
        return np.maximum(weights, 0.0)  # no part of a step makes it cheaper

    def seconds(self, rows: int, big_k: int, arms: tuple, catch_up: float = 0.0) -> float:
        key = (rows, big_k, arms, catch_up)
        if key not in self._memo:  # a choice asks for the same shapes many times
            self._memo[key] = self._seconds(rows, big_k, arms, catch_up)
        return self._memo[key]

    def _seconds(self, rows: int, big_k: int, arms: tuple, catch_up: float) -> float:
        plain = self.plain_seconds(rows)
        if big_k == 0:
            return plain
        return self.width_seconds(rows, big_k, arms, catch_up) + self.switch_share(arms)

    def width_seconds(self, rows: int, big_k: int, arms: tuple, catch_up: float = 0.0) -> float:
        """A speculative step's seconds without a switch (one in a run of them)."""
        c0, c1, c2, c3 = self.weights(arms)
        extra = c0 + big_k * (c1 + c2 * rows)
        cell = self.cells.get((arms, rows, big_k))
        if cell is not None:  # the cell's own steps, as much as they weigh, over the line
            extra = (cell[0] + extra) / (cell[1] + 1.0)
        return self.plain_seconds(rows) + extra + c3 * catch_up

    def switch_share(self, arms: tuple) -> float:
        """What a speculative step chosen now pays of a switch out of plain decoding."""
        return self.switch.get(arms, 0.0) / self.horizon if self.switching else 0.0

    def turnover_seconds(self, rows: int) -> float:
        """A step's seconds of rows joining or leaving before it (the nearest size's)."""
        if not self.turnover:
            return 0.0
        near = min(self.turnover, key=lambda b: (abs(b - rows), -b))
        return self.turnover[near]

    # --- bounds on what a step never run may cost --------------------------------------------

    def hope(self, rows: int, big_k: int, arms: tuple, catch_up: float = 0.0) -> float | None:
        """The least a step of `rows` rows and K = `big_k` with drafters `arms` may cost where
        its own cell has no steps (None where it has: its prediction stands): no less than a
        measured step of as many rows or fewer drafting fewer (their most expensive), nor
        than the chord between its measured neighbours at its batch size, nor than its plain
        step and, for chained drafters, its drafts' passes (`draft_seconds`). The line can
        price a width never run so dear that it never runs and never corrects it; this
        bound errs the other way, and a width it makes look best is worth one step to
        measure."""
        key = ("hope", rows, big_k, arms, catch_up)
        if key not in self._memo:
            self._memo[key] = self._hope(rows, big_k, arms, catch_up)
        return self._memo[key]

    def _hope(self, rows: int, big_k: int, arms: tuple, catch_up: float) -> float | None:
        if big_k == 0 or (arms, rows, big_k) in self.cells:
            return None
        least = self.plain_seconds(rows) + self.switch_share(arms)
        below, above = None, None  # the nearest measured widths at this size
        for (a, b, k), (total, weight) in self.cells.items():
            if a != arms or b > rows or weight <= 0:
                continue
            seconds = self.plain_seconds(b) + total / weight
            if k < big_k:
                least = max(least, seconds)
                if b == rows and (below is None or k > below[0]):
                    below = (k, seconds)
            elif b == rows and k > big_k and (above is None or k < above[0]):
                above = (k, seconds)
        if below is not None and above is not None:
            share = (big_k - below[0]) / (above[0] - below[0])
            least = max(least, below[1] + share * (above[1] - below[1]))
        # Chained drafters run a pass per draft: a step is no cheaper than a plain one and
        # its drafts' passes.
        drafting = big_k * self.draft_seconds(rows, arms)
        least = max(least, self.plain_seconds(rows) + self.switch_share(arms) + drafting)
        return least + self.weights(arms)[3] * catch_up

    def floor(self, rows: int, big_k: int) -> float | None:
        """The least a step of `rows` rows verifying `big_k` drafts a row may cost, whatever
        drafted them: no less than the cheapest such step of any drafter set that ran one,
        nor than one verifying fewer (None: no set ran one of `big_k` or fewer)."""
        cheapest: dict[int, float] = {}  # K -> the cheapest set's step at this size
        for (_, b, k), (total, weight) in self.cells.items():
            if b == rows and k <= big_k and weight > 0:
                seconds = self.plain_seconds(b) + total / weight
                cheapest[k] = min(cheapest.get(k, seconds), seconds)
        return max(cheapest.values(), default=None)

    def draft_seconds(self, rows: int, arms: tuple) -> float:
        """Seconds a draft position of drafters `arms` takes at `rows` rows, at least: as
        measured at the largest batch size up to `rows` (drafting costs no less with more
        rows); where the set never drafted alone (only sets of chained drafters are
        measured), the dearest of its drafters' own; 0 where none was (or no drafter is
        chained)."""
        own = self._drafting_at(rows, arms)
        if own is not None or len(arms) < 2:
            return own or 0.0
        return max((self._drafting_at(rows, (arm,)) or 0.0 for arm in arms), default=0.0)

    def _drafting_at(self, rows: int, arms: tuple) -> float | None:
        sizes = [b for a, b in self.drafting if a == arms and b <= rows]
        return self.drafting[arms, max(sizes)] if sizes else None

    # --- observations ------------------------------------------------------------------------

    def observe_drafting(self, rows: int, big_k: int, arms: tuple, seconds: float) -> None:
        """Chained drafters `arms` drafted up to `big_k` per row for `rows` rows in
        `seconds` (building and queueing their passes)."""
        self._memo.clear()
        before = self.drafting.get((arms, rows))
        self.drafting[arms, rows] = ema(before, seconds / big_k, self.alpha)

    def observe(
        self,
        rows: int,
        big_k: int,
        arms: tuple,
        seconds: float,
        catch_up=0,
        disturbed: bool = False,
    ) -> bool:
        """A step ran (`disturbed`: rows joined or left just before it). True where it was
        set aside as a shape's first step that built its kernels."""
        self._memo.clear()
        switch, self.switching = self.switching and big_k > 0, big_k == 0
        if big_k == 0:
            self._observe_plain(rows, seconds, disturbed)
            return False
        if disturbed:
            seconds = max(self.plain_seconds(rows), seconds - self.turnover_seconds(rows))
        predicted = self.width_seconds(rows, big_k, arms, catch_up)
        first = (arms, rows, big_k) not in self.seen
        self.seen.add((arms, rows, big_k))
        if first and seconds > 2 * predicted + switch * self.switch.get(arms, 0.0):
            return True  # a shape's first step built its kernels: the next one prices it
        if switch:  # what the switch cost beyond the width's price; the width learns after
            spent = max(0.0, min(seconds, 3 * predicted) - predicted)
            before = self.switch.get(arms)
            self.switch[arms] = spent if before is None else ema(before, spent, self.alpha)
            return False
        extra = min(seconds, 3 * predicted) - self.plain_seconds(rows)
        self._learn_width(rows, big_k, arms, extra, catch_up)
        return False

    def _observe_plain(self, rows: int, seconds: float, disturbed: bool) -> None:
        """A plain step: its batch size's price, or, carrying turnover, that size's turnover."""
        old = self.plain.get(rows)
        if disturbed and old is not None:
            spent = max(0.0, seconds - old)
            before = self.turnover.get(rows)
            self.turnover[rows] = spent if before is None else ema(before, spent, self.alpha)
        else:
            self.plain[rows] = seconds if old is None else ema(old, seconds, self.alpha)
        self._solved.clear()

    def _learn_width(self, rows: int, big_k: int, arms: tuple, extra: float, catch_up) -> None:
        """A speculative step cost `extra` seconds beyond its plain step: its cell (without a
        catch-up, which is the line's to place: c3) and the line learn it."""
        if not catch_up:
            cell = self.cells.setdefault((arms, rows, big_k), [0.0, 0.0])
            cell[0], cell[1] = self.decay * cell[0] + extra, self.decay * cell[1] + 1.0
        self._solved.clear()
        x = np.array([1.0, big_k, big_k * rows, catch_up])
        xtx, xty = self.fits.get(arms, (np.zeros((4, 4)), np.zeros(4)))
        self.fits[arms] = (self.decay * xtx + np.outer(x, x), self.decay * xty + x * extra)
