"""`usage`: a response's token counts, with what speculation did for it."""

from __future__ import annotations

from mlx_spec.core.stats import SpecStats


def usage(stats: SpecStats, prompt_tokens: int) -> dict:
    """OpenAI usage plus a `speculative` object."""
    completion = stats.generated_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "speculative": {
            "enabled": stats.drafter != "none",
            "drafter": None if stats.drafter == "none" else stats.drafter,
            "num_draft": stats.num_draft if stats.drafter != "none" else 0,
            "k_histogram": {str(k): n for k, n in sorted(stats.k_histogram.items())},
            "drafted_tokens": stats.drafted,
            "accepted_tokens": stats.accepted,
            "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length,
            "target_passes": stats.target_passes,
            "decode_tokens_per_sec": stats.decode_tokens_per_sec,
            "world_size": stats.world_size,
        },
    }
