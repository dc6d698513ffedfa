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
    """What one target pass added: accepted drafts then the recovered or bonus token."""

    tokens: list[int]
    num_drafted: int
    num_accepted: int
    seconds: float


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
    target: ModelRunner, last: int, *, sampling: SamplingConfig, max_tokens: int
) -> Iterator[Round]:
    """Plain decoding, one token per target pass, through mlx-lm's pipelined `generate_step`."""
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
    for token, _ in steps:
        target.length += 1
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
) -> Iterator[Round]:
    """Draft -> verify -> rollback rounds until `max_tokens` or the context is used up.

    `target` holds every token but `last`; the drafter has been begun on the same sequence.
    """
    produced = 0
    while produced < max_tokens and (room_left(target) is None or room_left(target) > 0):
        tic = time.perf_counter()
        draft = drafter.draft(draft_budget(num_draft, max_tokens - produced, target), sampling)
        k = draft.tokens.size
        target.checkpoint(k + 1, single_call=True)
        inputs = mx.concatenate([mx.array([last], mx.uint32), draft.tokens.astype(mx.uint32)])
        num_accepted, next_token = _verify(target(inputs), draft, sampling)
        hidden = target.last_hidden if drafter.needs_hidden else None  # before any replay
        mx.eval(num_accepted, next_token, draft.tokens)
        n = num_accepted.item()
        tokens = draft.tokens.tolist()[:n] + [next_token.item()]
        rollback_tic = time.perf_counter()
        target.rollback(n + 1)
        drafter.accept(n, tokens, None if hidden is None else hidden[: n + 1])
        stats.rollback_seconds += time.perf_counter() - rollback_tic
        produced += len(tokens)
        last = tokens[-1]
        yield Round(tokens, k, n, time.perf_counter() - tic)
