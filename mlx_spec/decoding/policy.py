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
while it keeps losing, never so often that probing costs more than about 1% of the time.

On a busy machine short steps are now and then held up for several times their cost (a
preempted thread, a collection): a timing far over its prediction counts for little unless
three such come in a row (then the cost rose; `_held`), a round far quicker than a plain
step has the plain step timed again, one slow probe cannot put off the next by more than
four times the last interval, and the probe schedule runs on across generations (a server
or a benchmark generates many short replies).

A lookup drafter (n-gram) can have nothing to offer at a position; while it wins, the policy
then takes one synchronised plain step and looks again. Those waiting steps are charged to the
drafter: its rate is (E(k) + w) / (T(k) + w t_wait), w waiting steps per round.

`PolicyMemory` keeps policies across generations (per target, drafter and sampling settings),
so a process that generates repeatedly (a server, a chat, a benchmark) does not pay for
learning the same costs twice.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
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

    def add(self, x: float, y: float, keep: float, weight: float = 1.0) -> None:
        terms = (1.0, x, x * x, y, x * y)
        self.sums = [s * keep + weight * v for s, v in zip(self.sums, terms, strict=True)]

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
    rounds: float = 0.0  # decayed count of its rounds ...
    waits: float = 0.0  # ... and of the plain steps taken while it had nothing to offer
    held: int = 0  # its rounds in a row held up (`_held`)


def chain_acceptance(
    hits: list[float], trials: list[float], prior: float, weight: float
) -> list[float]:
    """P(position i kept | positions before it kept) from kept / reached counts, each position
    shrunk towards the estimate of the one before it (the first towards `prior`) with `weight`
    pseudo-rounds."""
    out = []
    for h, t in zip(hits, trials, strict=True):
        prior = (h + weight * prior) / (t + weight)
        out.append(prior)
    return out


def expected_tokens(acceptance: list[float], k: int) -> float:
    """E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i: tokens a round with k drafts emits."""
    total, keep = 1.0, 1.0
    for a in acceptance[:k]:
        keep *= a
        total += keep
    return total


def count_round(hits: list[float], trials: list[float], asked: int, accepted: int) -> None:
    """Count a round in place: positions up to the first rejection were reached, those before
    it kept. Positions asked for but not proposed (a lookup that found fewer) are rejections."""
    for i in range(min(accepted + 1, asked)):
        trials[i] += 1.0
        hits[i] += float(i < accepted)


def _cap(limit: int, available: list[int | None] | None, arm: int) -> int:
    """The most drafts `arm` can be asked for: the limit, or fewer if it has fewer to offer."""
    has = None if available is None else available[arm]
    return limit if has is None else min(limit, has)


def ema(old: float | None, new: float, alpha: float) -> float:
    """Running average; a sample over 3x the average (a preempted thread, a collection) is
    taken as 3x, so one outlier cannot swing a decision."""
    return new if old is None else old + alpha * (min(new, 3 * old) - old)


OUTLIER_WEIGHT = 0.25  # an outlier timing counts as this share of a sample, at its cap
HELD_RUN = 3  # ... unless this many came in a row: then the cost rose (counted as `_ema` does)


def _held(sample: float, predicted: float, cap: float, run: int) -> tuple[int, float, float]:
    """How a timing counts against its prediction: (held-up samples in a row, this one
    included, given `run` before it; the value; the weight). A sample over `cap` x the
    prediction (the thread was held up: by the scheduler, a collection) counts as `cap` x and
    as a quarter of a sample, so a held-up sample now and then moves an estimate by little;
    from the `HELD_RUN`th in a row on it is taken for a cost that rose, in full (at most 3x,
    as `_ema`)."""
    run = run + 1 if sample > cap * predicted else 0
    if run and run < HELD_RUN:
        return run, cap * predicted, OUTLIER_WEIGHT
    return run, min(sample, 3 * predicted), 1.0


def _timing(old: float | None, new: float, alpha: float, cap: float, run: int) -> tuple[float, int]:
    """A running average of a timing and the held-up samples in a row (`_held`)."""
    if old is None:
        return new, 0
    run, value, weight = _held(new, old, cap, run)
    return old + alpha * weight * (value - old), run


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
            doubles after each probe that does not win, up to probe_max, or further where a
            probe costs so much that probing every probe_max tokens would cost more than
            `probe_budget` of the time (then up to 8 times that interval).
        probe_budget: the share of decoding time that probing a losing drafter may cost.
        outlier: a timing over this many times its prediction counts as that much, and as
            a quarter of a sample, unless `HELD_RUN` such came in a row (`_held`). On a
            busy machine a step now and then takes several times its cost (the thread
            preempted, a collection); short steps would otherwise be judged by those. A
            round this much quicker than a plain step also has the plain step timed again.
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
        probe_budget: float = 0.01,
        outlier: float = 1.25,
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
        self.probe_min, self.probe_max, self.probe_budget = probe_min, probe_max, probe_budget
        self.outlier = outlier
        self.plain: float | None = None  # seconds per plain step, pipelined
        self.wait: float | None = None  # seconds of one synchronised plain step (a wait)
        self._since_spec = 0  # plain steps since the last speculative round
        self._probe_every = probe_min
        self._rounds_since_plain = 0
        self._rounds = 0  # speculative rounds chosen for their rate
        self._speculating = False  # the last choice was a speculative round that won
        self._waiting: int | None = None  # the arm a one-step wait was taken for
        self._retimed = False  # the plain step was timed again since the last refresh
        self._held_plain = self._held_wait = 0  # held-up timings in a row (`_held`)

    def state(self) -> dict:
        """What the policy learned (acceptance, costs, the probe schedule), JSON-ready."""
        arms = [
            {"hits": a.hits, "trials": a.trials, "seconds": a.seconds.sums, "fill": a.fill,
             "rounds": a.rounds, "waits": a.waits}
            for a in self.arms
        ]  # fmt: skip
        return {"arms": arms, "plain": self.plain, "wait": self.wait,
                "probe_every": self._probe_every, "since_spec": self._since_spec}  # fmt: skip

    def restore(self, state: dict) -> None:
        """Take up what an earlier policy of the same shape learned (`state`); a state of
        another shape (arms, draft lengths) is ignored."""
        arms = state.get("arms") or []
        if len(arms) != len(self.arms) or any(len(a["hits"]) != self.max_draft for a in arms):
            return
        for arm, saved in zip(self.arms, arms, strict=True):
            arm.hits, arm.trials = list(saved["hits"]), list(saved["trials"])
            arm.seconds.sums = list(saved["seconds"])
            arm.fill, arm.rounds, arm.waits = saved["fill"], saved["rounds"], saved["waits"]
        self.plain, self.wait = state.get("plain"), state.get("wait")
        self._probe_every = int(state.get("probe_every", self.probe_min))
        self._since_spec = int(state.get("since_spec", 0))
        self.resume()

    def resume(self) -> None:
        """Start another generation with what was learned (the estimates stay, and so does
        the probe schedule: plain steps count towards the next probe across generations, or
        replies shorter than the interval would never probe again; the plain step is timed
        again first, since the context and the machine's load may differ)."""
        self._waiting, self._speculating = None, False
        self._rounds_since_plain = self.refresh_every  # time a stretch of plain steps first

    # --- estimates ---------------------------------------------------------------------------

    def acceptance(self, arm: int) -> list[float]:
        """Estimated P(position i kept | positions before it kept), i = 0..K-1."""
        a = self.arms[arm]
        return chain_acceptance(a.hits, a.trials, self.prior_accept, self.prior_weight)

    def expected_tokens(self, arm: int, k: int) -> float:
        """E(k): tokens a round with k drafts emits, the recovered or bonus token included."""
        return expected_tokens(self.acceptance(arm), k)

    def round_seconds(self, arm: int, k: int) -> float:
        """Predicted seconds of a round asking `arm` for k drafts (a drafter that proposes
        fewer than asked is charged for what it usually proposes)."""
        return self._seconds_at(arm, k * self.arms[arm].fill)

    def _seconds_at(self, arm: int, drafted: float) -> float:
        """Seconds of a round of `arm` that verifies `drafted` drafts."""
        line = self.arms[arm].seconds
        plain = self.plain or 1.0
        # The prior's scale: a plain step, or the arm's measured round where that is less (a
        # round costs at least a step: a plain step timed through a preemption is too long).
        w, _, _, wy, _ = line.sums
        scale = min(plain, wy / w) if w > 0 else plain
        prior = (1.05 * scale, 0.3 * scale)  # a pass over 2 tokens, a drafter of 0.2 steps
        seconds = line.at(drafted, prior, 0.01 * plain)
        return max(seconds, 0.5 * plain)  # a round is at least a target pass

    def rate(self, arm: int, k: int) -> float:
        """Predicted tokens per second of rounds asking `arm` for k drafts."""
        return self.expected_tokens(arm, k) / self.round_seconds(arm, k)

    def mode_rate(self, arm: int, k: int) -> float:
        """Predicted tokens per second of drafting with `arm` whenever it has something to
        offer and waiting one synchronised plain step whenever it has not."""
        a = self.arms[arm]
        waits = a.waits / a.rounds if a.rounds > 0 else 0.0  # per round
        wait = self.wait or 1.1 * (self.plain or 1.0)
        tokens = self.expected_tokens(arm, k) + waits
        return tokens / (self.round_seconds(arm, k) + waits * wait)

    # --- choice ------------------------------------------------------------------------------

    def _best(self, limit: int, available, mode: bool = False) -> tuple[float, int, int] | None:
        """(rate, arm, k) of the best round an arm can draft now (`available`: per arm, what
        it has to offer; None: all it is asked for), or None if none can. `mode`: rank by
        `mode_rate`, the rate of drafting with the arm whenever it can."""
        options = []
        rate = self.mode_rate if mode else self.rate
        for arm in range(len(self.arms)):
            cap = _cap(limit, available, arm)
            ks = range(1, cap + 1) if self.fixed is None else [min(self.fixed, cap)]
            options += [(rate(arm, k), arm, k) for k in ks if k > 0]
        return max(options) if options else None

    def choose(self, limit: int, available: list[int | None] | None = None) -> Choice:
        limit = min(limit, self.max_draft)
        if self.fixed is not None:
            best = self._best(limit, available)
            return Choice(best[1], best[2]) if best else Choice(0, 0)
        if self.plain is None or self._rounds_since_plain >= self.refresh_every:
            return Choice(plain_tokens=self.first_plain)
        # Speculating pays when the best drafter, drafting whenever it has something to offer
        # and waiting a plain step otherwise, beats plain decoding.
        ideal = self._best(limit, None, mode=True)
        if ideal is None:  # no room for a draft
            return Choice(plain_tokens=1)
        needed = self.margin / 2 if self._speculating else self.margin
        best = self._best(limit, available)
        if ideal[0] * self.plain > 1 + needed:
            self._speculating = True
            self._since_spec, self._probe_every = 0, self.probe_min
            if best is None or best[0] * (self.wait or self.plain) < 1:
                self._waiting = ideal[1]  # nothing worth drafting now: one step, look again
                return Choice(plain_tokens=1)
            rate, arm, k = best
            self._rounds += 1
            if self._rounds % self.explore_every == 0:  # a neighbouring k keeps its estimates fresh
                step = 1 if self._rounds // self.explore_every % 2 else -1
                k = max(1, min(_cap(limit, available, arm), k + step))
            return Choice(arm, k)
        self._speculating = False
        if self._since_spec >= self._probe_every and best is not None:  # probe: it may win now
            self._since_spec = 0
            self._probe_every = self._next_probe_interval(best[1], best[2])
            return Choice(best[1], best[2])
        return Choice(plain_tokens=max(1, self._probe_every - self._since_spec))

    def _next_probe_interval(self, arm: int, k: int) -> int:
        """Plain steps before the probe after this one: twice the last interval, at least what
        keeps the probe's expected loss within `probe_budget` of the time in between, but at
        most four times the last (or `probe_max`): the loss is an estimate from few probes, and
        one slow probe must not put off the next for hundreds of tokens."""
        loss = self.round_seconds(arm, k) - self.expected_tokens(arm, k) * self.plain
        need = max(0.0, loss) / (self.probe_budget * self.plain)
        cap = min(max(self.probe_max, 8 * need), max(self.probe_max, 4 * self._probe_every))
        return int(min(max(2 * self._probe_every, math.ceil(need)), cap))

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
            other.rounds, other.waits = other.rounds * factor, other.waits * factor
        a = self.arms[arm]
        a.rounds += 1.0
        count_round(a.hits, a.trials, asked, accepted)
        a.fill = ema(a.fill, drafted / asked, self.alpha)
        predicted = self._seconds_at(arm, drafted)
        # Before its first round an arm is predicted by the prior, which may miss a costly
        # drafter by more than `outlier`: then only a far outlier is cut.
        cap = self.outlier if a.seconds.sums[0] > 0 else 3.0
        a.held, value, weight = _held(seconds, predicted, cap, a.held)
        a.seconds.add(drafted, value, keep=self.decay, weight=weight)
        if self.plain is not None and seconds * self.outlier < self.plain and not self._retimed:
            # A round is a target pass at least: the plain timing was held up. Time it again
            # (once between refreshes, in case rounds here really are that quick).
            self.plain, self._retimed = None, True

    def observe_plain(self, tokens: int, seconds: float) -> None:
        if self._waiting is not None:  # a wait: charged to the drafter that had nothing
            self.arms[self._waiting].waits += tokens
            self.wait, self._held_wait = _timing(
                self.wait, seconds / tokens, self.alpha, self.outlier, self._held_wait
            )
            self._waiting = None
            return
        if self._rounds_since_plain >= self.refresh_every:
            self._retimed = False
        weight = min(1.0, self.alpha * tokens)  # a long stretch counts as several samples
        self.plain, self._held_plain = _timing(
            self.plain, seconds / tokens, weight, self.outlier, self._held_plain
        )
        self._since_spec += tokens
        self._rounds_since_plain = 0

    def describe(self) -> str:
        return f"auto (1-{self.max_draft})" if self.fixed is None else str(self.fixed)


class PolicyMemory:
    """Policies kept across generations of one target, keyed by drafter and sampling settings,
    so that what one generation measured (acceptance, costs, which drafter wins) serves the
    next. Held by the target model (`memory_of`)."""

    def __init__(self, max_entries: int = 64):
        self.max_entries = max_entries
        self._policies: dict[Hashable, DraftPolicy] = {}

    def get(self, key: Hashable, make) -> DraftPolicy:
        """The policy kept under `key` (resumed for a new generation), or `make()`'s."""
        policy = self._policies.pop(key, None)
        if policy is None:
            policy = make()
        elif isinstance(policy, AdaptiveDraftLength):
            policy.resume()
        self._policies[key] = policy  # most recently used last
        while len(self._policies) > self.max_entries:
            self._policies.pop(next(iter(self._policies)))
        return policy


_MEMORY_ATTR = "_mlx_spec_policy_memory"


def memory_of(model) -> PolicyMemory:
    """The `PolicyMemory` attached to a target model (created on first use)."""
    memory = getattr(model, _MEMORY_ATTR, None)
    if memory is None:
        memory = PolicyMemory()
        object.__setattr__(model, _MEMORY_ATTR, memory)
    return memory
