"""A model with its cache: prefill, forward passes, and checked rollback with replay."""

from __future__ import annotations

from collections.abc import Generator

from mlx_spec.caches.rollback import (
    CacheRollback,
    PrefixSnapshot,
    cache_nbytes,
    can_cut,
    check_length,
    cut_cache,
    needs_snapshot,
)
from mlx_spec.caches.taps import tap_for
from mlx_spec.decoding import distributed

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

PREFILL_STEP = 2048


def context_limit(model: nn.Module) -> int | None:
    """The model's maximum sequence length from its config, if it declares one."""
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        if isinstance(source, dict):
            limit = source.get("max_position_embeddings")
        else:
            limit = getattr(source, "max_position_embeddings", None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return None


class ModelRunner:
    """Runs one model over a token stream, keeping its cache rollback-ready.

    Args:
        model: an mlx-lm model.
        vocab_size: logits are cut to the tokenizer's vocabulary (padded rows never sampled).
        rollback: make the cache rollback-ready (refuses cache types that cannot roll back);
            plain decoding needs no rollback.
        keep_hidden: record the final hidden states (the head's input) of every pass, for
            drafters that condition on them; a tuple of layer ids: those layers' features,
            concatenated (see `hidden.LayerFeatures`).
    """

    def __init__(
        self,
        model: nn.Module,
        vocab_size: int,
        *,
        rollback: bool = True,
        keep_hidden: bool | tuple[int, ...] = False,
    ):
        self.model = model
        self.vocab_size = vocab_size
        self.context_limit = context_limit(model)
        self.cache = make_prompt_cache(model)
        self._rollback = CacheRollback(self.cache) if rollback else None
        self._tap = tap_for(model, keep_hidden)
        self.length = 0  # tokens in the cache
        self._fed: list[tuple[mx.array, mx.array | None]] = []
        self.replays = 0
        self.sync = distributed.sync_for(model)  # a sharded target's rank-0 sharing, else None

    def _forward(self, tokens: mx.array, hidden: mx.array | None) -> mx.array:
        if hidden is None:
            return self.model(tokens[None], cache=self.cache)
        return self.model(tokens[None], cache=self.cache, hidden=hidden[None])

    @property
    def last_hidden(self) -> mx.array:
        """`[S, hidden]` final hidden states of the last pass (needs keep_hidden)."""
        return self._tap.hidden[0]

    def prefill(self, tokens: list[int], hidden: mx.array | None = None) -> mx.array | None:
        """Feed tokens whose logits are not needed, in chunks, and evaluate the cache.

        Args:
            tokens: ids to feed.
            hidden: `[len(tokens), d]` per-token conditioning for models that take it (MTP).
        Returns:
            `[len(tokens), hidden]` final hidden states when the runner keeps them, else None.
        """
        steps = self.prefill_steps(tokens, hidden)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def prefill_steps(
        self, tokens: list[int], hidden: mx.array | None = None, step: int = PREFILL_STEP
    ) -> Generator[int, None, mx.array | None]:
        """`prefill` one chunk of `step` tokens at a time: yields the number of tokens fed
        after every chunk but the last (so a scheduler can run other work in between) and
        returns what `prefill` returns."""
        kept = []
        for start in range(0, len(tokens), step):
            chunk = mx.array(tokens[start : start + step], mx.uint32)
            cond = None if hidden is None else hidden[start : start + step]
            self._forward(chunk, cond)
            kept += [self.last_hidden] if self._tap else []
            mx.eval([c.state for c in self.cache], kept[-1:])
            self.length += chunk.size
            if start + step < len(tokens):
                yield start + step
        if self._tap is None:
            return None
        return mx.concatenate(kept) if kept else mx.zeros((0, 1))

    def truncate(self, length: int) -> bool:
        """Keep only the first `length` cached tokens, in place, when every cache can be cut
        exactly (see `cache.cut_cache`); returns False, changing nothing, when one cannot."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate {self.length} cached tokens to {length}")
        if not cut_cache(self.cache, self.length - length):
            return False
        self.length = length
        check_length(self.cache, length)
        return True

    def can_truncate(self, length: int) -> bool:
        """Whether `truncate(length)` would succeed."""
        return 0 <= length <= self.length and can_cut(self.cache, self.length - length)

    def snapshot(self) -> PrefixSnapshot | None:
        """The cache state now, for `restore` after more tokens were fed; None when every
        cache can be cut in place anyway (`truncate` is enough)."""
        return PrefixSnapshot(self.cache, self.length) if needs_snapshot(self.cache) else None

    def restore(self, snapshot: PrefixSnapshot) -> None:
        """Go back to a snapshot of this runner's cache (taken at fewer tokens)."""
        snapshot.restore(self.cache, self.length)
        self.length = snapshot.length

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache."""
        return cache_nbytes(self.cache)

    def checkpoint(self, num_tokens: int, single_call: bool) -> None:
        """Mark the cache state before feeding up to `num_tokens` tokens."""
        self._rollback.checkpoint(num_tokens, single_call)
        self._fed = []

    def __call__(self, tokens: mx.array, hidden: mx.array | None = None) -> mx.array:
        """Feed `[S]` tokens (with `[S, d]` conditioning for MTP modules); returns `[S, vocab]`
        logits cut to the tokenizer vocabulary."""
        logits = self._forward(tokens, hidden)[0]
        self._fed.append((tokens, hidden))
        self.length += tokens.size
        return logits[:, : self.vocab_size]

    def rollback(self, num_keep: int) -> None:
        """Keep the first `num_keep` tokens fed since the checkpoint, drop the rest."""
        num_fed = sum(t.size for t, _ in self._fed)
        single_call = len(self._fed) == 1 and num_fed > 1
        if self._rollback.rollback(num_fed, num_keep, single_call):
            self.length -= num_fed
            self.replays += 1
            if num_keep:
                kept = mx.concatenate([t for t, _ in self._fed])[:num_keep]
                cond = (
                    None
                    if self._fed[0][1] is None
                    else mx.concatenate([h for _, h in self._fed])[:num_keep]
                )
                self._forward(kept, cond)
                mx.eval([c.state for c in self.cache])
                self.length += num_keep
        else:
            self.length -= num_fed - num_keep
        self._fed = []
        self._rollback.verify(self.length)
