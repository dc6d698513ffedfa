"""The target's final hidden states (after its final norm, the input of the output head),
exposed without forking mlx-lm's model files.

The head module's class is swapped for a subclass that records its input: parameters, names
and numerics are untouched, and nothing is computed that the forward pass did not compute.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

_SUBCLASSES: dict[tuple[type, str], type] = {}


class HiddenTap:
    """Holds the last input seen by a model's output head: `[B, S, hidden]`."""

    def __init__(self):
        self.hidden: mx.array | None = None


def _recording_subclass(cls: type, method: str) -> type:
    key = (cls, method)
    if key not in _SUBCLASSES:
        original = getattr(cls, method)

        def recording(self, x, *args, **kwargs):
            self._mlx_spec_tap.hidden = x
            return original(self, x, *args, **kwargs)

        _SUBCLASSES[key] = type(f"Tapped{cls.__name__}", (cls,), {method: recording})
    return _SUBCLASSES[key]


def find_head(model: nn.Module) -> tuple[nn.Module, str]:
    """(module, method) that maps final hidden states to logits: `lm_head.__call__`, or the
    tied embedding's `as_linear`."""
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if name.split(".")[-1] == "lm_head":
            return module, "__call__"
    for name, module in modules.items():
        if name.split(".")[-1] == "embed_tokens" and hasattr(module, "as_linear"):
            return module, "as_linear"
    raise ValueError("cannot find the model's output head (no lm_head, no tied embed_tokens)")


def find_embedding(model: nn.Module) -> nn.Module:
    """The model's token embedding (`embed_tokens`)."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "embed_tokens":
            return module
    raise ValueError("cannot find the model's token embedding (embed_tokens)")


def tap_hidden(model: nn.Module) -> HiddenTap:
    """Make `model`'s head record its input; returns the tap (idempotent per model)."""
    head, method = find_head(model)
    tap = getattr(head, "_mlx_spec_tap", None)
    if tap is None:
        tap = HiddenTap()
        object.__setattr__(head, "_mlx_spec_tap", tap)
        head.__class__ = _recording_subclass(type(head), method)
    return tap
