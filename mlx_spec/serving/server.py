"""`mlx-spec serve`'s entry points, gathered from the modules that define them."""

from mlx_spec.serving.app import create_app
from mlx_spec.serving.config import ServerConfig
from mlx_spec.serving.errors import APIError
from mlx_spec.serving.factories import DrafterFactory, drafter_factories
from mlx_spec.serving.startup import batch_engine, follow

__all__ = [
    "APIError",
    "DrafterFactory",
    "ServerConfig",
    "batch_engine",
    "create_app",
    "drafter_factories",
    "follow",
]
