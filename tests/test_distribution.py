"""Distribution preservation end to end: the first three generated tokens of speculative
sampling with k = 2 (both draft positions, the residual at the second, the bonus token after
two) follow the target's exact distribution, enumerated over an 8-token vocabulary, for fixed,
moving and adaptive draft lengths. The same chi-square test rejects a verifier that accepts
every draft and, more subtly, one that draws the recovered token from the target's
distribution instead of the residual; and it has the power to reject the drafter's own
distribution from the same samples."""

from __future__ import annotations

import mlx_spec
import mlx_spec.core.verify
import mlx_spec.decoding.chain
from mlx_spec import DraftModelDrafter
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.decoding.policy import AdaptiveDraftLength
from mlx_spec.drafters.base import Draft, Drafter

import mlx.core as mx
import numpy as np
import pytest
from chisquare import chisquare_pvalue
from helpers import (
    ALPHA,
    CONFIGS,
    CONTROL_RUNS,
    DISTRIBUTION_PROMPT,
    DISTRIBUTION_RUNS,
    NEGATIVE_CONTROLS,
    ScriptedPolicy,
    exact_distribution,
    sampled,
)


class RandomOneHotDrafter(Drafter):
    """Drafts uniformly random tokens with no distribution (verified as one-hot)."""

    name = "random"

    def begin(self, prompt, vocab_size, hidden=None):
        self.vocab = vocab_size

    def draft(self, k, sampling):
        return Draft(mx.random.randint(0, self.vocab, (k,)).astype(mx.uint32))

    def accept(self, num_accepted, emitted, hidden=None):
        pass


class GreedyOneHotDrafter(DraftModelDrafter):
    """Proposes the draft model's argmax tokens with no distribution (like n-gram lookup:
    plausible tokens, verified as one-hot)."""

    name = "greedy-one-hot"

    def draft(self, k, sampling):
        return Draft(super().draft(k, SamplingConfig()).tokens)


def factory(kind, pair):
    _, _, draft, draft_tok = pair
    if kind == "draft-model":
        return lambda: DraftModelDrafter(draft, draft_tok)
    if kind == "one-hot":
        return lambda: GreedyOneHotDrafter(draft, draft_tok)
    return RandomOneHotDrafter


IDS = ["t1-top_k3", "t0.7-top_p0.8", "t1"]


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("kind", ["draft-model", "one-hot", "random"])
def test_three_token_distribution_matches_target(pair, request, config, kind):
    """Chi-square goodness of fit of DISTRIBUTION_RUNS speculative samples (k = 2) against the
    exact target distribution (sequences outside its support, e.g. top-k-masked tokens, fail
    at once)."""
    model, tok = pair[:2]
    if kind == "draft-model" and config is CONFIGS[0]:
        samples = request.getfixturevalue("draft_model_samples")
    else:
        samples = sampled(model, tok, factory(kind, pair), config)
    assert chisquare_pvalue(samples, exact_distribution(model, config)) > ALPHA


@pytest.fixture(scope="module")
def draft_model_samples(pair):
    """The draft-model drafter's samples at CONFIGS[0], drawn once: the fit test above and the
    power test below judge the same samples."""
    model, tok = pair[:2]
    return sampled(model, tok, factory("draft-model", pair), CONFIGS[0])


def test_power_the_drafters_own_distribution_is_rejected(pair, draft_model_samples):
    """The samples of a correct run are far from what the draft model alone would produce:
    the test can tell the two distributions apart."""
    draft = pair[2]
    assert chisquare_pvalue(draft_model_samples, exact_distribution(draft, CONFIGS[0])) < ALPHA


@pytest.mark.parametrize("kind", ["draft-model", "one-hot"])
def test_moving_draft_lengths_keep_the_distribution(pair, kind):
    """k drawn afresh every round (plain stretches, 1 or 2 drafts), independently of the
    tokens: still the target's distribution."""
    model, tok = pair[:2]
    seeds = iter(range(DISTRIBUTION_RUNS))
    samples = sampled(
        model,
        tok,
        factory(kind, pair),
        CONFIGS[0],
        num_draft=lambda: ScriptedPolicy(max_draft=2, seed=next(seeds)),
    )
    assert chisquare_pvalue(samples, exact_distribution(model, CONFIGS[0])) > ALPHA


@pytest.mark.parametrize("kind", ["draft-model", "one-hot"])
def test_adaptive_draft_length_keeps_the_distribution(pair, kind):
    """The real controller, told to measure plain decoding on the first token only, so that
    the second and third come from its speculative rounds."""
    model, tok = pair[:2]
    samples = sampled(
        model,
        tok,
        factory(kind, pair),
        CONFIGS[0],
        num_draft=lambda: AdaptiveDraftLength(2, first_plain=1, prior_accept=0.9),
    )
    assert chisquare_pvalue(samples, exact_distribution(model, CONFIGS[0])) > ALPHA


@pytest.mark.parametrize("kind", ["draft-model", "one-hot"])
@pytest.mark.parametrize("control", NEGATIVE_CONTROLS)
def test_negative_controls_fail(pair, monkeypatch, kind, control):
    """The same test rejects a verifier that accepts every draft (gross) and one that recovers
    from the target's distribution instead of the residual (subtle)."""
    model, tok = pair[:2]
    monkeypatch.setattr(*NEGATIVE_CONTROLS[control])
    samples = sampled(model, tok, factory(kind, pair), CONFIGS[0], runs=CONTROL_RUNS)
    assert chisquare_pvalue(samples, exact_distribution(model, CONFIGS[0])) < ALPHA


class RecordingDrafter(DraftModelDrafter):
    """A draft-model drafter that keeps every draft it makes."""

    drafts: list

    def draft(self, k, sampling):
        out = super().draft(k, sampling)
        self.drafts.append((np.array(out.tokens), np.array(out.probs)))
        return out


@pytest.mark.parametrize(
    "config", [SamplingConfig(temperature=1.0, top_k=2), SamplingConfig(temperature=1.0, min_p=0.3)]
)
def test_masked_tokens_never_drafted(pair, config):
    """Draft tokens come from the filtered distribution, which is zero off the kept set."""
    model, tok, draft, draft_tok = pair
    drafter = RecordingDrafter(draft, draft_tok)
    drafter.drafts = []
    mlx_spec.generate(
        model,
        tok,
        DISTRIBUTION_PROMPT,
        drafter=drafter,
        num_draft=3,
        max_tokens=60,
        seed=0,
        temperature=config.temperature,
        top_k=config.top_k,
        min_p=config.min_p,
    )
    assert drafter.drafts
    for tokens, probs in drafter.drafts:
        assert np.all(probs[np.arange(tokens.size), tokens] > 0)
        if config.top_k:
            assert np.all((probs > 0).sum(axis=-1) <= config.top_k)
        else:
            assert np.all((probs == 0) | (probs >= config.min_p * probs.max(-1, keepdims=True)))
