"""RoPE and RMSNorm in fewer ops on MLX's CPU backend, with the same results.

MLX has no CPU kernel for `mx.fast.rope` or `mx.fast.rms_norm`: on the CPU both run their
fallback, a graph of ops built on every call (RoPE: ~17 ops, among them an `exp` for the
frequencies and a `cos` and `sin` of every position; RMSNorm: 7). Each op costs a few
microseconds to schedule whatever its size, and a decoding pass of a small model is made of
small ops: through the demo target (8 layers, 16 RoPE and 17 RMSNorm calls) RoPE alone took a
tenth of a verifying pass over 8 rows x 4 tokens.

Here, when the default device is the CPU and the input is float32 and 4-D (RoPE) or float32
(RMSNorm):

- RoPE keeps each (dims, base, dtype)'s inverse frequencies and each length's `arange`
  (evaluated once), and shares the cosines and sines of a call's positions with the next
  calls at the same positions (every layer of a pass rotates its queries and keys at the
  same positions) when the offset is an array registered with `stable()`: the batch cache
  registers its offsets, which it replaces and never updates in place (an `mx.array` updated
  in place keeps its identity, so no other array can be trusted to still hold the same
  positions). The rotation itself is one fused kernel (a shapeless `mx.compile`) and a
  concatenation.
- RMSNorm is MLX's mean of squares, then one fused kernel for the scaling.

The arithmetic is the fallback's, op for op (the fused kernels compute the same float32
products and sums in the same order), so outputs are bitwise equal to MLX's own on this
backend (tested). Anything else (a GPU, another dtype, an explicit stream, a call inside
`mx.compile` or `mx.vmap` before the constants exist) goes to MLX's functions unchanged, and
gradients flow through the same ops.

`install()` (idempotent; run on Linux when `mlx_spec` is imported, unless
`MLX_SPEC_FUSED_OPS=0`) replaces `mx.fast.rope` and `mx.fast.rms_norm`, which `mlx.nn` and
mlx-lm's models look up at call time; `disabled()` switches it off for a block (the A/B of
`benchmarks/fast_math.py`).
"""

from __future__ import annotations

import math
import sys
import threading
from collections import OrderedDict
from functools import partial

from mlx_spec.platform.fastmath import env_allows, switched_off

import mlx.core as mx

ENV = "MLX_SPEC_FUSED_OPS"  # 0: keep MLX's own fallbacks

_state = {"installed": False, "on": True, "rope": None, "rms_norm": None}
_lock = threading.Lock()
_constants: dict[tuple, mx.array] = {}  # inverse frequencies, aranges: evaluated once
_stable: OrderedDict[int, mx.array] = OrderedDict()  # id -> offset array registered as stable
_angles: OrderedDict[tuple, tuple] = OrderedDict()  # (offset key, T, params) -> (cos, sin)
_KEEP = 16  # stable offsets and cached angles held (several caches can be decoding)


@partial(mx.compile, shapeless=True)
def _rotate(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


@partial(mx.compile, shapeless=True)
def _scale(x, mean_square, eps, weight):
    return x * mx.rsqrt(mean_square + eps) * weight


@partial(mx.compile, shapeless=True)
def _scale_unweighted(x, mean_square, eps):
    return x * mx.rsqrt(mean_square + eps)


def _remember(table: OrderedDict, key, value) -> None:
    """`table[key] = value` as the newest entry; the oldest beyond `_KEEP` dropped."""
    with _lock:
        table[key] = value
        table.move_to_end(key)
        while len(table) > _KEEP:
            table.popitem(last=False)


def stable(offset: mx.array) -> mx.array:
    """Register `offset` (an array of positions that is replaced, never updated in place) so
    that RoPE calls at its positions share their cosines and sines. Returns it."""
    _remember(_stable, id(offset), offset)
    return offset


def _constant(key: tuple, make) -> mx.array | None:
    """A constant made once and evaluated; None inside a function transformation (`compile`,
    `vmap`), where nothing may be evaluated: the caller then takes MLX's own path."""
    value = _constants.get(key)
    if value is None:
        value = make()
        try:
            mx.eval(value)
        except (ValueError, RuntimeError):
            return None
        _constants[key] = value
    return value


def _cos_sin(offset, length: int, half: int, base, scale: float, freqs, dtype):
    """The fallback's cosines and sines, op for op: positions (arange(T) + offset) * scale,
    times the inverse frequencies; None where the constants cannot be made (see `_constant`)."""
    if freqs is None:
        inv = _constant(
            ("inv", half, base, dtype),
            lambda: mx.exp(
                mx.arange(0, -half, -1, dtype=dtype) * mx.array(math.log(base) / half, dtype)
            ),
        )
    else:
        inv = mx.reciprocal(freqs.astype(mx.float32)).astype(dtype)
    steps = _constant(("arange", length, dtype), lambda: mx.arange(length, dtype=dtype))
    if inv is None or steps is None:
        return None
    if isinstance(offset, mx.array) and offset.size > 1:
        offset = offset.reshape(-1, 1, 1)  # [B, 1, 1]: each row its own positions
    positions = (steps + offset) * mx.array(scale, dtype)
    theta = positions[..., None] * inv
    return mx.cos(theta), mx.sin(theta)


def _angles_of(offset, length: int, half: int, base, scale: float, freqs, dtype):
    """`_cos_sin`, shared by the calls at a registered offset's positions (see `stable`)."""
    if not (isinstance(offset, mx.array) and _stable.get(id(offset)) is offset):
        return _cos_sin(offset, length, half, base, scale, freqs, dtype)
    # the frequencies array is held in the entry, so its id names it while the entry lives
    key = (id(offset), length, half, base, scale, None if freqs is None else id(freqs), dtype)
    with _lock:
        entry = _angles.get(key)
    if entry is not None:
        return entry[1]
    pair = _cos_sin(offset, length, half, base, scale, freqs, dtype)
    if pair is not None:
        _remember(_angles, key, ((offset, freqs), pair))
    return pair


def rope(a, dims, *, traditional, base, scale, offset, freqs=None, stream=None):
    """`mx.fast.rope`, in fewer ops on the CPU (see the module's docstring)."""
    pair = None
    if (
        _state["on"]
        and stream is None
        and a.ndim == 4
        and a.dtype == mx.float32
        and (freqs is None) != (base is None)
        and mx.default_device().type == mx.cpu
    ):
        if isinstance(offset, mx.array) and offset.dtype != mx.int32:
            offset = offset.astype(mx.int32)
        pair = _angles_of(offset, a.shape[2], dims // 2, base, scale, freqs, a.dtype)
    if pair is None:
        return _state["rope"](
            a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
        )
    cos, sin = pair
    half = dims // 2
    if traditional:
        o1, o2 = _rotate(a[..., 0:dims:2], a[..., 1:dims:2], cos, sin)
        out = mx.concatenate([o1[..., None], o2[..., None]], axis=-1)
        parts = [out.reshape(*a.shape[:3], dims)]
    else:
        parts = list(_rotate(a[..., :half], a[..., half:dims], cos, sin))
    if dims < a.shape[-1]:
        parts.append(a[..., dims:])
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def rms_norm(x, weight, eps, *, stream=None):
    """`mx.fast.rms_norm`, in fewer ops on the CPU (see the module's docstring)."""
    if (
        not _state["on"]
        or stream is not None
        or x.dtype != mx.float32
        or (weight is not None and weight.dtype != mx.float32)
        or x.ndim == 0
        or mx.default_device().type != mx.cpu
    ):
        return _state["rms_norm"](x, weight, eps)
    mean_square = mx.mean(mx.square(x), axis=-1, keepdims=True)
    epsilon = mx.array(eps, mx.float32)
    if weight is None:
        return _scale_unweighted(x, mean_square, epsilon)
    return _scale(x, mean_square, epsilon, weight)


def install() -> bool:
    """Replace `mx.fast.rope` and `mx.fast.rms_norm` (Linux, unless `ENV=0`); whether they
    are replaced."""
    if _state["installed"]:
        return True
    if sys.platform != "linux" or not env_allows(ENV):
        return False
    _state["rope"], _state["rms_norm"] = mx.fast.rope, mx.fast.rms_norm
    mx.fast.rope, mx.fast.rms_norm = rope, rms_norm
    _state["installed"] = True
    return True


def disabled():
    """MLX's own fallbacks inside the block (the replacements stay, switched off)."""
    return switched_off(_state)
