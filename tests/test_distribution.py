"""Distribution preservation end to end: the first two generated tokens of speculative sampling
follow the target's exact distribution, enumerated over a 8-token vocabulary."""

from __future__ import annotations

import mlx_spec
import mlx_spec.decode
from mlx_spec import DraftModelDrafter
from mlx_spec.drafters.base import Draft, Drafter
from mlx_spec.sampling import SamplingConfig, logits_to_probs, sample

import mlx.core as mx
import numpy as np
import pytest
import tinymodels as tm
from chisquare import chisquare_pvalue
from conftest import with_eos

ALPHA = 1e-3  # stated false-positive rate of each test
RUNS = 2000
ALPHABET = "abcde"
PROMPT = [3, 4, 5, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    vocab = tm.tokenizer_size(ALPHABET)
    config = tm.llama_config(
        vocab,
        hidden_size=16,
        num_hidden_layers=1,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    weights = tm.random_weights(config, seed=1, scale=0.3)  # flat enough to sample widely
    tokenizer = tm.build_tokenizer(ALPHABET)
    tm.write_checkpoint(root / "t", config, weights, tokenizer)
    tm.write_checkpoint(root / "d", config, tm.perturb(weights, 1.0, seed=2), tokenizer)
    model, tok = mlx_spec.load(str(root / "t"))
    draft, draft_tok = mlx_spec.load(str(root / "d"))
    return model, with_eos(tok), draft, draft_tok


def exact_two_token_distribution(model, config: SamplingConfig) -> dict:
    """P(t1, t2 | prompt) under the target with these sampling settings, by enumeration."""

    def next_probs(ids):
        return np.array(logits_to_probs(model(mx.array([ids]))[0, -1], config))

    first = next_probs(PROMPT)
    return {
        (a, b): first[a] * p
        for a in range(first.size)
        if first[a] > 0
        for b, p in enumerate(next_probs(PROMPT + [a]))
    }


def sampled_pairs(model, tok, make_drafter, config: SamplingConfig) -> list:
    out = []
    for seed in range(RUNS):
        result = mlx_spec.generate(
            model,
            tok,
            PROMPT,
            drafter=make_drafter(),
            num_draft=2,
            max_tokens=2,
            seed=seed,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
        )
        out.append(tuple(result.tokens))
    return out


class RandomOneHotDrafter(Drafter):
    """Drafts uniformly random tokens with no distribution (verified as one-hot)."""

    name = "random"

    def begin(self, prompt, vocab_size, hidden=None):
        self.vocab = vocab_size

    def draft(self, k, sampling):
        return Draft(mx.random.randint(0, self.vocab, (k,)).astype(mx.uint32))

    def accept(self, num_accepted, emitted, hidden=None):
        pass


def drafter_factory(kind, draft, draft_tok):
    if kind == "draft-model":
        return lambda: DraftModelDrafter(draft, draft_tok)
    return RandomOneHotDrafter


def always_accept(target_probs, draft_probs, draft_tokens):
    k = draft_tokens.shape[0]
    return mx.array(k), sample(target_probs[k])


CONFIGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_p=0.8),
    SamplingConfig(temperature=1.0, top_k=3),
]


@pytest.mark.parametrize("config", CONFIGS, ids=["t1", "t0.7-top_p0.8", "t1-top_k3"])
@pytest.mark.parametrize("kind", ["draft-model", "one-hot"])
def test_two_token_distribution_matches_target(pair, config, kind):
    """Chi-square goodness of fit of 2000 speculative samples against the exact target
    distribution (pairs outside its support, e.g. top-k-masked tokens, fail at once)."""
    model, tok, draft, draft_tok = pair

    def make_drafter():
        return (
            DraftModelDrafter(draft, draft_tok) if kind == "draft-model" else RandomOneHotDrafter()
        )

    samples = sampled_pairs(model, tok, make_drafter, config)
    assert chisquare_pvalue(samples, exact_two_token_distribution(model, config)) > ALPHA


@pytest.mark.parametrize("kind", ["draft-model", "one-hot"])
def test_negative_control_wrong_verifier_fails(pair, monkeypatch, kind):
    """The same test rejects a verifier that accepts every draft."""
    model, tok, draft, draft_tok = pair
    monkeypatch.setattr(mlx_spec.decode, "rejection_verify", always_accept)
    config = CONFIGS[0]

    def make_drafter():
        return (
            DraftModelDrafter(draft, draft_tok) if kind == "draft-model" else RandomOneHotDrafter()
        )

    samples = sampled_pairs(model, tok, make_drafter, config)
    assert chisquare_pvalue(samples, exact_two_token_distribution(model, config)) < ALPHA


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
        PROMPT,
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
