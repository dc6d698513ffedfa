"""MLX modules that mlx-lm lacks: MTP heads."""
