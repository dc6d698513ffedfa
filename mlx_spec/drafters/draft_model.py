"""A small model with the target's tokenizer, drafting autoregressively with its own cache."""

from __future__ import annotations

from mlx_spec.core.compat import check_model_covers_vocab, check_same_tokenizer
from mlx_spec.core.sampling import SamplingConfig, greedy, logits_to_probs, sample
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.drafters.base import Draft, Drafter, unique_id

import mlx.core as mx
import mlx.nn as nn

CATCH_UP = 4  # pending tokens fed ahead of a draft; fewer ride along with its first step


def context_budget(runner: ModelRunner, k: int, num_pending: int) -> int:
    """Drafts that fit the drafter's context: drafting k feeds pending + (k - 1) tokens."""
    if runner.context_limit is None:
        return k
    return max(0, min(k, runner.context_limit - runner.length - num_pending + 1))


def pick_token(logits: mx.array, sampling: SamplingConfig) -> tuple[mx.array, mx.array | None]:
    """The drafted token from `[vocab]` logits and the distribution it was drawn from (None
    when greedy: verification is then exact match)."""
    if sampling.greedy:
        return greedy(logits), None
    probs = logits_to_probs(logits, sampling)
    return sample(probs), probs


def draft_steps(
    runner: ModelRunner,
    inputs: mx.array,
    k: int,
    sampling: SamplingConfig,
    hidden: mx.array | None = None,
    feedback=None,
) -> Draft:
    """k autoregressive steps: feed `inputs` (`[S]`, with `[S, d]` hidden for MTP modules),
    take the last position's draw, feed it back (with `feedback()` as its hidden)."""
    tokens, probs = [], []
    for i in range(k):
        token, dist = pick_token(runner(inputs, hidden)[-1], sampling)  # from [vocab] logits
        probs += [] if dist is None else [dist]
        mx.async_eval(token)
        tokens.append(token)
        if i < k - 1:
            inputs = token[None]
            hidden = None if feedback is None else feedback()
    return Draft(mx.stack(tokens), mx.stack(probs) if probs else None)


class DraftModelDrafter(Drafter):
    """Draft k tokens with a small model.

    Its cache holds every token except `pending` (tokens emitted but not yet fed). After a
    rejection the cache rolls back to the accepted prefix; after a full acceptance the last draft
    token is still pending, so the next round feeds it together with the bonus token (catch-up).

    Args:
        model: an mlx-lm model.
        tokenizer: its tokenizer, which must equal the target's.
    """

    name = "draft-model"

    @property
    def identity(self):
        return (self.name, unique_id(self.model))

    def __init__(self, model: nn.Module, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.runner: ModelRunner | None = None
        self._pending: list[int] = []
        self._num_drafted = 0
        self._idle = False

    def check_compatible(self, target: nn.Module, tokenizer, vocab_size: int) -> None:
        check_same_tokenizer(tokenizer, self.tokenizer)
        check_model_covers_vocab(self.model, vocab_size, "draft")

    def begin(self, prompt: list[int], vocab_size: int, hidden=None) -> None:
        self.runner = ModelRunner(self.model, vocab_size)
        limit = self.runner.context_limit
        # A prompt that does not fit the drafter's context leaves it idle (plain decoding).
        self._idle = limit is not None and len(prompt) >= limit
        if not self._idle:
            self.runner.prefill(prompt[:-1])
        self._pending = [prompt[-1]]
        self._num_drafted = 0

    def extend(self, prompt, common, vocab_size, hidden=None, hidden_start=0) -> bool:
        """Cut the cache back to the shared prefix and prefill only the new tokens."""
        keep = 0 if self.runner is None else min(self.runner.length, common, len(prompt) - 1)
        limit = None if self.runner is None else self.runner.context_limit
        if self._idle or keep == 0 or (limit is not None and len(prompt) >= limit):
            self.begin(prompt, vocab_size)
            return True
        if not self.runner.truncate(keep):  # a recurrent or wrapped cache: start afresh
            self.begin(prompt, vocab_size)
            return True
        self.runner.prefill(prompt[keep:-1])
        self._pending = [prompt[-1]]
        self._num_drafted = 0
        return True

    def catch_up(self) -> None:
        """Prefill every pending token but the last (which the next draft feeds)."""
        backlog = self._pending[:-1]
        limit = None if self.runner is None else self.runner.context_limit
        if self._idle or len(backlog) < CATCH_UP or self._num_drafted:
            return
        if limit is not None and self.runner.length + len(self._pending) >= limit:
            return  # near the context limit: draft() decides what still fits
        self.runner.prefill(backlog)
        self._pending = self._pending[-1:]

    def draft(self, k: int, sampling: SamplingConfig) -> Draft:
        k = 0 if self._idle else context_budget(self.runner, k, len(self._pending))
        self._num_drafted = 0
        if k == 0:
            return Draft.empty()
        self.runner.checkpoint(len(self._pending) + k - 1, single_call=False)
        draft = draft_steps(self.runner, mx.array(self._pending, mx.uint32), k, sampling)
        self._num_drafted = k
        return draft

    def accept(self, num_accepted: int, emitted: list[int], hidden=None) -> None:
        k = self._num_drafted
        if k == 0:
            self._pending += emitted
            return
        # Fed this round: pending + drafts[:k-1]. Keep pending + the accepted drafts; after a
        # full acceptance the last draft was never fed and stays pending with the bonus token.
        fed = len(self._pending) + k - 1
        keep = fed if num_accepted == k else len(self._pending) + num_accepted
        self.runner.rollback(keep)
        self._pending = emitted[keep - len(self._pending) :]
        self._num_drafted = 0
