"""Attention of short queries on MLX's CUDA backend, without a stall at every new length.

On the CUDA backend (mlx 0.32.4, measured on an H200 with the demo target in float16),
`mx.fast.scaled_dot_product_attention` with more than one query builds a kernel for each new
(queries, keys) shape: about 40 ms the first time a shape is seen, against 0.1-0.3 ms once it
is built. A single query takes a kernel that serves every length. Speculative decoding's
verifying pass has 2..K+1 queries against a cache one or more tokens longer than the last
time, so nearly every verifying pass met a new shape: a verifying pass of 3 tokens took 42 ms
where a plain step took 2.2 ms, and every drafter ran at a fraction of plain decoding
(mlx-lm's own speculative decoding too).

Here, when MLX runs on CUDA and a call has 2..`MAX_QUERIES` queries (or more, while its scores
stay under `MAX_SCORES` elements: a prompt chunk of a new length meets a new shape too),
attention is computed with ordinary ops: the scaled queries grouped by key/value head,
`q @ k^T`, the mask (the lower-right "causal" of MLX's, a boolean or an additive array, per
row or per head), attention sinks as an extra logit, a float32 softmax and `p @ v`. Those
kernels take any shape, so a verifying pass of 3 tokens costs 4 ms there whatever the length
(measured with the same patch). A single query, a prompt chunk with more scores, an explicit
stream, `force_fused` and every other device (Metal, the CPU) go to MLX's function unchanged.

`install()` (idempotent; run when `mlx_spec` is imported, unless `MLX_SPEC_SHORT_ATTENTION=0`)
replaces `mx.fast.scaled_dot_product_attention`, which mlx-lm's models and this package's
drafters look up at call time. `MLX_SPEC_SHORT_ATTENTION=N` routes up to N queries (default
`MAX_QUERIES`). `forced()` routes calls as on CUDA whatever the device (the tests compare the
two paths on the CPU); `disabled()` keeps MLX's own for a block, `short_only()` MLX's own for
prompt chunks (`benchmarks/attention_shapes.py`'s A/B).
"""

from __future__ import annotations

import os

from mlx_spec.platform.fastmath import env_allows, switched_off

import mlx.core as mx

ENV = "MLX_SPEC_SHORT_ATTENTION"  # 0: MLX's own attention everywhere; N: longest query routed
MAX_QUERIES = 32  # a verifying pass (K + 1 <= 9 by default), a tree's nodes, a DFlash block
# Longer queries (prompt chunks) are routed too while their scores (rows x heads x queries x
# keys) stay under this many elements (64 MiB in float32): a new prompt length is a new shape
# for MLX's kernel, and the ordinary ops write and read the scores a few times per layer,
# ~0.1 ms at this size on a data-centre GPU against ~40 ms to build a kernel.
MAX_SCORES = 1 << 24

_state = {
    "installed": False,
    "on": True,
    "prefill": True,
    "forced": False,
    "original": None,
    "cuda": None,
}


def _limit() -> int:
    value = os.environ.get(ENV, "").strip()
    return int(value) if value.isdigit() and int(value) > 1 else MAX_QUERIES


def _routed(q: mx.array, keys: int) -> bool:
    """Whether a call of `q` [B, H, T, D] over `keys` keys goes through `attend` (on CUDA)."""
    queries = q.shape[2]
    if queries < 2:
        return False
    if queries <= _limit():
        return True
    return _state["prefill"] and q.shape[0] * q.shape[1] * queries * keys <= MAX_SCORES


def _on_cuda() -> bool:
    if _state["forced"]:
        return True
    if _state["cuda"] is None:
        cuda = getattr(mx, "cuda", None)
        _state["cuda"] = bool(cuda is not None and cuda.is_available())
    return _state["cuda"] and mx.default_device().type == mx.gpu


def _grouped_mask(mask: mx.array, heads: int, kv_heads: int) -> mx.array:
    """A mask broadcastable to [B, heads, T, L] as one to [B, kv_heads, heads/kv_heads, T, L]."""
    if mask.ndim < 4:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    rows, per_head, queries, keys = mask.shape
    if per_head == 1:
        return mask.reshape(rows, 1, 1, queries, keys)
    return mask.reshape(rows, kv_heads, heads // kv_heads, queries, keys)


def attend(q, k, v, scale: float, mask=None, sinks=None) -> mx.array:
    """softmax(scale q k^T + mask) v with MLX's conventions, in ordinary ops: q [B, H, T, D],
    k and v [B, H_kv, L, D] (grouped-query heads not tiled), `mask` None, "causal" (the last
    query aligned with the last key), a boolean or an additive array; `sinks` [H] logits."""
    b, heads, queries, _ = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    grouped = (q * mx.array(scale, q.dtype)).reshape(b, kv_heads, group, queries, q.shape[-1])
    scores = grouped @ mx.expand_dims(k, 2).swapaxes(-1, -2)  # [B, H_kv, group, T, L]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        seen = mx.arange(keys - queries, keys)[:, None] >= mx.arange(keys)[None]
        scores = mx.where(seen, scores, mx.array(-mx.inf, scores.dtype))
    elif mask is not None:
        mask = _grouped_mask(mask, heads, kv_heads)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    if sinks is not None:
        sink = mx.broadcast_to(
            sinks.astype(scores.dtype).reshape(1, kv_heads, group, 1, 1),
            (*scores.shape[:-1], 1),
        )
        probs = mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1, precise=True)
        probs = probs[..., 1:]
    else:
        probs = mx.softmax(scores, axis=-1, precise=True)
    out = probs.astype(v.dtype) @ mx.expand_dims(v, 2)  # [B, H_kv, group, T, D_v]
    return out.reshape(b, heads, queries, v.shape[-1])


def scaled_dot_product_attention(q, k, v, *, scale, mask=None, stream=None, **options):
    """`mx.fast.scaled_dot_product_attention`; short queries on CUDA in ordinary ops (see the
    module's docstring)."""
    if (
        _state["on"]
        and stream is None
        and not options.get("force_fused", False)
        and q.shape[2] > 1
        and _on_cuda()
        and _routed(q, k.shape[2])
    ):
        return attend(q, k, v, scale, mask, options.get("sinks"))
    if stream is not None:
        options["stream"] = stream
    return _state["original"](q, k, v, scale=scale, mask=mask, **options)


def install() -> bool:
    """Replace `mx.fast.scaled_dot_product_attention` (unless `ENV=0`); whether it is."""
    if _state["installed"]:
        return True
    if not env_allows(ENV):
        return False
    _state["original"] = mx.fast.scaled_dot_product_attention
    mx.fast.scaled_dot_product_attention = scaled_dot_product_attention
    _state["installed"] = True
    return True


def forced():
    """Short queries routed through `attend` inside the block, on any device."""
    return switched_off(_state, "forced", True)


def disabled():
    """MLX's own attention inside the block (the replacement stays, switched off)."""
    return switched_off(_state)


def short_only():
    """Inside the block only calls of up to `_limit()` queries are routed (no prompt chunks)."""
    return switched_off(_state, "prefill")
