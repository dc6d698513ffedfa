"""Verification of draft tokens against the target: pure functions on arrays.

Vocabulary: the draft tokens are accepted left to right; at the first rejection a
**recovered** token is sampled from the residual distribution; when every draft is accepted a
**bonus** token is sampled from the target's distribution after the last draft.
"""

from __future__ import annotations

from mlx_spec.core.sampling import greedy, sample

import mlx.core as mx


def greedy_verify(target_logits: mx.array, draft_tokens: mx.array) -> tuple[mx.array, mx.array]:
    """Exact-match verification for temperature 0.

    Args:
        target_logits: `[k+1, vocab]` target logits after the last token and each draft.
        draft_tokens: `[k]` proposed ids.
    Returns:
        (num_accepted, next_token): scalar arrays; next_token is the target's argmax after the
        accepted prefix (recovered on a mismatch, bonus when all k match).
    """
    target_tokens = greedy(target_logits)  # [k+1]
    k = draft_tokens.shape[0]
    matches = (target_tokens[:k] == draft_tokens).astype(mx.int32)
    num_accepted = mx.cumprod(matches).sum() if k else mx.array(0, mx.int32)
    return num_accepted, target_tokens[num_accepted]


def rejection_verify(
    target_probs: mx.array, draft_probs: mx.array | None, draft_tokens: mx.array
) -> tuple[mx.array, mx.array]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Draft i is accepted with probability min(1, target_probs[i, d_i] / draft_probs[i, d_i]); at
    the first rejection the next token comes from norm(max(0, target_probs - draft_probs)); if all
    are accepted it comes from target_probs[k]. A drafter without a distribution
    (`draft_probs=None`) is treated as one-hot on its tokens.

    Args:
        target_probs: `[k+1, vocab]` target sampling distributions.
        draft_probs: `[k, vocab]` distributions the drafts were sampled from, or None.
        draft_tokens: `[k]` proposed ids.
    Returns:
        (num_accepted, next_token) as scalar arrays.
    """
    k = draft_tokens.shape[0]
    if k == 0:
        return mx.array(0, mx.int32), sample(target_probs[0])
    if draft_probs is None:
        vocab_ids = mx.arange(target_probs.shape[-1])[None]
        draft_probs = (vocab_ids == draft_tokens[:, None]).astype(mx.float32)  # [k, vocab]
    rows = mx.arange(k)
    p_draft = target_probs[rows, draft_tokens]  # [k]
    q_draft = draft_probs[rows, draft_tokens]  # [k]
    u = mx.random.uniform(shape=(k,))
    accepted = (u * q_draft < p_draft).astype(mx.int32)  # u < p/q without dividing by q
    num_accepted = mx.cumprod(accepted).sum()
    candidates = mx.concatenate([residual(target_probs[:k], draft_probs), target_probs[k:]])
    return num_accepted, sample(candidates[num_accepted])  # [k+1, vocab] -> the row to draw


def residual(target_probs: mx.array, draft_probs: mx.array) -> mx.array:
    """norm(max(0, target_probs - draft_probs)) row-wise, `[k, vocab]`: what a rejected
    position's token is drawn from. Where p == q up to rounding leaves no mass, the target's
    row is the exact answer."""
    left = mx.maximum(target_probs - draft_probs, 0.0)
    mass = left.sum(axis=-1, keepdims=True)
    return mx.where(mass > 0, left / mx.maximum(mass, 1e-30), target_probs)
