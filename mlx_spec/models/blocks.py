"""Pieces of decoder layers shared by the drafters that define their own (EAGLE-3, DFlash)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class SwiGLU(nn.Module):
    """The Llama / Qwen MLP: `down(silu(gate(x)) * up(x))`, no biases."""

    def __init__(self, d: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def shaped_like(target_config: dict) -> dict:
    """The layer settings of a drafter distilled for a target: the target's width, attention
    shape, norm epsilon, rotary base and context (no rope scaling, no biases)."""
    text = target_config.get("text_config", target_config)
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    return dict(
        hidden_size=hidden,
        intermediate_size=text.get("intermediate_size", 4 * hidden),
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads", heads),
        head_dim=text.get("head_dim") or hidden // heads,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=(text.get("rope_parameters") or {}).get("rope_theta")
        or text.get("rope_theta", 10000.0),
        rope_scaling=None,
        max_position_embeddings=text.get("max_position_embeddings", 4096),
        attention_bias=False,
    )
