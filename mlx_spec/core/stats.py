"""Speculation statistics for one generation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecStats:
    """Counters and timings of one generation.

    A round is one target pass: its drafts, its accepted prefix, and the recovered or bonus token.
    Only emitted tokens are counted: a round cut short by EOS, a stop sequence or max_tokens
    counts the draft positions up to the cut.

    `cached_tokens`: prompt tokens already in the caches from an earlier turn of a `Session`
    (only the rest were prefilled); `cache_reset`: that session's caches could not be cut back
    to the new prompt and were rebuilt from scratch.
    """

    drafter: str = "none"
    num_draft: int | str = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_reset: bool = False
    generated_tokens: int = 0
    target_passes: int = 0
    replays: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    rollback_seconds: float = 0.0
    round_seconds: list[float] = field(default_factory=list)
    # Draft lengths chosen: rounds per k asked for (k = 0: plain decoding steps), and rounds per
    # drafter (with a drafter group, which drafter drafted them).
    k_histogram: dict[int, int] = field(default_factory=dict)
    drafter_rounds: dict[str, int] = field(default_factory=dict)
    # A target sharded over several processes: how many, and the collectives of the decode
    # (counted as each pass's graph is built, priced by a probe over the same group).
    world_size: int = 1
    comm_collectives: int = 0
    comm_seconds: float = 0.0
    # The base of the speedup estimate: the measured seconds of the plain steps and the tokens
    # they gave (a batch row: what plain steps at its batch sizes would have taken for all of
    # its tokens, `Row.paced`).
    plain_seconds: float = 0.0
    plain_tokens: int = 0

    def observe_choice(self, drafter: str | None, k: int) -> None:
        """A round asked `drafter` for k drafts (None, 0: a plain decoding step)."""
        self.k_histogram[k] = self.k_histogram.get(k, 0) + 1
        if drafter is not None:
            self.drafter_rounds[drafter] = self.drafter_rounds.get(drafter, 0) + 1

    def observe_round(self, drafted: int, accepted: int, emitted: int, seconds: float) -> None:
        """Record a round in which `drafted` tokens were proposed, the first `accepted` kept,
        and `emitted` tokens reached the output (after any truncation)."""
        if emitted < accepted:  # cut inside the accepted run: later positions never counted
            drafted = accepted = emitted
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < accepted)
        self.generated_tokens += emitted
        self.target_passes += 1
        self.round_seconds.append(seconds)
        if not drafted and seconds:
            self.plain_seconds += seconds
            self.plain_tokens += emitted

    def choices_line(self) -> str:
        """What an adaptive policy chose: 'k chosen: 0 x12, 1 x30; rounds by drafter: ...'
        (k = 0: plain decoding steps)."""
        hist = ", ".join(f"{k} x{n}" for k, n in sorted(self.k_histogram.items()))
        line = f"k chosen: {hist or 'none'}"
        if len(self.drafter_rounds) > 1 or "+" in self.drafter:
            used = ", ".join(f"{name} x{n}" for name, n in self.drafter_rounds.items())
            line += f"; rounds by drafter: {used or 'none'}"
        return line

    @property
    def drafted(self) -> int:
        return sum(self.drafted_per_position)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_position)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per round, recovered and bonus tokens included."""
        return self.generated_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Per draft position: rounds that kept it / rounds that drafted it."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)
        ]

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens the target had to process (those not already cached)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def prefill_tokens_per_sec(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def comm_seconds_per_pass(self) -> float:
        return self.comm_seconds / self.target_passes if self.target_passes else 0.0

    @property
    def decode_tokens_per_sec(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def plain_tokens_per_sec(self) -> float | None:
        """Plain decoding's pace, where this generation measured it."""
        return self.plain_tokens / self.plain_seconds if self.plain_seconds else None

    @property
    def speedup_estimate(self) -> float | None:
        """The decode's tokens per second over plain decoding's (None: not measured)."""
        plain = self.plain_tokens_per_sec
        return self.decode_tokens_per_sec / plain if plain and self.decode_seconds else None

    def round_latency_ms(self, q: float) -> float:
        return float(np.percentile(self.round_seconds, q) * 1e3) if self.round_seconds else 0.0

    def to_dict(self) -> dict:
        """Plain JSON-ready summary."""
        return {
            "drafter": self.drafter,
            "num_draft": self.num_draft,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "cache_reset": self.cache_reset,
            "generated_tokens": self.generated_tokens,
            "target_passes": self.target_passes,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "drafted_per_position": self.drafted_per_position,
            "accepted_per_position": self.accepted_per_position,
            "acceptance_by_position": self.acceptance_by_position,
            "prefill_tokens_per_sec": self.prefill_tokens_per_sec,
            "decode_tokens_per_sec": self.decode_tokens_per_sec,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "round_latency_p50_ms": self.round_latency_ms(50),
            "round_latency_p95_ms": self.round_latency_ms(95),
            "rollback_seconds": self.rollback_seconds,
            "replays": self.replays,
            "k_histogram": {str(k): n for k, n in sorted(self.k_histogram.items())},
            "drafter_rounds": dict(self.drafter_rounds),
            "world_size": self.world_size,
            "comm_collectives": self.comm_collectives,
            "comm_seconds": self.comm_seconds,
            "comm_seconds_per_pass": self.comm_seconds_per_pass,
        }


def merge_stats(runs: Sequence[SpecStats]) -> SpecStats:
    """Counters of several generations added up (per position, rounds, tokens, seconds)."""
    out = SpecStats(
        drafter=runs[0].drafter, num_draft=runs[0].num_draft, world_size=runs[0].world_size
    )
    width = max(len(s.drafted_per_position) for s in runs)
    out.drafted_per_position = [0] * width
    out.accepted_per_position = [0] * width
    for s in runs:
        for i, (d, a) in enumerate(
            zip(s.drafted_per_position, s.accepted_per_position, strict=True)
        ):
            out.drafted_per_position[i] += d
            out.accepted_per_position[i] += a
        out.prompt_tokens += s.prompt_tokens
        out.generated_tokens += s.generated_tokens
        out.target_passes += s.target_passes
        out.replays += s.replays
        out.prefill_seconds += s.prefill_seconds
        out.decode_seconds += s.decode_seconds
        out.rollback_seconds += s.rollback_seconds
        out.comm_collectives += s.comm_collectives
        out.comm_seconds += s.comm_seconds
        for k, n in s.k_histogram.items():
            out.k_histogram[k] = out.k_histogram.get(k, 0) + n
        for name, n in s.drafter_rounds.items():
            out.drafter_rounds[name] = out.drafter_rounds.get(name, 0) + n
    return out
