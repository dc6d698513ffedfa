"""Summarise a server's step trace (`mlx-spec serve --trace-steps FILE`): `mlx-spec steps FILE`.

Each line of the file is one step of the batch engine: its rows B, drafts K, the drafters its
rows drafted with, the policy's reason, where its milliseconds went and `t`, when it ended
(seconds since the server started). This prints

- the steps by (B, K, reason, drafters): how many, their share of the steps' time, the median
  step's milliseconds, tokens per step and tokens per millisecond, against plain steps (K = 0);
- the time between steps (prefills, model drafters taking rows in, an idle server), which no
  step's time holds;
- the speculative steps' prices: the tokens and milliseconds the policy expected of each
  kind of step against those it realised (how far the cost model and the acceptance
  estimates it chose by held), per mode and N where the load runs are marked;
- where `server_load.py --trace-steps FILE` wrote FILE.marks.jsonl beside it (each load run's
  mode, N and times), a table per mode and N: the speculative steps' share of the runs,
  tokens per millisecond of plain and speculative steps, the time between steps, the tail
  (steps of fewer rows than the run's clients) and tokens per second;
- with `--bins S`, a timeline of S-second bins: steps, speculative steps and their time, the
  median plain step, the time between steps and the tokens per second, to see where a load's
  speculative stretches lose or gain.

    mlx-spec serve --trace-steps steps.jsonl        # then run a load against it
    mlx-spec steps steps.jsonl --bins 0.4
    mlx-spec steps steps.jsonl --start 9.0 --end 10.8   # one stretch
    python benchmarks/server_load.py --concurrency 8 --modes none all --no-peer \\
        --trace-steps steps.jsonl                      # with the table per mode and N
    mlx-spec steps steps.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

SPANS = ("choose", "draft_build", "draft_queue", "verify_build", "verify", "host")


def load(path: str) -> list[dict]:
    """The steps of a trace file, each with `ms` (its time) and `gap_ms` (the time since the
    step before ended that is not its own). A last line cut short by a stopped server is
    skipped."""
    steps, last = [], None
    for line in Path(path).read_text().splitlines():
        try:
            step = json.loads(line)
        except json.JSONDecodeError:
            continue
        step["ms"] = 1000 * sum(step.get(name, 0.0) for name in SPANS)  # (older: no choose)
        step["gap_ms"] = 0.0 if last is None else max(0.0, 1000 * (step["t"] - last) - step["ms"])
        step.setdefault("drafters", "")
        last = step["t"]
        steps.append(step)
    return steps


def by_kind(steps: list[dict], top: int | None = None) -> list[str]:
    """Lines of the table of steps by (B, K, reason, drafters), the costliest first (the
    `top` costliest kinds)."""
    groups = defaultdict(list)
    for s in steps:
        groups[(s["rows"], s["num_draft"], s["why"], s["drafters"])].append(s)
    total = sum(s["ms"] for s in steps) or 1.0
    lines = [
        "| B | K | reason | drafters | steps | share of the steps' time | median ms | tokens "
        "per step | tokens per ms |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in sorted(groups, key=lambda k: -sum(s["ms"] for s in groups[k]))[:top]:
        group = groups[key]
        ms = sum(s["ms"] for s in group)
        tokens = sum(s["tokens"] for s in group)
        rows, k, why, drafters = key
        lines.append(
            f"| {rows} | {k} | {_reason(k, why)} | {drafters or '-'} | {len(group)} "
            f"| {100 * ms / total:.1f}% | {statistics.median(s['ms'] for s in group):.2f} "
            f"| {tokens / len(group):.1f} | {tokens / ms if ms else 0.0:.2f} |"
        )
    return lines


def _reason(k: int, why: str) -> str:
    """A step's reason as the tables name it: a plain step's is "plain", or where it starts
    or ends a run of plain steps "plain (start)" / "plain (flush)"."""
    if k:
        return why
    return f"plain ({why})" if why in ("start", "flush") else "plain"


def calibration(steps: list[dict], marks: list[dict] | None = None) -> list[str]:
    """Lines of a table of the speculative steps the policy priced (`expected_seconds`), by
    reason, drafters and whether they caught up (with `marks`, the load runs of
    `server_load.py --trace-steps`: per mode and N too): the tokens and milliseconds a step
    it expected and those the steps realised, and realised tokens per ms over expected. A
    catch-up's cost is spread over the steps it serves when choosing, so those steps realise
    more milliseconds than priced by design; elsewhere a ratio well under 1 is a policy
    that overrates the steps it takes. No lines where no step was priced (an older trace)."""
    runs = [(None, steps)] if marks is None else [(m, _inside(steps, m)) for m in marks]
    groups = defaultdict(list)
    for mark, part in runs:
        run = () if mark is None else (mark["mode"], mark["n"])
        for s in part:
            if s["num_draft"] and s.get("expected_seconds"):
                groups[(*run, s["why"], s["drafters"], bool(s["catch_up"]))].append(s)
    if not groups:
        return []
    lead = "" if marks is None else "| mode | N "
    lines = [
        f"{lead}| reason | drafters | catch-up | steps | tokens a step: expected / realised "
        "| ms a step: expected / realised | tokens per ms: realised over expected |",
        ("" if marks is None else "| --- | ---: ")
        + "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    order = sorted(groups, key=lambda k: (k[:-3], -len(groups[k])))
    for key in order:
        group = groups[key]
        n = len(group)
        tokens = sum(s["expected_tokens"] for s in group) / n, sum(s["tokens"] for s in group) / n
        ms = 1000 * sum(s["expected_seconds"] for s in group) / n, sum(s["ms"] for s in group) / n
        ratio = (tokens[1] / ms[1]) / (tokens[0] / ms[0]) if ms[1] and tokens[0] else 0.0
        *run, why, drafters, catch_up = key
        cells = "".join(f"| {c} " for c in run)
        lines.append(
            f"{cells}| {why} | {drafters} | {'yes' if catch_up else 'no'} | {n} "
            f"| {tokens[0]:.1f} / {tokens[1]:.1f} | {ms[0]:.1f} / {ms[1]:.1f} | {ratio:.2f} |"
        )
    return lines


def _inside(steps: list[dict], mark: dict) -> list[dict]:
    """The steps whose clock time falls within a marked load run."""
    return [s for s in steps if "wall" in s and mark["start"] <= s["wall"] <= mark["end"]]


def overall(steps: list[dict]) -> list[str]:
    """Tokens per millisecond of plain and speculative steps; the time between steps."""
    lines = []
    span = 1000 * (steps[-1]["t"] - steps[0]["t"]) + steps[0]["ms"]
    for name, part in (
        ("plain steps", [s for s in steps if not s["num_draft"]]),
        ("speculative steps", [s for s in steps if s["num_draft"]]),
    ):
        ms = sum(s["ms"] for s in part)
        if part:
            tokens = sum(s["tokens"] for s in part)
            lines.append(
                f"{name}: {len(part)}, {ms:.0f} ms ({100 * ms / span:.0f}% of the span), "
                f"{tokens} tokens, {tokens / ms:.2f} tokens per ms"
            )
    gaps = sum(s["gap_ms"] for s in steps)
    lines.append(
        f"between steps (prefill, joins, idle): {gaps:.0f} ms ({100 * gaps / span:.0f}% of "
        f"the {span / 1000:.2f} s from the first step to the last)"
    )
    return lines


def timeline(steps: list[dict], width: float) -> list[str]:
    """Lines of a table of `width`-second bins of the steps (by when they ended)."""
    bins = defaultdict(list)
    for s in steps:
        bins[int(s["t"] / width)].append(s)
    lines = [
        "| from (s) | steps | speculative | their ms | median plain ms (B) | between steps ms "
        "| tokens per s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for b in sorted(bins):
        part = bins[b]
        spec = [s for s in part if s["num_draft"]]
        plain = [s for s in part if not s["num_draft"]]
        ms = sum(s["ms"] + s["gap_ms"] for s in part) or 1.0
        median = (
            f"{statistics.median(s['ms'] for s in plain):.2f} "
            f"({statistics.median(s['rows'] for s in plain):g})"
            if plain
            else "-"
        )
        lines.append(
            f"| {b * width:.1f} | {len(part)} | {len(spec)} | {sum(s['ms'] for s in spec):.0f} "
            f"| {median} | {sum(s['gap_ms'] for s in part):.0f} "
            f"| {1000 * sum(s['tokens'] for s in part) / ms:.0f} |"
        )
    return lines


def load_marks(path: str) -> list[dict]:
    """The load runs of `server_load.py --trace-steps` (mode, N, repeat, start, end)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def by_run(steps: list[dict], marks: list[dict]) -> list[str]:
    """Lines of a table of the steps within each marked run, and per mode and N over its
    runs: the speculative steps' share of the run, tokens per ms of plain and speculative
    steps, the time between steps, the tail (steps of fewer rows than the run's clients),
    tokens per second. Steps need `wall` (a trace written by this release's server)."""
    groups: dict[tuple, list[list[dict]]] = defaultdict(list)
    for mark in marks:
        inside = []
        for s in _inside(steps, mark):
            since = 1000 * (s["wall"] - mark["start"]) - s["ms"]  # the run's own time
            inside.append({**s, "gap_ms": max(0.0, min(s["gap_ms"], since))})
        groups[(mark["mode"], mark["n"])].append((mark, inside))
    lines = [
        "| mode | N | runs | speculative steps' share | tokens per ms: plain / speculative "
        "| between steps | tail (fewer rows than N) | tokens per s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (mode, n), runs in groups.items():
        part = [s for _, inside in runs for s in inside]
        wall = sum(mark["end"] - mark["start"] for mark, _ in runs) * 1000 or 1.0
        spec = [s for s in part if s["num_draft"]]
        plain = [s for s in part if not s["num_draft"]]

        def rate(kind):
            ms = sum(s["ms"] for s in kind)
            return f"{sum(s['tokens'] for s in kind) / ms:.2f}" if ms else "-"

        tail = sum(s["ms"] + s["gap_ms"] for s in part if s["rows"] < n)
        lines.append(
            f"| {mode} | {n} | {len(runs)} | {100 * sum(s['ms'] for s in spec) / wall:.0f}% "
            f"| {rate(plain)} / {rate(spec)} | {100 * sum(s['gap_ms'] for s in part) / wall:.0f}% "
            f"| {100 * tail / wall:.0f}% | {1000 * sum(s['tokens'] for s in part) / wall:.0f} |"
        )
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `mlx-spec steps`."""
    p.add_argument("trace", help="a file written by `mlx-spec serve --trace-steps`")
    p.add_argument("--bins", type=float, metavar="S", help="also a timeline of S-second bins")
    p.add_argument("--top", type=int, default=15, help="kinds of step listed (default 15)")
    p.add_argument(
        "--marks",
        help="the load runs' times (default: TRACE.marks.jsonl, written by `server_load.py "
        "--trace-steps`, where it exists): also a table per mode and N",
    )
    p.add_argument("--start", type=float, default=0.0, help="steps that ended from S seconds")
    p.add_argument("--end", type=float, default=float("inf"), help="... until S seconds")


def run(args) -> int:
    """Print the summary of `args.trace`; 2 on bad input, 1 when it holds no steps."""
    if args.bins is not None and args.bins <= 0:
        print("mlx-spec steps: --bins must be > 0", file=sys.stderr)
        return 2
    if not Path(args.trace).is_file():
        print(f"mlx-spec steps: no such file: {args.trace}", file=sys.stderr)
        return 2
    steps = [s for s in load(args.trace) if args.start <= s["t"] <= args.end]
    if not steps:
        print("mlx-spec steps: no steps in that file (or stretch)", file=sys.stderr)
        return 1
    print("\n".join(overall(steps)))
    print()
    print("\n".join(by_kind(steps, args.top)))
    marks = args.marks or f"{args.trace}.marks.jsonl"
    runs = load_marks(marks) if Path(marks).is_file() else None
    priced = calibration(steps, runs)
    if priced:
        print()
        print("\n".join(priced))
    if runs is not None:
        print()
        print("\n".join(by_run(steps, runs)))
    elif args.marks:
        print(f"mlx-spec steps: no such file: {args.marks}", file=sys.stderr)
        return 2
    if args.bins:
        print()
        print("\n".join(timeline(steps, args.bins)))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mlx-spec steps", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))
