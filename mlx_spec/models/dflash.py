"""DFlash block drafters (z-lab, 2026): a whole block of draft tokens in one forward pass.

A stack of Qwen3-style layers reads two streams:
- the context: the target's features at `target_layer_ids` (decoder-layer *outputs*: Hugging
  Face `hidden_states[id + 1]`), concatenated, `ctx = hidden_norm(fc(features))`; in every
  layer K and V of the context come from `ctx` itself (no input norm) and are kept in the
  drafter's cache, at the context's absolute positions;
- the block: `[last token, mask, ..., mask]` embedded with the target's embedding (times
  `input_embedding_scale`), at the positions after the context; queries, and K/V that are
  used for this pass only.
Attention inside the block is bidirectional on full-attention layers (causal, and windowed,
on sliding ones). The block's outputs after its first position go through `norm` and the
target's head (times `output_multiplier`, soft-capped by `final_logit_softcapping`): the
drafts for the positions after the last token.

Layouts: z-lab's checkpoints (a Qwen3 config with `num_target_layers` and `dflash_config`
{`target_layer_ids`, `mask_token_id`, `block_size`, ...}; older ones keep `block_size` and
`target_layer_ids` at the top level) and the speculators `dflash` format
(`speculators_model_type: dflash`, `transformer_layer_config`, `aux_hidden_state_layer_ids`,
`block_size`, `mask_token_id`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlx_spec.caches.taps import decoder_layers, find_embedding, find_head
from mlx_spec.models.blocks import SwiGLU, shaped_like
from mlx_spec.models.checkpoint import cast_floats, load_checked, read_checkpoint

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    attention_bias: bool
    target_layer_ids: tuple[int, ...]  # decoder-layer outputs (hidden_states[id + 1])
    mask_token_id: int
    block_size: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        out["target_layer_ids"] = list(self.target_layer_ids)
        out["layer_types"] = list(self.layer_types)
        return out


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default: one tapped layer per draft layer, spread over 1 .. L - 3 (kept inside
    0 .. L - 1 for targets of fewer than 5 layers)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    ids = (round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))
    return tuple(min(max(i, 0), num_target_layers - 1) for i in ids)


def is_dflash_config(config: dict) -> bool:
    if config.get("speculators_model_type") == "dflash" or config.get("model_type") == "dflash":
        return True
    return "dflash_config" in config or "DFlash" in " ".join(config.get("architectures") or [])


def read_dflash_config(config: dict, num_target_layers: int | None = None) -> DFlashConfig:
    """A `DFlashConfig` from z-lab's, the speculators format's or a converted config.json.

    Raises:
        ValueError: not a DFlash config, or one without a mask token.
    """
    if config.get("model_type") == "dflash" and "target_layer_ids" in config:  # converted
        fields = {k: v for k, v in config.items() if k in DFlashConfig.__dataclass_fields__}
        fields["target_layer_ids"] = tuple(fields["target_layer_ids"])
        fields["layer_types"] = tuple(fields["layer_types"])
        return DFlashConfig(**fields)
    if not is_dflash_config(config):
        raise ValueError("not a DFlash config (no dflash_config, no speculators dflash type)")
    if config.get("speculators_model_type") == "dflash":
        layer = dict(config.get("transformer_layer_config") or {})
        extra = {k: config.get(k) for k in ("block_size", "mask_token_id")}
        extra["target_layer_ids"] = config.get("aux_hidden_state_layer_ids")
        if config.get("projector_type", "dflash") != "dflash":
            raise ValueError(f"DFlash projector {config['projector_type']!r} is not supported")
    else:
        layer = config
        extra = dict(config.get("dflash_config") or {})
        for key in ("block_size", "target_layer_ids", "mask_token_id"):
            extra.setdefault(key, config.get(key))
    layers = layer["num_hidden_layers"]
    ids = extra.get("target_layer_ids")
    if ids is None:
        depth = config.get("num_target_layers", num_target_layers)
        if depth is None:
            raise ValueError("the DFlash config names no target layers and no target depth")
        ids = default_target_layer_ids(depth, layers)
    if extra.get("mask_token_id") is None:
        raise ValueError("the DFlash config has no mask_token_id")
    heads = layer["num_attention_heads"]
    types = layer.get("layer_types") or ["full_attention"] * layers
    return DFlashConfig(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads", heads),
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=(layer.get("rope_parameters") or {}).get("rope_theta")
        or layer.get("rope_theta", 10000.0),
        rope_scaling=layer.get("rope_scaling"),
        max_position_embeddings=layer.get("max_position_embeddings", 32768),
        attention_bias=bool(layer.get("attention_bias", False)),
        target_layer_ids=tuple(int(i) for i in ids),
        mask_token_id=int(extra["mask_token_id"]),
        block_size=int(extra.get("block_size") or 16),
        layer_types=tuple(types),
        sliding_window=layer.get("sliding_window"),
        is_causal=layer.get("is_causal"),
        input_embedding_scale=float(extra.get("input_embedding_scale") or 1.0),
        output_multiplier=float(extra.get("output_multiplier") or 1.0),
        final_logit_softcapping=extra.get("final_logit_softcapping"),
    )


class _Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig, index: int):
        super().__init__()
        d, heads, kv, hd = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv, hd, hd**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(d, heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, kv * hd, bias=bias)
        self.v_proj = nn.Linear(d, kv * hd, bias=bias)
        self.o_proj = nn.Linear(heads * hd, d, bias=bias)
        self.q_norm = nn.RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, cfg.rms_norm_eps)
        self.rope = initialize_rope(
            hd, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings
        )
        sliding = cfg.layer_types[index] == "sliding_attention"
        self.causal = sliding if cfg.is_causal is None else bool(cfg.is_causal)
        self.window = cfg.sliding_window if sliding else None

    def _kv(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(b, s, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, s, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def __call__(self, x: mx.array, ctx: mx.array | None, cache: KVCache, start: int):
        """`x`: the normed block `[1, B, d]` at positions start ..; `ctx`: new context `[1, C,
        d]` at positions cache.offset .. start - 1 (stored), or None."""
        b, s, _ = x.shape
        if ctx is not None and ctx.shape[1]:
            k, v = self._kv(ctx, cache.offset)
            cache.update_and_fetch(k, v)
        q = self.q_norm(self.q_proj(x).reshape(b, s, self.heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=start)
        kb, vb = self._kv(x, start)
        if cache.keys is not None and cache.offset:
            kb = mx.concatenate([cache.keys[..., : cache.offset, :], kb], axis=2)
            vb = mx.concatenate([cache.values[..., : cache.offset, :], vb], axis=2)
        mask = self._mask(s, kb.shape[2], start) if self.causal or self.window else None
        out = scaled_dot_product_attention(q, kb, vb, cache=None, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, s, -1))

    def _mask(self, queries: int, keys: int, start: int) -> mx.array:
        context = keys - queries
        q_pos = (start + mx.arange(queries))[:, None]
        k_pos = mx.concatenate([mx.arange(context), start + mx.arange(queries)])[None]
        visible = mx.ones((queries, keys), dtype=mx.bool_)
        if self.causal:
            visible = visible & (k_pos <= q_pos)
        if self.window is not None:
            visible = visible & (q_pos - k_pos < self.window)
            if not self.causal:
                visible = visible & (k_pos - q_pos < self.window)
        return visible

    def rows_call(self, x: mx.array, cache, start: mx.array, mask: mx.array) -> mx.array:
        """A batch of rows: `x` `[B, S, d]` normed blocks, row i's at positions `start[i]` ..;
        the rows' context is what `cache` (a `BatchLayerCache`) holds; `mask` `[B, 1, S, C +
        S]` (see `DFlashModel.rows_mask`)."""
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, s, self.heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=start)
        kb, vb = self._kv(x, start)
        used = cache.positions.idx
        if cache.keys is not None and used:
            kb = mx.concatenate([cache.keys[..., :used, :], kb], axis=2)
            vb = mx.concatenate([cache.values[..., :used, :], vb], axis=2)
        out = scaled_dot_product_attention(q, kb, vb, cache=None, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, s, -1))

    def train_call(self, x, ctx, ctx_pos, blk_pos, mask):
        """Training: every block of a sequence at once. `x` `[B, N, d]` normed blocks at
        positions `blk_pos`, `ctx` `[B, S, d]` at `ctx_pos`; `mask` `[N, S + N]`."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, n, self.heads, -1)).transpose(0, 2, 1, 3)
        q = _rope_at(self.rope, q, blk_pos)
        keys, values = [], []
        for source, pos in ((ctx, ctx_pos), (x, blk_pos)):
            s = source.shape[1]
            k = self.k_norm(self.k_proj(source).reshape(b, s, self.kv_heads, -1))
            keys.append(_rope_at(self.rope, k.transpose(0, 2, 1, 3), pos))
            v = self.v_proj(source).reshape(b, s, self.kv_heads, -1)
            values.append(v.transpose(0, 2, 1, 3))
        k, v = mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)
        out = scaled_dot_product_attention(q, k, v, cache=None, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def _rope_at(rope, x: mx.array, positions: mx.array) -> mx.array:
    """`x` `[B, H, L, D]` with token j at `positions[j]`: one rope call over B * L one-token
    sequences, each with its own offset."""
    b, h, n, d = x.shape
    flat = x.transpose(0, 2, 1, 3).reshape(b * n, h, 1, d)
    out = rope(flat, mx.broadcast_to(positions[None], (b, n)).reshape(-1))
    return out.reshape(b, n, h, d).transpose(0, 2, 1, 3)


class _Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig, index: int):
        super().__init__()
        self.self_attn = _Attention(cfg, index)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x, ctx, cache, start):
        y = x + self.self_attn(self.input_layernorm(x), ctx, cache, start)
        return y + self.mlp(self.post_attention_layernorm(y))

    def rows_call(self, x, cache, start, mask):
        y = x + self.self_attn.rows_call(self.input_layernorm(x), cache, start, mask)
        return y + self.mlp(self.post_attention_layernorm(y))

    def train_call(self, x, ctx, ctx_pos, blk_pos, mask):
        y = x + self.self_attn.train_call(self.input_layernorm(x), ctx, ctx_pos, blk_pos, mask)
        return y + self.mlp(self.post_attention_layernorm(y))


class DFlashModel(nn.Module):
    """The draft stack, borrowing the target's embedding and head.

    `model(block [1, B], features [1, C, n T] or None, caches, start) -> logits [1, B - 1, V]`
    """

    def __init__(self, cfg: DFlashConfig, target: nn.Module, target_hidden: int):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * target_hidden, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = [_Layer(cfg, i) for i in range(cfg.num_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        object.__setattr__(self, "_embed", find_embedding(target))
        object.__setattr__(self, "_head", find_head(target))
        self.args = target.args

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target features it reads, as Hugging Face `hidden_states` indices."""
        return tuple(i + 1 for i in self.cfg.target_layer_ids)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def feed_context(self, features: mx.array, caches: list) -> None:
        """Append the context of `features` `[1, C, n T]` (the positions after those cached)
        to every layer's cache, without drafting: K/V of a layer's context depend on the
        context alone."""
        ctx = self.hidden_norm(self.fc(features.astype(self.fc.weight.dtype)))
        for layer, cache in zip(self.layers, caches, strict=True):
            k, v = layer.self_attn._kv(ctx, cache.offset)
            cache.update_and_fetch(k, v)

    def __call__(self, block: mx.array, features, caches: list, start: int) -> mx.array:
        cfg = self.cfg
        x = self._embed(block) * cfg.input_embedding_scale
        ctx = None
        if features is not None and features.shape[1]:
            ctx = self.hidden_norm(self.fc(features.astype(x.dtype)))
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, ctx, cache, start)
        return self.logits(x[:, 1:])

    # --- a batch of rows (the server's engine): the context in a `BatchCache` ---------------

    def feed_rows(self, features: mx.array, cache, lengths: list[int]) -> None:
        """Append to row i of `cache` (a `BatchCache` of this model) the context of the first
        `lengths[i]` positions of `features` `[B, C, n T]` (right-padded)."""
        ctx = self.hidden_norm(self.fc(features.astype(self.fc.weight.dtype)))
        cache.begin(lengths)
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            k, v = layer.self_attn._kv(ctx, layer_cache.offset)
            layer_cache.update_and_fetch(k, v)
        cache.end(lengths)

    def draft_rows(self, block: mx.array, cache, sizes: list[int]) -> mx.array:
        """Logits `[B, S - 1, V]` of each row's block: `block` `[B, S]`, row i's first
        `sizes[i]` real (its pending token, then mask tokens), placed right after the context
        its row of `cache` holds; a row sees that context and its own block's real tokens."""
        x = self._embed(block) * self.cfg.input_embedding_scale
        masks: dict = {}
        start = cache.layers[0].offset
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            attn = layer.self_attn
            key = (attn.causal, attn.window)
            if key not in masks:
                masks[key] = rows_mask(layer_cache.positions, sizes, block.shape[1], *key)
            x = layer.rows_call(x, layer_cache, start, masks[key])
        return self.logits(x[:, 1:])

    def logits(self, x: mx.array) -> mx.array:
        """The target's head over `norm(x)`, times `output_multiplier`, soft-capped."""
        head, method = self._head
        logits = getattr(head, method)(self.norm(x))
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap is not None and float(cap) > 0:
            logits = mx.tanh(logits / cap) * cap
        return logits


def rows_mask(positions, sizes: list[int], s: int, causal: bool, window: int | None):
    """`[B, 1, S, C + S]`: a row's block query sees the context columns its row holds (within
    the window) and its block's real tokens (the earlier ones if causal, within the window)."""
    pos = positions.pos[:, : positions.idx]  # [B, C] positions, EMPTY where nothing
    q_pos = positions.offset[:, None] + mx.arange(s)[None]  # [B, S]
    ctx = mx.broadcast_to((pos >= 0)[:, None, :], (pos.shape[0], s, pos.shape[1]))
    if window is not None:
        ctx = ctx & (q_pos[:, :, None] - pos[:, None, :] < window)
    j = mx.arange(s)
    blk = j[None, None, :] < mx.array(sizes)[:, None, None]  # [B, 1, S]
    if causal:
        blk = blk & (j[None, :, None] >= j[None, None, :])
    if window is not None:
        blk = blk & (mx.abs(j[None, :, None] - j[None, None, :]) < window)
    blk = mx.broadcast_to(blk, (len(sizes), s, s))
    return mx.concatenate([ctx, blk], axis=-1)[:, None]


def training_anchors(seq_len: int, block: int) -> list[int]:
    """Where the training blocks start in a sequence: every `block` positions from 1, each
    block's last draft still inside the sequence."""
    return list(range(1, seq_len - block + 1, block))


def train_logits(model: DFlashModel, tokens: mx.array, features: mx.array) -> mx.array:
    """Logits `[B, A, block - 1, V]` of every training block of `tokens` `[B, S]` at once:
    block j is `[tokens[a_j], mask ...]` at positions a_j .., seeing the context of
    positions before a_j and its own block (the round it stands for, with every earlier
    position committed). Draft i of block j guesses the token at a_j + i."""
    cfg = model.cfg
    block = cfg.block_size
    b, s = tokens.shape
    anchors = training_anchors(s, block)
    starts = mx.array(anchors)
    ids = mx.full((b, len(anchors), block), cfg.mask_token_id, mx.uint32)
    ids[:, :, 0] = tokens[:, starts].astype(mx.uint32)
    x = model._embed(ids.reshape(b, -1)) * cfg.input_embedding_scale
    ctx = model.hidden_norm(model.fc(features.astype(x.dtype)))
    blk_pos = (starts[:, None] + mx.arange(block)[None]).reshape(-1)
    ctx_pos = mx.arange(s)
    owner = mx.repeat(mx.arange(len(anchors)), block)  # the block each row belongs to
    sees_ctx = ctx_pos[None] < mx.repeat(starts, block)[:, None]
    mask = mx.concatenate([sees_ctx, owner[:, None] == owner[None]], axis=1)
    for layer in model.layers:
        x = layer.train_call(x, ctx, ctx_pos, blk_pos, mask)
    return model.logits(x).reshape(b, len(anchors), block, -1)[:, :, 1:]


def dflash_for(target: nn.Module, target_config: dict, layers: int = 2, block: int = 8):
    """A fresh DFlash drafter for `target` (to distil): as wide as the target, attention
    shaped like the target's, `layers` layers reading as many target layers (z-lab's
    default spread), the last token of the vocabulary as its mask token."""
    shape = shaped_like(target_config)
    vocab = target_config.get("text_config", target_config)["vocab_size"]
    depth = len(decoder_layers(target))
    cfg = DFlashConfig(
        **shape,
        num_layers=layers,
        target_layer_ids=default_target_layer_ids(depth, layers),
        mask_token_id=vocab - 1,
        block_size=block,
        layer_types=("full_attention",) * layers,
    )
    return DFlashModel(cfg, target, shape["hidden_size"])


def dflash_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The checkpoint's tensors under `DFlashModel`'s names (a `model.` prefix dropped)."""
    out = {}
    for name, value in weights.items():
        name = name[len("model.") :] if name.startswith("model.") else name
        if name in ("d2t", "t2d") or name.startswith("lm_head.") or name.startswith("embed"):
            raise ValueError(
                f"tensor {name}: DFlash drafters with their own head or vocabulary are not "
                "supported (the target's embedding and head are used)"
            )
        out[name] = value
    return out


def read_dflash(path: Path) -> tuple[dict, dict[str, mx.array]]:
    return read_checkpoint(path, "DFlash drafter")


def save_dflash(out: Path, cfg: DFlashConfig, weights: dict[str, mx.array], dtype) -> None:
    """A converted drafter: tensors under `DFlashModel`'s names, and its config."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = cast_floats(dflash_weights(weights), dtype)
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    (out / "config.json").write_text(
        json.dumps({"model_type": "dflash", **cfg.to_dict()}, indent=2)
    )


def build_dflash(path: Path, target: nn.Module) -> DFlashModel:
    """The DFlash drafter at `path` (either layout, or converted), bound to `target`.

    Raises:
        ValueError: it does not fit the target (tapped layers, hidden size, mask token) or
            its tensors do not fit its config; the message names the culprit.
    """
    config, weights = read_dflash(path)
    depth = len(decoder_layers(target))
    cfg = read_dflash_config(config, depth)
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < depth]
    if bad:
        raise ValueError(
            f"{path}: the DFlash drafter reads target layers {list(cfg.target_layer_ids)}; the "
            f"target has {depth} (0 .. {depth - 1})"
        )
    embed = find_embedding(target)
    vocab, width = embed.weight.shape
    if "scales" in embed:  # quantized: packed columns
        width = target.args.hidden_size
    if not 0 <= cfg.mask_token_id < vocab:
        raise ValueError(f"{path}: mask_token_id {cfg.mask_token_id} is outside the vocabulary")
    if cfg.hidden_size != width:
        raise ValueError(
            f"{path}: the DFlash drafter is {cfg.hidden_size} wide; it embeds with the "
            f"target's {width}-wide embedding"
        )
    model = DFlashModel(cfg, target, width)
    load_checked(model, dflash_weights(weights), path)
    return model
