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


def at_positions(x: mx.array, at: mx.array) -> mx.array:
    """`[B, 1, D]`: row i's position `at[i]` of `[B, S, D]`."""
    return mx.take_along_axis(x, at[:, None, None], axis=1)


class HeadPositions:
    """While `at` is set (`[B]` positions), the model's output head projects only row i's
    position `at[i]` (logits `[B, 1, V]`): a drafter catching up over many positions, or a
    prompt prefilled, needs the logits of one. A head that also records its input
    (`tap_hidden`) still records every position."""

    def __init__(self):
        self.at: mx.array | None = None

    def __call__(self, model: nn.Module, at: mx.array | None, *args, **kwargs) -> mx.array:
        """`model(*args, **kwargs)` with the head narrowed to `at` (None: every position)."""
        self.at = at
        try:
            return model(*args, **kwargs)
        finally:
            self.at = None


def _selecting_subclass(cls: type, method: str) -> type:
    key = (cls, f"{method}@")
    if key not in _SUBCLASSES:
        original = getattr(cls, method)

        def selecting(self, x, *args, **kwargs):
            at = self._mlx_spec_positions.at
            if at is None:
                return original(self, x, *args, **kwargs)
            out = original(self, at_positions(x, at), *args, **kwargs)
            tap = self.__dict__.get("_mlx_spec_tap")
            if tap is not None:  # a recording head below this one saw the narrowed input
                tap.hidden = x
            return out

        _SUBCLASSES[key] = type(f"Selecting{cls.__name__}", (cls,), {method: selecting})
    return _SUBCLASSES[key]


def head_positions(model: nn.Module) -> HeadPositions:
    """Let `model`'s head project chosen positions only (see `HeadPositions`; idempotent per
    model). Parameters, names and numerics are untouched."""
    head, method = find_head(model)
    positions = head.__dict__.get("_mlx_spec_positions")
    if positions is None:
        positions = HeadPositions()
        object.__setattr__(head, "_mlx_spec_positions", positions)
        head.__class__ = _selecting_subclass(type(head), method)
    return positions


def logits_at(model: nn.Module, at: mx.array, *args, **kwargs) -> mx.array:
    """`[B, 1, V]`: `model(*args, **kwargs)`'s logits at row i's position `at[i]` only, its
    head narrowed there (`head_positions`); a model whose output does not come from the
    head found is sliced afterwards."""
    logits = head_positions(model)(model, at, *args, **kwargs)
    return logits if logits.shape[1] == 1 else at_positions(logits, at)


# --- several layers: the features EAGLE-3 and DFlash read -------------------------------------


class LayerFeatures:
    """The features of several target layers from the last pass, concatenated in the order
    asked: `hidden` is `[B, S, len(ids) * T]`. An id follows Hugging Face's `hidden_states`
    numbering: `i` < L is the input of decoder layer i (0: the embeddings), `L` the final
    hidden state (after the final norm, the head's input)."""

    def __init__(self, slots: dict[int, mx.array], ids: tuple[int, ...], final: HiddenTap | None):
        self._slots, self.ids, self._final = slots, ids, final

    def _feature(self, i: int) -> mx.array:
        return self._final.hidden if i not in self._slots and self._final else self._slots[i]

    @property
    def hidden(self) -> mx.array:
        return mx.concatenate([self._feature(i) for i in self.ids], axis=-1)


def _layer_recording_subclass(cls: type) -> type:
    key = (cls, "__layer__")
    if key not in _SUBCLASSES:
        original = cls.__call__

        def recording(self, x, *args, **kwargs):
            slots, index, wanted = self._mlx_spec_layer_tap
            if index in wanted:
                slots[index] = x
            return original(self, x, *args, **kwargs)

        _SUBCLASSES[key] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": recording})
    return _SUBCLASSES[key]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of an mlx-lm model (`model.layers` on every architecture)."""
    return list(model.layers)


def tap_layers(model: nn.Module, ids) -> LayerFeatures:
    """Make the decoder layers named by `ids` (Hugging Face `hidden_states` indices, see
    `LayerFeatures`) record their features on every pass; returns the view of them.

    Raises:
        ValueError: an id outside 0 .. L for a model of L layers.
    """
    layers = decoder_layers(model)
    ids = tuple(int(i) for i in ids)
    bad = [i for i in ids if not 0 <= i <= len(layers)]
    if bad or not ids:
        raise ValueError(
            f"hidden-state layer ids {list(ids)} do not fit a target of {len(layers)} layers "
            f"(0 .. {len(layers)})"
        )
    first = layers[0].__dict__.get("_mlx_spec_layer_tap")
    slots, wanted = (first[0], first[2]) if first is not None else ({}, set())
    wanted.update(ids)
    for index, layer in enumerate(layers):
        if "_mlx_spec_layer_tap" not in layer.__dict__:
            object.__setattr__(layer, "_mlx_spec_layer_tap", (slots, index, wanted))
            layer.__class__ = _layer_recording_subclass(type(layer))
    final = tap_hidden(model) if len(layers) in ids else None
    return LayerFeatures(slots, ids, final)


def tap_for(model: nn.Module, keep: bool | tuple) -> HiddenTap | LayerFeatures | None:
    """The tap a runner keeps: None (False), the final hidden states (True), or the
    features of the layers a tuple of ids names."""
    if keep is True:
        return tap_hidden(model)
    if keep:
        return tap_layers(model, keep)
    return None
