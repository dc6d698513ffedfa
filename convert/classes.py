"""mlx-lm's model and arguments classes for a config, or a refusal that names the family."""

from __future__ import annotations

from convert.errors import ConversionError

from mlx_lm.utils import _get_classes  # mlx-lm's own lookup by model_type (no public name)


def model_classes(config: dict):
    """(model class, arguments class) of mlx-lm for `config["model_type"]`."""
    if "model_type" not in config:
        raise ConversionError("config.json has no model_type")
    try:
        return _get_classes(config)
    except ValueError as exc:
        raise ConversionError(
            f"unknown architecture {config['model_type']!r}: mlx-lm has no model for it"
        ) from exc
    except (ImportError, SystemExit) as exc:  # mlx-lm's module needs a package that is missing
        raise ConversionError(
            f"mlx-lm's {config['model_type']} model cannot be imported here ({exc})"
        ) from exc
