"""Reading a drafter checkpoint directory and loading it into a module with every tensor
checked: shared by the drafters that ship as repositories of their own (EAGLE-3, DFlash)."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_spec.platform import weight_layout

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


def read_checkpoint(path: Path, what: str) -> tuple[dict, dict[str, mx.array]]:
    """(config.json, every tensor) of a directory of safetensors (sharded or not).

    Raises:
        FileNotFoundError: no config.json, or no safetensors (pickled weights are refused).
    """
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{path}: no {what} here (no config.json)") from exc
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (pickled weights are refused)")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))
    return config, weights


def load_checked(module: nn.Module, tensors: dict[str, mx.array], path: Path) -> None:
    """Load `tensors` into `module` after checking that each parameter is there with its
    shape and nothing else is (the first culprit named); float32 on the CPU.

    Raises:
        ValueError: a tensor missing, of another shape, or unexpected.
    """
    expected = {name: tuple(v.shape) for name, v in tree_flatten(module.parameters())}
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name} is missing")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}"
            )
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ValueError(f"{path}: unexpected tensors {extra[:4]}")
    module.load_weights(list(tensors.items()), strict=True)
    if mx.default_device() == mx.cpu:
        module.set_dtype(mx.float32)
        weight_layout.column_major(module)
    mx.eval(module.parameters())


def cast_floats(tensors: dict[str, mx.array], dtype) -> dict[str, mx.array]:
    """Floating tensors in `dtype`, the others (index maps) as they are."""
    return {
        name: value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
        for name, value in tensors.items()
    }
