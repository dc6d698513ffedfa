"""Choosing each round's draft length (and drafter) from measured costs and acceptance.

A policy is asked before every round for a `Choice` and told what the round did. It never
reads models or tokens' values: the choice depends only on earlier rounds, so it cannot bias
the verification of the round it picks (any draft length keeps the output distribution).

`AdaptiveDraftLength` keeps, per drafter (arm), running estimates of the probability that draft
position i is kept given that the ones before it were, and of the time of a round as a line in
the number of drafts, a + b k: the drafter's k steps (c each) and the target's pass over k + 1
tokens (v_k), verification and rollback, fitted on the rounds the arm ran. No synchronisation
is added to split drafting from verifying, so the target's graph is still built while the
drafter computes. Each round it picks the k in 1..K (and the arm) that maximises expected
tokens per second, E(k) / (k c + v_k), with E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i, and
compares it with plain decoding (1 / the measured plain step time). When plain decoding wins it
asks for a stretch of plain steps and probes speculation again after it, at doubling intervals
while it keeps losing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Choice:
    """What the next round does.

    Attributes:
        arm: which drafter drafts (its index in the drafter group; 0 for a single drafter).
        num_draft: draft tokens asked for (k); 0 with `plain_tokens` 0 is a round without drafts.
        plain_tokens: > 0: decode this many tokens plainly (pipelined) before asking again.
    """

    arm: int = 0
    num_draft: int = 0
    plain_tokens: int = 0


class DraftPolicy:
    """Base: a policy that always drafts `num_draft` tokens with arm 0."""

    max_draft = 0  # the longest draft it may ask for

    def choose(self, limit: int, available: list[int | None] | None = None) -> Choice:
        """The next round's choice; `limit` caps k (output budget and context); `available`,
        per arm, how many drafts it can propose now (None: any number)."""
        raise NotImplementedError

    def observe_round(
        self, arm: int, asked: int, drafted: int, accepted: int, seconds: float
    ) -> None:
        """A speculative round: `asked` drafts requested, `drafted` returned, `accepted` kept,
        `seconds` from drafting to the end of the rollback."""

    def observe_plain(self, tokens: int, seconds: float) -> None:
        """A stretch of `tokens` plain decoding steps took `seconds` in all."""

    def describe(self) -> str:
        raise NotImplementedError


class FixedDraftLength(DraftPolicy):
    """k drafts every round (fewer where the budget ends): mlx-spec's behaviour before
    adaptive draft lengths, for `num_draft=<int>`."""

    def __init__(self, num_draft: int):
        self.num_draft = self.max_draft = num_draft

    def choose(self, limit: int, available: list[int | None] | None = None) -> Choice:
        return Choice(0, min(self.num_draft, limit))

    def describe(self) -> str:
        return str(self.num_draft)


class _Line:
    """Seconds of a round as a line in its number of drafts, by least squares over decayed
    sums of (1, x, x^2, y, x y); recent rounds weigh more."""

    def __init__(self):
        self.sums = [0.0] * 5

    def add(self, x: float, y: float, keep: float) -> None:
        terms = (1.0, x, x * x, y, x * y)
        self.sums = [s * keep + v for s, v in zip(self.sums, terms, strict=True)]

    def at(self, x: float, prior: tuple[float, float], floor: float) -> float:
        """The line at x. `prior` (intercept, slope) stands in before the first round; while
        the rounds had (nearly) one length, the slope leans on the prior's above them and on
        zero below them: both err towards dearer rounds, so k moves only when acceptance
        says so, and the rounds it then runs teach the real slope."""
        w, wx, wxx, wy, wxy = self.sums
        if w <= 0:
            return prior[0] + prior[1] * x
        mean_x, mean_y = wx / w, wy / w
        spread = max(wxx / w - mean_x**2, 0.0)
        measured = (wxy / w - mean_x * mean_y) / spread if spread > 1e-9 else 0.0
        trust = w * spread / (w * spread + 1.0)  # one pseudo-round of unit spread
        slope = trust * measured + (1.0 - trust) * (prior[1] if x > mean_x else 0.0)
        slope = max(slope, floor)  # a round never gets cheaper with more drafts
        return mean_y + slope * (x - mean_x)


@dataclass
class _Arm:
    """Running estimates for one drafter."""

    hits: list[float]  # per draft position: decayed count of rounds that kept it
    trials: list[float]  # ... that reached it (the drafts before it were kept)
    seconds: _Line = field(default_factory=_Line)  # round time against drafts verified
    fill: float = 1.0  # drafted / asked (a lookup drafter may find fewer than asked)


def _cap(limit: int, available: list[int | None] | None, arm: int) -> int:
    """The most drafts `arm` can be asked for: the limit, or fewer if it has fewer to offer."""
    has = None if available is None else available[arm]
    return limit if has is None else min(limit, has)


def _ema(old: float | None, new: float, alpha: float) -> float:
    """Running average; a sample over 3x the average (a preempted thread, a collection) is
    taken as 3x, so one outlier cannot swing a decision."""
    return new if old is None else old + alpha * (min(new, 3 * old) - old)


class AdaptiveDraftLength(DraftPolicy):
    """Online choice of k in 0..max_draft (and of the drafter) from measured costs.

    Args:
        max_draft: K, the longest draft considered.
        arms: how many drafters the group offers.
        fixed: a fixed k (only the drafter is chosen; no plain stretches).
        prior_accept: acceptance assumed at the first position before anything is measured
            (deeper positions assume the estimate of the position before them).
        prior_weight: pseudo-rounds behind the prior.
        decay: each observed round multiplies the arm's counts by this (recent rounds count more).
        idle_decay: every round multiplies the counts of the other arms by this, so a drafter
            that lost long ago is tried again.
        alpha: weight of a new timing in the running averages.
        margin: speculation must promise this much more than plain decoding to be taken up,
            and half as much to be kept (the band between keeps noisy timings from
            flip-flopping the choice; a gain within the timings' noise is not worth chasing).
        first_plain: plain steps that start a generation (they measure the plain step).
        refresh_every: after this many speculative rounds without plain steps, a stretch of
            `first_plain` plain steps measures the plain step again (the machine's load and the
            context length change it).
        explore_every: every this many speculative rounds, k one above or below the best is
            drafted instead, so the estimates of its neighbours stay current.
        probe_min, probe_max: plain steps before speculation is probed again; the interval
            doubles after each probe that does not win, up to probe_max.
    """

    def __init__(
        self,
        max_draft: int = 8,
        arms: int = 1,
        *,
        fixed: int | None = None,
        prior_accept: float = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.97,
        idle_decay: float = 0.995,
        alpha: float = 0.15,
        margin: float = 0.03,
        first_plain: int = 4,
        refresh_every: int = 64,
        explore_every: int = 16,
        probe_min: int = 4,
        probe_max: int = 32,
    ):
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        self.max_draft = max_draft
        self.fixed = fixed
        self.arms = [_Arm([0.0] * max_draft, [0.0] * max_draft) for _ in range(arms)]
        self.prior_accept, self.prior_weight = prior_accept, prior_weight
        self.decay, self.idle_decay, self.alpha, self.margin = decay, idle_decay, alpha, margin
        self.first_plain, self.refresh_every = first_plain, refresh_every
        self.explore_every = explore_every
        self.probe_min, self.probe_max = probe_min, probe_max
        self.plain: float | None = None  # seconds per plain step
        self._since_spec = 0  # plain steps since the last speculative round
        self._probe_every = probe_min
        self._rounds_since_plain = 0
        self._rounds = 0  # speculative rounds chosen for their rate
        self._speculating = False  # the last choice was a speculative round that won

    # --- estimates ---------------------------------------------------------------------------

    def acceptance(self, arm: int) -> list[float]:
        """Estimated P(position i kept | positions before it kept), i = 0..K-1."""
        a = self.arms[arm]
        out, prior = [], self.prior_accept
        for hits, trials in zip(a.hits, a.trials, strict=True):
            prior = (hits + self.prior_weight * prior) / (trials + self.prior_weight)
            out.append(prior)
        return out

    def expected_tokens(self, arm: int, k: int) -> float:
        """E(k): tokens a round with k drafts emits, the recovered or bonus token included."""
        total, keep = 1.0, 1.0
        for a in self.acceptance(arm)[:k]:
            keep *= a
            total += keep
        return total

    def round_seconds(self, arm: int, k: int) -> float:
        """Predicted seconds of a round asking `arm` for k drafts (a drafter that proposes
        fewer than asked is charged for what it usually proposes)."""
        return self._seconds_at(arm, k * self.arms[arm].fill)

    def _seconds_at(self, arm: int, drafted: float) -> float:
        """Seconds of a round of `arm` that verifies `drafted` drafts."""
        plain = self.plain or 1.0
        prior = (1.05 * plain, 0.3 * plain)  # a pass over 2 tokens, a drafter of 0.2 steps
        seconds = self.arms[arm].seconds.at(drafted, prior, 0.01 * plain)
        return max(seconds, 0.5 * plain)  # a round is at least a target pass

    def rate(self, arm: int, k: int) -> float:
        """Predicted tokens per second of rounds asking `arm` for k drafts."""
        return self.expected_tokens(arm, k) / self.round_seconds(arm, k)

    # --- choice ------------------------------------------------------------------------------

    def _best(self, limit: int, available) -> tuple[float, int, int] | None:
        """(rate, arm, k) of the best round an arm can draft now, None if none can."""
        options = []
        for arm in range(len(self.arms)):
            cap = _cap(limit, available, arm)
            ks = range(1, cap + 1) if self.fixed is None else [min(self.fixed, cap)]
            options += [(self.rate(arm, k), arm, k) for k in ks if k > 0]
        return max(options) if options else None

    def choose(self, limit: int, available: list[int | None] | None = None) -> Choice:
        limit = min(limit, self.max_draft)
        if self.fixed is not None:
            best = self._best(limit, available)
            return Choice(best[1], best[2]) if best else Choice(0, 0)
        if self.plain is None or self._rounds_since_plain >= self.refresh_every:
            return Choice(plain_tokens=self.first_plain)
        best = self._best(limit, available)
        # What the drafters would promise if each could draft in full: a lookup that finds
        # nothing now may find something at the next token.
        ideal = best if available is None else self._best(limit, None)
        if ideal is None:
            return Choice(plain_tokens=1)
        needed = self.margin / 2 if self._speculating else self.margin
        if best is not None and best[0] * self.plain > 1 + needed:
            self._speculating = True
            rate, arm, k = best
            self._since_spec, self._probe_every = 0, self.probe_min
            self._rounds += 1
            if self._rounds % self.explore_every == 0:  # a neighbouring k keeps its estimates fresh
                step = 1 if self._rounds // self.explore_every % 2 else -1
                k = max(1, min(_cap(limit, available, arm), k + step))
            return Choice(arm, k)
        if ideal[0] * self.plain > 1 + needed:
            # Speculation would win but no drafter has enough to offer now: one plain step,
            # then look again (a pipelined stretch would pass over the next match).
            return Choice(plain_tokens=1)
        self._speculating = False
        if self._since_spec >= self._probe_every and best is not None:  # probe: it may win now
            self._since_spec = 0
            self._probe_every = min(2 * self._probe_every, self.probe_max)
            return Choice(best[1], best[2])
        return Choice(plain_tokens=max(1, self._probe_every - self._since_spec))

    # --- observations ------------------------------------------------------------------------

    def observe_round(
        self, arm: int, asked: int, drafted: int, accepted: int, seconds: float
    ) -> None:
        if asked <= 0:
            return
        self._rounds_since_plain += 1
        for i, other in enumerate(self.arms):
            factor = self.decay if i == arm else self.idle_decay
            other.hits = [h * factor for h in other.hits]
            other.trials = [t * factor for t in other.trials]
        a = self.arms[arm]
        # Positions past `drafted` were asked for but not proposed: they count as rejected.
        for i in range(min(accepted + 1, asked)):
            a.trials[i] += 1.0
            a.hits[i] += float(i < accepted)
        a.fill = _ema(a.fill, drafted / asked, self.alpha)
        predicted = self._seconds_at(arm, drafted) if a.seconds.sums[0] > 0 else seconds
        a.seconds.add(drafted, min(seconds, 3 * predicted), keep=self.decay)

    def observe_plain(self, tokens: int, seconds: float) -> None:
        weight = min(1.0, self.alpha * tokens)  # a long stretch counts as several samples
        self.plain = _ema(self.plain, seconds / tokens, weight)
        self._since_spec += tokens
        self._rounds_since_plain = 0

    def describe(self) -> str:
        return f"auto (1-{self.max_draft})" if self.fixed is None else str(self.fixed)
