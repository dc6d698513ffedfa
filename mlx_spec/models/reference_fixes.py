"""Load-time fixes where mlx-lm's model of a family computes something other than transformers'
reference, applied to mlx-lm's classes without forking their files.

- gemma2: sliding-window attention on the layers `layer_types` marks (transformers alternates
  sliding and full layers, window `sliding_window`); mlx-lm's Gemma 2 attends to the whole context
  on every layer. Sliding layers get a RotatingKVCache of the window and a windowed mask. And
  a mask with one row per sequence (`[B, 1, n, C]`) meets the attention's grouped-query scores
  (`[B, kv_heads, repeats, n, C]`) with a unit axis for the repeats, not broadcast against the
  key-value heads (mlx-lm's Gemma 2 applies row h's mask to kv head h of every row).
- mistral, mixtral, ministral3, phi3, phimoe, starcoder2: a sliding window on every layer
  (transformers applies `sliding_window` to all layers of these families; mlx-lm's models attend
  to the whole context). Conversion marks such a config with `layer_types` all
  "sliding_attention"; every layer then gets a RotatingKVCache of the window, whose mask the
  model already asks for (`create_attention_mask(h, cache[0])`), and a one-pass call without a
  cache gets fresh windowed caches so that its mask is windowed too.
- minicpm3: hidden states divided by hidden_size / dim_model_base before the LM head also when
  the embeddings are tied (mlx-lm divides only with a separate LM head; transformers always).
- gpt_neox: the MLP width `intermediate_size` (mlx-lm's is always four times the hidden size).
- gpt_neox, gemma, starcoder2, gpt_bigcode: the MLP activation named by the config
  (`hidden_act`, `activation_function`); mlx-lm hard-codes one (tanh-approximate GELU for
  GPT-NeoX, whose checkpoints use the exact one; exact GELU for GPT-BigCode, whose use the
  tanh approximation).
- glm: rotary embeddings on the first `partial_rotary_factor` of each head (0.5 in GLM-4's
  configs, transformers' default), interleaved; mlx-lm's GLM rotates the whole head.
- ernie4_5_moe: experts chosen by the softmax scores plus the checkpoint's
  `moe_statics.e_score_correction_bias` (weighted by the scores alone), as transformers and the
  ERNIE 4.5 MoE releases do; mlx-lm's sanitize drops the bias and routes by the scores. Kept
  when the config sets `moe_score_correction` (conversion sets it: transformers always routes
  so), so directories converted by mlx-lm, which lack the tensor, load as before.
- jamba: expert weights are the softmax over all experts' router logits at the chosen experts,
  not renormalised, as transformers and the Jamba releases compute them; mlx-lm's takes the
  softmax over the chosen experts' logits only. Applied when the config sets
  `router_softmax_all` (conversion sets it: transformers always routes so).
- nanochat: the RMS norms use the config's `rms_norm_eps` (1e-6 in transformers' configs);
  mlx-lm's hard-code 1e-5.
- YaRN rotary embeddings with `truncate: false` (GPT-OSS's configs): transformers keeps the
  correction range unrounded; mlx-lm's YarnRoPE always floors and ceils it, shifting the
  interpolation ramp of every rotary frequency between the two. The frequencies are recomputed
  unrounded for such configs (any family, through `initialize_rope`).

Each fix adds the config fields it reads to the family's `ModelArgs` (so conversion keeps them in
config.json) and changes nothing when a config does not set them: such a model runs exactly as
mlx-lm's. `install()` is idempotent; `FIXED` names the families it touches.
"""

from __future__ import annotations

import dataclasses
import importlib

import mlx.core as mx
import mlx.nn as nn

FIXED = {
    "gemma2": "sliding-window attention on the sliding layers; per-row masks with grouped heads",
    "gpt_neox": "the configured MLP activation and width",
    "gemma": "the configured MLP activation",
    "starcoder2": "the configured MLP activation; a sliding window on every layer",
    "mistral": "a sliding window on every layer",
    "mixtral": "a sliding window on every layer",
    "ministral3": "a sliding window on every layer",
    "phi3": "a sliding window on every layer",
    "phimoe": "a sliding window on every layer",
    "minicpm3": "the logit scaling with tied embeddings",
    "gpt_bigcode": "the configured MLP activation",
    "glm": "rotary embeddings on the configured part of each head",
    "ernie4_5_moe": "expert choice with the score-correction bias",
    "jamba": "expert weights from the softmax over all experts",
    "nanochat": "the configured RMS-norm epsilon",
    "gpt_oss": "YaRN without rounding the correction range (truncate: false)",
}

# transformers model_type whose window covers every layer -> (mlx-lm module, its inner model
# class: the one the layers and the mask live in)
UNIFORM_WINDOW = {
    "mistral": ("llama", "LlamaModel"),
    "mixtral": ("mixtral", "MixtralModel"),
    "ministral3": ("ministral3", "LanguageModel"),
    "phi3": ("phi3", "Phi3Model"),
    "phimoe": ("phimoe", "PhiMoEModel"),
    "starcoder2": ("starcoder2", "Starcoder2Model"),
}

ACTIVATIONS = {
    "gelu": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_fast": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "silu": nn.silu,
    "swish": nn.silu,
    "relu": nn.relu,
}

_INSTALLED = False


def install() -> None:
    """Apply every fix (once)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    _fix_yarn_truncate()
    _fix_gemma2()
    _fix_minicpm3()
    _fix_glm()
    _fix_ernie4_5_moe()
    _fix_jamba()
    _fix_nanochat()
    for module, inner in sorted(set(UNIFORM_WINDOW.values())):
        _fix_uniform_window(module, inner)
    _fix_activation("gpt_neox", lambda m, x, act: m.dense_4h_to_h(act(m.dense_h_to_4h(x))))
    _fix_gpt_neox_width()
    # Gemma's published configs say "gelu" and mean the tanh approximation (transformers
    # rewrites it so); mlx-lm's Gemma computes the exact GELU.
    _fix_activation(
        "gemma",
        lambda m, x, act: m.down_proj(act(m.gate_proj(x)) * m.up_proj(x)),
        legacy={"gelu": "gelu_pytorch_tanh"},
    )
    _fix_activation("starcoder2", lambda m, x, act: m.c_proj(act(m.c_fc(x))))
    _fix_activation("gpt_bigcode", lambda m, x, act: m.c_proj(act(m.c_fc(x))))


def _extend_args(module, **fields) -> type:
    """Replace `module.ModelArgs` by a subclass with extra optional fields (default None)."""
    base = module.ModelArgs
    if all(f in {x.name for x in dataclasses.fields(base)} for f in fields):
        return base
    extended = dataclasses.make_dataclass(
        base.__name__,
        [(name, kind | None, dataclasses.field(default=None)) for name, kind in fields.items()],
        bases=(base,),
    )
    extended.__module__ = base.__module__
    extended.__qualname__ = base.__qualname__
    module.ModelArgs = extended
    return extended


# ------------------------------------------------------------------------------- activations


def _activation_name(args) -> str | None:
    for key in ("hidden_activation", "hidden_act", "activation_function"):
        name = getattr(args, key, None)
        if name:
            return name
    return None


def _fix_activation(family: str, call, legacy: dict[str, str] | None = None) -> None:
    module = importlib.import_module(f"mlx_lm.models.{family}")
    _extend_args(module, hidden_act=str, hidden_activation=str, activation_function=str)
    model_init, mlp_call = module.Model.__init__, module.MLP.__call__

    def __init__(self, args, *a, **k):
        model_init(self, args, *a, **k)
        name = _activation_name(args)
        name = (legacy or {}).get(name, name)
        if name is None:
            return  # mlx-lm's own activation
        if name not in ACTIVATIONS:
            raise ValueError(f"{family}: activation {name!r} is not supported")
        for _, sub in self.named_modules():
            if isinstance(sub, module.MLP):
                object.__setattr__(sub, "_reference_act", ACTIVATIONS[name])

    def __call__(self, x):
        act = getattr(self, "_reference_act", None)
        return mlp_call(self, x) if act is None else call(self, x, act)

    module.Model.__init__ = __init__
    module.MLP.__call__ = __call__


def _fix_gpt_neox_width() -> None:
    from mlx_lm.models import gpt_neox

    _extend_args(gpt_neox, intermediate_size=int)
    mlp_init = gpt_neox.MLP.__init__

    def __init__(self, args, *a, **k):
        mlp_init(self, args, *a, **k)
        width = getattr(args, "intermediate_size", None)
        if width and width != 4 * args.hidden_size:
            self.dense_h_to_4h = nn.Linear(args.hidden_size, width)
            self.dense_4h_to_h = nn.Linear(width, args.hidden_size)

    gpt_neox.MLP.__init__ = __init__


# ------------------------------------------------------------------------------------ gemma2


def _gemma2_layer_types(args) -> list[str] | None:
    """Per-layer attention kinds, or None when the config sets no window (mlx-lm's behaviour)."""
    if not getattr(args, "sliding_window", None):
        return None
    types = getattr(args, "layer_types", None)
    if not types:  # transformers' default for Gemma 2: even layers slide
        types = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(args.num_hidden_layers)
        ]
    if len(types) != args.num_hidden_layers:
        raise ValueError(f"gemma2: {len(types)} layer_types for {args.num_hidden_layers} layers")
    return list(types)


def _fix_gemma2() -> None:
    from mlx_lm.models import gemma2
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    _extend_args(gemma2, sliding_window=int, layer_types=list)
    inner_call = gemma2.GemmaModel.__call__

    def __call__(self, inputs: mx.array, cache=None):
        types = _gemma2_layer_types(self.args)
        if types is None:
            return inner_call(self, inputs, cache)
        h = self.embed_tokens(inputs)
        h = h * (self.args.hidden_size**0.5)
        if cache is None:
            cache = [None] * len(self.layers)
        window = self.args.sliding_window
        masks = {}
        for kind in set(types):
            c = cache[types.index(kind)]
            size = window if kind == "sliding_attention" else None
            masks[kind] = create_attention_mask(h, c, window_size=size, return_array=True)
        for layer, c, kind in zip(self.layers, cache, types, strict=True):
            h = layer(h, masks[kind], c)
        return self.norm(h)

    def make_cache(self):
        types = _gemma2_layer_types(self.args)
        if types is None:
            return [KVCache() for _ in self.layers]
        return [
            RotatingKVCache(max_size=self.args.sliding_window, keep=0)
            if kind == "sliding_attention"
            else KVCache()
            for kind in types
        ]

    gemma2.GemmaModel.__call__ = __call__
    gemma2.Model.make_cache = make_cache

    attention_call = gemma2.Attention.__call__

    def attention(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if isinstance(mask, mx.array) and mask.ndim == 4 and self.repeats > 1:
            mask = mask[:, :, None]  # [B, 1, 1, n, C] against [B, kv_heads, repeats, n, C]
        return attention_call(self, x, mask, cache)

    gemma2.Attention.__call__ = attention


# ------------------------------------------------------------------- window on every layer


def uniform_window(args) -> int | None:
    """The window when `args` marks every layer sliding (as conversion writes it), else None."""
    window = getattr(args, "sliding_window", None)
    types = getattr(args, "layer_types", None)
    if not window or not types or any(t != "sliding_attention" for t in types):
        return None
    if len(types) != args.num_hidden_layers:
        raise ValueError(f"{len(types)} layer_types for {args.num_hidden_layers} layers")
    return int(window)


def _fix_uniform_window(family: str, inner_name: str) -> None:
    from mlx_lm.models.cache import RotatingKVCache

    module = importlib.import_module(f"mlx_lm.models.{family}")
    _extend_args(module, sliding_window=int, layer_types=list)
    inner_cls = getattr(module, inner_name)
    model_init, make_cache = module.Model.__init__, getattr(module.Model, "make_cache", None)
    inner_call = inner_cls.__call__

    def __init__(self, args, *a, **k):
        window = uniform_window(args)
        if window is not None:
            # mlx-lm's own sliding layers (llama, ministral3) need one full-attention layer to
            # exist: build every layer as full attention; the caches below make them slide.
            full = ["full_attention"] * args.num_hidden_layers
            args = dataclasses.replace(args, layer_types=full, sliding_window=None)
        model_init(self, args, *a, **k)
        if window is None:
            return
        object.__setattr__(self, "_uniform_window", window)
        for _, sub in self.named_modules():
            if isinstance(sub, inner_cls):
                object.__setattr__(sub, "_uniform_window", window)

    def _make_cache(self):
        window = getattr(self, "_uniform_window", None)
        if window is None:
            if make_cache is not None:
                return make_cache(self)
            from mlx_lm.models.cache import KVCache

            return [KVCache() for _ in self.layers]
        return [RotatingKVCache(max_size=window, keep=0) for _ in self.layers]

    def __call__(self, inputs, cache=None, *a, **k):
        window = getattr(self, "_uniform_window", None)
        if window is not None and cache is None:
            # one pass without a cache: the mask comes from cache[0], so give it a window
            cache = [RotatingKVCache(max_size=window, keep=0) for _ in self.layers]
        return inner_call(self, inputs, cache, *a, **k)

    module.Model.__init__ = __init__
    module.Model.make_cache = _make_cache
    inner_cls.__call__ = __call__


# ---------------------------------------------------------------------------------- minicpm3


def _fix_minicpm3() -> None:
    from mlx_lm.models import minicpm3

    model_call = minicpm3.Model.__call__

    def __call__(self, inputs, mask=None, cache=None):
        if not self.args.tie_word_embeddings:
            return model_call(self, inputs, mask, cache)
        out = self.model(inputs, mask, cache)
        out = out / (self.args.hidden_size / self.args.dim_model_base)
        return self.model.embed_tokens.as_linear(out)

    minicpm3.Model.__call__ = __call__


# ------------------------------------------------------------------------- yarn (truncate)


def _yarn_freqs(rope, cfg: dict, base: float):
    """mlx-lm YarnRoPE frequencies (1 / inverse frequency) with the correction range unrounded,
    as transformers computes them when the config says `truncate: false`."""
    import math

    dims = rope.dims
    original = cfg.get("original_max_position_embeddings", 4096)

    def correction_dim(rotations):
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(correction_dim(cfg.get("beta_fast", 32)), 0)
    high = min(correction_dim(cfg.get("beta_slow", 1)), dims - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    mask = 1.0 - ramp
    extra = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    inter = cfg["factor"] * extra
    return (inter * extra) / (inter * mask + extra * (1 - mask))


def _fix_yarn_truncate() -> None:
    import sys

    from mlx_lm.models import rope_utils

    original = rope_utils.initialize_rope

    def initialize_rope(dims, base, traditional, scaling_config=None, *a, **k):
        rope = original(dims, base, traditional, scaling_config, *a, **k)
        cfg = scaling_config or {}
        if isinstance(rope, rope_utils.YarnRoPE) and cfg.get("truncate") is False:
            rope._freqs = _yarn_freqs(rope, cfg, base)
        return rope

    rope_utils.initialize_rope = initialize_rope
    # modules imported before this bound the original function by name
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "initialize_rope", None) is (
            original
        ):
            module.initialize_rope = initialize_rope


# --------------------------------------------------------------------------------------- glm


def _fix_glm() -> None:
    from mlx_lm.models import glm

    _extend_args(glm, partial_rotary_factor=float)
    attention_init = glm.GLMAttention.__init__

    def __init__(self, args, *a, **k):
        attention_init(self, args, *a, **k)
        factor = getattr(args, "partial_rotary_factor", None)
        if factor is not None:
            dims = int(self.head_dim * factor)
            self.rope = nn.RoPE(dims=dims, traditional=True, base=args.rope_theta)

    glm.GLMAttention.__init__ = __init__


# ------------------------------------------------------------------------------ ernie4_5_moe


def _fix_ernie4_5_moe() -> None:
    from mlx_lm.models import ernie4_5_moe as ernie

    _extend_args(ernie, moe_score_correction=bool)
    mlp_init, mlp_call = ernie.Ernie4_5_MoeMLP.__init__, ernie.Ernie4_5_MoeMLP.__call__
    sanitize = ernie.Model.sanitize

    def __init__(self, args, *a, **k):
        mlp_init(self, args, *a, **k)
        if getattr(args, "moe_score_correction", None):
            self.e_score_correction_bias = mx.zeros((args.moe_num_experts,))

    def __call__(self, x):
        if "e_score_correction_bias" not in self:
            return mlp_call(self, x)
        scores = self.gate_act(self.gate(x).astype(mx.float32))
        k = self.k
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        inds = mx.stop_gradient(mx.argpartition(-choice, kth=k - 1, axis=-1)[..., :k])
        weights = mx.take_along_axis(scores, inds, axis=-1)
        weights = weights / mx.maximum(weights.sum(axis=-1, keepdims=True), 1e-12)
        y = self.switch_mlp(x, inds)
        y = (y * weights[..., None]).sum(axis=-2).astype(y.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    def _sanitize(self, weights):
        if not getattr(self.args, "moe_score_correction", None):
            return sanitize(self, weights)
        # the checkpoint's name, or (reloading a converted directory) the parameter's own
        kept = {}
        for suffix in (".mlp.moe_statics.e_score_correction_bias", ".mlp.e_score_correction_bias"):
            for name in [k for k in weights if k.endswith(suffix)]:
                layer = name.removesuffix(suffix)
                kept[layer + ".mlp.e_score_correction_bias"] = weights.pop(name).reshape(-1)
        out = sanitize(self, weights)
        out.update(kept)
        return out

    ernie.Ernie4_5_MoeMLP.__init__ = __init__
    ernie.Ernie4_5_MoeMLP.__call__ = __call__
    ernie.Model.sanitize = _sanitize


# ------------------------------------------------------------------------------------- jamba


def _fix_jamba() -> None:
    from mlx_lm.models import jamba

    _extend_args(jamba, router_softmax_all=bool)
    block_init, block_call = jamba.JambaSparseMoeBlock.__init__, jamba.JambaSparseMoeBlock.__call__

    def __init__(self, args, *a, **k):
        block_init(self, args, *a, **k)
        object.__setattr__(self, "_softmax_all", bool(getattr(args, "router_softmax_all", None)))

    def __call__(self, x):
        if not getattr(self, "_softmax_all", False):
            return block_call(self, x)
        probs = mx.softmax(self.router(x).astype(mx.float32), axis=-1, precise=True)
        k = self.num_experts_per_tok
        inds = mx.stop_gradient(mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k])
        scores = mx.take_along_axis(probs, inds, axis=-1).astype(x.dtype)
        y = self.switch_mlp(x, inds)
        return (y * scores[..., None]).sum(axis=-2)

    jamba.JambaSparseMoeBlock.__init__ = __init__
    jamba.JambaSparseMoeBlock.__call__ = __call__


# ---------------------------------------------------------------------------------- nanochat


def _fix_nanochat() -> None:
    from mlx_lm.models import nanochat

    _extend_args(nanochat, rms_norm_eps=float)
    model_call = nanochat.Model.__call__
    eps = [1e-5]  # the epsilon of the model being traced (mlx-lm's value by default)

    def rms_norm(x):
        return mx.fast.rms_norm(x, None, eps[0])

    def __call__(self, *a, **k):
        eps[0] = getattr(self.args, "rms_norm_eps", None) or 1e-5
        try:
            return model_call(self, *a, **k)
        finally:
            eps[0] = 1e-5

    nanochat.rms_norm = rms_norm
    nanochat.Model.__call__ = __call__
