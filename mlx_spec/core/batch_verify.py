"""Sampling and verification for a batch of rows, each with its own settings and random stream.

Every random draw of a row comes from that row's own key, so a seeded request gives the same
output whatever else runs in the batch. Draws are Gumbel-max (`argmax(log p + g)`): a token of
probability 0 is never drawn, and a one-hot distribution (a greedy row) gives its token.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from mlx_spec.core.sampling import SamplingConfig, logits_to_probs
from mlx_spec.core.verify import residual

import mlx.core as mx


class RowRandom:
    """One row's random stream: a key split anew for every draw."""

    def __init__(self, seed: int | None = None):
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self.key = mx.random.key(seed % (1 << 64))

    def next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub


def config_groups(configs: Sequence[SamplingConfig]) -> dict[SamplingConfig, list[int]]:
    """Rows grouped by identical sampling settings, in order of first appearance."""
    groups: dict[SamplingConfig, list[int]] = {}
    for i, config in enumerate(configs):
        groups.setdefault(config, []).append(i)
    return groups


def batch_probs(logits: mx.array, configs: Sequence[SamplingConfig]) -> mx.array:
    """Each row's sampling distribution: `[B, ..., V]` logits -> `[B, ..., V]` probabilities
    (one-hot on the argmax for greedy rows)."""
    groups = config_groups(configs)
    parts, order = [], []
    for config, rows in groups.items():
        part = logits if len(groups) == 1 else logits[mx.array(rows)]
        parts.append(_probs(part, config))
        order += rows
    if len(groups) == 1:
        return parts[0]
    inverse = [0] * len(order)
    for at, row in enumerate(order):
        inverse[row] = at
    return mx.concatenate(parts)[mx.array(inverse)]


def _probs(logits: mx.array, config: SamplingConfig) -> mx.array:
    if config.greedy:
        top = mx.argmax(logits, axis=-1, keepdims=True)
        return (mx.arange(logits.shape[-1]) == top).astype(mx.float32)
    return logits_to_probs(logits, config)


def gumbel(randoms: Sequence[RowRandom | None], shape: tuple[int, ...]) -> mx.array:
    """`[B, *shape]` Gumbel noise, row i from its own stream (zeros for rows without one)."""
    rows = [
        mx.zeros(shape) if r is None else mx.random.gumbel(shape=shape, key=r.next_key())
        for r in randoms
    ]
    return mx.stack(rows)


def uniform(randoms: Sequence[RowRandom | None], shape: tuple[int, ...]) -> mx.array:
    """`[B, *shape]` uniforms in [0, 1), row i from its own stream (zeros without one)."""
    rows = [
        mx.zeros(shape) if r is None else mx.random.uniform(shape=shape, key=r.next_key())
        for r in randoms
    ]
    return mx.stack(rows)


def draw(probs: mx.array, noise: mx.array) -> mx.array:
    """`[B, V]` probabilities and `[B, V]` Gumbel noise -> `[B]` uint32 ids."""
    return mx.argmax(mx.log(probs) + noise, axis=-1).astype(mx.uint32)


def batch_verify(
    target_probs: mx.array,
    draft_probs: mx.array | None,
    draft_tokens: mx.array,
    num_drafted: mx.array,
    uniforms: mx.array,
    noise: mx.array,
) -> tuple[mx.array, mx.array]:
    """Speculative sampling for every row at once (Leviathan et al. 2023; Chen et al. 2023).

    Row i's draft j < num_drafted[i] is accepted with probability min(1, p/q) while all
    before it were; at its first rejection the next token is drawn from norm(max(0, p - q))
    at that position, and after a full acceptance from p after its last draft. Greedy rows
    (one-hot p and q) reduce to exact match against the target's argmax.

    Args:
        target_probs: `[B, K+1, V]` target distributions after the last token and each draft.
        draft_probs: `[B, K, V]` distributions the drafts were drawn from, or None (one-hot).
        draft_tokens: `[B, K]` ids (entries past a row's num_drafted are ignored).
        num_drafted: `[B]` drafts per row.
        uniforms: `[B, K]` uniforms in [0, 1) for the acceptance tests.
        noise: `[B, V]` Gumbel noise for the recovered or bonus draw.
    Returns:
        (num_accepted `[B]`, next_token `[B]`).
    """
    b, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs is None:
        one_hot = mx.arange(vocab)[None, None] == draft_tokens[..., None]
        draft_probs = one_hot.astype(mx.float32)  # [B, K, V]
    picked = draft_tokens[..., None].astype(mx.int32)
    p = mx.take_along_axis(target_probs[:, :k], picked, axis=-1)[..., 0]  # [B, K]
    q = mx.take_along_axis(draft_probs, picked, axis=-1)[..., 0]
    real = mx.arange(k)[None] < num_drafted[:, None]
    accepted = ((uniforms * q < p) & real).astype(mx.int32)
    num_accepted = mx.cumprod(accepted, axis=1).sum(axis=1) if k else mx.zeros((b,), mx.int32)
    at = num_accepted[:, None, None]
    p_next = mx.take_along_axis(target_probs, at, axis=1)[:, 0]  # [B, V]
    if k:
        q_next = mx.take_along_axis(draft_probs, mx.minimum(at, k - 1), axis=1)[:, 0]
        rejected = (num_accepted < num_drafted)[:, None]
        p_next = mx.where(rejected, residual(p_next, q_next), p_next)
    return num_accepted, draw(p_next, noise)


def greedy_batch_verify(
    target_logits: mx.array, draft_tokens: mx.array, num_drafted: mx.array
) -> tuple[mx.array, mx.array]:
    """`batch_verify` for a batch of greedy rows, from logits (no distributions built)."""
    target_tokens = mx.argmax(target_logits, axis=-1).astype(mx.uint32)  # [B, K+1]
    k = draft_tokens.shape[1]
    real = mx.arange(k)[None] < num_drafted[:, None]
    matches = ((target_tokens[:, :k] == draft_tokens) & real).astype(mx.int32)
    num_accepted = (
        mx.cumprod(matches, axis=1).sum(axis=1)
        if k
        else mx.zeros((draft_tokens.shape[0],), mx.int32)
    )
    nxt = mx.take_along_axis(target_tokens, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, nxt


def row_uniforms(random: RowRandom | None, n: int, k: int) -> mx.array:
    """`[K]`: n uniforms from the row's own stream (one per draft it has), zeros after."""
    if random is None or n == 0:
        return mx.zeros((k,))
    u = uniform([random], (n,))[0]
    return mx.concatenate([u, mx.zeros((k - n,))]) if k > n else u
