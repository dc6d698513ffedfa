"""The fast exp of MLX's Linux CPU backend: as exact as MLX's own, same attention and SwiGLU,
same gradients, and installed into mlx-lm's models (those imported before and after)."""

from __future__ import annotations

import importlib
import sys

import mlx_spec  # first: loads the optimized BLAS before mlx
from mlx_spec.platform import fastmath

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import activations, base

pytestmark = pytest.mark.skipif(
    not fastmath._state["installed"], reason="the fast exp is installed on Linux only"
)

ORIGINAL_SWIGLU, ORIGINAL_SDPA = fastmath._state["originals"] or (None, None)


@pytest.fixture(autouse=True)
def every_size(monkeypatch):
    """The fast paths for the small arrays of these tests too (not only from MIN_ELEMENTS)."""
    monkeypatch.setattr(fastmath, "MIN_ELEMENTS", 0)


def test_exp_is_within_an_ulp_over_float32s_range():
    xs = np.linspace(-87.3, 88.0, 400_001).astype(np.float32)
    truth = np.exp(xs.astype(np.float64))
    ours = np.array(fastmath.exp(mx.array(xs))).astype(np.float64)
    assert np.max(np.abs(ours - truth) / truth) < 1.5e-7  # float32's ulp is 1.19e-7
    edges = np.array(fastmath.exp(mx.array([-mx.inf, -200.0, -88.0, 0.0, 100.0, mx.inf])))
    assert edges[:3].tolist() == [0.0, 0.0, 0.0] and edges[3] == 1.0
    assert np.all(np.isfinite(edges[4:])) and edges[4] > 1e38


def test_swiglu_and_its_gradient_match_mlx_lm():
    gate, x = mx.random.normal((3, 5, 64)) * 6, mx.random.normal((3, 5, 64))
    assert mx.allclose(fastmath.swiglu(gate, x), ORIGINAL_SWIGLU(gate, x), atol=1e-6, rtol=1e-6)

    def loss(fn):
        return lambda g, y: (fn(g, y) ** 2).sum()

    ours = mx.grad(loss(fastmath.swiglu), argnums=(0, 1))(gate, x)
    theirs = mx.grad(loss(ORIGINAL_SWIGLU), argnums=(0, 1))(gate, x)
    for a, b in zip(ours, theirs, strict=True):
        assert mx.allclose(a, b, atol=1e-5, rtol=1e-5)


def _masks(b, h, length, keys):
    causal = mx.arange(keys - length, keys)[:, None] >= mx.arange(keys)[None]
    rows = mx.random.uniform(shape=(b, 1, length, keys)) > 0.3
    rows = rows | (mx.arange(keys)[None, None, None] == keys - 1)  # never a row of nothing
    heads = mx.random.uniform(shape=(b, h, length, keys)) > 0.3
    heads = heads | (mx.arange(keys) == keys - 1)
    return {
        "none": None,
        "causal": "causal",
        "bool [L, S]": causal,
        "bool [B, 1, L, S]": rows,
        "bool [B, H, L, S]": heads,
        "additive [L, S]": mx.where(causal, 0.0, -1e9),
        "additive [1, H, L, S]": mx.random.normal((1, h, length, keys)),
    }


@pytest.mark.parametrize("kv_heads", [2, 6])
@pytest.mark.parametrize("length", [1, 4])
def test_attention_matches_mlx_for_every_mask_kind(kv_heads, length):
    b, h, keys, dim = 3, 6, 11, 16
    q = mx.random.normal((b, h, length, dim))
    k, v = mx.random.normal((b, kv_heads, keys, dim)), mx.random.normal((b, kv_heads, keys, dim))
    for name, mask in _masks(b, h, length, keys).items():
        ours = fastmath.scaled_dot_product_attention(q, k, v, None, scale=0.25, mask=mask)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        assert ours.shape == theirs.shape, name
        assert mx.allclose(ours, theirs, atol=1e-5, rtol=1e-5), name


def test_attention_gradients_are_mlx_lms():
    q, k, v = (mx.random.normal((2, 4, 3, 8)) for _ in range(3))
    mask = mx.random.uniform(shape=(2, 1, 3, 3)) > 0.2
    mask = mask | mx.eye(3, dtype=mx.bool_)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v, None, scale=0.3, mask=mask) ** 2).sum()

    ours = mx.grad(loss(fastmath.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    theirs = mx.grad(loss(ORIGINAL_SDPA), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, theirs, strict=True):
        assert mx.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_what_it_does_not_cover_goes_to_mlx_lm_unchanged():
    q, k, v = (mx.random.normal((1, 2, 3, 8)) for _ in range(3))
    sinks = mx.zeros((2,))
    expect = ORIGINAL_SDPA(q, k, v, None, scale=0.5, mask="causal", sinks=sinks)
    got = fastmath.scaled_dot_product_attention(
        q, k, v, None, scale=0.5, mask="causal", sinks=sinks
    )
    assert mx.array_equal(got, expect)
    half = [a.astype(mx.float16) for a in (q, k, v)]
    assert mx.array_equal(
        fastmath.scaled_dot_product_attention(*half, None, scale=0.5, mask=None),
        ORIGINAL_SDPA(*half, None, scale=0.5, mask=None),
    )
    gate = mx.random.normal((4, 8))
    with fastmath.disabled():
        assert mx.array_equal(fastmath.swiglu(gate, gate), ORIGINAL_SWIGLU(gate, gate))
    assert not mx.array_equal(fastmath.swiglu(gate, gate), ORIGINAL_SWIGLU(gate, gate))


def test_small_arrays_keep_mlxs_exp(monkeypatch):
    monkeypatch.setattr(fastmath, "MIN_ELEMENTS", 16384)
    assert fastmath.MIN_SWIGLU == 8192  # SwiGLU's single kernel pays from fewer elements
    gate = mx.random.normal((4, 2047)) * 4  # 4 elements short
    assert mx.array_equal(fastmath.swiglu(gate, gate), ORIGINAL_SWIGLU(gate, gate))
    gate = mx.random.normal((4, 2048)) * 4
    assert not mx.array_equal(fastmath.swiglu(gate, gate), ORIGINAL_SWIGLU(gate, gate))
    # attention keeps MLX's softmax below MIN_ELEMENTS scores (B x heads x queries x keys)
    q, k = mx.random.normal((1, 4, 1, 16)) * 4, mx.random.normal((1, 4, 4095, 16))
    want = ORIGINAL_SDPA(q, k, k, None, scale=0.5, mask=None)
    assert mx.array_equal(fastmath.scaled_dot_product_attention(q, k, k, None, 0.5, None), want)
    k = mx.random.normal((1, 4, 4096, 16))
    want = ORIGINAL_SDPA(q, k, k, None, scale=0.5, mask=None)
    got = fastmath.scaled_dot_product_attention(q, k, k, None, 0.5, None)
    assert not mx.array_equal(got, want)


def test_mlx_lm_models_use_it_whether_imported_before_or_after():
    assert activations.swiglu is fastmath.swiglu
    assert base.scaled_dot_product_attention is fastmath.scaled_dot_product_attention
    llama = importlib.import_module("mlx_lm.models.llama")  # imported at load, before or not
    assert llama.swiglu is fastmath.swiglu
    name = "mlx_lm.models.olmo2"  # a module no test loads: imported only now
    sys.modules.pop(name, None)
    olmo2 = importlib.import_module(name)
    assert olmo2.scaled_dot_product_attention is fastmath.scaled_dot_product_attention
    assert fastmath.install()  # idempotent


def test_a_model_computes_the_same_with_and_without_it(checkpoints):
    for family in ("llama", "qwen3_5"):
        model, _ = mlx_spec.load(str(checkpoints[family][0]))
        tokens = mx.array([[1, 5, 9, 3, 7, 2, 8, 4]], mx.uint32)
        fast = model(tokens)
        with fastmath.disabled():
            slow = model(tokens)
        assert mx.allclose(fast, slow, atol=1e-4, rtol=1e-4), family
        assert mx.array_equal(fast.argmax(-1), slow.argmax(-1)), family


def test_a_mask_converted_for_one_layer_serves_the_next_and_no_other():
    q, k, v = (mx.random.normal((1, 2, 3, 8)) for _ in range(3))
    rows = mx.random.uniform(shape=(1, 1, 3, 3)) > 0.3
    rows = rows | mx.eye(3, dtype=mx.bool_)
    for mask in ["causal", rows, "causal", rows, rows.astype(mx.float32) * -5.0, "causal"]:
        ours = fastmath.scaled_dot_product_attention(q, k, v, None, scale=0.5, mask=mask)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask)
        assert mx.allclose(ours, theirs, atol=1e-5, rtol=1e-5)


def test_a_quantized_cache_goes_to_mlx_lms_quantized_attention():
    from mlx_lm.models.cache import QuantizedKVCache

    cache = QuantizedKVCache(group_size=32, bits=8)
    q = mx.random.normal((1, 2, 3, 64))
    keys, values = cache.update_and_fetch(mx.random.normal((1, 2, 3, 64)), q)
    # (mlx-lm's quantized attention scales its queries in place: each call gets a copy)
    expect = ORIGINAL_SDPA(mx.array(q), keys, values, cache, scale=0.125, mask="causal")
    got = fastmath.scaled_dot_product_attention(
        mx.array(q), keys, values, cache, scale=0.125, mask="causal"
    )
    assert mx.array_equal(got, expect)
