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
