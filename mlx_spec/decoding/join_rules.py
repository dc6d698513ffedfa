"""Whether a row joining the batch takes a model drafter in: the drafter feeds the row's prompt
before it drafts at all, a cost paid whether the policy then drafts with it or not."""

from __future__ import annotations

from mlx_spec.decoding.policy import ema
from mlx_spec.decoding.step_costs import Plan, StepCosts


class JoinRules:
    """What taking rows into each model drafter costs (seconds per token fed, timed per join),
    how much the policy drafted with each drafter per batch size lately, and the rows turned
    away from each since one joined anyway. `BatchDraftPolicy.join_pays` weighs them:

    - A late join (a row that left the drafter out at joining, to feed its whole sequence)
      costing more than `budget` of the plain time of the row's life left (`repays`): never.
    - A join costing, for as many rows as the batch holds, at most a third of `budget` of
      the plain time of the row's expected life (`cheap`): always, but for a saved state or
      a late join. It keeps the drafter at hand for the policy and the guard to use.
    - Else by what was measured at that size (`judged`): the guard's verdict, and whether the
      policy drafted with it in at least `min_share` of its recent steps there.
    - Else (a size hardly run at): where the join is `cheap`, or where the cost model
      predicts that drafting with it pays there.

    Every `probe_join`-th row turned away joins anyway, rarer where the guard's verdict is a
    loss (`probe_interval`), so that the drafter stays measured.

    Args:
        arms: the number of drafters.
        costs: the step costs (a join is priced against the batch's plain time).
        budget, min_share, probe_join, use_decay: as `BatchDraftPolicy`'s `join_budget`,
            `min_share`, `probe_join`, `use_decay`.
    """

    def __init__(
        self,
        arms: int,
        costs: StepCosts,
        budget: float,
        min_share: float,
        probe_join: int,
        use_decay: float,
    ):
        self.arms, self.costs = arms, costs
        self.budget, self.min_share, self.probe_join = budget, min_share, probe_join
        self.use_decay = use_decay
        self.per_token: dict[int, float] = {}  # arm -> seconds per token fed at joining
        self.timed: dict[int, int] = {}  # arm -> joins timed
        # Per batch size: per arm, [decayed steps where a row could draft with it, decayed
        # steps drafting with it].
        self.use: dict[int, list] = {}
        self.turned_away = [0] * arms  # rows that skipped each arm since one joined
        self.built: set[int] = set()  # drafters whose first join (compiling) went uncharged
        self.pending: dict[int, float] = {}  # arm -> join seconds not yet charged to the guard

    def judged(self, arm: int, rows: int, ratio: float | None) -> bool | None:
        """Whether drafter `arm` pays at `rows` rows by what was measured there: the guard's
        `ratio` (None: no verdict) and the share of recent steps the policy drafted with it
        (at least `min_share`); None where neither has a say (a size hardly run at). Where
        the policy hardly drafted with it, the guard compared plain steps with plain steps."""
        steps, used = self.use[rows][arm] if rows in self.use else (0.0, 0.0)
        seen = steps >= 4.0
        hardly = seen and used < self.min_share * steps  # it hardly drafted with it here
        if ratio is not None:
            return ratio >= 1.0 and not hardly
        if seen:  # cheap or not, a join buys steps the policy mostly decodes plainly
            return not hardly
        return None

    def turn_away(self, arm: int, ratio: float | None) -> bool:
        """Count a row turned away from drafter `arm`; True where it joins anyway, so that
        the drafter stays measured (`probe_interval`)."""
        self.turned_away[arm] += 1
        if self.turned_away[arm] >= self.probe_interval(ratio):
            self.turned_away[arm] = 0
            return True
        return False

    def probe_interval(self, ratio: float | None) -> int:
        """Rows turned away from a drafter before one joins anyway: every `probe_join`-th,
        and where the guard's verdict `ratio` is a loss every `probe_join * (1 - ratio) /
        0.05`-th, at most every `probe_join`-th squared (a join buys less there)."""
        if ratio is None or ratio >= 1.0:
            return self.probe_join
        scale = min(float(self.probe_join), max(1.0, (1.0 - ratio) / 0.05))
        return int(round(self.probe_join * scale))

    def cheap(
        self, arm: int, rows: int, tokens: int, life: float, measured: bool, budget=None
    ) -> bool:
        """Whether taking rows of `tokens` tokens into drafter `arm` costs, for `rows` rows
        (each row of a batch that turns over joins once in a row's life), at most `budget`
        (default `budget`) of the plain time of `life` steps of that many rows (`measured`:
        the plain steps are). True until a join after the first (which compiles) is timed:
        two rows, once, to learn the cost."""
        budget = self.budget if budget is None else budget
        if tokens <= 0 or life <= 0 or budget <= 0:
            return False
        per_token = self.per_token.get(arm)
        if per_token is None:
            return self.timed.get(arm, 0) < 2
        if not measured:
            return False
        plain = self.costs.plain_seconds(rows)
        return rows * per_token * tokens <= budget * life * plain

    def repays(self, arm: int, rows: int, tokens: int, life: float, measured: bool) -> bool:
        """Whether one row feeding drafter `arm` `tokens` tokens costs at most `budget` of
        the plain time of `life` steps of `rows` rows (the batch waits while it feeds); True
        while the drafter's cost per token (or, `measured`, the plain steps) is unmeasured."""
        per_token = self.per_token.get(arm)
        if per_token is None or not measured:
            return True
        return per_token * tokens <= self.budget * life * self.costs.plain_seconds(rows)

    def observe(self, arm: int, tokens: int, seconds: float) -> None:
        """Drafter `arm` took a row in, fed `tokens` tokens, in `seconds` (the first join is
        left out: it compiles the drafter's kernels; so are joins of a few tokens, from a
        saved state: their time is the call's, not the tokens')."""
        if tokens < 16:
            return
        self.timed[arm] = self.timed.get(arm, 0) + 1
        if self.timed[arm] == 1:
            return
        self.per_token[arm] = ema(self.per_token.get(arm), seconds / tokens, 0.2)

    def took_in(self, joined: dict[int, float] | None) -> None:
        """Drafters spent `joined[arm]` seconds taking rows in since the last step: pending
        charges to the guard, but for a drafter's first join (compiling its kernels)."""
        for arm, spent in (joined or {}).items():
            if arm not in self.built:
                self.built.add(arm)
                continue
            self.pending[arm] = self.pending.get(arm, 0.0) + spent

    def count_use(self, rows: Plan, offered) -> None:
        """A step of len(rows) rows counts for each arm of `offered` (one its rows could
        draft with), and as a use where a row drafted with it."""
        use = self.use.setdefault(len(rows), [[0.0, 0.0] for _ in range(self.arms)])
        drafting = {arm for arm, k in rows if arm is not None and k > 0}
        for arm in offered:
            steps, used = use[arm]
            use[arm] = [self.use_decay * steps + 1.0, self.use_decay * used + (arm in drafting)]
