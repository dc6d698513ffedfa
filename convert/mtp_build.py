"""Turn extracted MTP tensors into the MLX drafter module, checked against the target.

The MTP decoder layer is of the target's own kind, so its tensors go through the target's own
mlx-lm sanitizing (expert stacking, attention splits) by posing as the deepest target layer
that has the same tensors. Loading them strictly into `MTPModule` proves the layout.
"""

from __future__ import annotations

import re

from convert.errors import ConversionError
from convert.mtp import MTPTensors, text_config
from mlx_spec.models.mtp import MTPModule

import mlx.core as mx
import mlx.nn as nn

_LAYER_NAME = re.compile(r"^(.*layers\.)(\d+)\.(.+)$")


def template_layer(target_names, suffixes: set[str]) -> tuple[int, str]:
    """(index, name prefix) of the deepest target layer holding every MTP decoder tensor."""
    layers: dict[int, tuple[str, set[str]]] = {}
    for name in target_names:
        m = _LAYER_NAME.match(name)
        if m:
            layers.setdefault(int(m.group(2)), (m.group(1), set()))[1].add(m.group(3))
    for index in sorted(layers, reverse=True):
        prefix, present = layers[index]
        if suffixes <= present:
            return index, prefix
    example = sorted(suffixes)[0] if suffixes else "?"
    raise ConversionError(f"no target layer has the MTP layer's kind (e.g. {example})")


def _split_layer(mtp: MTPTensors, i: int) -> tuple[dict, dict]:
    """MTP layer i as (family head tensors, decoder-layer tensors), keyed by suffix."""
    head, decoder, start = {}, {}, f"layers.{i}."
    for name, value in mtp.tensors.items():
        if name.startswith(start):
            suffix = name[len(start) :]
            (head if suffix in mtp.family.head_shapes else decoder)[suffix] = value
    return head, decoder


def build_mtp_module(
    model: nn.Module, config: dict, mtp: MTPTensors, target_names, own_copies: tuple[str, ...]
) -> MTPModule:
    """The MTP module loaded with every MTP layer of the checkpoint (drafting reuses layer 0)."""
    index, prefix = template_layer(target_names, set(_split_layer(mtp, 0)[1]))
    own = re.compile(rf"layers\.{index}\.(.+)$")
    weights = {k: v for k, v in mtp.tensors.items() if not k.startswith("layers.")}
    for i in range(mtp.num_layers):
        head, decoder = _split_layer(mtp, i)
        sanitized = model.sanitize({f"{prefix}{index}.{s}": v for s, v in decoder.items()})
        weights.update(
            {f"layers.{i}.{m.group(1)}": v for k, v in sanitized.items() if (m := own.search(k))}
        )
        weights.update({f"layers.{i}.{s}": v for s, v in head.items()})
    eps = text_config(config).get("rms_norm_eps", 1e-6)
    module = MTPModule(mtp.family.name, model, index, eps, mtp.num_layers, own_copies)
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ConversionError(f"MTP layer does not fit target layer {index}: {exc}") from exc
    mx.eval(module.parameters())
    return module
