"""A step's plan: each row's (drafter, k) at the batch's K, made once per distinct ask."""

from __future__ import annotations

from mlx_spec.decoding.batch_asks import RowAsk
from mlx_spec.decoding.row_gains import Gains, row_gain
from mlx_spec.decoding.step_costs import Plan, StepCosts, catch_up_tokens, step_shape


class MergedAsks:
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

    def rows(self, plan: Plan) -> Plan:
        return [plan[i] for i in self.of_row]

    def shape(self, plan: Plan) -> tuple[int, int, tuple]:
        """As `step_shape` of the plan's rows."""
        return (self.size, *step_shape(plan)[1:])

    def tokens(self, plan: Plan, gains: Gains) -> float:
        """The tokens the plan's rows emit with E(k) `gains`."""
        return sum(
            count * row_gain(choice, ask, gains)
            for choice, count, ask in zip(plan, self.counts, self.distinct, strict=True)
        )

    def slows(self, plan: Plan, gains: Gains, seconds: float, plain: float) -> bool:
        """Whether a step of the plan, taking `seconds` where a plain step takes `plain`, is
        expected to slow a row that is behind its pace (`RowAsk.behind`): one whose tokens
        per second under the plan, E(k) / seconds, fall short of a plain step's 1 / plain.
        A lone row's plans are weighed by its own tokens already: none slows it but by a
        misjudgement, and ruling plans out for it would only keep the policy from exploring."""
        if not self.behind or self.size == 1:
            return False
        return any(
            ask.behind and row_gain(choice, ask, gains) * plain < seconds
            for choice, ask in zip(plan, self.distinct, strict=True)
        )

    def catch_up(self, plan: Plan) -> int:
        """As `catch_up_tokens` of the plan's rows."""
        return catch_up_tokens(list(zip(plan, self.counts, self.widest, strict=True)))

    def priced(self, plan: Plan, rate: float, gains: Gains) -> tuple[float, float] | None:
        """(tokens, seconds) of a plan rated `rate` tokens per second (None: rated 0)."""
        tokens = self.tokens(plan, gains)
        return (tokens, tokens / rate) if rate > 0 else None


def widest_k(asks: list[RowAsk], max_draft: int) -> int:
    """The largest K that changes a plan (at least 1): beyond what any row can draft (its
    budget, its lookup's match), every K plans the same step."""
    most = 1
    for ask in asks:
        if ask.fixed is None:
            for avail in ask.available:
                most = max(most, min(ask.limit, max_draft if avail is None else avail))
    return min(most, max_draft)


def drafters_open(
    ask: RowAsk, target: int, max_draft: int, force: int | None, only: int | None
) -> range | list[int]:
    """The drafters a row may take (indices into its `arms`): `only` narrows them to that
    drafter where the row has several and that one among them, then `force` to that one
    where the row may use it and it has drafts to be had."""
    arms, ways = ask.arms, range(len(ask.arms))
    if only is not None and len(arms) > 1 and only in arms:
        ways = [arms.index(only)]
    if force is not None and force in [arms[i] for i in ways]:
        if ask.drafts(arms.index(force), target, max_draft) > 0:
            ways = [arms.index(force)]
    return ways


def plan_row(
    ask: RowAsk,
    big_k: int,
    gains: Gains,
    batch: int,
    max_draft: int,
    costs: StepCosts,
    force: int | None = None,
    only: int | None = None,
) -> tuple[tuple[int | None, int], float]:
    """A row's (arm, k) at batch K = `big_k` (its own where it drafts a fixed k), and its
    E(k). A row that may use several drafters takes the one with the most tokens per second
    of a step of `batch` rows where it alone drafts (`force`, `only`: `drafters_open`)."""
    choice, gain, score = (None, 0), 1.0, 0.0
    target = ask.fixed if ask.fixed is not None else big_k
    ways = drafters_open(ask, target, max_draft, force, only)
    several = len(ways) > 1
    for i in ways:
        k = ask.drafts(i, target, max_draft)
        if k <= 0:
            continue
        arm = ask.arms[i]
        g = gains.of(arm, ask.levels[i] if ask.levels else 0)[k]
        s = g / costs.seconds(batch, k, (arm,)) if several else g
        if choice[0] is None or s > score:
            choice, gain, score = (arm, k), g, s
    return choice, gain


def follow_plan(
    asks: list[RowAsk], follow: Plan, gains: Gains, max_draft: int, costs: StepCosts
) -> Plan:
    """The rows of the step after a switch out of plain decoding (whose rows were `follow`):
    each row drafting with the same drafter to the same K where it still can (a row with a
    fixed k, its own), so that the step prices the switch step's width."""
    big_k, rows = max(k for _, k in follow), []
    for ask, (arm, _) in zip(asks, follow, strict=True):
        if ask.fixed is not None:  # (its k whatever the batch's K)
            rows.append(plan_row(ask, big_k, gains, len(asks), max_draft, costs)[0])
            continue
        n = 0
        if arm is not None and arm in ask.arms:
            n = ask.drafts(ask.arms.index(arm), big_k, max_draft)
        rows.append((arm, n) if n > 0 else (None, 0))
    return rows
