"""What the cost model says of trees against chains, here and on a memory-bound device.

Reads a `mlx-spec bench --json` report that has tree rows (medusa, lookahead, draft-tree,
mtp-tree) beside the chain rows of the same drafters (draft-model, mtp) at one fixed k, and
prints for each row at temperature 0:

- E: tokens per target pass (the mean accepted length, the bonus token included);
- nodes: tokens the target scores per pass (k + 1 for a chain; for trees the bench's
  `nodes_per_pass`, the mean over the tree rounds: root, nodes and lookahead's window);
- c: the drafter's cost per level (per drafted token for a chain) in plain steps, as the
  bench measured it;
- here: E / (k c + v(nodes)), with v the measured cost of a target pass over that many tokens
  on this machine (interpolated from the bench's `target_pass_ms`), against the measured
  speedup;
- memory-bound: E / (k c + 1), the same with every pass of a few dozen tokens costing one
  plain step, as on a GPU reading the weights once per pass (a Mac's).

Usage:
    python benchmarks/tree_prediction.py benchmarks/results/bench_tree.json
"""

from __future__ import annotations

import argparse
import json
import sys


def pass_cost(costs: dict, temperature: str, nodes: float) -> float:
    """A target pass over `nodes` tokens in plain steps, linear between measured sizes."""
    ms = {int(n): t for n, t in costs["target_pass_ms"][temperature].items()}
    unit = ms[1]
    sizes = sorted(ms)
    if nodes in ms:
        return ms[nodes] / unit
    below = max((n for n in sizes if n < nodes), default=sizes[0])
    above = min((n for n in sizes if n > nodes), default=sizes[-1])
    if above == below:
        return ms[below] / unit * nodes / below
    share = (nodes - below) / (above - below)
    return (ms[below] + share * (ms[above] - ms[below])) / unit


def rows_of(report: dict) -> list[dict]:
    rows = [r for r in report["results"] if r["temperature"] == 0 and r["num_draft"] != "auto"]
    out = []
    for r in rows:
        mode, k, c = r["mode"], r["num_draft"], r.get("draft_cost")
        if mode in ("plain", "mlx-lm", "all", "ngram") or c is None:
            continue
        e = r["mean_accepted_length"]
        nodes = r.get("nodes_per_pass") or k + 1
        v = pass_cost(report["costs"], "0.0", nodes)
        out.append(
            {
                "mode": mode,
                "k": k,
                "E": e,
                "nodes": nodes,
                "c": c,
                "measured": r["speedup"],
                "here": e / (k * c + v),
                "memory_bound": e / (k * c + 1.0),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a `mlx-spec bench --json` report with tree rows")
    args = parser.parse_args(argv)
    try:
        with open(args.report) as f:
            report = json.load(f)
        rows = rows_of(report)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {args.report}: {exc}", file=sys.stderr)
        return 2
    print("| mode | k | E (tokens/pass) | nodes/pass | c | measured | model here | memory-bound |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['mode']} | {r['k']} | {r['E']:.2f} | {r['nodes']:.1f} | {r['c']:.3f} | "
            f"{r['measured']:.2f}x | {r['here']:.2f}x | {r['memory_bound']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
