"""Hugging Face -> MLX conversion for targets, draft models and MTP drafters."""

from convert.core import ConversionResult, Quantization, convert_checkpoint
from convert.errors import ConversionError

__all__ = ["ConversionError", "ConversionResult", "Quantization", "convert_checkpoint"]
