"""Where mlx-spec keeps what it makes once: converted models, downloads, learned policies."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MLX_SPEC_CACHE"
SOURCE_ATTR = "_mlx_spec_source"  # on a loaded model: the folder it was loaded from


def cache_root() -> Path:
    """$MLX_SPEC_CACHE, else ~/.cache/mlx-spec."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mlx-spec")
