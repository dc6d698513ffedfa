"""What a benchmark run returns: one `BenchResult` per configuration, in a `BenchReport`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlx_spec.bench.config import ALL, AUTO, DRAFT_MODEL, PEER, PLAIN, SPEC_MODES
from mlx_spec.core.stats import SpecStats


@dataclass
class BenchResult:
    """One configuration's measurements (the module docstring of `mlx_spec.bench.harness`
    defines each)."""

    mode: str
    library: str
    num_draft: int | str
    temperature: float
    tokens_per_sec: float
    tokens_per_sec_runs: list[float]
    speedup: float
    acceptance_rate: float | None
    acceptance_by_position: list[float]
    mean_accepted_length: float
    target_passes_per_token: float
    latency_p50_ms: float
    latency_p95_ms: float
    ttft_ms: float
    prefill_tokens_per_sec: float
    peak_memory_mb: float
    rollback_ms: float | None
    rollback_share: float | None
    expected_tokens_per_round: float
    draft_ms: float | None
    draft_cost: float | None
    verify_cost: float | None
    predicted_speedup: float | None
    realized_over_predicted: float | None
    vs_mlx_lm: float | None = None
    vs_best_fixed_k: float | None = None
    k_histogram: dict[str, int] = field(default_factory=dict)
    drafter_rounds: dict[str, int] = field(default_factory=dict)
    matches_plain: bool | None = None
    generations: int = 0
    nodes_per_pass: float | None = None  # tree modes: tokens a tree round's pass scores
    comm_ms_per_pass: float | None = None  # a sharded target: priced collectives per pass
    stats: SpecStats | None = field(default=None, repr=False)
    latencies_ms: list[float] = field(default_factory=list, repr=False)

    @property
    def label(self) -> str:
        return self.mode if self.mode == PLAIN else f"{self.mode} k={self.num_draft}"

    def to_dict(self) -> dict:
        """JSON-ready record (the per-token latency samples left out)."""
        out = asdict(self)
        out.pop("latencies_ms")
        stats = out.pop("stats")
        if stats is not None:
            out["drafted_per_position"] = stats["drafted_per_position"]
            out["accepted_per_position"] = stats["accepted_per_position"]
            out["target_passes"] = stats["target_passes"]
            out["generated_tokens"] = stats["generated_tokens"]
        return out


def k_shares(r: BenchResult) -> str:
    """'0:40% 2:35% 4:25%' (k = 0: plain steps), and the group's rounds by drafter."""
    total = sum(r.k_histogram.values())
    text = " ".join(f"{k}:{n / total:.0%}" for k, n in r.k_histogram.items()) if total else "-"
    if r.mode == ALL and r.drafter_rounds:
        rounds = sum(r.drafter_rounds.values())
        text += " (" + ", ".join(f"{d} {n / rounds:.0%}" for d, n in r.drafter_rounds.items()) + ")"
    return text


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


TABLE_HEAD = [
    "| mode | k | T | tok/s | speedup | bound | realized/bound | acceptance | by position "
    "| mean acc. len | passes/token | latency p50/p95 ms | TTFT ms | prefill tok/s "
    "| peak MB | rollback | k chosen (share of rounds) |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: "
    "| ---: | ---: | ---: | ---: | --- |",
]


def _table_row(r: BenchResult) -> str:
    positions = " ".join(f"{a:.2f}" for a in r.acceptance_by_position) or "-"
    rollback = _fmt(r.rollback_share, ".1%")
    return (
        f"| {r.mode} | {r.num_draft or '-'} | {r.temperature:g} | {r.tokens_per_sec:.1f} "
        f"| {r.speedup:.2f}x | {_fmt(r.predicted_speedup, '.2f', 'x')} "
        f"| {_fmt(r.realized_over_predicted)} | {_fmt(r.acceptance_rate)} | {positions} "
        f"| {r.mean_accepted_length:.2f} | {r.target_passes_per_token:.2f} "
        f"| {r.latency_p50_ms:.2f} / {r.latency_p95_ms:.2f} | {r.ttft_ms:.1f} "
        f"| {r.prefill_tokens_per_sec:.0f} | {r.peak_memory_mb:.0f} | {rollback} "
        f"| {k_shares(r) if r.num_draft == AUTO else '-'} |"
    )


def _header_lines(h: dict) -> list[str]:
    lines = [
        "## mlx-spec bench",
        "",
        f"- machine: {h['machine']}; device {h['device']}; BLAS {h['blas']}; dtype {h['dtype']}",
        f"- versions: mlx {h['mlx']}, mlx-lm {h['mlx_lm']}, mlx-spec {h['mlx_spec']}, "
        f"Python {h['python']}",
        f"- target: {h['target']}",
    ]
    for key in ("sharded", "draft_model", "mtp"):
        if h.get(key):
            lines.append(f"- {key.replace('_', ' ')}: {h[key]}")
    return lines + [
        f"- prompts: {h['prompts']}; {h['max_tokens']} tokens generated per prompt (EOS "
        f"off); {h['repeats']} repeat(s) after a warm-up, medians",
        *[f"- note: {note}" for note in h.get("notes", [])],
    ]


@dataclass
class BenchReport:
    """What `run_bench` returns: the machine and settings, the cost model, one result per
    configuration."""

    header: dict
    config: dict
    costs: dict
    results: list[BenchResult]

    def result(self, mode: str, num_draft: int, temperature: float) -> BenchResult | None:
        """The result of one configuration (num_draft 0 for plain), or None."""
        for r in self.results:
            if (r.mode, r.num_draft, r.temperature) == (mode, num_draft, temperature):
                return r
        return None

    def select(self, mode: str | None = None, temperature: float | None = None) -> list:
        """Results of a mode and/or temperature, in run order."""
        return [
            r
            for r in self.results
            if (mode is None or r.mode == mode)
            and (temperature is None or r.temperature == temperature)
        ]

    @property
    def temperatures(self) -> list[float]:
        return list(dict.fromkeys(r.temperature for r in self.results))

    @property
    def modes(self) -> list[str]:
        return list(dict.fromkeys(r.mode for r in self.results))

    def summary(self) -> dict:
        """The headline numbers: the best speculative configuration at greedy (speedup,
        realized/predicted) and mlx-spec against mlx-lm per temperature."""
        out: dict = {}
        greedy_spec = [r for r in self.select(temperature=0.0) if r.mode in SPEC_MODES]
        if greedy_spec:
            out["best_greedy"] = _best_greedy(greedy_spec)
        versus = self._versus_mlx_lm()
        if versus:
            out["vs_mlx_lm"] = versus
        auto = [r for r in self.results if r.num_draft == AUTO]
        if auto:
            out["auto"] = [_auto_summary(r) for r in auto]
        differ = [
            r.label + f" T={r.temperature:g}" for r in self.results if r.matches_plain is False
        ]
        if differ:
            out["greedy_outputs_differing_from_plain"] = differ
        return out

    def _versus_mlx_lm(self) -> dict:
        """{temperature: each library's best k and tokens/s, and their ratio}."""
        versus = {}
        for t in self.temperatures:
            ours = self.select(DRAFT_MODEL, t)
            peers = self.select(PEER, t)
            if ours and peers:
                a = max(ours, key=lambda r: r.tokens_per_sec)
                b = max(peers, key=lambda r: r.tokens_per_sec)
                versus[str(t)] = {
                    "mlx_spec_num_draft": a.num_draft,
                    "mlx_spec_tokens_per_sec": a.tokens_per_sec,
                    "mlx_lm_num_draft": b.num_draft,
                    "mlx_lm_tokens_per_sec": b.tokens_per_sec,
                    "ratio": a.tokens_per_sec / b.tokens_per_sec if b.tokens_per_sec else None,
                }
        return versus

    def to_dict(self) -> dict:
        return {
            "benchmark": "mlx-spec bench",
            "header": self.header,
            "config": self.config,
            "costs": self.costs,
            "results": [r.to_dict() for r in self.results],
            "summary": self.summary(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    def to_markdown(self) -> str:
        """The header, the results table, mlx-spec against mlx-lm, the cost model, the
        headline numbers."""
        lines = [*_header_lines(self.header), "", *TABLE_HEAD]
        lines += [_table_row(r) for r in self.results]
        lines += self._comm_lines() + self._peer_lines()
        lines += ["", *self._cost_lines(), *self._summary_lines()]
        return "\n".join(lines)

    def _comm_lines(self) -> list[str]:
        comm = [
            f"{r.label} T={r.temperature:g} {r.comm_ms_per_pass:.2f}"
            for r in self.results
            if r.comm_ms_per_pass is not None
        ]
        if not comm:
            return []
        return ["", "Communication of the sharded target, ms per pass (priced "
                "collectives): " + ", ".join(comm)]  # fmt: skip

    def _peer_lines(self) -> list[str]:
        peer_rows = [r for r in self.results if r.mode == DRAFT_MODEL and r.vs_mlx_lm]
        if not peer_rows:
            return []
        lines = [
            "",
            "mlx-spec against mlx-lm's speculative decoding (same draft model, prompts and "
            "settings):",
            "",
            "| k | T | mlx-spec tok/s | mlx-lm tok/s | mlx-spec / mlx-lm |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in peer_rows:
            peer = self.result(PEER, r.num_draft, r.temperature)
            lines.append(
                f"| {r.num_draft} | {r.temperature:g} | {r.tokens_per_sec:.1f} "
                f"| {peer.tokens_per_sec:.1f} | {r.vs_mlx_lm:.2f}x |"
            )
        return lines

    def _cost_lines(self) -> list[str]:
        c = self.costs
        out = [
            "Cost model, in plain decoding steps (target passes timed at a "
            f"{c['cost_context']}-token cache):",
            "",
        ]
        for t, step in c["plain_step_ms"].items():
            v = ", ".join(f"{j}: {x:.2f}" for j, x in c["verify_cost"][t].items())
            one = c["target_pass_ms"][t][1]
            out.append(
                f"- T={float(t):g}: plain step {step:.2f} ms, 1-token target pass {one:.2f} ms; "
                f"v_k (k drafts verified) {v}"
            )
        drafts = [
            f"{r.label} T={r.temperature:g}: {r.draft_cost:.3f}"
            for r in self.results
            if r.library == "mlx-spec" and r.draft_cost is not None
        ]
        if drafts:
            out.append("- drafter cost c per drafted token: " + ", ".join(drafts))
        return out

    def _summary_lines(self) -> list[str]:
        s = self.summary()
        out = [
            f"auto, {a['mode']} T={a['temperature']:g}: {a['speedup']:.2f}x plain, "
            f"{_fmt(a['vs_best_fixed_k'], '.2f', 'x')} the best fixed k."
            for a in s.get("auto", [])
        ]
        if "best_greedy" in s:
            b = s["best_greedy"]
            out.append(
                f"Best greedy: {b['mode']} k={b['num_draft']}, {b['speedup']:.2f}x plain, "
                f"{_fmt(b['realized_over_predicted'])} of the bound "
                f"({_fmt(b['predicted_speedup'], '.2f', 'x')})."
            )
        for t, v in s.get("vs_mlx_lm", {}).items():
            out.append(
                f"mlx-spec vs mlx-lm at T={float(t):g}, each at its best k "
                f"(mlx-spec k={v['mlx_spec_num_draft']}, mlx-lm k={v['mlx_lm_num_draft']}): "
                f"{_fmt(v['ratio'], '.2f', 'x')}."
            )
        if "greedy_outputs_differing_from_plain" in s:
            out.append(
                "Greedy output differing from plain decoding (near-ties in a batched pass): "
                + ", ".join(s["greedy_outputs_differing_from_plain"])
                + "."
            )
        return ["", *out] if out else []


def _best_greedy(greedy_spec: list[BenchResult]) -> dict:
    best = max(greedy_spec, key=lambda r: r.speedup)
    return {
        "mode": best.mode,
        "num_draft": best.num_draft,
        "speedup": best.speedup,
        "predicted_speedup": best.predicted_speedup,
        "realized_over_predicted": best.realized_over_predicted,
    }


def _auto_summary(r: BenchResult) -> dict:
    return {
        "mode": r.mode,
        "temperature": r.temperature,
        "speedup": r.speedup,
        "vs_best_fixed_k": r.vs_best_fixed_k,
    }
