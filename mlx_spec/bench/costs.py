"""The cost model's formulas: expected tokens per round, round cost and the analytic bound."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mlx_spec.core.stats import SpecStats

if TYPE_CHECKING:
    from mlx_spec.bench.report import BenchReport


def median_or_zero(values: Sequence[float]) -> float:
    """The median of `values`; 0.0 when there are none."""
    return statistics.median(values) if values else 0.0


def expected_tokens_per_round(stats: SpecStats) -> float:
    """E[tokens per round] = 1 + sum_i a_i / R (a_i: rounds that kept draft i+1; R: rounds)."""
    if not stats.target_passes:
        return 0.0
    return 1.0 + sum(stats.accepted_per_position) / stats.target_passes


def draft_length_shares(stats: SpecStats) -> dict[int, float]:
    """{j: share of rounds that drafted exactly j tokens}."""
    rounds = stats.target_passes
    if not rounds:
        return {}
    reached = [rounds, *stats.drafted_per_position, 0]
    return {j: (reached[j] - reached[j + 1]) / rounds for j in range(len(reached) - 1)}


def expected_round_cost(
    stats: SpecStats, draft_cost: float, verify_cost: Mapping[int, float]
) -> float:
    """sum_j f_j (j c + v_j), in target steps; v_0 = 1."""
    costs = {0: 1.0, **verify_cost}  # v_0: a plain step unless measured
    return sum(f * (j * draft_cost + costs[j]) for j, f in draft_length_shares(stats).items())


def predicted_speedup(
    stats: SpecStats, draft_cost: float, verify_cost: Mapping[int, float]
) -> float:
    """The analytic bound: E[tokens per round] / E[round cost in target steps].

    Args:
        stats: acceptance counts (per draft position) and the number of rounds.
        draft_cost: c, one drafted token's cost over one target step.
        verify_cost: v_j for each j drafted: a (j + 1)-token target pass over a 1-token pass.
    """
    cost = expected_round_cost(stats, draft_cost, verify_cost)
    return expected_tokens_per_round(stats) / cost if cost else 0.0


def analytic_curve(report: BenchReport, mode: str, temperature: float) -> list[tuple[int, float]]:
    """The bound as a function of k, [(k, predicted speedup)] for k = 1 .. K, from the
    configuration of `mode` with the largest k K: its acceptance by position (E(k) = 1 +
    sum_{i<k} a_i / d_i), its drafter cost c, and each k's measured v_k. It assumes every round
    drafts k tokens (true of draft models and MTP heads; n-gram lookups may draft fewer)."""
    rows = [
        r
        for r in report.select(mode, temperature)
        if r.draft_cost is not None and isinstance(r.num_draft, int)
    ]
    if not rows:
        return []
    ref = max(rows, key=lambda r: r.num_draft)
    verify = report.costs["verify_cost"][str(temperature)]
    out = []
    for k in range(1, ref.num_draft + 1):
        tokens = 1.0 + sum(ref.acceptance_by_position[:k])
        v = verify[k] if k in verify else verify[str(k)]
        out.append((k, tokens / (k * ref.draft_cost + v)))
    return out
