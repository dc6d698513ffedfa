"""Load-time fixes where mlx-lm's model of a family computes something other than transformers'
reference, applied to mlx-lm's classes without forking their files.

- gemma2: sliding-window attention on the layers `layer_types` marks (transformers alternates
  sliding and full layers, window `sliding_window`); mlx-lm's Gemma 2 attends to the whole context
  on every layer. Sliding layers get a RotatingKVCache of the window and a windowed mask.
- gpt_neox, gemma, starcoder2: the MLP activation named by the config (`hidden_act`); mlx-lm
  hard-codes one (tanh-approximate GELU for GPT-NeoX, whose checkpoints use the exact one).

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
    "gemma2": "sliding-window attention on the sliding layers",
    "gpt_neox": "the configured MLP activation",
    "gemma": "the configured MLP activation",
    "starcoder2": "the configured MLP activation",
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
    _fix_gemma2()
    _fix_activation("gpt_neox", lambda m, x, act: m.dense_4h_to_h(act(m.dense_h_to_4h(x))))
    # Gemma's published configs say "gelu" and mean the tanh approximation (transformers
    # rewrites it so); mlx-lm's Gemma computes the exact GELU.
    _fix_activation(
        "gemma",
        lambda m, x, act: m.down_proj(act(m.gate_proj(x)) * m.up_proj(x)),
        legacy={"gelu": "gelu_pytorch_tanh"},
    )
    _fix_activation("starcoder2", lambda m, x, act: m.c_proj(act(m.c_fc(x))))


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
    for key in ("hidden_activation", "hidden_act"):
        name = getattr(args, key, None)
        if name:
            return name
    return None


def _fix_activation(family: str, call, legacy: dict[str, str] | None = None) -> None:
    module = importlib.import_module(f"mlx_lm.models.{family}")
    _extend_args(module, hidden_act=str, hidden_activation=str)
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
