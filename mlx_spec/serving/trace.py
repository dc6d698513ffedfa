"""The speculation trace a stream carries when asked (`"speculative": {"trace": true}`)."""

from __future__ import annotations

from mlx_spec.api import GenerationChunk
from mlx_spec.core.stats import SpecStats


def token_entry(chunk: GenerationChunk) -> dict:
    """How one token came: its text, kind, drafter and its round's draft count."""
    entry = {"text": chunk.text, "kind": chunk.kind}
    if chunk.drafter is not None:
        entry["drafter"] = chunk.drafter
    if chunk.kind != "draft":  # the round's last token closes it: the page counts rounds by it
        entry["drafted"] = chunk.drafted
    return entry


def tokens_field(chunks: list[GenerationChunk]) -> dict:
    """The `speculative` field of a content chunk: its tokens (the list is emptied)."""
    tokens = [token_entry(c) for c in chunks]
    chunks.clear()
    return {"tokens": tokens}


def summary(stats: SpecStats) -> dict:
    """What speculation did for the whole output, for the final chunk's `speculative` field."""
    return {
        "drafter": None if stats.drafter == "none" else stats.drafter,
        "num_draft": stats.num_draft if stats.drafter != "none" else 0,
        "generated_tokens": stats.generated_tokens,
        "target_passes": stats.target_passes,
        "drafted_tokens": stats.drafted,
        "accepted_tokens": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "drafted_per_position": list(stats.drafted_per_position),
        "accepted_per_position": list(stats.accepted_per_position),
        "acceptance_by_position": stats.acceptance_by_position,
        "k_histogram": {str(k): n for k, n in sorted(stats.k_histogram.items())},
        "drafter_rounds": dict(stats.drafter_rounds),
        "decode_tokens_per_sec": stats.decode_tokens_per_sec,
        "plain_tokens_per_sec": stats.plain_tokens_per_sec,
        "speedup_estimate": stats.speedup_estimate,
    }


def final_field(chunks: list[GenerationChunk], stats: SpecStats) -> dict:
    """The `speculative` field of the final chunk: the tokens still untold and the summary."""
    return {**tokens_field(chunks), "summary": summary(stats)}
