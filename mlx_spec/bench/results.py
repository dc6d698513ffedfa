"""From timed runs to `BenchResult`s: medians per configuration, then speedups, costs and ratios."""

from __future__ import annotations

from mlx_spec.bench.config import AUTO, DRAFT_MODEL, PEER, PLAIN, TREE_MODES
from mlx_spec.bench.costs import expected_tokens_per_round, median_or_zero, predicted_speedup
from mlx_spec.bench.report import BenchResult
from mlx_spec.bench.runs import Run, steady_sum
from mlx_spec.bench.settings import Setting
from mlx_spec.bench.timers import TimedDrafter
from mlx_spec.core.stats import merge_stats

import numpy as np


def summarize(s: Setting, runs: list[list[Run]], timed: TimedDrafter | None) -> BenchResult:
    """Medians over repeats, counts over all generations; costs and ratios come later."""
    rates = []
    for repeat in runs:
        tokens, seconds = steady_sum(repeat)
        rates.append(tokens / seconds if seconds else 0.0)
    flat = [run for repeat in runs for run in repeat]
    stats = merge_stats([run.stats for run in flat])
    by_repeat = [[x for run in repeat for x in run.token_latencies()] for repeat in runs]
    p50 = median_or_zero([float(np.percentile(x, 50)) for x in by_repeat if x])
    p95 = median_or_zero([float(np.percentile(x, 95)) for x in by_repeat if x])
    speculative = s.mode != PLAIN
    rollback = [run.stats.rollback_seconds for run in flat]
    decode = sum(run.stats.decode_seconds for run in flat)
    measured_rollback = s.mode not in (PLAIN, PEER)
    return BenchResult(
        mode=s.mode,
        library="mlx-lm" if s.mode == PEER else "mlx-spec",
        num_draft=s.num_draft,
        temperature=s.temperature,
        tokens_per_sec=median_or_zero(rates),
        tokens_per_sec_runs=rates,
        speedup=1.0,
        acceptance_rate=stats.acceptance_rate if speculative else None,
        acceptance_by_position=[
            a / d if d else 0.0
            for a, d in zip(stats.accepted_per_position, stats.drafted_per_position, strict=True)
        ],
        mean_accepted_length=stats.mean_accepted_length,
        target_passes_per_token=(
            stats.target_passes / stats.generated_tokens if stats.generated_tokens else 0.0
        ),
        latency_p50_ms=p50 * 1e3,
        latency_p95_ms=p95 * 1e3,
        ttft_ms=median_or_zero([run.ttft for run in flat]) * 1e3,
        prefill_tokens_per_sec=median_or_zero([run.prefill_tokens_per_sec for run in flat]),
        peak_memory_mb=median_or_zero([max(run.peak_memory for run in rep) for rep in runs]) / 1e6,
        rollback_ms=median_or_zero(rollback) * 1e3 if measured_rollback else None,
        rollback_share=(sum(rollback) / decode if decode else 0.0) if measured_rollback else None,
        expected_tokens_per_round=expected_tokens_per_round(stats),
        draft_ms=timed.seconds / timed.drafted * 1e3 if timed and timed.drafted else None,
        nodes_per_pass=timed.nodes / timed.rounds if getattr(timed, "rounds", 0) else None,
        draft_cost=None,
        verify_cost=None,
        predicted_speedup=None,
        realized_over_predicted=None,
        generations=len(flat),
        comm_ms_per_pass=stats.comm_seconds_per_pass * 1e3 if stats.world_size > 1 else None,
        k_histogram={str(k): n for k, n in sorted(stats.k_histogram.items())},
        drafter_rounds=dict(stats.drafter_rounds),
        stats=stats,
        latencies_ms=[x * 1e3 for rep in by_repeat for x in rep],
    )


def relate(results: list[BenchResult], runs: dict, settings: list[Setting], steps: dict) -> dict:
    """Speedups over plain; the cost model in plain decoding steps and the predicted speedups
    (the peer borrows the draft model's c); the peer ratios; whether greedy outputs equal plain
    decoding's. Returns the cost model's numbers per temperature."""
    by_key = {(r.mode, r.num_draft, r.temperature): r for r in results}
    plain_tokens = {
        s.temperature: _tokens(runs[i]) for i, s in enumerate(settings) if s.mode == PLAIN
    }
    unit = {}  # seconds per plain decoding step, per temperature
    for r in results:
        if r.mode == PLAIN and r.tokens_per_sec:
            unit[r.temperature] = 1.0 / r.tokens_per_sec
    verify = {t: {n - 1: seconds / unit[t] for n, seconds in steps[t].items()} for t in unit}
    for i, r in enumerate(results):
        t = r.temperature
        if t not in unit:
            continue
        if r.mode == PLAIN:
            r.speedup = r.predicted_speedup = r.realized_over_predicted = 1.0
            continue
        _relate_one(r, by_key, unit[t], verify[t])
        if t == 0 and t in plain_tokens:
            r.matches_plain = _tokens(runs[i]) == plain_tokens[t]
    _ratios_to_best_fixed_k(results)
    return {
        "plain_step_ms": {str(t): u * 1e3 for t, u in unit.items()},
        "target_pass_ms": {
            str(t): {n: seconds * 1e3 for n, seconds in by_n.items()} for t, by_n in steps.items()
        },
        "verify_cost": {str(t): v for t, v in verify.items()},
    }


def _tokens(runs: list[list[Run]]) -> list[list[int]]:
    """The tokens of every generation of one configuration, repeat by repeat."""
    return [run.tokens for rep in runs for run in rep]


def _relate_one(r: BenchResult, by_key: dict, unit: float, verify: dict) -> None:
    """A speculative row's speedup, drafter cost c, v_k and predicted speedup (`unit`: seconds
    per plain step); for an mlx-lm row also the ratio to mlx-spec's draft-model row."""
    t = r.temperature
    r.speedup = r.tokens_per_sec * unit
    r.verify_cost = verify.get(r.num_draft)
    draft_ms = r.draft_ms
    if r.mode == PEER:
        ours = by_key.get((DRAFT_MODEL, r.num_draft, t))
        draft_ms = ours.draft_ms if ours is not None else None
        if ours is not None and r.tokens_per_sec:
            ours.vs_mlx_lm = r.vs_mlx_lm = ours.tokens_per_sec / r.tokens_per_sec
    if draft_ms is not None and r.stats is not None:
        r.draft_cost = draft_ms / 1e3 / unit
    if r.draft_cost is not None and r.mode not in TREE_MODES:  # trees: tree_prediction.py
        r.predicted_speedup = predicted_speedup(r.stats, r.draft_cost, verify)
        if r.predicted_speedup:
            r.realized_over_predicted = r.speedup / r.predicted_speedup


def _ratios_to_best_fixed_k(results: list[BenchResult]) -> None:
    """Each auto row's tokens/s over the best fixed k of its mode and temperature."""
    for r in results:
        fixed = [x for x in results if (x.mode, x.temperature) == (r.mode, r.temperature)]
        fixed = [x.tokens_per_sec for x in fixed if isinstance(x.num_draft, int)]
        if r.num_draft == AUTO and fixed and max(fixed):
            r.vs_best_fixed_k = r.tokens_per_sec / max(fixed)
