"""A model with its cache: prefill, forward passes, and checked rollback with replay."""

from __future__ import annotations

from mlx_spec.cache import CacheRollback

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
    """

    def __init__(self, model: nn.Module, vocab_size: int, *, rollback: bool = True):
        self.model = model
        self.vocab_size = vocab_size
        self.context_limit = context_limit(model)
        self.cache = make_prompt_cache(model)
        self._rollback = CacheRollback(self.cache) if rollback else None
        self.length = 0  # tokens in the cache
        self._fed: list[mx.array] = []
        self.replays = 0

    def prefill(self, tokens: list[int]) -> None:
        """Feed tokens whose logits are not needed, in chunks, and evaluate the cache."""
        for start in range(0, len(tokens), PREFILL_STEP):
            chunk = mx.array(tokens[start : start + PREFILL_STEP], mx.uint32)
            self.model(chunk[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.length += chunk.size

    def checkpoint(self, num_tokens: int, single_call: bool) -> None:
        """Mark the cache state before feeding up to `num_tokens` tokens."""
        self._rollback.checkpoint(num_tokens, single_call)
        self._fed = []

    def __call__(self, tokens: mx.array) -> mx.array:
        """Feed `[S]` tokens; returns `[S, vocab]` logits cut to the tokenizer vocabulary."""
        logits = self.model(tokens[None], cache=self.cache)[0]
        self._fed.append(tokens)
        self.length += tokens.size
        return logits[:, : self.vocab_size]

    def rollback(self, num_keep: int) -> None:
        """Keep the first `num_keep` tokens fed since the checkpoint, drop the rest."""
        num_fed = sum(t.size for t in self._fed)
        single_call = len(self._fed) == 1 and num_fed > 1
        if self._rollback.rollback(num_fed, num_keep, single_call):
            self.length -= num_fed
            self.replays += 1
            if num_keep:
                kept = mx.concatenate(self._fed)[:num_keep]
                self.model(kept[None], cache=self.cache)
                mx.eval([c.state for c in self.cache])
                self.length += num_keep
        else:
            self.length -= num_fed - num_keep
        self._fed = []
        self._rollback.verify(self.length)
