"""Choosing the draft length of each batched step from measured costs and acceptance.

Under batching one target pass serves every row, and verifying k drafts per row makes that pass
k + 1 tokens wide for all of them: where the pass is compute-bound (a CPU, a large batch) that
costs nearly k + 1 times a plain step, where it is memory-bound (a GPU, a small batch) nearly
nothing. So the batch, not each row, chooses K: each step the policy predicts, for K in 0..max,
the tokens the batch emits (per row, E(k) from its drafter's measured acceptance by position)
and the step's time (a linear model fitted online to the steps run: a fixed part, the tokens
the target is fed, the passes and rows of each model drafter, and the catch-up: what a model
drafter must feed first after plain steps it sat out), and picks the K with the most tokens per
second, the catch-up spread over the steps it enables; K = 0 is batched plain decoding.
Speculation must beat plain decoding by a margin to be taken up (half of it to be kept); while
it loses, a probe step runs now and then, less often the more a probe costs. Probes and every
`explore_every`-th speculative step measure what the model cannot know: a drafter set never
run, a width never run at that batch size whose least possible cost (`_Costs.hope`) would make
it the best, else a width near the best one whose own cost is least known.

Rows with a fixed `num_draft` draft that many whatever K is; rows that may use several
drafters (a group) take the one with the most expected tokens per cost each step. Each row's
E(k) is its drafter's scaled by how the row's own drafts fared (`RowRecord`; `_level`): the
lookup keeps 14-25% of its drafts on one request and over 60% on the next (a request's text
suits it or not, the same in every run), and priced at the drafter's acceptance over all
rows, a batch counted on drafts its rows with little to look up would not keep. The choice
depends on earlier steps only, so every row's output keeps the target's distribution.

Weighed as a whole, a batch gains by drafting for the rows whose drafts are kept, and the
rows with little to draft pay for the wider pass all the same: at 8 rows on a 2-core x86 a
pass verifying one draft a row costs about 1.15 plain steps, two 1.5, so a request whose
text suits no drafter ran slower than with speculation off while the rows beside it ran
faster (`server_load.py`'s requests against plain decoding). Where the engine keeps each
row's pace against plain decoding (`BatchEngine`'s `pace_slack`, off by default), a row
that has fallen behind by more than its slack asks as `behind`: no plan is taken whose
step is expected to give that row fewer tokens per second than a plain step would
(`_Merged.slows`; the probes still run); its tokens at plain pace make up the difference.
That costs the batch the steps such rows hold back.

A model drafter costs a pass over each joining row's prompt before it drafts at all, paid
whether the policy then drafts with it or not: a row's cost, once, timed per token fed
(`observe_join`) and kept out of the step costs. A row takes the drafter in where the guard
found, at that size, that the drafter's steps realise at least as much as the steps without
it; where the guard has no verdict, where the policy drafted with it in at least `min_share`
of its recent steps of that size; at a size it has hardly run at, where that cost, for every
row of the batch once in a row's expected life, is a small share of the batch's plain time
over that life (`join_budget`), or where its cost model, fitted at the sizes it has seen,
predicts that drafting with it pays there. Every `probe_join`-th row turned away joins
anyway (rarer where the guard's verdict is a loss), so that the drafter stays measured. So
at a batch size where the policy decodes plainly, or where a group's rows draft with a
cheaper drafter, rows skip the pass, and take the drafter in later if the batch comes to a
size where it pays (fewer rows: the end of a busy spell).

A closed batch (every slot taken, nothing waiting to join: the engine's `closed`, each
step) serves its own rows alone: no request waits for what its steps gain. A step that
speeds some rows and not others trades one user's time for another's (every row pays the
wider pass), and it puts the rows out of step: they end apart, their clients' next requests
join one at a time (a pass and a pipeline restart each), and the batch runs part-empty
until they have. So there the policy takes a plan only where every row is expected to gain
by it, its unluckiest one included (`_slowest`: rows in step end as late as the row that
kept the fewest drafts; a row's mean tokens a step, its drafter's share of its asks with
drafts to be had times its E(k) at its level, less the deviations by which the least of B
rows falls short of its mean over the steps they have left, over the plan's price against
a plain step's), by the margin, the best such plan by rate. Where its rows are in step
(three quarters of them or more with the same budget left), a plan that drafts is also
charged the ends it puts apart (each a lone pass for the row's next request), spread over
as many steps as the batch's closed runs of speculative steps with its drafters last
(`_desync`). No probe runs (but of a
drafter set no step has used, where the rule could take it at the least its step may
cost: `_may_bear`), nor an exploring step (the batch passes through other sizes as rows
end and join, where they do), and while no plan passes the engine holds the batch to
plain steps for `closed_hold` steps (more as its steps without a plan mount) without the
rows' asks (`BatchEngine._closed_choice`; a batch that has been running full counts as
closed while it refills). On a 2-core x86
at 8 rows (a pass verifying one draft a row 1.33x a plain one), 8 clients of equal
requests through the server, six alternated rounds: the group 0.88x of plain decoding on
average with the batch priced by when it would end (every K's plan and plain decoding;
the rule before this one), 1.00x with each row priced by its mean (0.98x with every mode
served in rotation); priced by the unluckiest row, in rotation, 1.015x and 0.97x in two
rounds of 12 repeats against 0.98x and 0.98x (`benchmarks/README.md`). Where a wider pass
costs little more (a memory-bound GPU), every row with drafts to be had gains and the
batch drafts as an open one does. A lone row and an open batch keep the best K by rate (a
freed slot is filled again, and a waiting request gains by the batch's pace).

What a step's cost leaves out (catch-ups and joins spread over many steps, a pipeline of
plain steps broken, rows out of step) a guard measures per drafter at 2 rows or more, and
for a lone row's model drafters (`alone`): it
runs windows of steps where the drafter is allowed and windows where it is barred (the rows
drafting with their other drafters, or decoding plainly), and where the steps with it
realise less per second at a batch size (its joins counted), bars it there but for a window
now and then (`_Guard`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from statistics import NormalDist

from mlx_spec.decoding.policy import chain_acceptance, count_round, ema, expected_tokens

import numpy as np


@dataclass
class RowAsk:
    """What a row may do this step.

    Attributes:
        arms: the drafters it may draft with (indices into the policy's arms); empty: none.
        fixed: a fixed k (None: the batch's K).
        limit: the most drafts its output budget and context allow.
        available: per arm in `arms`, drafts it can have now (None: any number).
        backlog: per arm in `arms`, tokens its drafter must feed before drafting (piled up
            over plain steps); empty: none.
        own: per arm in `arms`, the row's own (kept, reached) counts by draft position
            (`count_round`), or None; empty: none. Its acceptance against the drafter's
            over all rows sets its `levels`.
        levels: set by the policy (`BatchDraftPolicy._prepare`): per arm, the row's
            acceptance level (`_Gains.of`).
        behind: the row has fallen behind the pace plain decoding would have kept by more
            than it may (the engine's ledger, `BatchEngine.pace_slack`): no step may be
            expected to slow it further (`_Merged.slows`).
        left: the tokens it may still emit (its budget; 0: not told, as `UNTOLD_LEFT`): a
            catch-up is spread over no more steps than its rows have left (`_serves`).
        drafting: per arm in `arms`, the share of its recent asks where that drafter had
            drafts to be had (`RowRecord`; empty: always): an n-gram lookup finds none on
            some steps, a model drafter always has.
    """

    arms: list[int]
    fixed: int | None = None
    limit: int = 0
    available: list[int | None] = field(default_factory=list)
    backlog: list[int] = field(default_factory=list)
    own: list = field(default_factory=list)
    levels: list[int] = field(default_factory=list)
    behind: bool = False
    left: int = 0
    drafting: list[float] = field(default_factory=list)

    def level(self, arm: int) -> int:
        return self.levels[self.arms.index(arm)] if self.levels else 0

    def share(self, arm: int) -> float:
        """The share of its recent asks where drafter `arm` had drafts to be had."""
        return self.drafting[self.arms.index(arm)] if self.drafting else 1.0

    def keeping(self, indices: list[int]) -> RowAsk:
        """The ask with the drafters at `indices` of `arms` alone."""

        def kept(values: list) -> list:
            return [values[i] for i in indices] if values else []

        return replace(
            self,
            arms=kept(self.arms),
            available=kept(self.available),
            backlog=kept(self.backlog),
            own=kept(self.own),
            levels=kept(self.levels),
            drafting=kept(self.drafting),
        )


@dataclass
class RowRecord:
    """A row's own acceptance, for its asks (`RowAsk.own`): per drafter, its (kept, reached)
    counts by draft position, each round weighing `DECAY` times the next: what a row's text
    lets a drafter guess changes within a request (the embedded pair's MTP head keeps far
    fewer of its drafts over a generation's opening than after it), and a level set by its
    first rounds held the row to them long after."""

    own: dict = field(default_factory=dict)
    # Per drafter, the share of its recent asks where it had drafts to be had
    # (`RowAsk.drafting`), each ask weighing 1 / (1 - HAD) times the one before it.
    had: dict = field(default_factory=dict)

    DECAY = 0.7
    HAD = 0.85

    def drafted(self, arm: int, asked: int, accepted: int) -> None:
        """The row asked drafter `arm` for `asked` drafts and kept `accepted`."""
        hits, trials = self.own.setdefault(arm, ([], []))
        hits[:] = [h * self.DECAY for h in hits]
        trials[:] = [t * self.DECAY for t in trials]
        if len(trials) < asked:
            hits += [0.0] * (asked - len(hits))
            trials += [0.0] * (asked - len(trials))
        count_round(hits, trials, asked, accepted)

    def ask(
        self,
        arms: list[int],
        fixed,
        limit: int,
        available: list,
        backlog: list,
        behind=False,
        left: int = 0,
    ) -> RowAsk:
        own = [self.own.get(a) for a in arms]
        if limit > 0:
            for arm, avail in zip(arms, available, strict=False):
                has = avail is None or avail > 0
                self.had[arm] = self.HAD * self.had.get(arm, 1.0) + (1.0 - self.HAD) * has
        return RowAsk(
            arms, fixed, limit, available, backlog, own, behind=behind, left=left,
            drafting=[self.had.get(a, 1.0) for a in arms],
        )  # fmt: skip


LEVELS = 4  # acceptance levels per doubling (`_Gains.of`)
UNTOLD_LEFT = 64  # a row's tokens still to emit where its ask does not tell (`RowAsk.left`)


def largest_normal(n: int) -> float:
    """The expected largest of `n` standard normal draws (Blom's approximation; 0 for one)."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


class _Gains(list):
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


class _Merged:
    """A step's asks with the rows that ask alike merged (a batch's rows mostly do): a plan
    is one (arm, k) per distinct ask, made once for all its rows, and spelled out per row
    only for the step chosen."""

    def __init__(self, asks: list[RowAsk]):
        self.asks, self.size = asks, len(asks)
        self.distinct: list[RowAsk] = []
        self.counts: list[int] = []
        self.widest: list[dict[int, int]] = []  # per distinct ask: arm -> its longest backlog
        self.of_row: list[int] = []
        index: dict[tuple, int] = {}
        for ask in asks:
            key = (tuple(ask.arms), ask.fixed, ask.limit, tuple(ask.available), ask.behind)
            key += tuple(ask.levels)
            i = index.setdefault(key, len(self.distinct))
            if i == len(self.distinct):
                self.distinct.append(ask)
                self.counts.append(0)
                self.widest.append({})
            self.counts[i] += 1
            widest = self.widest[i]
            for arm, backlog in zip(ask.arms, ask.backlog, strict=False):
                widest[arm] = max(widest.get(arm, 0), backlog)
            self.of_row.append(i)
        self.behind = any(ask.behind for ask in self.distinct)

    def rows(self, plan: list) -> list[tuple[int | None, int]]:
        return [plan[i] for i in self.of_row]

    def shape(self, plan: list) -> tuple[int, int, tuple]:
        """As `BatchDraftPolicy.shape` of the plan's rows."""
        return (self.size, *BatchDraftPolicy.shape(plan)[1:])

    def tokens(self, plan: list, gains: _Gains) -> float:
        """The tokens the plan's rows emit with E(k) `gains`."""
        return sum(
            count * _gain(choice, ask, gains)
            for choice, count, ask in zip(plan, self.counts, self.distinct, strict=True)
        )

    def slows(self, plan: list, gains: _Gains, seconds: float, plain: float) -> bool:
        """Whether a step of the plan, taking `seconds` where a plain step takes `plain`, is
        expected to slow a row that is behind its pace (`RowAsk.behind`): one whose tokens
        per second under the plan, E(k) / seconds, fall short of a plain step's 1 / plain.
        A row that drafts nothing pays the wider pass for nothing, and one that drafts
        little gains less than the pass costs it (see the module's text). A lone row's
        plans are weighed by its own tokens already: none slows it but by a misjudgement,
        and ruling plans out for it would only keep the policy from exploring."""
        if not self.behind or self.size == 1:
            return False
        return any(
            ask.behind and _gain(choice, ask, gains) * plain < seconds
            for choice, ask in zip(plan, self.distinct, strict=True)
        )

    def catch_up(self, plan: list) -> int:
        """As `BatchDraftPolicy.catch_up` of the plan's rows."""
        return _catch_up(list(zip(plan, self.counts, self.widest, strict=True)))


def _gain(choice: tuple[int | None, int], ask: RowAsk, gains: _Gains) -> float:
    """E(k) of a row drafting `choice` (arm, k) at its acceptance level (1: no drafts)."""
    arm, k = choice
    return 1.0 if arm is None or k <= 0 else gains.of(arm, ask.level(arm))[k]


def _catch_up(groups: list[tuple[tuple[int | None, int], int, dict[int, int]]]) -> int:
    """`BatchDraftPolicy.catch_up` over groups of rows that draft alike: per group its
    (arm, k), its rows and, per arm, its longest backlog."""
    big_k = max((k for (_, k), _, _ in groups), default=0)
    rows: dict[int, int] = {}
    widest: dict[int, int] = {}
    for (arm, k), count, backlogs in groups:
        if arm is not None and k > 0:
            rows[arm] = rows.get(arm, 0) + count
            widest[arm] = max(widest.get(arm, 0), backlogs.get(arm, 0))
    return sum(n * max(0, widest[arm] - big_k) for arm, n in rows.items())


def _without(ask: RowAsk, barred: int) -> RowAsk:
    """The ask with the drafters in `barred` (a bitmask) left out."""
    if not any(barred >> arm & 1 for arm in ask.arms):
        return ask
    return ask.keeping([i for i, arm in enumerate(ask.arms) if not barred >> arm & 1])


class _Costs:
    """Seconds of a step. A plain step of B rows: a running average per B (the nearest B
    stands in for one not seen). A step where a set of drafters drafts up to K per row: the
    plain step of its B plus c0 + K (c1 + c2 B) + c3 W: a switch out of the pipelined plain
    steps, then per draft position a drafter pass and B more tokens in the target's pass, and
    per catch-up token (W: what the model drafters feed first beyond a speculative step's
    own, after plain steps) its share of their first pass. c0 .. c3 are fitted per drafter
    set by least squares over the steps run (decayed, all batch sizes pooled, so that what
    B = 8 taught serves B = 5), behind a prior of a few steps' weight: 0.05, 0.1, 0.1 and
    0.01 of a one-row plain step.

    A pass's cost is not linear in its width everywhere: a CPU's matrix kernels run some
    widths much faster than their neighbours (on a 2-core x86, 8 rows verifying 1 draft each
    cost about 15% more than a plain step, 2 drafts each about 50% more). So each (drafter
    set, B, K) also keeps the average of its own steps' cost beyond the plain step (steps without a
    catch-up: the first steps after a plain stretch carry one, which the line places on c3),
    and where it has some, the prediction leans on it over the line (a step of its own
    weighs as much as the line).

    Two costs a step may carry are no width's: the switch out of plain decoding (the first
    speculative step after plain ones: on an H100 at 8 rows it took 0-5 ms more than the
    next ones, about a plain step, at random) and turnover (rows joined or left just before:
    the step runs the batch's cache formed anew). A switch step's cost beyond its width's
    goes to a running average per drafter set (`switch`), which a speculative step chosen
    after plain ones pays, spread over the `horizon` steps it is expected to start; the
    width learns from the steps after it. Turnover costs plain and speculative steps alike:
    its average per batch size is learnt from the plain steps that carried it (`turnover`)
    and taken off the speculative steps that did (plain decoding is most steps and would
    soon forget one; the few probes that price speculation while it trails would carry it
    for long: at 8 rows on an H100 the policy priced every speculative step at 10-15 ms
    where a run of them took 5).

    The first step of a shape (drafters, B, K) may build its kernels (MLX compiles them on a
    GPU at first use: on an H100, 10-40 ms against 3-5 ms a step): a first step costing over
    twice its price is set aside, and the next one of its shape prices it. Kept, it priced
    speculation out for the whole life of a server's engine (every H100 run's first engine
    to speculate decoded plainly at 8 rows with its K = 1 cell at 17 ms and its switch at
    13; the engines after it, in the same process, drafted on 45% (guard on) and 96%
    (guard off) of the steps)."""

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

    def hope(self, rows: int, big_k: int, arms: tuple, catch_up: float = 0.0) -> float | None:
        """The least a step of `rows` rows and K = `big_k` with drafters `arms` may cost where
        its own cell has no steps (None where it has: its prediction stands). Taken from the
        cells of the same drafters that have: a step is no cheaper than one of as many rows
        or fewer drafting fewer (their most expensive), nor than the chord between its
        measured neighbours at its batch size, nor than its plain step and, for drafters
        that run a pass per draft (`BatchDraftPolicy`'s `chained`), its drafts' passes at
        their measured cost (`draft_seconds`): on an H100 a lone row's MTP head costs
        nearly a plain step per draft, and a width never run, hoped to cost a plain step,
        had its exploring steps run K = 7 and 8 at several plain steps each. The line stands in
        for such a cell when choosing; it is fitted to the widths that ran, and a CPU's
        widths are far from a line (a 2-core x86 at B = 1: K = 1 costs 1.75 plain steps,
        K = 6 2.5): fitted to K = 1 and 2, it prices K = 6 at 4 plain steps, and a width so
        priced never runs, so never corrects it. This estimate errs the other way: a width it
        makes look best is worth one step to measure (`BatchDraftPolicy._choose`)."""
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
        rows); where the set never drafted alone (a group's rows drafting with a model
        drafter and the n-gram lookup: only sets of chained drafters are measured), the
        dearest of its drafters' own (a step is no cheaper than its chained drafter's
        passes; without it such a set's widths were hoped to cost a plain step); 0 where
        none was (or no drafter is chained)."""
        own = self._drafting_at(rows, arms)
        if own is not None or len(arms) < 2:
            return own or 0.0
        return max((self._drafting_at(rows, (arm,)) or 0.0 for arm in arms), default=0.0)

    def _drafting_at(self, rows: int, arms: tuple) -> float | None:
        sizes = [b for a, b in self.drafting if a == arms and b <= rows]
        return self.drafting[arms, max(sizes)] if sizes else None

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
            old = self.plain.get(rows)
            if disturbed and old is not None:
                spent = max(0.0, seconds - old)
                before = self.turnover.get(rows)
                self.turnover[rows] = spent if before is None else ema(before, spent, self.alpha)
            else:
                self.plain[rows] = seconds if old is None else ema(old, seconds, self.alpha)
            self._solved.clear()
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
        if not catch_up:  # a catch-up's cost is the line's to place (c3), not the cell's
            cell = self.cells.setdefault((arms, rows, big_k), [0.0, 0.0])
            cell[0], cell[1] = self.decay * cell[0] + extra, self.decay * cell[1] + 1.0
        self._solved.clear()
        x = np.array([1.0, big_k, big_k * rows, catch_up])
        xtx, xty = self.fits.get(arms, (np.zeros((4, 4)), np.zeros(4)))
        self.fits[arms] = (self.decay * xtx + np.outer(x, x), self.decay * xty + x * extra)
        return False


class _Guard:
    """What each drafter adds, against decoding without it, per batch size.

    The step costs the policy predicts leave out what only shows over many steps: the
    model drafters' catch-ups and joins as rows come and go, a pipeline of plain steps
    broken by each speculative one, rows out of step. So steps run in windows of `window`
    steps, and in each, every drafter the rows have is either allowed (the policy may draft
    with it) or barred (it may not: the rows draft with their other drafters, or decode
    plainly where every one is barred). Per batch size and drafter, the guard keeps the
    tokens per second of the steps where it was allowed and of those where it was barred
    (decayed by `decay` per step; speculative and plain steps alike). What a switch costs
    is the allowed side's: a drafter's first steps after barred ones pay its backlog, and
    the first `settle` steps after it is barred again still count as allowed (they pay
    what it left behind: a pipeline to start again, rows out of step). The side that
    realised more leads; the other runs one window in every `|ratio - 1| / budget`
    (`least` .. `most`), so that it stays measured at an expected cost of about `budget`
    of the time. A batch size with no barred windows yet runs one after `first` allowed
    ones (a size that persists, not one passed through).

    Each drafter keeps its own schedule, so a lone drafter is judged against plain
    decoding, and a group's drafters each against the others: mostly, where the n-gram
    lookup leads and the MTP head trails, the head's windows add it to the lookup and its
    barred windows are the lookup alone (what the head adds, with its joins and
    catch-ups), and the lookup's barred windows are plain decoding.

    A window is a bitmask of the drafters barred (`BatchChoice.window`; 0: none).
    """

    def __init__(self, window=16, settle=4, budget=0.01, least=4, most=64, decay=0.98, first=3):
        self.window, self.settle, self.budget, self.decay = window, settle, budget, decay
        self.least, self.most, self.first = least, most, first
        # (B, drafter, allowed) -> decayed tokens, seconds, steps
        self.rates: dict[tuple[int, int, bool], list[float]] = {}
        self.since: dict[tuple[int, int], int] = {}  # (B, drafter) -> windows since it trailed
        # (B, drafter) -> decayed allowed steps that drafted with it, until `least` of them
        # have: then it is in `drafted`, and judged whatever its allowed steps draft (the
        # policy decoding plainly where it may draft costs the asks and probes)
        self.drafting: dict[tuple[int, int], float] = {}
        self.drafted: set[tuple[int, int]] = set()
        self.arms: tuple = ()  # the drafters the current window's rows have
        self.barred = 0  # the current window's barred drafters (a bitmask)
        self.left = 0  # its steps still to run
        self.unsettled: dict[int, int] = {}  # drafter -> barred steps still counted as allowed

    def ratio(self, rows: int, arm: int, drafted: bool = False) -> float | None:
        """Tokens per second of the steps with drafter `arm` allowed over those with it
        barred at `rows` rows (or a size one away, where `rows` has not both); None where
        neither has (`drafted`: or where its allowed steps have not yet drafted with it
        `least` times, decayed: `drafted`)."""
        for b in sorted((rows, rows - 1, rows + 1), key=lambda b: (abs(b - rows), -b)):
            on, off = self.rates.get((b, arm, True)), self.rates.get((b, arm, False))
            if on and off and min(on[2], off[2]) >= 4 and on[1] and off[1]:
                if drafted and (b, arm) not in self.drafted:
                    return None
                return (on[0] / on[1]) / (off[0] / off[1])
        return None

    verdict = ratio  # `BatchDraftPolicy.join_pays`: what taking a row into a drafter pays

    def holds(self, arms: tuple) -> bool:
        """Whether the next step runs on in the current window (drafters `arms` as its own):
        `window_for` then answers its bitmask, judging nothing."""
        return self.left > 0 and arms == self.arms

    def window_for(self, rows: int, arms: tuple) -> int:
        """The drafters barred for the next step, of `rows` rows with drafters `arms` (a
        bitmask). A drafter new to the window (a row that joined with it) is judged at
        once; the others keep their side until the window ends."""
        fresh = self.left <= 0
        if fresh or arms != self.arms:
            barred = 0
            for arm in arms:
                was = bool(self.barred >> arm & 1)
                bar = was if not fresh and arm in self.arms else self._bars(rows, arm)
                if bar and not was:  # its first barred steps still count as allowed
                    self.unsettled[arm] = self.settle
                elif not bar:
                    self.unsettled.pop(arm, None)
                barred |= bar << arm
            self.arms, self.barred = arms, barred
            if fresh:
                self.left = self.window
        self.left -= 1
        return self.barred

    def _bars(self, rows: int, arm: int) -> bool:
        """Whether drafter `arm` is barred in the window starting now (its schedule moves
        on by one window)."""
        # Until its allowed steps have drafted with it (the policy's own choice: a lone
        # row's first windows come before its probes), they weigh plain steps against plain
        # steps, and its joins: no verdict (a lone row's MTP head on a 2-core x86, 1.2x of
        # plain decoding once drafting, was barred through a whole run by two such windows
        # and the joins charged to them).
        ratio = self.ratio(rows, arm, drafted=True)
        if ratio is None:
            lead, every = False, self.first
        else:
            lead = ratio < 1.0
            every = int(min(self.most, max(self.least, abs(ratio - 1.0) / self.budget)))
        behind = self.since.get((rows, arm), 0) + 1
        self.since[rows, arm] = behind if behind < every else 0
        return lead if behind < every else not lead

    def observe(
        self, rows: int, barred: int, tokens: int, seconds: float, drafted=frozenset()
    ) -> None:
        """A step of `rows` rows ran with drafters `barred` (a bitmask; `drafted`: those its
        rows drafted with): it counts for each drafter of the window's rows, on its side."""
        d = self.decay
        for arm in self.arms:
            allowed = not barred >> arm & 1
            if not allowed and self.unsettled.get(arm, 0) > 0:
                self.unsettled[arm] -= 1
                allowed = True
            entry = self.rates.setdefault((rows, arm, allowed), [0.0, 0.0, 0.0])
            entry[:] = [d * entry[0] + tokens, d * entry[1] + seconds, d * entry[2] + 1.0]
            if allowed and (rows, arm) not in self.drafted:
                count = d * self.drafting.get((rows, arm), 0.0) + (arm in drafted)
                self.drafting[rows, arm] = count
                if count >= self.least:
                    self.drafted.add((rows, arm))

    def charge(self, rows: int, arm: int, seconds: float) -> None:
        """Time drafter `arm` spent beside the steps at `rows` rows (taking rows in: no step
        without it would have it), with no tokens: its allowed side's."""
        entry = self.rates.setdefault((rows, arm, True), [0.0, 0.0, 0.0])
        entry[1] += seconds


@dataclass
class BatchChoice:
    """K for the step and, per row, (arm or None, k)."""

    num_draft: int
    rows: list[tuple[int | None, int]]
    probe: bool = False
    catch_up: int = 0  # the catch-up tokens of the step (see `_Costs`)
    only: int | None = None  # the one drafter a group's rows draft with (None: each its best)
    # The guard's window the step runs in (`_Guard`): a bitmask of the drafters barred from
    # it (0: none; every drafter the rows have: plain decoding, the policy unasked), or None
    # (the guard stood aside: no row can draft, one drafts a fixed k, or a lone row whose
    # drafters are not watched alone).
    window: int | None = None
    # Why the policy chose it (`batch_engine.py --trace` reports the time of each): "best"
    # (the plan it rates best; a plain step where that is plain decoding), "explore" (an
    # exploring step: another width or drafter), "probe", "follow" (the step after a switch
    # out of plain decoding, repeating its plan to price its width).
    why: str = "best"
    # What the policy priced the step at: (tokens, seconds) of its plan as the cost model and
    # the acceptance estimates have them (a catch-up's cost spread as when choosing), or None
    # (a follow step, a drafter tried for the first time): `StepTrace` keeps it beside what
    # the step realised, so that a trace shows how well the policy's prices hold.
    expected: tuple[float, float] | None = None


class BatchDraftPolicy:
    """Online choice of the batch's draft length (and each row's drafter).

    Args:
        arms: the drafters' names.
        max_draft: K at most.
        prior_accept, prior_weight, decay: the acceptance estimates, as `AdaptiveDraftLength`.
        margin: speculation must promise this much more than plain decoding to be taken up,
            and half as much to be kept.
        probe_min, probe_max, probe_budget: plain steps between probes while speculation loses:
            doubling from probe_min up to probe_max, or beyond where a probe's expected loss
            would exceed `probe_budget` of the time between probes.
        explore_every: every this many speculative steps, another K (of 1 .. best + 1, the
            one whose own cost is least known) runs instead, so that the cost model sees
            every width it might choose.
        horizon: the speculative steps a catch-up is expected to serve (its cost is spread
            over them when choosing), until measured: per set of drafters that catch up,
            the steps they went on drafting after their catch-ups (`_horizon`, a decayed
            mean behind this prior of weight 2); never more than the catching-up rows have
            left (`_serves`). In a group at 8 rows on a 2-core x86 the
            MTP head went on drafting for far fewer than 8 steps after most of its
            catch-ups, priced at an eighth of their cost a step, which took 7-27% of the
            runs (`batch_engine.py --keep-prompt-cache --trace`).
        min_share, probe_join, use_decay: `join_pays` (see the module): the share of steps
            (decayed by `use_decay` per step of the same batch size) below which a joining
            row skips a model drafter, and every how many skipped rows one joins anyway
            (more of them where the guard found the drafter's steps realising less: see
            `join_pays`).
        guard: check each drafter's steps against steps without it over windows of steps
            (`_Guard`), and bar it where they realise less, at `guard_from` rows or
            more (a lone row has no rows out of step; what the guard would measure there
            of a drafter whose whole cost is in its steps, the n-gram lookup, is how the
            last request's text suited it, not the next one's), and at fewer rows for the
            drafters in `alone`.
        alone: the drafters the guard watches for a lone row too: model drafters, whose
            joins, catch-ups and pipeline restarts fall outside the step costs the policy
            weighs (on an H100 a lone row's draft model and MTP head, each drafting on
            steps the step costs priced as gains, ran at 0.74x and 0.80x of plain decoding
            through the server, where a lone row's speculative step costs about two plain
            ones whatever it drafts).
        chained: the drafters that run a pass per draft (a draft model, an MTP or EAGLE
            head): their measured seconds per draft bound what a width never run may cost
            (`_Costs.hope`; `observe`'s `drafting`).
        join_budget: a row joins a model drafter where the drafter's measured cost of
            taking rows in, for as many rows as the batch has, stays within a third of this
            share of the plain time of the row's expected life, and within all of it where
            the policy has hardly run at that size (`join_pays`); 0: never.
        recheck: while plain decoding wins, the rows' asks unchanged (the same rows, drafters
            and drafts to be had) and no probe due, the full comparison runs every this many
            steps only (the others repeat its answer): speculation grows no likelier as its
            catch-up piles up and the rows' budgets shrink, and weighing every K of every
            drafter each step costs the host time a CPU's passes share.
        own_weight: a row's acceptance level for a drafter (`_level`) is its kept drafts
            against what the drafter's acceptance over all rows expects of the positions it
            reached, each side with this many pseudo-drafts kept as expected (0: every row
            at the drafter's acceptance).
        every_row: in a closed batch (`closed`: every slot taken, nothing waiting), take a
            plan only where every row is expected to gain by it, and neither probe nor
            explore (see the module); False: by rate, as any batch.
        closed_hold: while a closed batch finds no such plan, the steps the engine holds
            it to plain decoding without asking its rows (`BatchEngine._closed_choice`; the
            hold grows as its steps without a plan mount, `BatchEngine._hold_steps`).

    The search over K stops past best + 1 at a K whose best plan promises under
    `stop_below` (0.85) of the best rate, and never goes beyond what a row can draft.
    """

    def __init__(
        self,
        arms: list[str],
        max_draft: int = 8,
        *,
        prior_accept: float = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.97,
        margin: float = 0.03,
        probe_min: int = 4,
        probe_max: int = 32,
        probe_budget: float = 0.01,
        explore_every: int = 8,
        horizon: int = 8,
        min_share: float = 0.25,
        probe_join: int = 8,
        use_decay: float = 0.95,
        recheck: int = 4,
        guard: bool = True,
        guard_from: int = 2,
        join_budget: float = 0.03,
        alone=(),
        chained=(),
        own_weight: float = 2.0,
        every_row: bool = True,
        closed_hold: int = 16,
    ):
        self.arms, self.max_draft = list(arms), max_draft
        # A closed batch (`closed`, set by the engine each step: every slot taken, nothing
        # waiting to join) drafts only where every row gains (see the module).
        self.closed, self.every_row, self.closed_hold = False, every_row, closed_hold
        self.hits = [[0.0] * max_draft for _ in arms]
        self.trials = [[0.0] * max_draft for _ in arms]
        self.prior_accept, self.prior_weight, self.decay = prior_accept, prior_weight, decay
        self.margin = margin
        self.probe_min, self.probe_max, self.probe_budget = probe_min, probe_max, probe_budget
        self.explore_every, self.horizon = explore_every, horizon
        self.costs = _Costs(decay, horizon=horizon)
        self._follow: list | None = None  # the rows of the switch step just observed (`_choose`)
        self._plain_seen = 0  # plain steps measured (the first ones set the cost prior)
        self._speculating = False
        self._since_spec = 0
        self._probe_every = probe_min
        self._steps = 0  # speculative steps chosen for their rate
        self.recheck = recheck
        self.stop_below = 0.85
        self.thin = 8.0  # rounds reaching a drafter's first draft, below which it is a guess
        self._quiet: list | None = None  # [the asks' signature, plain steps it still answers]
        self.min_share, self.probe_join, self.use_decay = min_share, probe_join, use_decay
        # Per batch size: per arm, [decayed steps where a row could draft with it, decayed
        # steps drafting with it].
        self._use: dict[int, list] = {}
        self._offered: set[int] | None = None  # the arms the last choice's rows had (None: all)
        self._turned_away = [0] * len(self.arms)  # rows that skipped each arm since one joined
        self.guard = _Guard() if guard else None
        self.guard_from, self.join_budget = guard_from, join_budget
        self.alone = frozenset(alone)
        self.chained = frozenset(chained)
        self._backlogging = self.alone | self.chained  # drafters that pile up a backlog
        self._built: set[int] = set()  # drafters whose first join (compiling) went uncharged
        self._join_cost: dict[int, float] = {}  # arm -> seconds per token fed at joining
        self._joins: dict[int, int] = {}  # arm -> joins timed
        self._joined: dict[int, float] = {}  # arm -> join seconds not yet charged to the guard
        # Drafters that caught up -> (decayed steps they drafted after, decayed catch-ups),
        # and the run since the last catch-up ([drafters, steps]) (`_horizon`).
        self._served: dict[tuple, tuple[float, float]] = {}
        self._serving: list | None = None
        self.own_weight = own_weight
        # A closed batch's runs of speculative steps: drafters -> (decayed steps, decayed
        # runs), and the run going on ([drafters, steps]) (`_desync`).
        self._closed_runs: dict[tuple, tuple[float, float]] = {}
        self._closed_run: list | None = None

    # --- estimates ---------------------------------------------------------------------------

    def acceptance(self, arm: int) -> list[float]:
        return chain_acceptance(
            self.hits[arm], self.trials[arm], self.prior_accept, self.prior_weight
        )

    @staticmethod
    def shape(rows: list[tuple[int | None, int]]) -> tuple[int, int, tuple]:
        """(B, K, drafters drafting) of a step where row i drafts k_i with arm a_i."""
        big_k = max((k for _, k in rows), default=0)
        arms = tuple(sorted({a for a, k in rows if a is not None and k > 0}))
        return len(rows), big_k, arms

    def _plan(
        self,
        asks: list[RowAsk] | _Merged,
        big_k: int,
        gains,
        force: int | None = None,
        only: int | None = None,
    ) -> tuple[list, float]:
        """Each row's (arm, k) at batch K = big_k, and the tokens the step would emit. A row
        that may use several drafters takes the one with the most tokens per second of a
        step where it alone drafts (`force`: that arm, where the row may use it and it has
        drafts; `only`: that arm or none, where the row may use it). `gains[arm][k]`: E(k)
        of each arm."""
        merged = asks if isinstance(asks, _Merged) else _Merged(asks)
        plan, tokens = self._merged_plan(merged, big_k, gains, force, only)
        return merged.rows(plan), tokens

    def _merged_plan(self, merged: _Merged, big_k: int, gains, force=None, only=None):
        """`_plan` per distinct ask: (one (arm, k) per distinct ask, tokens)."""
        plan, tokens = [], 0.0
        for ask, count in zip(merged.distinct, merged.counts, strict=True):
            choice, gain = self._row_plan(ask, big_k, gains, merged.size, force, only)
            plan.append(choice)
            tokens += gain * count
        return plan, tokens

    def _row_plan(
        self,
        ask: RowAsk,
        big_k: int,
        gains,
        batch: int,
        force: int | None = None,
        only: int | None = None,
    ) -> tuple[tuple, float]:
        choice, gain, score = (None, 0), 1.0, 0.0
        target = ask.fixed if ask.fixed is not None else big_k
        arms, available, levels = ask.arms, ask.available, ask.levels
        # The drafters it may take (`only`, then `force`, narrow them), by index into `arms`
        # (a choice weighs every K of every plan: no copies of the ask).
        ways = range(len(arms))
        if only is not None and len(arms) > 1 and only in arms:
            ways = [arms.index(only)]
        if force is not None and force in [arms[i] for i in ways]:
            avail = available[arms.index(force)]
            if min(target, ask.limit, self.max_draft if avail is None else avail) > 0:
                ways = [arms.index(force)]
        several = len(ways) > 1
        for i in ways:
            arm, avail = arms[i], available[i]
            k = min(target, ask.limit, self.max_draft if avail is None else avail)
            if k <= 0:
                continue
            g = gains.of(arm, levels[i] if levels else 0)[k]
            s = g / self.costs.seconds(batch, k, (arm,)) if several else g
            if choice[0] is None or s > score:
                choice, gain, score = (arm, k), g, s
        return choice, gain

    def _gains(self, hopeful: bool = False) -> _Gains:
        """E(k) for k = 0..max_draft, per arm (and acceptance level: `_Gains`); `hopeful`:
        for an arm with fewer than `thin` rounds behind it, from each position's acceptance
        plus 1 / sqrt(rounds that reached it + the prior's weight), at most 0.95 (what a few
        unlucky rounds may hide)."""
        out = []
        for arm in range(len(self.arms)):
            acceptance = self.acceptance(arm)
            if hopeful and self.trials[arm][0] < self.thin:
                acceptance = [
                    max(a, min(0.95, a + (t + self.prior_weight) ** -0.5))
                    for a, t in zip(acceptance, self.trials[arm], strict=True)
                ]
            out.append(acceptance)
        return _Gains(out, self.max_draft)

    def _level(self, own, acceptance: list[float]) -> int:
        """A row's acceptance level for a drafter (`_Gains.of`) from its own counts
        (`RowAsk.own`): its kept drafts against what the drafter's acceptance over all rows
        (`acceptance`, by position) expects of the positions it reached, behind
        `own_weight` pseudo-drafts kept as expected; their ratio rounded to `LEVELS` steps
        per doubling (rows alike then ask alike and merge: `_Merged`), from an eighth to
        twice."""
        if not self.own_weight:
            return 0
        hits, trials = own
        expected = sum(t * a for t, a in zip(trials, acceptance, strict=False))
        ratio = (sum(hits) + self.own_weight) / (expected + self.own_weight)
        return int(max(-3 * LEVELS, min(LEVELS, round(LEVELS * math.log2(ratio)))))

    def _prepare(self, asks: list[RowAsk]) -> None:
        """Each row's acceptance levels (`RowAsk.levels`); each drafter's acceptance is
        worked out once for all the rows."""
        acceptance: dict[int, list[float]] = {}
        for ask in asks:
            if not ask.own:
                continue
            levels = []
            for arm, own in zip(ask.arms, ask.own, strict=True):
                if own is not None and arm not in acceptance:
                    acceptance[arm] = self.acceptance(arm)
                levels.append(0 if own is None else self._level(own, acceptance[arm]))
            ask.levels = levels

    @staticmethod
    def catch_up(asks: list[RowAsk], rows: list[tuple[int | None, int]]) -> int:
        """W of a step: per model drafter, its drafting rows times how far the longest
        backlog among them exceeds the step's K (a speculative step's own emitted tokens
        are no catch-up; the first pass is as wide as its longest row)."""
        groups = []
        for ask, row in zip(asks, rows, strict=True):  # no backlog given: none
            groups.append((row, 1, dict(zip(ask.arms, ask.backlog, strict=False))))
        return _catch_up(groups)

    def _rate(self, asks, rows: list[tuple[int | None, int]], tokens: float) -> float:
        shape = self.shape(rows)
        horizon = self._serves(asks, rows, shape, tokens)
        spread = self.catch_up(asks, rows) / horizon
        return tokens / self.costs.seconds(*shape, spread)

    def _serves(self, asks, rows, shape: tuple, tokens: float) -> float:
        """The speculative steps a catch-up of the plan (`rows`, one (arm, k) per ask) is
        spread over: its drafters' measured horizon (`_horizon`), at most the steps its
        catching-up rows have left, their budgets (`RowAsk.left`) at the plan's tokens a
        row. A row near its end cannot repay a catch-up over eight steps: at 5 rows on a
        2-core x86, the end of an 8-client burst, a group's step that fed the draft model
        171 tokens of history took 92 ms against a plain step's 12, priced as if the rows
        had a horizon's steps to go."""
        horizon = self._horizon(shape[2])
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

    def _backlogged(self, arms: tuple) -> tuple:
        """The drafters of `arms` that pile up a backlog while they sit out (model
        drafters; all of `arms` where the policy was told of none)."""
        known = self._backlogging
        return tuple(a for a in arms if a in known) if known else arms

    def _horizon(self, arms: tuple) -> float:
        """The speculative steps a catch-up of drafters `arms` is expected to serve: the
        steps they went on drafting after their catch-ups (a decayed mean behind
        `horizon`, weight 2), within 1 .. `horizon`."""
        served = self._served.get(self._backlogged(arms))
        if served is None:
            return float(self.horizon)
        steps, runs = served
        mean = (2.0 * self.horizon + steps) / (2.0 + runs)
        return min(float(self.horizon), max(1.0, mean))

    def _follow_catch_up(self, arms: tuple, catch_up: int) -> None:
        """Count the steps drafters go on drafting after a catch-up (`_horizon`): a step
        with a catch-up starts a run (ending the last), a step drafting with every drafter
        of the run and catching up none extends it, any other step ends it."""
        run, key = self._serving, self._backlogged(arms)
        if run is not None and not catch_up and key and set(run[0]) <= set(key):
            run[1] += 1
            return
        if run is not None:
            self._tally(self._served, run)
        self._serving = [key, 1] if catch_up and key else None

    def _tally(self, ended: dict, run: list) -> None:
        """Add a run that ended ([drafters, steps]) to `ended`'s decayed (steps, runs) of its
        drafters."""
        steps, runs = ended.get(run[0], (0.0, 0.0))
        ended[run[0]] = (self.decay * steps + run[1], self.decay * runs + 1.0)

    # --- choice ------------------------------------------------------------------------------

    def barred(self, size: int, offered: set[int], free: bool) -> BatchChoice | None:
        """The next step's choice without the rows' asks, where the guard's running window
        bars every drafter the rows have (`offered`; `free`: no row drafts a fixed k): plain
        decoding, whatever they would ask, as `choose` would answer. None where the asks are
        needed (a window starts, the rows' drafters changed, or one is allowed). The asks
        are a host's work per row and step (an n-gram lookup, each drafter's backlog): on a
        GPU a small model's plain step is about as short, and the guard's plain windows are
        most of the steps where speculation does not pay. Where no row has a drafter
        (speculation off), plain decoding too, as `choose` would answer their asks (8 rows'
        asks and their weighing were 0.8% of plain decoding's time on a 2-core x86)."""
        if not offered:
            self._offered, self._follow, self._quiet = set(), None, None
            return BatchChoice(0, [(None, 0)] * size)
        guard = self.guard
        if not (free and guard is not None):
            return None
        arms = self._watched(size, offered)
        if len(arms) < len(offered):  # a drafter the guard does not judge here may draft
            return None
        if self._plain_seen < 2 or not guard.holds(arms):
            return None
        if any(not guard.barred >> arm & 1 for arm in arms):
            return None
        self._offered = set(offered)
        return BatchChoice(0, [(None, 0)] * size, window=guard.window_for(size, arms))

    def _watched(self, size: int, offered: set[int]) -> tuple:
        """The drafters of `offered` the guard judges at batches of `size` rows."""
        if self.guard is None:
            return ()
        if size < self.guard_from:
            offered = offered & self.alone
        return tuple(sorted(offered))

    def choose(self, asks: list[RowAsk]) -> BatchChoice:
        self._prepare(asks)
        self._offered = {arm for ask in asks for arm in ask.arms}
        free = all(ask.fixed is None for ask in asks) and any(ask.arms for ask in asks)
        window = None
        watched = self._watched(len(asks), self._offered)
        if watched and free and self._plain_seen >= 2:
            window = self.guard.window_for(len(asks), watched)
            asks = [_without(ask, window) for ask in asks]
            if not any(ask.arms for ask in asks):  # every drafter barred: the policy unasked
                return BatchChoice(0, [(None, 0)] * len(asks), window=window)
        choice = self._choose(asks)
        choice.window = window
        return choice

    def _choose(self, asks: list[RowAsk]) -> BatchChoice:
        follow, self._follow = self._follow, None
        if follow is not None and len(follow) == len(asks):
            # A switch step's cost is not its width's: the next step, each row drafting with
            # the same drafter to the same K where it still can, prices the width.
            big_k, rows, gains = max(k for _, k in follow), [], self._gains()
            for ask, (arm, _) in zip(asks, follow, strict=True):
                if ask.fixed is not None:  # (its k whatever the batch's K)
                    rows.append(self._row_plan(ask, big_k, gains, len(asks))[0])
                    continue
                n = 0
                if arm is not None and arm in ask.arms:
                    avail = ask.available[ask.arms.index(arm)]
                    n = min(big_k, ask.limit, self.max_draft if avail is None else avail)
                rows.append((arm, n) if n > 0 else (None, 0))
            if any(n for _, n in rows):
                return self._choice(asks, max(n for _, n in rows), rows, why="follow")
        signature = self._signature(asks)
        quiet = self._quiet
        if quiet is not None and quiet[0] == signature and quiet[1] > 0:
            if self._since_spec < self._probe_every:  # no probe due: the last answer stands
                quiet[1] -= 1
                return BatchChoice(0, [(None, 0)] * len(asks))
        self._quiet = None
        accept = self._gains()
        plain_rows, plain_tokens = self._plan(asks, 0, accept)
        plain_rate = self._rate(asks, plain_rows, plain_tokens)
        if self._plain_seen < 2 or not any(a.arms for a in asks):
            return BatchChoice(0, plain_rows)
        plain_seconds = self.costs.plain_seconds(len(asks))
        # A group's rows each take the drafter that looks best for them alone; a step pays
        # for every drafter its rows use, though (a model drafter's passes for one row that
        # an n-gram lookup cannot serve), so where they mix drafters, each of those drafters
        # alone is a plan too; so is a group drafter no step has used alone yet.
        group = {arm for ask in asks if len(ask.arms) > 1 for arm in ask.arms}
        untried = [arm for arm in sorted(group) if (arm,) not in self.costs.fits]
        merged = _Merged(asks)
        best, plans, unmeasured, hopeful, hoped = None, {}, None, None, 0.0
        held = None  # the best plan that would slow a row behind its pace (`_Merged.slows`)
        calm: dict = {}  # per K, its best plan that no drafter catches up in
        contender = (1 + self.margin) * plain_rate  # what a hope must promise to be tried
        # Only a probe or an exploring step runs a width for its hope: other steps leave it.
        exploring = self._since_spec >= self._probe_every
        exploring = exploring or (self._steps + 1) % self.explore_every == 0
        hopes = self._gains(hopeful=True) if exploring else None
        for big_k in range(1, self._widest(merged.distinct) + 1):
            variants = [None, *untried]
            reach = 0.0  # the most this K may promise (its rate, or its hope where that
            # would make it the one to measure)
            for only in variants:  # grows while it runs
                plan, tokens = self._merged_plan(merged, big_k, accept, only=only)
                shape = merged.shape(plan)
                if only is None and len(shape[2]) > 1:
                    variants += [arm for arm in shape[2] if arm not in variants]
                horizon = self._serves(merged.distinct, plan, shape, tokens)
                spread = merged.catch_up(plan) / horizon
                seconds = self.costs.seconds(*shape, spread)
                rate = tokens / seconds
                if merged.slows(plan, accept, seconds, plain_seconds):
                    # Not for a row already behind its pace, however it pays; a probe alone
                    # may run it (its loss is budgeted), so that the estimates stay measured.
                    if held is None or rate > held[0]:
                        held = (rate, big_k, plan, only)
                    continue
                if exploring:  # what it may do: a width never run here at its least
                    # possible cost, a drafter with few rounds behind it at hopeful acceptance
                    least = self.costs.hope(*shape, spread) or seconds
                    hope = merged.tokens(plan, hopes) / least
                else:
                    hope = 0.0
                if hope > contender:
                    reach = max(reach, hope)
                    if hope > hoped:  # (its rate as the model prices it, K, plan, only)
                        hopeful, hoped = (rate, big_k, plan, only), hope
                reach = max(reach, rate)
                if big_k not in plans or rate > plans[big_k][2]:
                    plans[big_k] = (plan, shape, rate, only)
                if not spread and (big_k not in calm or rate > calm[big_k][2]):
                    calm[big_k] = (plan, shape, rate, only)
                if best is None or rate > best[0]:
                    best = (rate, big_k, plan, only)
                    contender = (1 + self.margin) * max(rate, plain_rate)
                if shape[2] not in self.costs.fits and (unmeasured is None or rate > unmeasured[0]):
                    unmeasured = (rate, big_k, plan, only)
            # Past the best K (and the one above it, which exploring may run), a K whose
            # best plan falls well behind ends the search: tokens grow ever slower with K,
            # a step's cost no slower (weighing every K of every drafter each step costs
            # a CPU's batch a few percent of its time), unless its width never ran and may
            # do better than its price.
            if best is not None and big_k >= best[1] + 2 and reach < self.stop_below * best[0]:
                break
        # A width that never ran at this size, whose least possible cost would make it the
        # best: the exploring steps and probes measure it (each width once; its price is
        # then its own).
        if hoped <= contender:
            hopeful = None
        held_back = best is None  # every plan would slow a row that is behind its pace
        if held_back:
            best = held
        needed = self.margin / 2 if self._speculating else self.margin
        speculate = not held_back and best[0] > plain_rate * (1 + needed)
        why, chosen = "best", None
        closed = self.closed and self.every_row and len(asks) > 1
        if speculate and closed:
            # A closed batch serves its own rows alone: a plan is taken only where every
            # row is expected to gain by it (`_slowest`), the best such plan by rate.
            borne = []
            for big_k, (plan, shape, rate, _) in plans.items():
                spread = self._spread(merged, plan, shape, accept)
                if self._slowest(merged, plan, shape, spread, accept) > 1 + needed:
                    borne.append((rate, big_k))
            speculate, why = bool(borne), "closed"
            chosen = max(borne)[1] if borne else None
        if speculate:
            self._speculating, self._since_spec, self._probe_every = True, 0, self.probe_min
            self._steps += 1
            if chosen is not None:  # (a closed batch: no exploring step, see the module)
                plan, _, rate, only = plans[chosen]
                priced = self._priced(merged, plan, rate, accept)
                return self._choice(
                    asks, chosen, merged.rows(plan), only=only, why="closed", expected=priced
                )
            if self._steps % self.explore_every == 0:  # another K keeps the costs honest
                if hopeful is not None:
                    rows = merged.rows(hopeful[2])
                    priced = self._priced(merged, hopeful[2], hopeful[0], accept)
                    return self._choice(
                        asks, hopeful[1], rows, only=hopeful[3], why="explore", expected=priced
                    )
                arm = self._untried(merged, best, accept)
                if arm is not None and (self._steps // self.explore_every) % 2:
                    rows = self._plan(merged, best[1], accept, arm)[0]
                    return self._choice(asks, best[1], rows, why="explore")
                # A step with a catch-up measures no width (`_Costs.observe`): where a
                # width has a plan without one, that plan explores it.
                plans = {k: calm.get(k, plan) for k, plan in plans.items()}
                big_k = self._explore(best[1], plans)
                plan, _, rate, only = plans[big_k]
                priced = self._priced(merged, plan, rate, accept)
                return self._choice(
                    asks, big_k, merged.rows(plan), only=only, why="explore", expected=priced
                )
            priced = self._priced(merged, best[2], best[0], accept)
            return self._choice(asks, best[1], merged.rows(best[2]), only=best[3], expected=priced)
        self._speculating = False
        if closed and (unmeasured is None or not self._may_bear(merged, unmeasured[2], accept)):
            # No probe but of a drafter set no step has used (its cost a guess), and only
            # where the rule could take it at the least its step may cost: no less than a
            # step of as many rows verifying as many drafts with any set that ran one
            # (`_Costs.floor`). Else, as rows end and join, the batch passes through other
            # sizes, where probes measure it. (Nor of a drafter with few rounds behind its
            # acceptance: a group's model drafters, which its rows seldom prefer to the
            # lookup, stay so, and their probes with catch-ups cost 8 rows on a 2-core x86
            # what the rule saved.)
            return BatchChoice(0, plain_rows, why="closed")
        if self._since_spec >= self._probe_every:
            self._since_spec = 0
            # A set of drafters no step has used is priced by the prior alone (no better
            # than a guess): the probe measures it first; then a width that never ran and
            # may be the best (a lone row's first probes after an unlucky one: K = 1 alone
            # says nothing of the deeper drafts, nor of what wider steps cost). The next
            # probe waits as long as the model's price of this one asks.
            probe = unmeasured or hopeful or best
            self._probe_every = self._next_probe(probe[0], plain_rate)
            # Until a drafter has a few rounds behind its acceptance, that estimate (and the
            # loss it predicts) is a guess: two unlucky probes of a cold start would space
            # the next ones out by hundreds of steps, and a drafter keeping 85% of its
            # drafts stayed unused. Its probes come at least every `probe_max` steps.
            if self._thin(merged.shape(probe[2])[2]):
                self._probe_every = min(self._probe_every, self.probe_max)
            rows = merged.rows(probe[2])
            priced = self._priced(merged, probe[2], probe[0], accept)
            return self._choice(
                asks, probe[1], rows, probe=True, only=probe[3], why="probe", expected=priced
            )
        if signature is not None:
            self._quiet = [signature, self.recheck - 1]
        return BatchChoice(0, plain_rows, why=why)

    def _thin(self, arms) -> bool:
        """Whether a drafter of `arms` has fewer than `thin` rounds behind its acceptance."""
        return any(self.trials[arm][0] < self.thin for arm in arms)

    def _spread(self, merged: _Merged, plan, shape, gains) -> float:
        """The plan's catch-up per step, spread over the steps it serves (`_serves`)."""
        tokens = merged.tokens(plan, gains)
        return merged.catch_up(plan) / self._serves(merged.distinct, plan, shape, tokens)

    def _may_bear(self, merged: _Merged, plan, gains) -> bool:
        """Whether a closed batch could take `plan` of a drafter set no step has used at the
        least its step may cost (`_Costs.hope`, and no less than `_Costs.floor`)."""
        shape = merged.shape(plan)
        spread = self._spread(merged, plan, shape, gains)
        least = self.costs.hope(*shape, spread) or self.costs.seconds(*shape, spread)
        floor = self.costs.floor(shape[0], shape[1])
        least = least if floor is None else max(least, floor)
        return self._slowest(merged, plan, shape, spread, gains, least) > 1 + self.margin

    def _slowest(
        self, merged: _Merged, plan, shape, spread: float, gains, seconds: float | None = None
    ) -> float:
        """What a closed batch's steps drafted as `plan` (per distinct ask) gain its
        unluckiest row over the rows' lives: tokens per second over a plain step's.

        Rows in step end together, as late as the one that kept the fewest drafts, so the
        batch gains by what its unluckiest row keeps, not by a row's mean. A row drafts at
        its share d of the steps (`RowAsk.drafting`: its drafter's share of its recent asks
        with drafts to be had; a row with none now is priced at its drafter's E(k) for when
        it has), so a step gives it 1 + d (E(k) - 1) tokens on average, with variance
        d V(k) + d (1 - d) (E(k) - 1)^2 (E and V at its own acceptance level:
        `_Gains.moments`); a row with no drafter, 1. Over the m steps its shortest-lived
        row has left, the least of B rows' tokens is about the least mean less z_B
        deviations (z_B the expected largest of B standard normals): per step, min mean -
        z_B sqrt(max variance / m). Every row pays the plan's step (`seconds`; default:
        its price)."""
        if seconds is None:
            seconds = self.costs.seconds(*shape, spread)
        plain = self.costs.plain_seconds(shape[0])
        least, wide, life = math.inf, 0.0, math.inf
        for ask, i in zip(merged.asks, merged.of_row, strict=True):
            distinct, (arm, k) = merged.distinct[i], plan[i]
            if arm is None or k <= 0:  # none to be had now: its drafter's at K later
                k = min(shape[1], distinct.limit) if distinct.fixed is None else 0
                levels = {a: distinct.level(a) for a in distinct.arms}
                arm = max(levels, key=lambda a: gains.of(a, levels[a])[k], default=None)
            mean, variance = 1.0, 0.0
            if arm is not None and k > 0:
                tokens, spread_k = gains.moments(arm, distinct.level(arm), k)
                share = ask.share(arm)
                mean = 1.0 + share * (tokens - 1.0)
                variance = share * spread_k + share * (1.0 - share) * (tokens - 1.0) ** 2
            least, wide = min(least, mean), max(wide, variance)
            life = min(life, (ask.left or UNTOLD_LEFT) / mean)
        deficit = largest_normal(merged.size) * math.sqrt(wide / max(life, 1.0))
        seconds += self._desync(merged, plan, shape, life)
        return (least - deficit) * plain / seconds

    @staticmethod
    def _ends(merged: _Merged, plan) -> int:
        """The ends `plan` may put apart in a batch in step: at least three quarters of its
        rows with the same budget left (`RowAsk.left`, none 0) end on one step, and a plan
        puts out of that step the rows of them that draft, but one where all of them do.
        Rows that share a budget by chance among others that do not would end apart anyway,
        at the next plan that drafts (where a wider pass costs little, a closed batch drafts
        nearly every step, and a rule that charged a bare majority, which a K = 1 step
        keeps, held it to plain steps: 0.78x of plain decoding's time where it took 0.68x).
        Of 8 rows of equal requests whose last request came a step after the others (a burst
        of clients, 7 of them prefilled together), the 7 end together under plain decoding,
        and their clients' next requests join together (uncharged, such a batch on a 2-core
        x86 took a lookup step about 16 steps in, once or twice a run, about even by itself,
        and its runs spent 6% of their time with fewer than 8 rows against plain decoding's
        4-5%)."""
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

    def _desync(self, merged: _Merged, plan, shape: tuple, life: float) -> float:
        """Seconds a closed batch's speculative step of `plan` is charged for the rows it
        puts out of step (`_ends`). Rows in step end on one step, and their clients' next
        requests join together; a row put ahead ends alone (a step of rows leaving, a
        pipeline started again) and its client's next request is prefilled alone, a pass
        of its own. So each such end costs a step's turnover (`_Costs.turnover_seconds`)
        and a lone row's plain pass, once; what repays it is the run of speculative steps
        the plan starts, as long as a closed batch's runs with its drafters last (a decayed
        mean, `_follow_closed_run`), at most the rows' `life`: the charge is spread over
        those steps. Not before such a run was measured (the first runs measure it).

        On a 2-core x86 at 8 rows, 8 clients of equal requests through the server: once or
        twice a run a closed batch's n-gram lookup found matches for most rows and took a
        K = 1 step and one more after it, each about even or better by itself; with the
        rows' ends put apart, the runs spent 8% of their time with fewer than 8 rows against
        4% for plain decoding, and ran about 1% slower (charged, none was taken, and the
        tail was plain decoding's 4%). Where a closed batch's runs last (a memory-bound
        GPU, every row drafting every step), the charge is spread over the rows' life, and
        in step or not, the batch drafts."""
        runs = self._closed_runs.get(shape[2])
        ends = 0 if runs is None else self._ends(merged, plan)
        if not ends:
            return 0.0
        each = self.costs.turnover_seconds(shape[0]) + self.costs.plain_seconds(1)
        return ends * each / max(1.0, min(life, runs[0] / runs[1]))

    def _follow_closed_run(self, rows: int, shape: tuple) -> None:
        """Count a closed batch's runs of speculative steps (`_desync`): a speculative step
        of a closed batch starts a run (with its drafters) or extends it; any other step
        ends it."""
        run = self._closed_run
        if self.closed and self.every_row and rows > 1 and shape[1]:
            if run is None:
                self._closed_run = [shape[2], 1]
            else:
                run[1] += 1
            return
        if run is not None:
            self._tally(self._closed_runs, run)
            self._closed_run = None

    @staticmethod
    def _signature(asks: list[RowAsk]) -> tuple | None:
        """What of the rows' asks can make speculation newly worth it: their drafters, the
        drafts each can have (an n-gram lookup that found a match) and whether it is behind
        its pace; None where a row has a fixed k (it drafts whatever the batch's K)."""
        if any(ask.fixed is not None for ask in asks):
            return None
        return tuple((tuple(a.arms), a.limit > 0, tuple(a.available), a.behind) for a in asks)

    def _widest(self, asks: list[RowAsk]) -> int:
        """The largest K that changes a plan (at least 1): beyond what any row can draft
        (its budget, its lookup's match), every K plans the same step."""
        most = 1
        for ask in asks:
            if ask.fixed is None:
                for avail in ask.available:
                    most = max(most, min(ask.limit, self.max_draft if avail is None else avail))
        return min(most, self.max_draft)

    def _untried(self, merged: _Merged, best: tuple, accept) -> int | None:
        """Of the drafters rows may choose between (a group), the least tried one that the
        best plan (`best`: its rate, K, plan) leaves out and that is worth a step to measure,
        or None. A row of a group drafts with the arm whose acceptance and cost look best;
        an arm that is never run is never measured (a cheap n-gram lookup behind an MTP head
        whose prior looked better), so exploring steps alternate between another K and such
        an arm: one with fewer than `thin` rounds behind its acceptance (a guess), or one
        that can draft without catching up first. A model drafter the plans leave out piles
        up a backlog (every token decoded since it last drafted): forced into a step once
        its acceptance is known, it fed that backlog for every row on each of those steps
        and measured nothing new (a group of 8 rows on a 2-core x86: up to 8% of a run
        in such steps, at under half the lookup's tokens per second)."""
        used = {arm for arm, k in merged.rows(best[2]) if arm is not None and k > 0}
        group = {arm for ask in merged.distinct if len(ask.arms) > 1 for arm in ask.arms}
        eligible = []
        for arm in group - used:
            if self.trials[arm][0] >= self.thin:
                forced = self._merged_plan(merged, best[1], accept, force=arm)[0]
                if merged.catch_up(forced) > 0:
                    continue
            eligible.append(arm)
        if not eligible:
            return None
        return min(eligible, key=lambda arm: (self.trials[arm][0], arm))

    def _explore(self, best: int, plans: dict) -> int:
        """The K an exploring step runs: of 1 .. best + 1 (best excluded), the one whose own
        cost is least known (its cell has the least weight; the nearest to `best` among
        equals). The line alone can price a width wrongly for good: fitted to K = 2 .. 4, it
        made K = 1 look dear at B = 8 on a 2-core CPU, where a step of K = 1 costs far less
        than the line says, so K = 1 never ran and never corrected it. `plans`: each K's
        (plan, shape, rate, only), as `choose` planned them."""
        candidates = [k for k in range(1, best + 2) if k != best and k in plans]
        if not candidates:
            return best

        def known(big_k: int) -> tuple[float, int]:
            b, k, arms = plans[big_k][1]
            cell = self.costs.cells.get((arms, b, k))
            return (0.0 if cell is None else cell[1], abs(big_k - best))

        return min(candidates, key=known)

    def _choice(
        self,
        asks,
        big_k: int,
        rows,
        probe: bool = False,
        only=None,
        window=None,
        why="best",
        expected=None,
    ) -> BatchChoice:
        catch_up = self.catch_up(asks, rows)
        return BatchChoice(big_k, rows, probe, catch_up, only, window, why, expected)

    @staticmethod
    def _priced(merged: _Merged, plan: list, rate: float, gains: _Gains):
        """(tokens, seconds) of a plan the policy rated `rate` tokens per second."""
        tokens = merged.tokens(plan, gains)
        return (tokens, tokens / rate) if rate > 0 else None

    def replan(self, asks: list[RowAsk], choice: BatchChoice) -> BatchChoice:
        """The rows' drafts for the K already chosen, from asks made since (no new choice)."""
        self._prepare(asks)
        if choice.window:
            asks = [_without(ask, choice.window) for ask in asks]
        rows = self._plan(asks, choice.num_draft, self._gains(), only=choice.only)[0]
        return self._choice(
            asks,
            choice.num_draft,
            rows,
            choice.probe,
            choice.only,
            choice.window,
            choice.why,
            choice.expected,
        )

    def join_pays(
        self,
        arm: int,
        rows: int,
        probe: bool = True,
        tokens: int = 0,
        life: float = 0.0,
        always_cheap: bool = True,
        late: bool = False,
    ) -> bool:
        """Whether a row joining a batch of `rows` rows should feed drafter `arm` its prompt
        (`tokens` of it), to decode `life` more tokens; `late`: a row of the batch that left
        the drafter out at joining, to feed it its whole sequence so far.

        - A late join (`tokens` told) that would cost more than `join_budget` of the plain
          time of the row's `life` left (`_repays`): never. Whatever the drafter does at
          that size, a row near its end cannot earn a history's feed back: at the end of a
          burst of 8 equal requests on a 2-core x86, the last row took in the draft model
          and the MTP head (150 tokens, 17 ms, two plain steps of its own) with 2 tokens
          left.

        - Where the join costs, for as many rows as the batch holds, at most a third of
          `join_budget` of the plain time of the row's expected life (`_cheap`), and
          `always_cheap`: always. (Not so for a state the prompt cache saved, nor a row
          that left the drafter out taking it in late: those are judged by what the
          drafter does at that size alone, below. A saved state costs nothing to take in,
          and a row joined to a drafter costs the steps the policy weighs it in, its
          catch-ups and its probes.) It
          keeps the drafter at hand for the policy and the guard to use step by step, which
          a row turned away at its start never is: a lone user's MTP head (one layer over
          the prompt to join), judged by the hard openings of the first requests' text, was
          turned away from every later request (0.97-1.05x of plain decoding on a 2-core
          CPU, where drafting two a step throughout gave 1.09-1.18x).
        - Where the guard has measured, at that size, the steps with the drafter allowed
          against those with it barred: whether they realised at least as much (their joins
          counted) and the policy drafted with it in at least `min_share` of its recent
          steps there (else both sides were plain steps).
        - Else, where the policy has a few recent steps of that size that could draft with
          it: whether it drafted with it in at least `min_share` of them. A cheap join is no
          reason: a lone user's draft model on a fast 2-core CPU was fed every request's
          prompt (under 3% of the request's plain time each) for steps the policy then
          decoded plainly but for its probes, 0.95-0.97x of plain decoding through HTTP.
        - Else (a size it has hardly run at): where the join is cheap (`_cheap`), and
          otherwise where `_predicts` says drafting with it pays there.

        With `probe`, every `probe_join`-th row it turns away joins anyway, so that the
        drafter stays measured: a lone user's next request is not judged for good by one
        hard stretch of text. Where the guard's verdict is that the drafter loses, a join
        buys less (its cost, and steps that keep measuring a known loss): every
        `probe_join * (1 - ratio) / 0.05`-th row, at most every `probe_join`-th squared (a
        verdict of 0.8: every 32nd). A size the batch passes through on its way down (8
        rows, then 7 as a row ends) is thus priced, not joined blindly: a late join feeds
        the drafter a whole history."""
        if late and tokens > 0 and not self._repays(arm, rows, tokens, life):
            return False
        if always_cheap and self._cheap(arm, rows, tokens, life, self.join_budget / 3):
            return True
        guarded = bool(self._watched(rows, {arm}))
        ratio = self.guard.verdict(rows, arm) if guarded else None
        steps, used = self._use[rows][arm] if rows in self._use else (0.0, 0.0)
        seen = steps >= 4.0
        hardly = seen and used < self.min_share * steps  # it hardly drafted with it here
        if ratio is not None:
            # Where the policy has hardly drafted with it at this size, the guard compared
            # plain steps with plain steps: its ratio is noise, and a join is a cost alone (8
            # rows with a draft model on this CPU: 98% plain steps, rows joining whenever
            # the noise read >= 1, 0.94x of plain decoding).
            pays = ratio >= 1.0 and not hardly
        elif seen:  # cheap or not, a join buys steps the policy mostly decodes plainly
            pays = not hardly
        else:
            pays = self._cheap(arm, rows, tokens, life) or self._predicts(arm, rows)
        if pays:
            return True
        if not probe:
            return False
        self._turned_away[arm] += 1
        if self._turned_away[arm] >= self._probe_interval(ratio):
            self._turned_away[arm] = 0
            return True
        return False

    def _probe_interval(self, ratio: float | None) -> int:
        """Rows turned away from a drafter before one joins anyway (`join_pays`)."""
        if ratio is None or ratio >= 1.0:
            return self.probe_join
        scale = min(float(self.probe_join), max(1.0, (1.0 - ratio) / 0.05))
        return int(round(self.probe_join * scale))

    def _cheap(self, arm: int, rows: int, tokens: int, life: float, budget=None) -> bool:
        """Whether taking rows of `tokens` tokens into drafter `arm` costs, for `rows` rows
        (each row of a batch that turns over joins once in a row's life), at most `budget`
        (default `join_budget`) of the plain time of `life` steps of that many rows. True
        until a join after the first (which compiles) is timed: two rows, once, to learn
        the cost."""
        budget = self.join_budget if budget is None else budget
        if tokens <= 0 or life <= 0 or budget <= 0:
            return False
        per_token = self._join_cost.get(arm)
        if per_token is None:
            return self._joins.get(arm, 0) < 2
        if self._plain_seen < 2:
            return False
        plain = self.costs.plain_seconds(rows)
        return rows * per_token * tokens <= budget * life * plain

    def _repays(self, arm: int, rows: int, tokens: int, life: float) -> bool:
        """Whether one row feeding drafter `arm` `tokens` tokens costs at most `join_budget`
        of the plain time of `life` steps of `rows` rows (the batch waits while it feeds);
        True while the drafter's cost per token is unmeasured."""
        per_token = self._join_cost.get(arm)
        if per_token is None or self._plain_seen < 2:
            return True
        return per_token * tokens <= self.join_budget * life * self.costs.plain_seconds(rows)

    def observe_join(self, arm: int, tokens: int, seconds: float) -> None:
        """Drafter `arm` took a row in, fed `tokens` tokens, in `seconds` (the first join
        is left out: it compiles the drafter's kernels; so are joins of a few tokens, from
        a saved state: their time is the call's, not the tokens')."""
        if tokens < 16:
            return
        self._joins[arm] = self._joins.get(arm, 0) + 1
        if self._joins[arm] == 1:
            return
        self._join_cost[arm] = ema(self._join_cost.get(arm), seconds / tokens, 0.2)

    def _predicts(self, arm: int, rows: int) -> bool:
        """Whether the cost model predicts that drafting with `arm` alone beats plain
        decoding at `rows` rows (a batch size whose steps the policy has not seen lately: its
        costs come from the sizes it has seen); True while the arm's steps are unmeasured."""
        if self._plain_seen < 2 or (arm,) not in self.costs.fits:
            return True
        gains = self._gains()[arm]
        plain = self.costs.seconds(rows, 0, ())
        best = max(
            gains[k] / self.costs.seconds(rows, k, (arm,)) for k in range(1, self.max_draft + 1)
        )
        return best * plain > 1 + self.margin

    def _count_use(self, rows: list[tuple[int | None, int]]) -> None:
        """A step of len(rows) rows counts for each arm one of its rows could draft with
        (a step where no row had it, the rows having left it out, says nothing of it)."""
        use = self._use.setdefault(len(rows), [[0.0, 0.0] for _ in self.arms])
        drafting = {arm for arm, k in rows if arm is not None and k > 0}
        offered = range(len(self.arms)) if self._offered is None else self._offered
        for arm in offered:
            steps, used = use[arm]
            use[arm] = [self.use_decay * steps + 1.0, self.use_decay * used + (arm in drafting)]
        self._offered = None

    def _next_probe(self, rate: float, plain_rate: float) -> int:
        """Steps before the next probe: twice the last interval, at least enough that a
        probe's expected loss (in plain steps) stays within `probe_budget` of them."""
        loss = max(0.0, plain_rate / max(rate, 1e-9) - 1.0)
        need = loss / self.probe_budget
        return int(min(max(2 * self._probe_every, np.ceil(need)), max(self.probe_max, 8 * need)))

    # --- observations ------------------------------------------------------------------------

    def observe(
        self,
        rows: list[tuple[int | None, int]],
        outcomes,
        seconds: float,
        catch_up: int = 0,
        window: int | None = None,
        joined: dict[int, float] | None = None,
        disturbed: bool = False,
        drafting: float = 0.0,
    ) -> None:
        """A step ran: row i drafted with `rows[i]` (arm, k asked); `outcomes[i]` = (drafted,
        accepted); it took `seconds`, `drafting` of them drafting, `catch_up` tokens of it
        catching up, in the guard's `window` (`BatchChoice`); model drafters spent
        `joined[arm]` seconds taking rows in since the last step. A join is a row's cost,
        once, not a step's: the step costs leave it out (fitted as a step's, it would price
        every speculative step as the first after a join, and the policy would stop drafting
        where a join pays for itself many times over); the guard counts it as its
        drafter's, so that joins that do not pay lose.

        `disturbed`: rows joined or left the batch since the last step, and the step also
        ran what that left queued (the batch's cache re-formed: rows written in, dropped,
        columns squeezed), whatever K it had: the guard counts it as it came, the step costs
        take that cost apart (`_Costs`).

        What is paid once per process is no drafter's verdict: a drafter's first join
        (compiling its kernels) is not charged, and a shape's first step that built its
        kernels (`_Costs.observe`) is not counted by the guard either (on a fresh GPU
        machine, seconds: a verdict on them would turn rows away from the drafter, unmeasured
        again, for a long time)."""
        drafted = [(a, d) for (a, _), (d, _) in zip(rows, outcomes, strict=True)]
        for arm, spent in (joined or {}).items():
            if arm not in self._built:
                self._built.add(arm)
                continue
            self._joined[arm] = self._joined.get(arm, 0.0) + spent
        if window is None and not self._watched(len(rows), set(self._joined)):
            self._joined = {}  # joins before steps the guard does not judge: none to charge
        shape = self.shape(drafted)
        self._follow = list(rows) if shape[1] and self.costs.switching else None
        built = self.costs.observe(*shape, seconds, catch_up, disturbed)
        self._follow_catch_up(shape[2], catch_up)
        if drafting > 0 and shape[1] and not (catch_up or built) and set(shape[2]) <= self.chained:
            self.costs.observe_drafting(*shape, drafting)
        if self.guard is not None and window is not None and not built:
            tokens = len(rows) + sum(n for _, n in outcomes)
            self.guard.observe(len(rows), window, tokens, seconds, set(shape[2]))
            for arm, spent in self._joined.items():  # joins before steps it stood aside from too
                self.guard.charge(len(rows), arm, spent)
            self._joined = {}
        if window and self._offered is not None:  # a barred drafter says nothing of whether
            self._offered = {a for a in self._offered if not window >> a & 1}  # it pays here
        if self._offered == set():
            self._offered = None  # every drafter barred: nothing to count
        else:
            self._count_use(rows)
        self._follow_closed_run(len(rows), shape)
        if any(k for _, k in rows):
            self._quiet = None  # acceptance and costs of speculation moved
        else:
            self._since_spec += 1
            self._plain_seen += 1
        for (arm, asked), (_, accepted) in zip(rows, outcomes, strict=True):
            if arm is None or asked <= 0:
                continue
            self.hits[arm] = [h * self.decay for h in self.hits[arm]]
            self.trials[arm] = [t * self.decay for t in self.trials[arm]]
            count_round(self.hits[arm], self.trials[arm], asked, accepted)
