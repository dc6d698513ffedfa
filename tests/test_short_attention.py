"""Short-query attention in ordinary ops (mlx_spec/platform/short_attention.py): MLX's results,
and the decoders' tokens unchanged when every verifying pass goes through it."""

from __future__ import annotations

import mlx_spec
from mlx_spec import DraftModelDrafter
from mlx_spec.caches.prompt_cache import RowCache
from mlx_spec.core.compat import scored_vocab
from mlx_spec.drafters.batch import BatchDraftModel, BatchNgram
from mlx_spec.platform import short_attention

import mlx.core as mx
import pytest
from conftest import FAMILIES
from helpers import busy_requests, engine_for, run_all, with_eos

ORIGINAL = short_attention._state["original"] or mx.fast.scaled_dot_product_attention

pytestmark = pytest.mark.skipif(
    not short_attention._state["installed"], reason="MLX_SPEC_SHORT_ATTENTION=0"
)


def _qkv(b, heads, kv_heads, queries, keys, dim=16, dim_v=None, seed=0):
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    q = mx.random.normal((b, heads, queries, dim), key=k1)
    k = mx.random.normal((b, kv_heads, keys, dim), key=k2)
    v = mx.random.normal((b, kv_heads, keys, dim_v or dim), key=k3)
    return q, k, v


def _masks(b, heads, queries, keys):
    key = mx.random.key(7)
    causal = mx.arange(keys - queries, keys)[:, None] >= mx.arange(keys)[None]
    per_row = mx.random.uniform(shape=(b, 1, queries, keys), key=key) > 0.4
    per_row = per_row | causal  # every query sees something
    per_head = (mx.random.uniform(shape=(b, heads, queries, keys), key=key) > 0.5) | causal
    return {
        "none": None,
        "causal": "causal",
        "bool 2-D": causal,
        "bool per row": per_row,
        "bool per head": per_head,
        "additive 2-D": mx.where(causal, 0.0, -1e9),
        "additive per row": mx.random.normal((b, 1, queries, keys), key=key),
    }


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("queries,keys", [(2, 2), (3, 17), (9, 40)])
def test_attend_is_mlx_attention(heads, kv_heads, queries, keys):
    b = 2
    q, k, v = _qkv(b, heads, kv_heads, queries, keys)
    for name, mask in _masks(b, heads, queries, keys).items():
        want = ORIGINAL(q, k, v, scale=0.25, mask=mask)
        got = short_attention.attend(q, k, v, 0.25, mask)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item(), name


def test_attend_with_sinks_and_a_wider_value():
    q, k, v = _qkv(2, 6, 2, 4, 11, dim=16, dim_v=24)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0, 1.5, -0.5])
    for mask in (None, "causal"):
        want = ORIGINAL(q, k, v, scale=0.3, mask=mask, sinks=sinks)
        got = short_attention.attend(q, k, v, 0.3, mask, sinks)
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item(), mask
    # the sink takes its share: without it the output differs
    assert not mx.allclose(
        short_attention.attend(q, k, v, 0.3, "causal"),
        ORIGINAL(q, k, v, scale=0.3, mask="causal", sinks=sinks),
        atol=1e-3,
    ).item()


def test_attend_in_half_precision_is_close_to_mlx():
    q, k, v = (a.astype(mx.float16) for a in _qkv(1, 4, 2, 5, 30))
    want = ORIGINAL(q, k, v, scale=0.25, mask="causal")
    got = short_attention.attend(q, k, v, 0.25, "causal")
    assert got.dtype == mx.float16
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=2e-3).item()


def test_routing(monkeypatch):
    calls = []
    real = short_attention.attend
    monkeypatch.setattr(
        short_attention, "attend", lambda *a, **kw: calls.append(a[0].shape[2]) or real(*a, **kw)
    )
    fast = mx.fast.scaled_dot_product_attention
    assert fast is short_attention.scaled_dot_product_attention

    def run(queries, **kw):
        q, k, v = _qkv(1, 2, 2, queries, 40)
        return fast(q, k, v, scale=0.5, mask="causal", **kw)

    # On the CPU nothing is routed: MLX's own attention.
    for queries in (1, 3):
        run(queries)
    assert calls == []
    with short_attention.forced():
        for queries in (1, 2, 9, 32, 33):
            run(queries)
        run(3, force_fused=False)
        run(4, stream=mx.cpu)  # an explicit stream keeps MLX's own
        assert calls == [2, 9, 32, 33, 3]  # 33 queries: a prompt chunk with few scores
        # a prompt chunk whose scores pass the bound keeps MLX's own (2 heads x 33 x 40 > bound)
        monkeypatch.setattr(short_attention, "MAX_SCORES", 2 * 33 * 40 - 1)
        run(33)
        assert calls[-1] == 3
        monkeypatch.setattr(short_attention, "MAX_SCORES", 1 << 24)
        with short_attention.short_only():
            run(32)
            run(33)  # a chunk under the bound, but chunks are not routed in the block
        assert calls[-1] == 32 and calls.count(33) == 1
        monkeypatch.setenv(short_attention.ENV, "8")
        run(9)
        with short_attention.short_only():
            run(9)
        run(8)
        assert calls[-1] == 8 and calls.count(9) == 2
        with short_attention.disabled():
            run(3)
        assert calls[-1] == 8
    run(5)
    assert calls[-1] == 8  # outside the block: MLX's own again


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_tokens_unchanged_when_verifying_passes_are_routed(loaded, family):
    """A sliding-window target (gemma3) and a hybrid one (qwen3_5) included: greedy draft-model
    and n-gram decoding with every short pass in ordinary ops equals plain decoding."""
    model, tok, draft, draft_tok = loaded[family]
    tok, draft_tok = with_eos(tok), with_eos(draft_tok)
    prompt = "abcab cab"
    expected = mlx_spec.generate(model, tok, prompt, max_tokens=40).tokens
    calls = []
    real = short_attention.attend
    with short_attention.forced():
        short_attention.attend = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        try:
            for drafter in (DraftModelDrafter(draft, draft_tok), "ngram"):
                result = mlx_spec.generate(
                    model, tok, prompt, drafter=drafter, num_draft=3, max_tokens=40
                )
                assert result.tokens == expected, drafter
        finally:
            short_attention.attend = real
    assert calls  # the verifying passes went through it


def test_batched_rows_unchanged_when_verifying_passes_are_routed(loaded):
    """Rows of different lengths (per-row masks) through the batch engine."""
    model, tok, draft, _ = loaded["llama"]
    tok = with_eos(tok)
    drafters = {"ngram": BatchNgram(), "draft-model": BatchDraftModel(draft)}
    engine = engine_for(model, tok, drafters, max_batch=4, prefill_step=16, row_cache=RowCache())
    requests = busy_requests(scored_vocab(model, tok), "all", 3)
    with short_attention.forced():
        results = run_all(engine, requests)
    for req, (tokens, _) in zip(requests, results, strict=True):
        want = mlx_spec.generate(model, tok, req["prompt"], max_tokens=req["max_tokens"]).tokens
        assert tokens == want
