"""Fast exponentials for MLX's Linux CPU backend: SwiGLU and attention's softmax.

The Linux CPU wheel of MLX is built for baseline x86-64: its `exp`, `sigmoid` and `softmax` run
one element at a time, each polynomial step an out-of-line call to libm's `fmaf` (~16 ns an
element). In a verifying pass (8 rows x 4 tokens through the demo target) the SwiGLU of every
MLP and the softmax of every attention layer then take about a seventh of the pass.

Here `exp` is the classic range reduction (x = n ln 2 + r, |r| <= ln 2 / 2), a degree-7
polynomial in r and 2^n built from its exponent bits, in shapeless `mx.compile`d functions
that g++ vectorizes: within 1 ulp of exp over float32's range (MLX's own: ~30), SwiGLU over
8 x 4 x 1024 elements in a third of the time, attention's softmax in two thirds. mlx-lm's
`swiglu` and `scaled_dot_product_attention` are replaced by versions that use it (the same
products; the softmax over float32 scores, as MLX's own CPU attention computes it) when the
default device is the CPU, the inputs are float32 and large enough (`MIN_ELEMENTS`: below,
the extra kernels cost more than they save); anything else (another device or dtype, attention
sinks, a quantized cache) goes to mlx-lm's functions unchanged. Gradients are mlx-lm's own
(`mx.custom_function`), so training through a patched model is as before.

`install()` is idempotent; it runs on Linux when `mlx_spec` is imported, unless
`MLX_SPEC_FAST_MATH=0`. Model modules imported later bind the replacements (they import the
names from `mlx_lm.models.activations` and `.base`); those imported before are rebound.
`disabled()` switches the fast paths off for a block (`benchmarks/fast_math.py`'s A/B).
"""

from __future__ import annotations

import contextlib
import os
import sys
from functools import partial

import mlx.core as mx

ENV = "MLX_SPEC_FAST_MATH"  # 0: keep MLX's own exp everywhere

_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 = hi + lo, hi exact in few bits
_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
      5.0000001201e-1)  # fmt: skip
_ROUND = 12582912.0  # 1.5 * 2^23
_LOW, _HIGH = -87.33654, 88.0  # below: 0 (exp < 2^-126); above: clamped (2^n stays finite)

_state = {"installed": False, "on": True, "originals": None, "mask": None}


@partial(mx.compile, shapeless=True)
def _reduce(x: mx.array) -> tuple[mx.array, mx.array]:
    """exp(x) = p * 2^n with |r| <= ln 2 / 2: p (a polynomial in r) and 2^n's float32 bits."""
    c = mx.minimum(mx.maximum(x, _LOW), _HIGH)
    # n = round(c / ln 2): adding 1.5 * 2^23 leaves no fraction bits (a float32's sum rounds
    # to nearest), cheaper than `floor` in MLX's CPU kernels (a 1M-element pass 3.1-3.4 ms, not 4)
    n = (c * _LOG2E + _ROUND) - _ROUND
    r = c - n * _LN2_HI - n * _LN2_LO
    p = _P[0]
    for coefficient in _P[1:]:
        p = p * r + coefficient
    p = p * (r * r) + r + 1.0
    return p, mx.left_shift(n.astype(mx.int32) + 127, 23)


def _parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """p and 2^n of exp(x). Reading the bits as float32 (`view`) cannot be traced shapeless: it
    runs between the compiled functions, which then serve every shape without retracing."""
    p, bits = _reduce(x)
    return p, bits.view(mx.float32)


@partial(mx.compile, shapeless=True)
def _exp_of(x: mx.array, p: mx.array, two_n: mx.array) -> mx.array:
    return mx.where(x < _LOW, 0.0, p * two_n)


def exp(x: mx.array) -> mx.array:
    """exp of float32 `x` (0 below float32's normal range)."""
    return _exp_of(x, *_parts(x))


@partial(mx.compile, shapeless=True)
def _swiglu_of(gate: mx.array, x: mx.array, p: mx.array, two_n: mx.array) -> mx.array:
    return gate / (1.0 + _exp_of(-gate, p, two_n)) * x


@partial(mx.compile, shapeless=True)
def _reduce_from(scores: mx.array, top: mx.array) -> tuple[mx.array, mx.array]:
    return _reduce(scores - top)


@partial(mx.compile, shapeless=True)
def _exp_from(scores: mx.array, top: mx.array, p: mx.array, two_n: mx.array) -> mx.array:
    return _exp_of(scores - top, p, two_n)


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis of float32 `scores` (-inf: weight 0). The shift by the row's
    maximum is recomputed inside both kernels rather than written out (one pass fewer over
    the scores: an attention over a long prefix has a million per layer)."""
    top = scores.max(axis=-1, keepdims=True)
    p, bits = _reduce_from(scores, top)
    e = _exp_from(scores, top, p, bits.view(mx.float32))
    return e / e.sum(axis=-1, keepdims=True)


# Below this many elements the fast path's extra kernels cost more (a few microseconds each)
# than the scalar exp it saves (measured: `benchmarks/fast_math.py`, one row of the demo target).
MIN_ELEMENTS = 16384
# SwiGLU's one kernel pays from fewer: eight calls over 8192 elements (a plain step of 8 rows
# through the demo target's MLPs) took 0.77 ms against MLX's 1.09 (4096: 0.62 against 0.57).
MIN_SWIGLU = 8192


def _active(x: mx.array, elements: int, least: int | None = None) -> bool:
    return (
        _state["on"]
        and elements >= (MIN_ELEMENTS if least is None else min(least, MIN_ELEMENTS))
        and x.dtype == mx.float32
        and mx.default_device().type == mx.cpu
    )


@mx.custom_function
def _swiglu(gate, x):
    return _swiglu_of(gate, x, *_parts(-gate))


@_swiglu.vjp
def _swiglu_vjp(primals, cotangent, output):
    return mx.vjp(_state["originals"][0], list(primals), [cotangent])[1]


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu` (silu(gate) * x), with the fast exp on the CPU."""
    if not _active(gate, gate.size, MIN_SWIGLU):
        return _state["originals"][0](gate, x)
    return _swiglu(gate, x)


def _additive(mask, queries: int, keys: int) -> mx.array:
    """The mask as a 4-D additive float mask (0 or -inf where boolean). A model builds one mask
    per pass and hands it to every layer: the last one converted is kept for the next layer."""
    # An array mask is known by its identity: the entry keeps it alive, so its id stays its own.
    key = ("causal", queries, keys) if isinstance(mask, str) else ("array", id(mask))
    last = _state["mask"]
    if last is not None and last[0] == key:
        return last[2]
    given = mask
    if isinstance(mask, str):  # "causal": query i is position keys - queries + i
        mask = mx.arange(keys - queries, keys)[:, None] >= mx.arange(keys)[None]
    if mask.dtype == mx.bool_:
        mask = mx.where(mask, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape) if mask.ndim < 4 else mask
    _state["mask"] = (key, given, mask)
    return mask


def _attend(q, k, v, scale, add=None) -> mx.array:
    """Attention of `[B, H, L, D]` queries over `[B, Hk, S, D]` keys and values (grouped:
    H / Hk queries per key head), `add` a 4-D additive mask or None."""
    b, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    q = (q * scale).reshape(b, kv_heads, heads // kv_heads, length, dim)
    scores = q @ mx.expand_dims(k, 2).swapaxes(-1, -2)  # [B, Hk, rep, L, S]
    if add is not None:
        if add.shape[1] == 1:
            scores = scores + mx.expand_dims(add, 2)
        else:
            scores = scores + add.reshape(add.shape[0], kv_heads, -1, *add.shape[2:])
    out = softmax(scores) @ mx.expand_dims(v, 2)
    return out.reshape(b, heads, length, v.shape[-1])


@mx.custom_function
def _attend_masked(q, k, v, add, scale):
    return _attend(q, k, v, scale, add)


@_attend_masked.vjp
def _attend_masked_vjp(primals, cotangent, output):
    q, k, v, add, scale = primals
    grads = _reference_vjp([q, k, v], cotangent, scale, add)
    return (*grads, mx.zeros_like(add), mx.zeros_like(scale))


@mx.custom_function
def _attend_unmasked(q, k, v, scale):
    return _attend(q, k, v, scale)


@_attend_unmasked.vjp
def _attend_unmasked_vjp(primals, cotangent, output):
    q, k, v, scale = primals
    return (*_reference_vjp([q, k, v], cotangent, scale, None), mx.zeros_like(scale))


def _reference_vjp(qkv: list, cotangent, scale: mx.array, mask) -> list:
    """The gradients of mlx-lm's attention (the fast one's forward computes the same)."""
    value = scale.item()

    def reference(q, k, v):
        return _state["originals"][1](q, k, v, None, scale=value, mask=mask)

    return mx.vjp(reference, qkv, [cotangent])[1]


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's `scaled_dot_product_attention`, with the fast softmax on the CPU."""
    original = _state["originals"][1]
    if sinks is not None or not isinstance(keys, mx.array):
        # attention sinks; a quantized cache's keys are (packed, scales, biases) tuples
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    b, heads, length, _ = queries.shape
    if not _active(queries, b * heads * length * keys.shape[2]):
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    factor = mx.array(scale, mx.float32)
    if mask is None:
        return _attend_unmasked(queries, keys, values, factor)
    add = _additive(mask, length, keys.shape[2])
    return _attend_masked(queries, keys, values, add, factor)


def install() -> bool:
    """Route mlx-lm's SwiGLU and attention through the fast exp (Linux, unless `ENV=0`);
    whether it is installed."""
    if _state["installed"]:
        return True
    if sys.platform != "linux" or not env_allows(ENV):
        return False
    import mlx_lm.models.activations as activations
    import mlx_lm.models.base as base

    old = (activations.swiglu, base.scaled_dot_product_attention)
    _state["originals"] = old
    new = (swiglu, scaled_dot_product_attention)
    for name, module in list(sys.modules.items()):
        if not name.startswith(("mlx_lm.", "mlx_vlm.", "mlx_spec.")) or module is None:
            continue
        for attribute, before, after in zip(
            ("swiglu", "scaled_dot_product_attention"), old, new, strict=True
        ):
            if getattr(module, attribute, None) is before:
                setattr(module, attribute, after)
    _state["installed"] = True
    return True


def env_allows(name: str) -> bool:
    """Whether the environment leaves a fast path on: `name` unset, or not 0 / off / no."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "off", "no")


@contextlib.contextmanager
def switched_off(state: dict, key: str = "on", value: bool = False):
    """A fast path's `state[key]` (`"on"`) set to `value` (False) inside the block."""
    before, state[key] = state[key], value
    try:
        yield
    finally:
        state[key] = before


def disabled():
    """MLX's own exp inside the block (the fast paths installed stay, switched off)."""
    return switched_off(_state)
