"""The decode loops: plain (mlx-lm's pipelined step) and draft -> verify -> rollback rounds."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from mlx_spec.core import clock
from mlx_spec.core.sampling import SamplingConfig, logits_to_probs, pick
from mlx_spec.core.stats import SpecStats
from mlx_spec.core.verify import greedy_verify, rejection_verify
from mlx_spec.decoding.policy import Choice, DraftPolicy, FixedDraftLength
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.drafters.base import Drafter

import mlx.core as mx
from mlx_lm.generate import generate_step


@dataclass
class Round:
    """What one target pass added: accepted drafts then the recovered or bonus token.

    `keep`: set by a consumer whose output ends inside a speculative round (EOS, a stop string,
    or it stops listening) to the number of `tokens` that stay in the sequence; the caches are
    then rolled back to that point instead of to the whole round (None keeps all of it).
    """

    tokens: list[int]
    num_drafted: int
    num_accepted: int
    seconds: float
    keep: int | None = None
    drafter: str | None = None  # the drafter (a group's arm) that drafted it; None: plain


def room_left(runner: ModelRunner) -> int | None:
    """Tokens that may still be generated before the sequence fills the runner's context (the
    pending last token, not yet in the cache, takes a place), or None when unbounded."""
    if runner.context_limit is None:
        return None
    return runner.context_limit - runner.length - 1


def _make_sampler(sampling: SamplingConfig, vocab_size: int, sync=None):
    def sampler(logprobs: mx.array) -> mx.array:  # [1, padded_vocab] -> [1]
        token = pick(logprobs[..., :vocab_size], sampling)
        return token if sync is None else sync.share(token)  # rank 0's token on every rank

    return sampler


def plain_rounds(
    target: ModelRunner,
    last: int,
    *,
    sampling: SamplingConfig,
    max_tokens: int,
    trace: list[int] | None = None,
) -> Iterator[Round]:
    """Plain decoding, one token per target pass, through mlx-lm's pipelined `generate_step`.

    The pipeline feeds each token before it is yielded, so the cache holds `last` and every
    yielded token (`target.length` counts them); `trace` (if given) gets each yielded token.
    """
    room = room_left(target)
    budget = max_tokens if room is None else min(max_tokens, room)
    if budget <= 0:
        return
    steps = generate_step(
        mx.array([last], mx.uint32),
        target.model,
        max_tokens=budget,
        sampler=_make_sampler(sampling, target.vocab_size, target.sync),
        prompt_cache=target.cache,
    )
    tic = clock.now()
    target.length += 1  # `last`, fed by the first step
    for token, _ in steps:
        target.length += 1
        if trace is not None:
            trace.append(token)
        now = clock.now()
        yield Round([token], 0, 0, now - tic)
        tic = now


def draft_budget(num_draft: int, remaining: int, target: ModelRunner) -> int:
    """Drafts for this round: never more than the output budget or the target's context allow."""
    k = min(num_draft, remaining - 1)
    room = room_left(target)
    if room is not None:
        k = min(k, room - 1)  # the pass writes last + k drafts
    return max(k, 0)


def _verify(logits: mx.array, tokens: mx.array, draft_probs, sampling: SamplingConfig):
    if sampling.greedy:
        return greedy_verify(logits, tokens)
    return rejection_verify(logits_to_probs(logits, sampling), draft_probs, tokens)


def _share_outcome(sync, num_accepted: mx.array, next_token: mx.array):
    """Rank 0's accepted count and next token on every rank (one collective), so that every
    rank of a sharded target keeps the same tokens and rolls back by the same amount."""
    if sync is None:
        return num_accepted, next_token
    both = mx.stack([num_accepted.astype(mx.int32), next_token.reshape(()).astype(mx.int32)])
    both = sync.share(both)
    return both[0], both[1]


class _Decoder:
    """The state of one speculative generation: the pending token, what was produced, timing."""

    def __init__(self, target, drafter, last, policy, sampling, max_tokens, stats, trace, phases):
        self.target, self.drafter, self.policy = target, drafter, policy
        self.sampling, self.max_tokens, self.stats, self.trace = sampling, max_tokens, stats, trace
        self.last, self.produced = last, 0
        self.phases = phases  # a PhaseTimer when the round is being profiled
        self._last_arm: int | None = None  # the arm of the last round (None: plain steps)

    def _mark(self, phase: str, *arrays) -> None:
        if self.phases is not None:
            self.phases.mark(phase, *arrays)

    def room(self) -> bool:
        left = room_left(self.target)
        return self.produced < self.max_tokens and (left is None or left > 0)

    def _commit(self, tokens: list[int]) -> None:
        self.produced += len(tokens)
        self.last = tokens[-1]
        if self.trace is not None:
            self.trace.extend(tokens)

    def spec_round(self, arm: int, k: int) -> Iterator[Round]:
        """One draft -> verify round, settled when the consumer asks for more (or closes)."""
        target, drafter, sampling = self.target, self.drafter, self.sampling
        start = clock.now()
        self._mark("policy")
        drafter.select(arm)
        drafter.catch_up()
        self._mark("drafter catch-up")
        tic = clock.now()
        # Catching up on plain steps is the price of keeping speculation on hand, paid whatever
        # is chosen; catching up on another drafter's rounds is the price of switching to this one.
        switching = self._last_arm is not None and self._last_arm != arm
        self._last_arm = arm
        draft = drafter.draft(k, sampling)
        self._mark("drafting", draft.tokens, draft.probs)
        drafted = draft.tokens.size
        target.checkpoint(drafted + 1, single_call=True)
        sync = target.sync  # a sharded target: every rank verifies rank 0's drafts
        proposed = draft.tokens if sync is None or not drafted else sync.share_input(draft.tokens)
        inputs = mx.concatenate([mx.array([self.last], mx.uint32), proposed.astype(mx.uint32)])
        num_accepted, next_token = _verify(target(inputs), proposed, draft.probs, sampling)
        num_accepted, next_token = _share_outcome(sync, num_accepted, next_token)
        hidden = target.last_hidden if drafter.needs_hidden else None  # before any replay
        self._mark("building the verify graph")
        mx.eval(num_accepted, next_token, proposed)
        self._mark("target pass + verification")
        n = num_accepted.item()
        tokens = proposed.tolist()[:n] + [next_token.item()]
        rnd = Round(tokens, drafted, n, clock.now() - start, drafter=drafter.arm_names[arm])
        self._mark("reading the result")
        try:
            yield rnd
        finally:
            settle = clock.now()
            if self.phases is not None:
                self.phases.start()
            keep = _settle(target, drafter, rnd, hidden)
            self._commit(rnd.tokens[:keep])
            self._mark("rollback + drafter update")
            done = clock.now()
            self.stats.rollback_seconds += done - settle
            spent = rnd.seconds - (0.0 if switching else tic - start) + done - settle
            self.policy.observe_round(arm, k, drafted, n, spent)
            self.stats.observe_choice(drafter.arm_names[arm], k)
            self._mark("policy")

    def plain_stretch(self, count: int) -> Iterator[Round]:
        """Up to `count` plain decoding steps, pipelined: each step's pass is queued before the
        token of the step before it is read. The drafter follows every token. A consumer that
        closes early gets the token queued ahead of it taken back out of the target's cache, so
        the invariant of the speculative rounds holds: the target holds all but `last`."""
        target = self.target
        count = min(count, self.max_tokens - self.produced)
        left = room_left(target)
        count = count if left is None else min(count, left)
        if count <= 0:
            return
        tic = clock.now()
        token, hidden = self._plain_step(mx.array([self.last], mx.uint32))
        rnd, ahead, settled, spent = None, None, True, 0.0
        try:
            for i in range(count):
                self._last_arm = None
                ahead = self._plain_step(token) if i < count - 1 else None
                rnd = Round([token.item()], 0, 0, clock.now() - tic)
                spent += rnd.seconds
                self.stats.observe_choice(None, 0)
                settled = False
                yield rnd
                self._follow(rnd, hidden)
                settled = True
                tic = clock.now()
                if ahead is not None:
                    token, hidden = ahead
        finally:
            if not settled:  # closed after `rnd`: its token stays pending
                if ahead is not None:
                    target.rollback(0)  # undo the pass queued ahead over it
                self._follow(rnd, hidden)
            if rnd is not None:  # the stretch as a whole: its start is not overlapped
                self.policy.observe_plain(i + 1, spent)

    def _follow(self, rnd: Round, hidden: mx.array | None) -> None:
        self.drafter.accept(0, rnd.tokens, hidden)
        self._commit(rnd.tokens)

    def _plain_step(self, token: mx.array) -> tuple[mx.array, mx.array | None]:
        """Queue one pass over `[1]` token: (`[1]` next id, `[1, T]` hidden at its position)."""
        self.target.checkpoint(1, single_call=True)
        nxt = pick(self.target(token), self.sampling)
        if self.target.sync is not None:
            nxt = self.target.sync.share(nxt)
        hidden = self.target.last_hidden[-1:] if self.drafter.needs_hidden else None
        mx.async_eval(nxt)
        return nxt, hidden


def speculative_rounds(
    target: ModelRunner,
    drafter: Drafter,
    last: int,
    *,
    policy: DraftPolicy,
    sampling: SamplingConfig,
    max_tokens: int,
    stats: SpecStats,
    trace: list[int] | None = None,
    phases=None,
) -> Iterator[Round]:
    """Draft -> verify -> rollback rounds (and plain stretches, when the policy asks for them)
    until `max_tokens` or the context is used up.

    `target` holds every token but `last`; the drafter has been begun on the same sequence.
    A round is settled (target rolled back to the kept tokens, drafter told) when the consumer
    asks for the next one or closes the generator, so that it can first cut the round with
    `Round.keep`. After settling, the caches hold the sequence up to its last kept token, which
    is pending; `trace` (if given) gets the kept tokens. `phases` (a `profile.PhaseTimer`)
    times the phases of every speculative round, adding synchronisations to split them.
    """
    run = _Decoder(target, drafter, last, policy, sampling, max_tokens, stats, trace, phases)
    while run.room():
        if phases is not None:
            phases.start()
        limit = draft_budget(policy.max_draft, max_tokens - run.produced, target)
        choice = policy.choose(limit, drafter.arms_available(limit))
        if target.sync is not None and not isinstance(policy, FixedDraftLength):
            # a measuring policy decides on each rank's own clock: rank 0's choice holds
            arm, num_draft, plain = target.sync.share_ints(
                [choice.arm, choice.num_draft, choice.plain_tokens]
            )
            choice = Choice(arm, num_draft, plain)
        if choice.plain_tokens:
            yield from run.plain_stretch(choice.plain_tokens)
        else:
            yield from run.spec_round(choice.arm, min(choice.num_draft, limit))


def _settle(target: ModelRunner, drafter: Drafter, rnd: Round, hidden) -> int:
    """Roll the target back to the round's kept tokens and tell the drafter; returns how many
    of the round's tokens were kept (at least one: the last kept token becomes pending)."""
    keep = len(rnd.tokens) if rnd.keep is None else max(1, min(rnd.keep, len(rnd.tokens)))
    target.rollback(keep)  # fed: last + the drafts; kept: last + the first keep - 1 tokens
    # A cut inside the accepted run looks to the drafter like a rejection after keep - 1 drafts.
    drafter.accept(keep - 1, rnd.tokens[:keep], None if hidden is None else hidden[:keep])
    return keep
