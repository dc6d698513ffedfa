"""EAGLE-3 heads (Li et al. 2025), run on features of several target layers.

What one step computes (T: the target's hidden size, d: the head's, ids: the target layers it
reads, Hugging Face `hidden_states` numbering: id i is the input of decoder layer i):

    g_p = fc(concat(hs[id_0]_p, hs[id_1]_p, ...))              # [len(ids) T] -> [d]
    x   = concat(input_layernorm(e(t_{p+1})), hidden_norm(g_p))  # [2d]: q/k/v read 2d
    y   = r + attn(x)  with r = g_p (or hidden_norm(g_p) with `norm_before_residual`)
    y   = y + mlp(post_attention_layernorm(y))
    logits over the draft vocabulary = lm_head(norm(y)); draft id j is target id j + d2t[j]

The pair (g_p, t_{p+1}) predicts t_{p+2}, as an MTP head's pair does; a drafting step past the
first feeds back y (the layer's output before `norm`) in place of g. The embedding is the
target's unless the checkpoint ships its own.

Two published layouts: the EAGLE repository's (`midlayer.*`, config `LlamaForCausalLMEagle3`
with `draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`) and the
`speculators` format (`speculators_model_type: eagle3`, `layers.0.*`, the layer settings in
`transformer_layer_config`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlx_spec.caches.taps import at_positions, decoder_layers, find_embedding
from mlx_spec.models.blocks import SwiGLU, shaped_like
from mlx_spec.models.checkpoint import cast_floats, load_checked, read_checkpoint

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # d
    target_hidden_size: int  # T
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    attention_bias: bool
    vocab_size: int  # the target's
    draft_vocab_size: int
    layer_ids: tuple[int, ...]
    norm_before_residual: bool = False
    layout: str = "eagle3"  # or "speculators"

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        out["layer_ids"] = list(self.layer_ids)
        return out


def is_eagle3_config(config: dict) -> bool:
    """An EAGLE-3 head's config, in either published layout or converted."""
    if config.get("speculators_model_type") == "eagle3" or config.get("model_type") == "eagle3":
        return True
    return "draft_vocab_size" in config and "Eagle3" in " ".join(config.get("architectures") or [])


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default: the inputs of layers 2, L // 2 and L - 3 (kept inside 0 .. L - 1
    for targets of fewer than 6 layers)."""
    ids = (2, num_layers // 2, num_layers - 3)
    return tuple(sorted(min(max(i, 0), num_layers - 1) for i in ids))


def read_eagle3_config(config: dict, num_target_layers: int | None = None) -> Eagle3Config:
    """An `Eagle3Config` from either layout's config.json (or a converted one).

    Raises:
        ValueError: not an EAGLE-3 config, or one that leaves a setting undecidable.
    """
    if config.get("model_type") == "eagle3" and "layer_ids" in config:  # converted
        fields = {k: v for k, v in config.items() if k in Eagle3Config.__dataclass_fields__}
        ids = fields["layer_ids"] or (
            default_layer_ids(num_target_layers) if num_target_layers is not None else ()
        )
        return Eagle3Config(**{**fields, "layer_ids": tuple(ids)})
    if config.get("speculators_model_type") == "eagle3":
        layer = dict(config.get("transformer_layer_config") or {})
        layout = "speculators"
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        draft_vocab = config.get("draft_vocab_size", layer.get("vocab_size"))
        target_hidden = config.get("target_hidden_size") or layer.get("hidden_size")
        before_residual = bool(config.get("norm_before_residual", False))
    elif is_eagle3_config(config):
        layer, layout = config, "eagle3"
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        draft_vocab = config.get("draft_vocab_size", config.get("vocab_size"))
        target_hidden = config.get("target_hidden_size") or config.get("hidden_size")
        before_residual = bool(config.get("norm_before_residual", False))
    else:
        raise ValueError("not an EAGLE-3 config (no Eagle3 architecture, no speculators eagle3)")
    if ids is None:  # the default needs the target's depth; () until it is known
        ids = default_layer_ids(num_target_layers) if num_target_layers is not None else ()
    heads = layer["num_attention_heads"]
    return Eagle3Config(
        hidden_size=layer["hidden_size"],
        target_hidden_size=target_hidden,
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads", heads),
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=layer.get("rope_theta", 10000.0),
        rope_scaling=layer.get("rope_scaling"),
        max_position_embeddings=layer.get("max_position_embeddings", 4096),
        attention_bias=bool(layer.get("attention_bias", False)),
        vocab_size=layer["vocab_size"],
        draft_vocab_size=draft_vocab,
        layer_ids=tuple(sorted(int(i) for i in ids)),
        norm_before_residual=before_residual,
        layout=layout,
    )


class _Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        d, heads, kv, hd = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.heads, self.kv_heads, self.scale = heads, kv, hd**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(2 * d, heads * hd, bias=bias)
        self.k_proj = nn.Linear(2 * d, kv * hd, bias=bias)
        self.v_proj = nn.Linear(2 * d, kv * hd, bias=bias)
        self.o_proj = nn.Linear(heads * hd, d, bias=False)
        self.rope = initialize_rope(
            hd, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings
        )

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, s, self.kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, s, self.kv_heads, -1).transpose(0, 2, 1, 3)
        offset = 0 if cache is None else cache.offset  # None: a whole sequence (training)
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, s, -1))


class Eagle3Layer(nn.Module):
    """The decoder layer over (embedding, g) pairs."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = _Attention(cfg)
        self.mlp = SwiGLU(d, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(d, eps)
        self.hidden_norm = nn.RMSNorm(d, eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps)
        self.norm_before_residual = cfg.norm_before_residual

    def __call__(self, e: mx.array, g: mx.array, mask, cache) -> mx.array:
        h = self.hidden_norm(g)
        residual = h if self.norm_before_residual else g
        x = mx.concatenate([self.input_layernorm(e), h], axis=-1)
        y = residual + self.self_attn(x, mask, cache)
        return y + self.mlp(self.post_attention_layernorm(y))


class Eagle3Head(nn.Module):
    """`head(tokens [1, S], cache=..., hidden=[1, S, len(ids) T] or [1, S, d]) -> logits
    [1, S, target vocab]` (-inf outside the draft vocabulary). `hidden` of the features'
    width goes through `fc`; of the head's own width (a fed-back output) it is g as is.

    Args:
        cfg: the head's settings.
        target: the target model (its embedding, unless `own_embedding`).
        own_embedding: the checkpoint ships `embed_tokens.weight`.
        d2t: `[draft vocab]` offsets to target ids (None: the vocabularies are the same).
    """

    def __init__(
        self,
        cfg: Eagle3Config,
        target: nn.Module,
        *,
        own_embedding: bool = False,
        d2t: mx.array | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        features = len(cfg.layer_ids) * cfg.target_hidden_size
        if features == cfg.hidden_size:
            raise ValueError(
                f"EAGLE-3 features ({features}) as wide as the head ({cfg.hidden_size}): a "
                "fed-back state could not be told from target features"
            )
        self.fc = nn.Linear(features, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        if own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            object.__setattr__(self, "_embed", find_embedding(target))
        self.args = target.args  # the context limit, as the target's
        ids = None
        if d2t is not None:
            ids = mx.arange(cfg.draft_vocab_size, dtype=mx.int32) + d2t.astype(mx.int32)
        elif cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(
                f"the draft vocabulary ({cfg.draft_vocab_size}) differs from the target's "
                f"({cfg.vocab_size}) and there is no d2t map"
            )
        object.__setattr__(self, "target_ids", ids)  # kept out of the parameter tree
        object.__setattr__(self, "feedback", None)

    @property
    def features(self) -> int:
        return self.fc.weight.shape[1]

    def make_cache(self) -> list:
        return [KVCache()]

    def embed(self, tokens: mx.array) -> mx.array:
        own = "embed_tokens" in self
        return self.embed_tokens(tokens) if own else self._embed(tokens)

    def g_of(self, hidden: mx.array) -> mx.array:
        """g: target features through `fc`; a fed-back output (the head's width) as is."""
        return self.fc(hidden) if hidden.shape[-1] == self.features else hidden

    def __call__(
        self,
        tokens: mx.array,
        cache: list,
        hidden: mx.array,
        at: mx.array | None = None,
        full: bool = True,
    ) -> mx.array:
        """Logits `[B, S, V]`; with `at` (`[B]` positions) only row i's position `at[i]`:
        `[B, 1, V]`, and `feedback` as narrow. `full=False`: over the draft vocabulary."""
        e = self.embed(tokens)
        g = self.g_of(hidden.astype(e.dtype))
        mask = create_attention_mask(g, cache[0], return_array=True)
        y = self.midlayer(e, g, mask, cache[0])
        if at is not None:
            y = at_positions(y, at)
        object.__setattr__(self, "feedback", y)
        logits = self.lm_head(self.norm(y))
        if self.target_ids is None or not full:
            return logits
        full = mx.full((*logits.shape[:-1], self.cfg.vocab_size), -mx.inf, logits.dtype)
        full[..., self.target_ids] = logits
        return full


def eagle3_for(target: nn.Module, target_config: dict, draft_ids=None) -> Eagle3Head:
    """A fresh EAGLE-3 head for `target` (to distil): as wide as the target, its attention
    shaped like the target's, reading the default layers, drafting over the target ids
    `draft_ids` (ascending; None: the whole vocabulary, no d2t); its output head starts as
    the target's rows of those ids."""
    from mlx_spec.caches.taps import find_head

    shape = shaped_like(target_config)
    vocab = target_config.get("text_config", target_config)["vocab_size"]
    size = vocab if draft_ids is None else len(draft_ids)
    cfg = Eagle3Config(
        **shape,
        target_hidden_size=shape["hidden_size"],
        vocab_size=vocab,
        draft_vocab_size=size,
        layer_ids=default_layer_ids(len(decoder_layers(target))),
    )
    d2t = None
    if draft_ids is not None:  # draft index i drafts target id i + d2t[i]
        d2t = mx.array(draft_ids, mx.int64) - mx.arange(size, dtype=mx.int64)
    head = Eagle3Head(cfg, target, d2t=d2t)
    out, _ = find_head(target)
    if out.weight.dtype in (mx.float32, mx.float16, mx.bfloat16):
        rows = out.weight[: cfg.vocab_size]
        if draft_ids is not None:
            rows = rows[mx.array(draft_ids)]
        head.lm_head.weight = mx.array(rows.astype(mx.float32))
    return head


def eagle3_weights(weights: dict[str, mx.array], layout: str) -> dict[str, mx.array]:
    """The checkpoint's tensors under `Eagle3Head`'s names (d2t, t2d left out)."""
    out = {}
    for name, value in weights.items():
        if name in ("d2t", "t2d"):
            continue
        if layout == "speculators" and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0.") :]
        elif layout == "speculators" and name.startswith("layers."):
            raise ValueError(
                f"tensor {name}: EAGLE-3 heads of more than one layer are not supported"
            )
        out[name] = value
    return out


def read_eagle3(path: Path) -> tuple[dict, dict[str, mx.array]]:
    """(config.json, every tensor) of an EAGLE-3 directory (safetensors; sharded or not)."""
    return read_checkpoint(path, "EAGLE-3 head")


def save_eagle3(out: Path, cfg: Eagle3Config, weights: dict[str, mx.array], dtype) -> None:
    """Write a converted head: its tensors under `Eagle3Head`'s names in `dtype` (d2t kept as
    integers), and a config.json `read_eagle3_config` reads back. Empty `layer_ids`: the
    EAGLE-3 default, chosen for the target at load time."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = cast_floats(eagle3_weights(weights, cfg.layout), dtype)
    if "d2t" in weights:
        tensors["d2t"] = weights["d2t"].astype(mx.int64)
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    config = {"model_type": "eagle3", **cfg.to_dict(), "layout": "eagle3"}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def build_eagle3(path: Path, target: nn.Module) -> Eagle3Head:
    """The EAGLE-3 head stored at `path` (either published layout, or converted), bound to
    `target`, its shapes checked against the target's.

    Raises:
        ValueError: the head does not fit the target (layer ids, hidden size, vocabulary) or
            its tensors do not fit its config; the message names the culprit.
    """
    config, weights = read_eagle3(path)
    layers = len(decoder_layers(target))
    cfg = read_eagle3_config(config, layers)
    bad = [i for i in cfg.layer_ids if not 0 <= i <= layers]
    if bad:
        raise ValueError(
            f"{path}: the EAGLE-3 head reads target layers {list(cfg.layer_ids)}; the target "
            f"has {layers} (ids 0 .. {layers})"
        )
    embed = find_embedding(target)
    target_hidden = embed.weight.shape[1] if hasattr(embed, "weight") else None
    if (
        target_hidden is not None
        and "scales" not in embed
        and target_hidden != (cfg.target_hidden_size)
    ):
        raise ValueError(
            f"{path}: the EAGLE-3 head reads {cfg.target_hidden_size}-wide target features; "
            f"the target's hidden size is {target_hidden}"
        )
    d2t = weights.get("d2t")
    if cfg.draft_vocab_size != cfg.vocab_size and d2t is None:
        raise ValueError(f"{path}: tensor d2t is missing (draft vocabulary {cfg.draft_vocab_size})")
    if d2t is not None and d2t.shape != (cfg.draft_vocab_size,):
        raise ValueError(
            f"{path}: tensor d2t has shape {tuple(d2t.shape)}, expected ({cfg.draft_vocab_size},)"
        )
    head = Eagle3Head(cfg, target, own_embedding="embed_tokens.weight" in weights, d2t=d2t)
    if head.target_ids is not None:
        top = int(head.target_ids.max().item())
        if top >= cfg.vocab_size or int(head.target_ids.min().item()) < 0:
            raise ValueError(f"{path}: tensor d2t maps draft ids outside the target vocabulary")
    load_checked(head, eagle3_weights(weights, cfg.layout), path)
    return head
