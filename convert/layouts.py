"""Tensor layouts transformers writes that a family's mlx-lm `sanitize` does not take, rewritten
into the names and shapes it does, before that sanitize runs.

- gpt_oss: the unquantized experts (`experts.gate_up_proj` [E, hidden, 2I] with gate and up
  interleaved, `experts.down_proj` [E, I, hidden], and their biases), as transformers' GPT-OSS
  holds them (it multiplies `x @ W`), and as the bf16 releases store them; mlx-lm's sanitize
  takes only the MXFP4 `_blocks`/`_scales` form. Rewritten to mlx-lm's per-projection
  `[E, out, in]` weights.
- longcat_flash: transformers' class allocates gate/up projections for the zero-computation
  experts too (indices from `n_routed_experts` on), which compute nothing (they return their
  input) and which the published checkpoints do not have: dropped.
- olmo_hybrid: the OLMo-Hybrid checkpoint names transformers writes (`attention_layer_norm`,
  `feedforward_layer_norm`) renamed to those mlx-lm's layers hold (`input_layernorm`,
  `post_attention_layernorm`), and the gated-delta short convolution split into its query, key
  and value parts by the widths the config gives: transformers holds it as one `conv1d` and
  writes it back as three equal thirds, not at the query/key/value boundaries (the checkpoints
  it loads have the right widths; either way the channels are in order, so rejoining and
  splitting recovers them).
- nanochat: transformers' names (`model.layers.N.self_attn.q_proj`, `mlp.fc1`, ...) renamed to
  the original nanochat names mlx-lm's model holds (`transformer.h.N.attn.c_q`, `mlp.c_fc`, ...).
"""

from __future__ import annotations

import re

import mlx.core as mx


def _gpt_oss(config: dict, weights: dict) -> dict:
    out = {}
    for name, value in weights.items():
        if name.endswith("experts.gate_up_proj") and value.ndim == 3:
            value = value.swapaxes(-1, -2)  # [E, 2I, hidden]
            base = name.removesuffix("gate_up_proj")
            out[base + "gate_proj.weight"] = mx.contiguous(value[..., ::2, :])
            out[base + "up_proj.weight"] = mx.contiguous(value[..., 1::2, :])
        elif name.endswith("experts.gate_up_proj_bias"):
            base = name.removesuffix("gate_up_proj_bias")
            out[base + "gate_proj.bias"] = mx.contiguous(value[..., ::2])
            out[base + "up_proj.bias"] = mx.contiguous(value[..., 1::2])
        elif name.endswith("experts.down_proj") and value.ndim == 3:
            out[name + ".weight"] = mx.contiguous(value.swapaxes(-1, -2))  # [E, hidden, I]
        elif name.endswith("experts.down_proj_bias"):
            out[name.removesuffix("_bias") + ".bias"] = value
        else:
            out[name] = value
    return out


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def _longcat_flash(config: dict, weights: dict) -> dict:
    routed = config.get("n_routed_experts")
    if not isinstance(routed, int):
        return weights

    def zero_expert(name):
        match = _EXPERT_INDEX.search(name)
        return match is not None and int(match.group(1)) >= routed

    return {k: v for k, v in weights.items() if not zero_expert(k)}


_NANOCHAT = (
    (r"^model\.embed_tokens\.", "transformer.wte."),
    (r"^model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.", r"transformer.h.\1.attn.c_\2."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"transformer.h.\1.attn.c_proj."),
    (r"^model\.layers\.(\d+)\.mlp\.fc1\.", r"transformer.h.\1.mlp.c_fc."),
    (r"^model\.layers\.(\d+)\.mlp\.fc2\.", r"transformer.h.\1.mlp.c_proj."),
)


def _nanochat(config: dict, weights: dict) -> dict:
    out = {}
    for name, value in weights.items():
        for pattern, replacement in _NANOCHAT:
            name = re.sub(pattern, replacement, name)
        out[name] = value
    return out


_CONV = re.compile(r"^(.*\.linear_attn\.)(?:([qkv])_)?conv1d\.weight$")


def _olmo_hybrid(config: dict, weights: dict) -> dict:
    key = (config.get("linear_num_key_heads") or 0) * (config.get("linear_key_head_dim") or 0)
    value = (config.get("linear_num_value_heads") or 0) * (config.get("linear_value_head_dim") or 0)
    out, convs = {}, {}
    for name, tensor in weights.items():
        match = _CONV.match(name)
        if match:
            convs.setdefault(match.group(1), {})[match.group(2) or "qkv"] = tensor
            continue
        name = name.replace(".attention_layer_norm.", ".input_layernorm.")
        out[name.replace(".feedforward_layer_norm.", ".post_attention_layernorm.")] = tensor
    for prefix, parts in convs.items():
        if "qkv" in parts:
            whole = parts["qkv"]
        elif set(parts) == {"q", "k", "v"}:
            whole = mx.concatenate([parts["q"], parts["k"], parts["v"]], axis=0)
        else:  # an incomplete set: left for the missing-tensor check to name
            out.update({f"{prefix}{p}_conv1d.weight": t for p, t in parts.items()})
            continue
        if not key or not value or whole.shape[0] != 2 * key + value:
            out[f"{prefix}conv1d.weight"] = whole  # unexpected: refused as an unknown tensor
            continue
        for part, start, size in (("q", 0, key), ("k", key, key), ("v", 2 * key, value)):
            out[f"{prefix}{part}_conv1d.weight"] = mx.contiguous(whole[start : start + size])
    return out


# model_type -> rewrite of the checkpoint's tensors (applied before mlx-lm's sanitize)
LAYOUTS = {
    "gpt_oss": _gpt_oss,
    "longcat_flash": _longcat_flash,
    "nanochat": _nanochat,
    "olmo_hybrid": _olmo_hybrid,
}


def rewrite(config: dict, weights: dict) -> dict:
    """`weights` in the layout mlx-lm's model of `config` sanitizes (unchanged for other
    families)."""
    fix = LAYOUTS.get(config.get("model_type"))
    return weights if fix is None else fix(config, weights)
