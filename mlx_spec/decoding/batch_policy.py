"""The batch's draft length each step, chosen from measured step costs and acceptance.

One target pass serves every row, and verifying k drafts per row makes it k + 1 tokens wide for
all of them, so the batch, not each row, chooses K: the K whose plan promises the most tokens
per second (`plan_search`: E(k) per row from `row_gains`, seconds from `step_costs`), by a
margin over plain decoding (K = 0). Probes and exploring steps measure what the cost model
cannot know (`exploration`); a closed batch takes a plan only where every row gains by it
(`closed_batch_rule`); a guard checks each drafter against steps without it (`drafter_guard`);
`join_pays` says whether a joining row takes a model drafter in (`join_rules`). The choice
depends on earlier steps only, so every row's output keeps the target's distribution. The
rules and the measurements behind them: docs/serving.md.
"""

from __future__ import annotations

from dataclasses import replace

from mlx_spec.decoding.batch_asks import UNTOLD_LEFT, RowAsk, RowRecord, asks_signature
from mlx_spec.decoding.batch_choice import BatchChoice, Decision
from mlx_spec.decoding.batch_plans import MergedAsks, follow_plan, plan_row, widest_k
from mlx_spec.decoding.catch_ups import CatchUpHorizon
from mlx_spec.decoding.closed_batch_rule import ClosedBatchRule
from mlx_spec.decoding.drafter_guard import DrafterGuard
from mlx_spec.decoding.exploration import ProbeSchedule, least_known_width, untried_drafter
from mlx_spec.decoding.join_rules import JoinRules
from mlx_spec.decoding.plan_search import Candidate, PlanSearch
from mlx_spec.decoding.row_gains import DrafterAcceptance, Gains
from mlx_spec.decoding.step_costs import Plan, StepCosts, catch_up_tokens, step_shape

__all__ = ["UNTOLD_LEFT", "BatchChoice", "BatchDraftPolicy", "Decision", "RowAsk", "RowRecord"]


def _part(part: str, name: str) -> property:
    """An attribute of one of the policy's parts (`<part>.<name>`), read and set on it."""
    return property(
        lambda self: getattr(getattr(self, part), name),
        lambda self, value: setattr(getattr(self, part), name, value),
    )


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
            one whose own cost is least known) or an untried drafter of a group runs instead.
        horizon: the speculative steps a catch-up serves, until measured (`CatchUpHorizon`).
        min_share, probe_join, use_decay: `join_pays`: the share of steps (decayed by
            `use_decay` per step of the same batch size) below which a joining row skips a
            model drafter, and every how many skipped rows one joins anyway.
        join_budget: the share of a row's expected plain time a join may cost (`JoinRules`);
            0: never.
        recheck: while plain decoding wins, the rows' asks unchanged and no probe due, the
            full comparison runs every this many steps only (the others repeat its answer).
        guard, guard_from, alone: check each drafter's steps against steps without it over
            windows of steps (`DrafterGuard`), and bar it where they realise less, at
            `guard_from` rows or more, and at fewer for the drafters in `alone` (model
            drafters, whose joins, catch-ups and pipeline restarts no step cost shows).
        chained: the drafters that run a pass per draft (a draft model, an MTP or EAGLE
            head): their measured seconds per draft bound what a width never run may cost.
        own_weight: a row's acceptance level (`acceptance_level`) weighs its own drafts behind
            this many pseudo-drafts kept as expected (0: every row at its drafter's).
        every_row: in a closed batch (`closed`: every slot taken, nothing waiting), take a
            plan only where every row is expected to gain by it, and neither probe nor
            explore (`ClosedBatchRule`); False: by rate, as any batch.
        closed_hold: while a closed batch finds no such plan, the steps the engine holds
            it to plain decoding without asking its rows.

    The search over K stops past best + 1 at a K whose best plan promises under
    `stop_below` (0.85) of the best rate, and never goes beyond what a row can draft.
    """

    # Knobs and state its parts keep, read and set on the policy as before (tests and
    # benchmarks set some of them).
    prior_accept, prior_weight = _part("accepts", "prior_accept"), _part("accepts", "prior_weight")
    hits, trials = _part("accepts", "hits"), _part("accepts", "trials")
    probe_min, probe_max = _part("schedule", "probe_min"), _part("schedule", "probe_max")
    probe_budget, recheck = _part("schedule", "probe_budget"), _part("schedule", "recheck")
    explore_every, horizon = _part("schedule", "explore_every"), _part("catch_ups", "horizon")
    _since_spec, _probe_every = _part("schedule", "since_spec"), _part("schedule", "probe_every")
    min_share, probe_join = _part("joins", "min_share"), _part("joins", "probe_join")
    use_decay, join_budget = _part("joins", "use_decay"), _part("joins", "budget")
    _join_cost, _use = _part("joins", "per_token"), _part("joins", "use")

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
        self.arms, self.max_draft, self.decay = list(arms), max_draft, decay
        # Set by the engine each step: every slot taken, nothing waiting to join.
        self.closed, self.every_row, self.closed_hold = False, every_row, closed_hold
        self.margin, self.own_weight = margin, own_weight
        self.stop_below = 0.85
        self.thin = 8.0  # rounds reaching a drafter's first draft, below which it is a guess
        self.guard = DrafterGuard() if guard else None
        self.guard_from = guard_from
        self.alone, self.chained = frozenset(alone), frozenset(chained)
        n = len(self.arms)
        self.accepts = DrafterAcceptance(n, max_draft, prior_accept, prior_weight, decay)
        self.schedule = ProbeSchedule(probe_min, probe_max, probe_budget, explore_every, recheck)
        self.costs = StepCosts(decay, horizon=horizon)
        self.catch_ups = CatchUpHorizon(horizon, decay, self.alone | self.chained)
        self.closed_rule = ClosedBatchRule(self.costs, self.catch_ups, decay)
        self.joins = JoinRules(n, self.costs, join_budget, min_share, probe_join, use_decay)
        self._follow: list | None = None  # the rows of the switch step just observed
        self._plain_seen = 0  # plain steps measured (the first ones set the cost prior)
        self._offered: set[int] | None = None  # the arms the last choice's rows had (None: all)

    # --- estimates ---------------------------------------------------------------------------

    def acceptance(self, arm: int) -> list[float]:
        return self.accepts.of(arm)

    @staticmethod
    def shape(rows: Plan) -> tuple[int, int, tuple]:
        """(B, K, drafters drafting) of a step where row i drafts k_i with arm a_i."""
        return step_shape(rows)

    @staticmethod
    def catch_up(asks: list[RowAsk], rows: Plan) -> int:
        """W of a step (`catch_up_tokens`), each row with its own backlogs (none given: none)."""
        groups = []
        for ask, row in zip(asks, rows, strict=True):
            groups.append((row, 1, dict(zip(ask.arms, ask.backlog, strict=False))))
        return catch_up_tokens(groups)

    def _gains(self, hopeful: bool = False) -> Gains:
        """E(k) per drafter; `hopeful`: at hopeful acceptance for those with fewer than `thin`
        rounds behind them (`DrafterAcceptance.gains`)."""
        return self.accepts.gains(self.thin if hopeful else None)

    def _prepare(self, asks: list[RowAsk]) -> None:
        """Each row's acceptance levels (`DrafterAcceptance.set_levels`)."""
        self.accepts.set_levels(asks, self.own_weight)

    def _plan(self, asks, big_k: int, gains, force=None, only=None) -> tuple[Plan, float]:
        """Each row (of `asks`, or a `MergedAsks`) drafting at batch K = big_k (`plan_row`),
        and the tokens the step would emit."""
        merged = asks if isinstance(asks, MergedAsks) else MergedAsks(asks)
        plan, tokens = self._merged_plan(merged, big_k, gains, force, only)
        return merged.rows(plan), tokens

    def _merged_plan(self, merged: MergedAsks, big_k: int, gains, force=None, only=None):
        """`_plan` per distinct ask: (one (arm, k) per distinct ask, tokens)."""
        plan, tokens = [], 0.0
        for ask, count in zip(merged.distinct, merged.counts, strict=True):
            choice, gain = plan_row(
                ask, big_k, gains, merged.size, self.max_draft, self.costs, force, only
            )
            plan.append(choice)
            tokens += gain * count
        return plan, tokens

    def _rate(self, asks: list[RowAsk], rows: Plan, tokens: float) -> float:
        shape = self.shape(rows)
        horizon = self._serves(asks, rows, shape, tokens)
        spread = self.catch_up(asks, rows) / horizon
        return tokens / self.costs.seconds(*shape, spread)

    def _serves(self, asks: list[RowAsk], rows: Plan, shape: tuple, tokens: float) -> float:
        """The steps a catch-up of the plan is spread over (`CatchUpHorizon.serves`)."""
        return self.catch_ups.serves(asks, rows, shape, tokens)

    def _horizon(self, arms: tuple) -> float:
        """The steps a catch-up of drafters `arms` serves (`CatchUpHorizon.steps`)."""
        return self.catch_ups.steps(arms)

    # --- choice ------------------------------------------------------------------------------

    def barred(self, size: int, offered: set[int], free: bool) -> BatchChoice | None:
        """The next step's choice without the rows' asks (a host's work per row and step),
        where the guard's running window bars every drafter the rows have (`offered`; `free`:
        no row drafts a fixed k): plain decoding, as `choose` would answer. None where the
        asks are needed (a window starts, the rows' drafters changed, or one is allowed).
        Where no row has a drafter (speculation off), plain decoding too."""
        if not offered:
            self._offered, self._follow, self.schedule.quiet = set(), None, None
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
            asks = [ask.without(window) for ask in asks]
            if not any(ask.arms for ask in asks):  # every drafter barred: the policy unasked
                return BatchChoice(0, [(None, 0)] * len(asks), window=window)
        choice = self._choose(asks)
        choice.window = window
        return choice

    def _choose(self, asks: list[RowAsk]) -> BatchChoice:
        """The choice for the rows' asks (the guard's barred drafters left out)."""
        follow = self._follow_step(asks)
        if follow is not None:
            return follow
        signature = asks_signature(asks)
        if self.schedule.repeats_plain(signature):
            return BatchChoice(0, [(None, 0)] * len(asks))
        accept = self._gains()
        plain_rows, plain_tokens = self._plan(asks, 0, accept)
        plain_rate = self._rate(asks, plain_rows, plain_tokens)
        if self._plain_seen < 2 or not any(a.arms for a in asks):
            return BatchChoice(0, plain_rows)
        merged = MergedAsks(asks)
        search = self._search(merged, accept, plain_rate)
        needed = self.margin / 2 if self.schedule.speculating else self.margin
        speculate = search.best is not None and search.best.rate > plain_rate * (1 + needed)
        decision, chosen = Decision.BEST, None
        if speculate and self._under_closed_rule(len(asks)):
            chosen = self.closed_rule.pick(merged, search.plans, accept, needed)
            speculate, decision = chosen is not None, Decision.CLOSED
        if speculate:
            return self._speculate(search, chosen)
        self.schedule.speculating = False
        return self._decline(search, plain_rows, signature, decision)

    def _under_closed_rule(self, size: int) -> bool:
        """Whether a batch of `size` rows chooses by the closed batch's rule."""
        return self.closed and self.every_row and size > 1

    def _follow_step(self, asks: list[RowAsk]) -> BatchChoice | None:
        """After a switch out of plain decoding (whose cost is not its width's), the step
        that prices its width (`follow_plan`); None where no switch step was just observed,
        or no row can draft as it did."""
        follow, self._follow = self._follow, None
        if follow is None or len(follow) != len(asks):
            return None
        rows = follow_plan(asks, follow, self._gains(), self.max_draft, self.costs)
        if not any(n for _, n in rows):
            return None
        return self._choice(asks, max(n for _, n in rows), rows, decision=Decision.FOLLOW)

    def _search(self, merged: MergedAsks, accept: Gains, plain_rate: float) -> PlanSearch:
        """Every K's plans weighed (`PlanSearch.run`), a group's drafters no step has used
        alone among them; at hopeful acceptance too where the step may probe or explore."""
        group = {arm for ask in merged.asks if len(ask.arms) > 1 for arm in ask.arms}
        untried = [arm for arm in sorted(group) if (arm,) not in self.costs.fits]
        hopes = self._gains(hopeful=True) if self.schedule.exploring() else None
        search = PlanSearch(
            merged, accept, hopes, self.costs, self.catch_ups, plain_rate, self.margin
        )

        def plan_of(big_k: int, only: int | None) -> tuple[Plan, float]:
            return self._merged_plan(merged, big_k, accept, only=only)

        widest = widest_k(merged.distinct, self.max_draft)
        return search.run(plan_of, widest, untried, self.stop_below)

    def _speculate(self, search: PlanSearch, chosen: int | None) -> BatchChoice:
        """A speculative step: the closed batch's plan of K = `chosen` (no exploring step
        there), every `explore_every`-th step an exploring one, else the best plan."""
        explores = self.schedule.speculated()
        if chosen is not None:
            return self._take(search, search.plans[chosen], Decision.CLOSED)
        if explores:  # another K keeps the costs honest
            return self._exploring_step(search)
        return self._take(search, search.best, Decision.BEST)

    def _exploring_step(self, search: PlanSearch) -> BatchChoice:
        """A width never run at this size whose least possible cost would make it the best;
        else, every other time, a group's drafter the best plan leaves out (`_untried`);
        else the width nearest the best whose own cost is least known."""
        merged, best, hopeful = search.merged, search.best, search.worth_measuring()
        if hopeful is not None:
            return self._take(search, hopeful, Decision.EXPLORE)
        arm = self._untried(merged, best, search.accept)
        if arm is not None and self.schedule.tries_drafter():
            rows = self._plan(merged, best.big_k, search.accept, arm)[0]
            return self._choice(merged.asks, best.big_k, rows, decision=Decision.EXPLORE)
        plans = search.exploring_plans()
        big_k = least_known_width(best.big_k, plans, self.costs.cells)
        return self._take(search, plans[big_k], Decision.EXPLORE)

    def _untried(self, merged: MergedAsks, best: Candidate, accept: Gains) -> int | None:
        """A group's drafter worth an exploring step (`untried_drafter`)."""

        def forced(arm: int) -> Plan:
            return self._merged_plan(merged, best.big_k, accept, force=arm)[0]

        rounds = [trials[0] for trials in self.trials]
        return untried_drafter(merged, best, rounds, self.thin, forced)

    def _decline(
        self, search: PlanSearch, plain_rows: Plan, signature, decision: Decision
    ) -> BatchChoice:
        """No plan taken for its rate: a closed batch's plain step (no probe but of a drafter
        set no step has used, where the rule could take it: `ClosedBatchRule.may_bear`), a
        probe where one is due, else plain decoding, its answer held while the asks stay."""
        merged, unmeasured = search.merged, search.unmeasured
        if self._under_closed_rule(merged.size) and (
            unmeasured is None
            or not self.closed_rule.may_bear(merged, unmeasured.plan, search.accept, self.margin)
        ):
            return BatchChoice(0, plain_rows, decision=Decision.CLOSED)
        if self.schedule.probe_due():
            return self._probe(search)
        self.schedule.hold_plain(signature)
        return BatchChoice(0, plain_rows, decision=decision)

    def _probe(self, search: PlanSearch) -> BatchChoice:
        """A probe: of a drafter set no step has used (priced by the prior alone), else of a
        width that may be the best, else of the best plan (`ProbeSchedule.probed`)."""
        probe = search.unmeasured or search.worth_measuring() or search.best or search.held
        thin = self.accepts.thin(probe.shape[2], self.thin)
        self.schedule.probed(probe.rate, search.plain_rate, thin)
        return self._take(search, probe, Decision.PROBE, probe=True)

    def _take(
        self, search: PlanSearch, candidate: Candidate, decision: Decision, probe=False
    ) -> BatchChoice:
        """The choice of a plan weighed in `search`, with its price."""
        merged, plan = search.merged, candidate.plan
        priced = merged.priced(plan, candidate.rate, search.accept)
        rows, big_k, only = merged.rows(plan), candidate.big_k, candidate.only
        return self._choice(merged.asks, big_k, rows, probe, only, decision, priced)

    def _choice(
        self, asks, big_k: int, rows, probe=False, only=None, decision=Decision.BEST, priced=None
    ) -> BatchChoice:
        catch_up = self.catch_up(asks, rows)
        return BatchChoice(big_k, rows, probe, catch_up, only, None, decision, priced)

    def replan(self, asks: list[RowAsk], choice: BatchChoice) -> BatchChoice:
        """The rows' drafts for the K already chosen, from asks made since (no new choice)."""
        self._prepare(asks)
        if choice.window:
            asks = [ask.without(choice.window) for ask in asks]
        rows = self._plan(asks, choice.num_draft, self._gains(), only=choice.only)[0]
        return replace(choice, rows=rows, catch_up=self.catch_up(asks, rows))

    # --- joins -------------------------------------------------------------------------------

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
        the drafter out at joining, to feed it its whole sequence so far; `always_cheap`: a
        cheap join is taken whatever was measured; `probe`: a row turned away may join
        anyway, so that the drafter stays measured. The rules: `JoinRules`."""
        if late and tokens > 0 and not self.joins.repays(arm, rows, tokens, life, self._measured):
            return False
        if always_cheap and self._cheap(arm, rows, tokens, life, self.join_budget / 3):
            return True
        ratio = self.guard.verdict(rows, arm) if self._watched(rows, {arm}) else None
        pays = self.joins.judged(arm, rows, ratio)
        if pays is None:  # a size it has hardly run at
            pays = self._cheap(arm, rows, tokens, life) or self._predicts(arm, rows)
        if pays:
            return True
        return bool(probe) and self.joins.turn_away(arm, ratio)

    @property
    def _measured(self) -> bool:
        """Whether plain steps were measured (a join is priced against their time)."""
        return self._plain_seen >= 2

    def _cheap(self, arm: int, rows: int, tokens: int, life: float, budget=None) -> bool:
        """`JoinRules.cheap`."""
        return self.joins.cheap(arm, rows, tokens, life, self._measured, budget)

    def observe_join(self, arm: int, tokens: int, seconds: float) -> None:
        """Drafter `arm` took a row in, fed `tokens` tokens, in `seconds` (`JoinRules.observe`)."""
        self.joins.observe(arm, tokens, seconds)

    def _predicts(self, arm: int, rows: int) -> bool:
        """Whether the cost model predicts that drafting with `arm` alone beats plain
        decoding at `rows` rows (a batch size whose steps the policy has not seen lately: its
        costs come from the sizes it has seen); True while the arm's steps are unmeasured."""
        if not self._measured or (arm,) not in self.costs.fits:
            return True
        gains = self._gains()[arm]
        plain = self.costs.seconds(rows, 0, ())
        best = max(
            gains[k] / self.costs.seconds(rows, k, (arm,)) for k in range(1, self.max_draft + 1)
        )
        return best * plain > 1 + self.margin

    # --- observations ------------------------------------------------------------------------

    def observe(
        self,
        rows: Plan,
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
        once: the step costs leave it out, and the guard counts it as its drafter's.
        `disturbed`: rows joined or left the batch since the last step (`StepCosts` takes
        that cost apart). What is paid once per process (a drafter's first join, a shape's
        first step that built its kernels) is no drafter's verdict."""
        drafted = [(a, d) for (a, _), (d, _) in zip(rows, outcomes, strict=True)]
        self.joins.took_in(joined)
        shape = self.shape(drafted)
        self._follow = list(rows) if shape[1] and self.costs.switching else None
        built = self.costs.observe(*shape, seconds, catch_up, disturbed)
        self.catch_ups.follow(shape[2], catch_up)
        if drafting > 0 and shape[1] and not (catch_up or built) and set(shape[2]) <= self.chained:
            self.costs.observe_drafting(*shape, drafting)
        self._guard_observes(rows, outcomes, seconds, window, shape[2], built)
        self._count_use(rows, window)
        self.closed_rule.follow(self._under_closed_rule(len(rows)), shape)
        speculative = any(k for _, k in rows)
        self.schedule.observed(speculative)
        if not speculative:
            self._plain_seen += 1
        self.accepts.count(rows, outcomes)

    def _guard_observes(
        self, rows: Plan, outcomes, seconds: float, window, drafters: tuple, built: bool
    ) -> None:
        """The guard counts a step of its `window` on its side, and the joins pending since
        the steps it judged last go to their drafters (none go where it does not judge)."""
        if window is None and not self._watched(len(rows), set(self.joins.pending)):
            self.joins.pending = {}
        if self.guard is None or window is None or built:
            return
        tokens = len(rows) + sum(n for _, n in outcomes)
        self.guard.observe(len(rows), window, tokens, seconds, set(drafters))
        for arm, spent in self.joins.pending.items():  # joins before steps it stood aside from too
            self.guard.charge(len(rows), arm, spent)
        self.joins.pending = {}

    def _count_use(self, rows: Plan, window: int | None) -> None:
        """A step counts for each drafter one of its rows could draft with (`_offered`) and
        the guard did not bar (a barred drafter says nothing of whether it pays here)."""
        offered, self._offered = self._offered, None
        if window and offered is not None:
            offered = {a for a in offered if not window >> a & 1}
        if offered == set():
            return  # every drafter barred: nothing to count
        self.joins.count_use(rows, range(len(self.arms)) if offered is None else offered)
