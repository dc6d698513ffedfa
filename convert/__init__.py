"""Hugging Face -> MLX conversion for targets, draft models and MTP drafters.

The converter itself (`mlx-spec convert`) is not built yet; until it is, use MLX model
directories (for example those made by `mlx_lm.convert`).
"""
