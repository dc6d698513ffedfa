"""Figures and tables of a `bench.BenchReport`, for notebooks (matplotlib, imported on use).

Each function draws on `ax` (a new figure when None) and returns the axes.
"""

from __future__ import annotations

from mlx_spec.bench import (
    ALL,
    AUTO,
    PEER,
    PLAIN,
    SPEC_MODES,
    BenchReport,
    BenchResult,
    analytic_curve,
)

MODE_COLORS = {
    PLAIN: "#7f7f7f",
    "draft-model": "#1f77b4",
    "ngram": "#2ca02c",
    "mtp": "#d62728",
    "medusa": "#8c564b",
    "lookahead": "#e377c2",
    "draft-tree": "#17becf",
    "mtp-tree": "#bcbd22",
    "eagle3": "#aec7e8",
    "dflash": "#98df8a",
    ALL: "#ff7f0e",
    PEER: "#9467bd",
}


def _fixed_k(rows: list[BenchResult]) -> list[BenchResult]:
    """The rows of a fixed k (not "auto"), by k."""
    return sorted((r for r in rows if isinstance(r.num_draft, int)), key=lambda r: r.num_draft)


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:  # not a dependency of the package
        raise ImportError("the plots need matplotlib: pip install matplotlib") from exc
    return plt


def _axes(ax, size=(8, 4)):
    if ax is None:
        _, ax = _pyplot().subplots(figsize=size)
    return ax


def show_table(report: BenchReport) -> None:
    """Display the report's Markdown (header, table, cost model) in a notebook."""
    from IPython.display import Markdown, display

    display(Markdown(report.to_markdown()))


def _best_per_mode(report: BenchReport, temperature: float) -> list[BenchResult]:
    """Plain, then each mode's fastest configuration at this temperature."""
    out = []
    for mode in report.modes:
        rows = report.select(mode, temperature)
        if rows:
            out.append(max(rows, key=lambda r: r.tokens_per_sec))
    return out


def tokens_per_sec_bars(report: BenchReport, ax=None):
    """Decode tokens/s of every configuration, one group of bars per temperature."""
    ax = _axes(ax, (10, 4))
    x = 0.0
    ticks, labels = [], []
    for t in report.temperatures:
        for r in report.select(temperature=t):
            ax.bar(x, r.tokens_per_sec, color=MODE_COLORS.get(r.mode, "#333333"), width=0.8)
            ax.text(x, r.tokens_per_sec, f"{r.speedup:.2f}x", ha="center", va="bottom", fontsize=7)
            ticks.append(x)
            labels.append(f"{r.label}\nT={t:g}")
            x += 1
        x += 1
    ax.set_xticks(ticks, labels, rotation=90, fontsize=7)
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Tokens per second by mode (label: speedup over plain)")
    handles = [
        _pyplot().Rectangle((0, 0), 1, 1, color=MODE_COLORS.get(m, "#333333")) for m in report.modes
    ]
    ax.legend(handles, report.modes, fontsize=8)
    return ax


def speedup_vs_k(report: BenchReport, temperature: float = 0.0, ax=None):
    """Measured speedup against k per drafter, the bound at each measured k (from that run's
    acceptance), the analytic curve from the largest k's acceptance by position, and the
    speedup of "auto" (k chosen every round) as a dotted line."""
    ax = _axes(ax)
    for mode in [m for m in report.modes if m in (*SPEC_MODES, PEER)]:
        color = MODE_COLORS.get(mode)
        auto = report.result(mode, AUTO, temperature)
        if auto is not None:
            ax.axhline(auto.speedup, color=color, linestyle=":", label=f"{mode} auto")
        rows = _fixed_k(report.select(mode, temperature))
        if not rows:
            continue
        ks = [r.num_draft for r in rows]
        ax.plot(ks, [r.speedup for r in rows], "o-", color=color, label=f"{mode} measured")
        bound = [(r.num_draft, r.predicted_speedup) for r in rows if r.predicted_speedup]
        if bound:
            ax.plot(*zip(*bound, strict=True), "x", color=color, markersize=8)
        curve = analytic_curve(report, mode, temperature)
        if curve:
            ax.plot(*zip(*curve, strict=True), "--", color=color, alpha=0.6)
    ax.axhline(1.0, color=MODE_COLORS[PLAIN], linewidth=1)
    ax.plot([], [], "x", color="black", label="bound of each run")
    ax.plot([], [], "--", color="black", alpha=0.6, label="analytic, from the largest k")
    ax.set_xlabel("k (drafts per round)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"Speedup against k, T={temperature:g} (x: bound per run; dashed: analytic)")
    ax.legend(fontsize=8)
    return ax


def acceptance_by_position(report: BenchReport, temperature: float = 0.0, ax=None):
    """Acceptance at each draft position (rounds that kept draft i / rounds that drafted it),
    from each mode's configuration with the largest k."""
    ax = _axes(ax)
    for mode in [m for m in report.modes if m in (*SPEC_MODES, PEER)]:
        rows = _fixed_k(report.select(mode, temperature))
        if not rows:
            continue
        r = rows[-1]
        positions = range(1, len(r.acceptance_by_position) + 1)
        ax.plot(
            positions,
            r.acceptance_by_position,
            "o-",
            color=MODE_COLORS.get(mode),
            label=f"{mode} k={r.num_draft}",
        )
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(kept | drafted)")
    ax.set_title(f"Acceptance by draft position, T={temperature:g}")
    ax.legend(fontsize=8)
    return ax


def latency_distribution(report: BenchReport, temperature: float = 0.0, ax=None):
    """Per-token latency (a round's time over its tokens) of plain decoding and of each mode at
    its fastest k: boxes span p25-p75, whiskers p5-p95."""
    ax = _axes(ax)
    rows = [r for r in _best_per_mode(report, temperature) if r.latencies_ms]
    ax.boxplot(
        [r.latencies_ms for r in rows],
        whis=(5, 95),
        showfliers=False,
        tick_labels=[r.label for r in rows],
    )
    ax.set_ylabel("per-token latency (ms)")
    ax.set_title(f"Per-token latency, T={temperature:g}")
    ax.tick_params(axis="x", labelsize=8)
    return ax


def versus_mlx_lm(report: BenchReport, ax=None):
    """mlx-spec's draft-model tokens/s over mlx-lm's speculative decoding, per k and
    temperature."""
    ax = _axes(ax)
    for t in report.temperatures:
        rows = [r for r in _fixed_k(report.select("draft-model", t)) if r.vs_mlx_lm]
        if rows:
            ax.plot(
                [r.num_draft for r in rows],
                [r.vs_mlx_lm for r in rows],
                "o-",
                label=f"T={t:g}",
            )
    ax.axhline(1.0, color=MODE_COLORS[PLAIN], linewidth=1)
    ax.set_xlabel("k (drafts per round)")
    ax.set_ylabel("mlx-spec / mlx-lm tokens/s")
    ax.set_title("Against mlx-lm's speculative decoding (same draft model)")
    ax.legend(fontsize=8)
    return ax
