"""Lossless: greedy speculative output equals plain decoding, token for token."""

from __future__ import annotations

import mlx_spec
from mlx_spec import DraftModelDrafter

import pytest
from conftest import FAMILIES
from helpers import with_eos

PROMPT = "abcab cab"
KS = (1, 2, 4, 8)


def plain_tokens(model, tok, prompt=PROMPT, max_tokens=40):
    return mlx_spec.generate(model, tok, prompt, max_tokens=max_tokens).tokens


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("eos", [False, True], ids=["no-eos", "eos"])
def test_greedy_equals_plain(loaded, family, eos):
    """Draft model and n-gram drafters, k in {1,2,4,8}: output == plain decoding (40 tokens,
    past the gemma3 sliding window of 8, through the qwen3_5 recurrent state)."""
    model, tok, draft, draft_tok = loaded[family]
    if not eos:
        tok, draft_tok = with_eos(tok), with_eos(draft_tok)
    expected = plain_tokens(model, tok)
    assert len(expected) == 40 or eos
    rates = []
    for k in KS:
        for drafter in (DraftModelDrafter(draft, draft_tok), "ngram"):
            result = mlx_spec.generate(
                model, tok, PROMPT, drafter=drafter, num_draft=k, max_tokens=40
            )
            assert result.tokens == expected, (family, k, drafter)
            if not isinstance(drafter, str):
                rates.append(result.stats.acceptance_rate)
    if not eos:  # rollback after rejections and catch-up after full acceptance both exercised
        assert any(0.0 < r < 1.0 for r in rates), rates


@pytest.mark.parametrize("family", FAMILIES)
def test_long_generation_with_rejections(loaded, family):
    """200 tokens at k=4: many rollbacks, sliding window wrapped many times."""
    model, tok, draft, draft_tok = loaded[family]
    tok, draft_tok = with_eos(tok), with_eos(draft_tok)
    expected = plain_tokens(model, tok, max_tokens=200)
    result = mlx_spec.generate(
        model, tok, PROMPT, drafter=DraftModelDrafter(draft, draft_tok), num_draft=4, max_tokens=200
    )
    assert result.tokens == expected
    assert 0 < result.stats.acceptance_rate < 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [1, 4])
def test_self_draft_accepts_everything(loaded, family, k):
    """Drafter == target at temperature 0: acceptance 1.0, mean accepted length k+1."""
    model, tok, _, _ = loaded[family]
    tok = with_eos(tok)
    max_tokens = 10 * (k + 1)
    result = mlx_spec.generate(
        model,
        tok,
        PROMPT,
        drafter=DraftModelDrafter(model, tok),
        num_draft=k,
        max_tokens=max_tokens,
    )
    assert result.tokens == plain_tokens(model, tok, max_tokens=max_tokens)
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.mean_accepted_length == k + 1
    assert result.stats.accepted_per_position == [10] * k


def test_stats_are_consistent(loaded):
    """Stats add up: emitted = accepted + one per pass; per-position counts never increase."""
    model, tok, draft, draft_tok = loaded["llama"]
    tok, draft_tok = with_eos(tok), with_eos(draft_tok)
    stats = mlx_spec.generate(
        model, tok, PROMPT, drafter=DraftModelDrafter(draft, draft_tok), num_draft=4, max_tokens=60
    ).stats
    assert stats.generated_tokens == 60
    assert stats.accepted + stats.target_passes == 60
    drafted = stats.drafted_per_position
    assert all(a <= d for a, d in zip(stats.accepted_per_position, drafted, strict=True))
    assert drafted == sorted(drafted, reverse=True)
    record = stats.to_dict()
    for key in (
        "acceptance_rate",
        "mean_accepted_length",
        "target_passes",
        "decode_tokens_per_sec",
        "round_latency_p50_ms",
        "round_latency_p95_ms",
        "rollback_seconds",
        "prefill_tokens_per_sec",
    ):
        assert key in record
    assert record["round_latency_p95_ms"] >= record["round_latency_p50_ms"] > 0


@pytest.mark.parametrize("drafter_kind", ["draft", "ngram"])
def test_same_seed_same_output(loaded, drafter_kind):
    """Sampling at temperature 1 is reproducible under a seed and varies across seeds."""
    model, tok, draft, draft_tok = loaded["llama"]
    tok = with_eos(tok)

    def run(seed):
        drafter = DraftModelDrafter(draft, draft_tok) if drafter_kind == "draft" else "ngram"
        return mlx_spec.generate(
            model,
            tok,
            PROMPT,
            drafter=drafter,
            num_draft=3,
            temperature=1.0,
            max_tokens=30,
            seed=seed,
        ).tokens

    assert run(3) == run(3)
    assert len({tuple(run(s)) for s in range(4)}) > 1
