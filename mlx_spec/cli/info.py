"""`mlx-spec info`: versions, device and the BLAS MLX uses."""

from __future__ import annotations

import platform

import mlx_spec
from mlx_spec.platform import blas


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="versions, device and the BLAS MLX uses")
    p.set_defaults(func=run)


def run(args) -> int:
    import mlx.core as mx

    rows = {
        "mlx-spec": mlx_spec.__version__,
        "mlx": mx.__version__,
        "mlx-lm": _mlx_lm_version(),
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "device": str(mx.default_device()),
        "blas": blas.describe(),
        "dtype on this device": "float32" if mx.default_device() == mx.cpu else "checkpoint's",
    }
    width = max(map(len, rows))
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")
    blas.warn_if_slow()
    return 0


def _mlx_lm_version() -> str:
    try:
        from importlib.metadata import version

        return version("mlx-lm")
    except Exception:  # metadata missing in odd installs; not worth failing info for
        return "unknown"
