"""Figures and tables of a `bench.BenchReport`, for notebooks (matplotlib, imported on use).

Each function draws on `ax` (a new figure when None) and returns the axes.
"""

from __future__ import annotations

from mlx_spec.bench.config import ALL, AUTO, PEER, PLAIN, SPEC_MODES
from mlx_spec.bench.costs import analytic_curve
from mlx_spec.bench.report import BenchReport, BenchResult

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


# ------------------------------------------------ benchmarks/real_model.py (a real chat model)


def load_record(path) -> dict:
    """A results file of `benchmarks/real_model.py`."""
    import json
    from pathlib import Path

    return json.loads(Path(path).read_text())


def _rows(record: dict, temperature: float) -> dict[str, dict]:
    """engine/mode -> summary entry at `temperature`."""
    suffix = f"/T={float(temperature)}"
    return {k[: -len(suffix)]: v for k, v in record["summary"].items() if k.endswith(suffix)}


def real_model_table(record: dict) -> None:
    """Display every engine and mode: decode tokens/s, speedup over the engine's own plain
    decoding (geometric mean over the prompts, by kind), the lowest prompt, greedy outputs
    equal to plain decoding's."""
    from IPython.display import Markdown, display

    kinds = sorted({p["kind"] for p in record["prompts"]})
    count = {k: sum(p["kind"] == k for p in record["prompts"]) for k in kinds}
    args = record.get("args", {})
    head = (
        f"{len(record['prompts'])} prompts ("
        + ", ".join(f"{n} {k}" for k, n in count.items())
        + f"), at most {args.get('max_tokens', '?')} tokens, "
        + f"{args.get('repeats', '?')} repeat(s)\n\n"
    )
    columns = " | ".join(kinds)
    lines = [head + f"| engine / mode | T | tok/s | speedup | {columns} | lowest | = plain |"]
    lines.append("|" + " --- |" * (6 + len(kinds)))
    for temperature in sorted({float(k.rsplit("=", 1)[1]) for k in record["summary"]}):
        for name, e in sorted(_rows(record, temperature).items()):
            kind = " | ".join(_num(e["speedup_by_kind"].get(k)) for k in kinds)
            same = (
                f"{e['greedy_same_prompts']}/{len(e['greedy_same'])}" if "greedy_same" in e else "-"
            )
            lines.append(
                f"| {name} | {temperature:g} | {e['tps_mean']:.1f} | {_num(e['speedup_geomean'])} "
                f"| {kind} | {_num(e['speedup_min'])} | {same} |"
            )
    display(Markdown("\n".join(lines)))


def _num(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def speedup_by_kind(record: dict, temperature: float = 0.0, engine: str = "mlx-spec", ax=None):
    """Grouped bars: each mode's speedup over plain decoding by prompt kind (geometric means)."""
    ax = _axes(ax, (9, 4))
    rows = {k.split("/", 1)[1]: v for k, v in _rows(record, temperature).items()
            if k.startswith(engine + "/") and not k.endswith("/plain")}  # fmt: skip
    kinds = sorted({p["kind"] for p in record["prompts"]})
    width = 0.8 / max(1, len(rows))
    for i, (mode, e) in enumerate(sorted(rows.items())):
        xs = [j + i * width for j in range(len(kinds))]
        color = MODE_COLORS.get({"draft": "draft-model", "auto": ALL}.get(mode, mode))
        values = [e["speedup_by_kind"].get(k) or 0 for k in kinds]
        ax.bar(xs, values, width, label=mode, color=color)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], kinds)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"{engine}, T = {temperature:g}")
    ax.legend(fontsize=8)
    return ax


def acceptance_by_position_real(record: dict, temperature: float = 0.0, ax=None):
    """Acceptance at each draft position per drafter: rounds that kept draft i among those
    that drafted it."""
    ax = _axes(ax)
    for name, e in sorted(_rows(record, temperature).items()):
        values = [v for v in e.get("acceptance_by_position") or [] if v is not None]
        if values:
            ax.plot(range(1, len(values) + 1), values, marker="o", label=name.split("/", 1)[1])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    return ax


def prompt_speedups(record: dict, temperature: float = 0.0, mode: str = "mlx-spec/auto", ax=None):
    """Every prompt's speedup of `mode` over its engine's plain decoding, sorted, coloured by
    prompt kind: whether any prompt got slower."""
    ax = _axes(ax, (9, 3))
    entry = _rows(record, temperature)[mode]
    kind = {p["id"]: p["kind"] for p in record["prompts"]}
    ordered = sorted(entry["speedups"].items(), key=lambda item: item[1])
    colors = {k: f"C{i}" for i, k in enumerate(sorted(set(kind.values())))}
    ax.bar(
        range(len(ordered)), [v for _, v in ordered], color=[colors[kind[p]] for p, _ in ordered]
    )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([])
    ax.set_ylabel("speedup")
    ax.set_title(f"{mode}, T = {temperature:g}: each prompt")
    for k, c in colors.items():
        ax.bar([], [], color=c, label=k)
    ax.legend(fontsize=8)
    return ax
