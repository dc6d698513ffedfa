"""Logits to probabilities: the one place where temperature, top-k, top-p and min-p live.

The target and every drafter go through `logits_to_probs`, so the `draft_probs` that a drafter
hands to the verifier are exactly the distribution its tokens were sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings shared by the target and the drafters.

    Args:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of tokens whose mass reaches top_p (1.0 = off).
        min_p: drop tokens whose probability is below min_p times the top one (0 = off).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: mx.array, config: SamplingConfig) -> mx.array:
    """Turn logits into the sampling distribution, row-wise.

    Args:
        logits: `[..., vocab]` raw logits.
        config: the sampling settings; must not be greedy.
    Returns:
        `[..., vocab]` float32 probabilities; filtered tokens have probability exactly 0.
    """
    logits = logits.astype(mx.float32) / config.temperature
    vocab = logits.shape[-1]
    if 0 < config.top_k < vocab:
        kth = mx.topk(logits, config.top_k, axis=-1).min(axis=-1, keepdims=True)
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if config.top_p < 1.0:
        probs = _top_p(probs, config.top_p)
    if config.min_p > 0.0:
        floor = config.min_p * probs.max(axis=-1, keepdims=True)
        probs = mx.where(probs < floor, 0.0, probs)
    return probs / probs.sum(axis=-1, keepdims=True)


def _top_p(probs: mx.array, top_p: float) -> mx.array:
    """Zero the tail outside the smallest prefix (by probability) whose mass reaches top_p."""
    order = mx.argsort(-probs, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass of strictly better tokens
    keep_sorted = mass_before < top_p
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, probs, 0.0)


def sample(probs: mx.array) -> mx.array:
    """Draw one token per row from `[..., vocab]` probabilities; returns `[...]` uint32 ids."""
    return mx.random.categorical(mx.log(probs), axis=-1).astype(mx.uint32)


def pick(logits: mx.array, config: SamplingConfig) -> mx.array:
    """Next ids from `[..., vocab]` logits: argmax when greedy, else a draw from the sampling
    distribution; returns `[...]` uint32 ids."""
    return greedy(logits) if config.greedy else sample(logits_to_probs(logits, config))


def greedy(logits: mx.array) -> mx.array:
    """Argmax per row: `[..., vocab]` -> `[...]` uint32 ids."""
    return mx.argmax(logits, axis=-1).astype(mx.uint32)
