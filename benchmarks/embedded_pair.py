"""Acceptance and speedup of each drafter of the embedded pair on held-out standard-library files.

A thin wrapper of `mlx-spec bench` (see `mlx_spec/bench/harness.py` for how every number is
measured): with no model flags it runs the embedded pair; any other `mlx-spec bench` option
passes through.
`--summary FILE` instead prints the README's summary table of a JSON report that bench wrote:
per drafter and temperature, the best fixed k against `auto` (k chosen every round).

    python benchmarks/embedded_pair.py --json benchmarks/results/embedded_pair.json
    python benchmarks/embedded_pair.py --quick
    python benchmarks/embedded_pair.py --summary benchmarks/results/bench.json
"""

from __future__ import annotations

import json
import sys

from mlx_spec import cli

NAMES = {
    "draft-model": "draft model",
    "ngram": "n-gram lookup",
    "mtp": "MTP head",
    "all": "all three (group)",
    "mlx-lm": "mlx-lm, same draft model",
}


def summary(report: dict) -> str:
    """Markdown: one row per mode and temperature, best fixed k against auto."""
    rows = report["results"]
    lines = [
        "| drafter | T | best fixed k | tok/s | speedup | auto tok/s | auto speedup "
        "| auto / best fixed | acceptance at position 1 (auto) "
        "| k chosen by auto (share of rounds) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for t in dict.fromkeys(r["temperature"] for r in rows):
        plain = next(r for r in rows if r["mode"] == "plain" and r["temperature"] == t)
        lines.append(f"| plain | {t:g} | - | {plain['tokens_per_sec']:.1f} | 1.00x | | | | | |")
        for mode, name in NAMES.items():
            mine = [r for r in rows if r["mode"] == mode and r["temperature"] == t]
            fixed = [r for r in mine if isinstance(r["num_draft"], int)]
            auto = next((r for r in mine if r["num_draft"] == "auto"), None)
            if not mine:
                continue
            best = max(fixed, key=lambda r: r["tokens_per_sec"]) if fixed else None
            cells = [name, f"{t:g}"]
            cells += ["-", "", ""] if best is None else [
                str(best["num_draft"]), f"{best['tokens_per_sec']:.1f}", f"{best['speedup']:.2f}x"
            ]  # fmt: skip
            if auto is None:
                cells += ["", "", "", "", ""]
            else:
                ratio = auto.get("vs_best_fixed_k")
                first = auto["acceptance_by_position"][:1]  # empty: auto never drafted
                total = sum(auto["k_histogram"].values()) or 1
                shares = " ".join(f"{k}:{n / total:.0%}" for k, n in auto["k_histogram"].items())
                cells += [
                    f"{auto['tokens_per_sec']:.1f}",
                    f"**{auto['speedup']:.2f}x**",
                    "-" if ratio is None else f"{ratio:.2f}",
                    f"{first[0]:.2f}" if first else "-",
                    shares,
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summary"]:
        with open(sys.argv[2]) as handle:
            print(summary(json.load(handle)))
        sys.exit(0)
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
