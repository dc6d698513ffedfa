"""The decode loops: plain (mlx-lm's pipelined step) and draft -> verify -> rollback rounds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from mlx_spec.drafters.base import Drafter
from mlx_spec.runner import ModelRunner
from mlx_spec.sampling import SamplingConfig, greedy, logits_to_probs, sample
from mlx_spec.stats import SpecStats
from mlx_spec.verify import greedy_verify, rejection_verify

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


def room_left(runner: ModelRunner) -> int | None:
    """Tokens that may still be generated before the sequence fills the runner's context (the
    pending last token, not yet in the cache, takes a place), or None when unbounded."""
    if runner.context_limit is None:
        return None
    return runner.context_limit - runner.length - 1


def _make_sampler(sampling: SamplingConfig, vocab_size: int):
    def sampler(logprobs: mx.array) -> mx.array:  # [1, padded_vocab] -> [1]
        logits = logprobs[..., :vocab_size]
        return greedy(logits) if sampling.greedy else sample(logits_to_probs(logits, sampling))

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
        sampler=_make_sampler(sampling, target.vocab_size),
        prompt_cache=target.cache,
    )
    tic = time.perf_counter()
    target.length += 1  # `last`, fed by the first step
    for token, _ in steps:
        target.length += 1
        if trace is not None:
            trace.append(token)
        now = time.perf_counter()
        yield Round([token], 0, 0, now - tic)
        tic = now


def draft_budget(num_draft: int, remaining: int, target: ModelRunner) -> int:
    """Drafts for this round: never more than the output budget or the target's context allow."""
    k = min(num_draft, remaining - 1)
    room = room_left(target)
    if room is not None:
        k = min(k, room - 1)  # the pass writes last + k drafts
    return max(k, 0)


def _verify(logits: mx.array, draft, sampling: SamplingConfig):
    if sampling.greedy:
        return greedy_verify(logits, draft.tokens)
    return rejection_verify(logits_to_probs(logits, sampling), draft.probs, draft.tokens)


def speculative_rounds(
    target: ModelRunner,
    drafter: Drafter,
    last: int,
    *,
    num_draft: int,
    sampling: SamplingConfig,
    max_tokens: int,
    stats: SpecStats,
    trace: list[int] | None = None,
) -> Iterator[Round]:
    """Draft -> verify -> rollback rounds until `max_tokens` or the context is used up.

    `target` holds every token but `last`; the drafter has been begun on the same sequence.
    A round is settled (target rolled back to the kept tokens, drafter told) when the consumer
    asks for the next one or closes the generator, so that it can first cut the round with
    `Round.keep`. After settling, the caches hold the sequence up to its last kept token, which
    is pending; `trace` (if given) gets the kept tokens.
    """
    produced = 0
    tic = time.perf_counter()
    while produced < max_tokens and (room_left(target) is None or room_left(target) > 0):
        draft = drafter.draft(draft_budget(num_draft, max_tokens - produced, target), sampling)
        k = draft.tokens.size
        target.checkpoint(k + 1, single_call=True)
        inputs = mx.concatenate([mx.array([last], mx.uint32), draft.tokens.astype(mx.uint32)])
        num_accepted, next_token = _verify(target(inputs), draft, sampling)
        hidden = target.last_hidden if drafter.needs_hidden else None  # before any replay
        mx.eval(num_accepted, next_token, draft.tokens)
        n = num_accepted.item()
        tokens = draft.tokens.tolist()[:n] + [next_token.item()]
        rnd = Round(tokens, k, n, time.perf_counter() - tic)
        try:
            yield rnd
        finally:
            tic = time.perf_counter()  # settling counts towards the next round's latency
            keep = _settle(target, drafter, rnd, hidden, trace)
            stats.rollback_seconds += time.perf_counter() - tic
        produced += keep
        last = rnd.tokens[keep - 1]


def _settle(target: ModelRunner, drafter: Drafter, rnd: Round, hidden, trace) -> int:
    """Roll the target back to the round's kept tokens and tell the drafter; returns how many
    of the round's tokens were kept (at least one: the last kept token becomes pending)."""
    keep = len(rnd.tokens) if rnd.keep is None else max(1, min(rnd.keep, len(rnd.tokens)))
    target.rollback(keep)  # fed: last + the drafts; kept: last + the first keep - 1 tokens
    # A cut inside the accepted run looks to the drafter like a rejection after keep - 1 drafts.
    drafter.accept(keep - 1, rnd.tokens[:keep], None if hidden is None else hidden[:keep])
    if trace is not None:
        trace.extend(rnd.tokens[:keep])
    return keep
