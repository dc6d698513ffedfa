"""The machine, the software versions and the models' sizes, for benchmark headers."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import mlx_spec
from mlx_spec.platform import blas

import mlx.core as mx
from mlx.utils import tree_flatten


def machine_info() -> dict:
    """The machine and software versions, for benchmark headers."""
    import mlx_lm

    return {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "device": str(mx.default_device()),
        "blas": blas.describe(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "mlx_spec": mlx_spec.__version__,
        "python": platform.python_version(),
    }


def param_count(model) -> int:
    return sum(p.size for _, p in tree_flatten(model.parameters()))


def model_dtype(model) -> str:
    dtypes = sorted({str(p.dtype) for _, p in tree_flatten(model.parameters())})
    return ", ".join(d.replace("mlx.core.", "") for d in dtypes)


def shown_path(path) -> str:
    """A path for reports, with the home directory written as ~."""
    text, home = str(path), str(Path.home())
    return "~" + text[len(home) :] if text.startswith(home + os.sep) else text
