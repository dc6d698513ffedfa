"""The verification math as pure functions: exact cases and a statistical test."""

from __future__ import annotations

from mlx_spec.core.sampling import SamplingConfig, logits_to_probs, sample
from mlx_spec.core.verify import greedy_verify, rejection_verify

import mlx.core as mx
import numpy as np
import pytest
from chisquare import chisquare_pvalue

ALPHA = 1e-3  # false-positive rate of every statistical test here


def onehot_logits(ids, vocab=6):
    return mx.array(np.eye(vocab, dtype=np.float32)[ids] * 5.0)


@pytest.mark.parametrize(
    "target_argmax,drafts,accepted,next_token",
    [
        ([1, 2, 3], [1, 2], 2, 3),  # all accepted: bonus
        ([1, 2, 3], [1, 4], 1, 2),  # mismatch at 1: recovered = target's token
        ([1, 2, 3], [0, 2], 0, 1),  # first rejected
        ([4], [], 0, 4),  # no drafts: plain step
    ],
)
def test_greedy_verify(target_argmax, drafts, accepted, next_token):
    """Exact-match verification keeps the matching prefix and takes the target's next token."""
    n, token = greedy_verify(onehot_logits(target_argmax), mx.array(drafts, mx.uint32))
    assert (n.item(), token.item()) == (accepted, next_token)


def test_identical_distributions_always_accept():
    """p == q: every draft is accepted (the acceptance ratio is 1)."""
    mx.random.seed(0)
    probs = mx.softmax(mx.random.normal((4, 7)), axis=-1)
    for _ in range(50):
        drafts = sample(probs[:3])
        n, _ = rejection_verify(probs, probs[:3], drafts)
        assert n.item() == 3


def test_zero_target_probability_always_rejected_and_never_recovered():
    """A draft the target cannot produce is rejected; recovered tokens keep to p's support."""
    target = mx.array([[0.0, 0.5, 0.5, 0.0], [0.25] * 4])
    for seed in range(50):
        mx.random.seed(seed)
        n, token = rejection_verify(target, None, mx.array([3], mx.uint32))
        assert n.item() == 0 and token.item() in (1, 2)


def _first_token(target, draft_probs, verifier):
    drafts = sample(draft_probs) if draft_probs is not None else mx.array([2, 1], mx.uint32)
    n, token = verifier(target, draft_probs, drafts)
    return drafts[0].item() if n.item() >= 1 else token.item()


def always_accept(target_probs, draft_probs, draft_tokens):
    """A wrong verifier for the negative control."""
    k = draft_tokens.shape[0]
    return mx.array(k), sample(target_probs[k])


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft-probs", "one-hot"])
def test_first_token_follows_target(with_probs):
    """The first emitted token is distributed as the target's row 0 (chi-square, 3000 draws),
    and the always-accept verifier fails the same test (negative control)."""
    mx.random.seed(1)
    config = SamplingConfig(temperature=1.0, top_k=5)
    target = logits_to_probs(mx.random.normal((3, 8)), config)  # [k+1, vocab]
    draft = logits_to_probs(mx.random.normal((2, 8)), config) if with_probs else None
    expected = dict(enumerate(np.array(target[0]).tolist()))
    for verifier, should_pass in ((rejection_verify, True), (always_accept, False)):
        mx.random.seed(2)
        samples = [_first_token(target, draft, verifier) for _ in range(3000)]
        assert (chisquare_pvalue(samples, expected) > ALPHA) == should_pass, verifier.__name__


def test_sampling_filters_match_reference():
    """top-k / top-p / min-p keep exactly the tokens a numpy reference keeps."""
    logits = np.array([[2.0, 1.0, 0.5, 0.1, -1.0, -3.0]], np.float32)
    probs = np.exp(logits) / np.exp(logits).sum()
    min_p_kept = list(np.flatnonzero(probs[0] >= 0.2 * probs.max()))
    cases = {
        SamplingConfig(temperature=1.0, top_k=2): [0, 1],
        SamplingConfig(temperature=1.0, top_p=0.6): [0, 1],
        SamplingConfig(temperature=1.0, min_p=0.2): min_p_kept,
    }
    for config, kept in cases.items():
        out = np.array(logits_to_probs(mx.array(logits), config))[0]
        assert sorted(np.flatnonzero(out > 0).tolist()) == sorted(kept), config
        assert abs(out.sum() - 1) < 1e-6
        np.testing.assert_allclose(out[kept], probs[0][kept] / probs[0][kept].sum(), rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"min_p": 1.0}],
)
def test_invalid_sampling_settings(kwargs):
    """Invalid settings are refused with a message naming the setting."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingConfig(**kwargs)
