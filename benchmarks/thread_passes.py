"""Whole target passes on one BLAS thread and on all of them, and what start-up timings pick.

`mlx_spec.platform.blas_threads` picks a thread count per pass width from timings of the target's
MLP matmul pair, once per process. This checks the pick against what it stands for: a pass of the
target over B rows x n tokens (rows holding `--context` tokens), timed with one thread and
with every thread, interleaved in rounds (medians, ms); then `--processes` fresh processes each
load the target (which times the weights' layout, `mlx_spec.platform.weight_layout`) and
calibrate, as the engine does when it starts, and the layout each kept and the widths each gave
one thread
are printed. A width given one thread where two run its passes faster, or the slower layout,
costs every pass the difference for the whole life of the process.

Examples:
    python benchmarks/thread_passes.py
    python benchmarks/thread_passes.py --shapes 1x1 1x2 8x1 8x2 --processes 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import mlx_spec  # first: loads the optimized BLAS before anything imports mlx
from mlx_spec.platform import blas_threads

import mlx.core as mx
from pass_width import ours  # a timer of BatchCache passes, rolled back in place

SHAPES = ["1x1", "1x2", "1x3", "1x4", "2x1", "4x1", "8x1", "8x2", "8x3"]

# Run in each fresh process: load the target (the layout is timed), calibrate, print the layout
# kept and the widths given one thread.
CALIBRATE = """
import json, sys
import mlx_spec
from mlx_spec.platform import blas_threads, weight_layout
model, _ = mlx_spec.load(sys.argv[1])
plan = blas_threads.BlasThreads.calibrate(model)
widths = None if plan is None else sorted(plan.best)
print(json.dumps({"layout": weight_layout._decision["layout"], "one_thread": widths}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="target MLX directory (default: the embedded pair's target)")
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="BxN: rows x tokens per row")
    p.add_argument("--context", type=int, default=100, help="tokens each row holds")
    p.add_argument("--rounds", type=int, default=6, help="rounds over every shape and count")
    p.add_argument("--reps", type=int, default=5, help="passes per shape and count per round")
    p.add_argument("--processes", type=int, default=10, help="fresh processes that calibrate")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.model is None:
        from mlx_spec.embedded import converted_pair

        args.model = str(converted_pair()[0])
    functions = blas_threads._openblas()
    if functions is None or mx.default_device() != mx.cpu:
        print("nothing to compare: no OpenBLAS behind MLX's CPU matmuls, or not on the CPU")
        return 1
    most, setter = functions
    model, _ = mlx_spec.load(args.model)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    timers = {}
    for rows, width in shapes:
        prefix = mx.random.randint(0, 1000, (rows, args.context)).astype(mx.uint32)
        timers[rows, width] = ours(model, prefix, width)
    times: dict[tuple, list[float]] = {(s, t): [] for s in shapes for t in (1, most)}
    for _ in range(args.rounds):
        for shape, run in timers.items():
            for threads in (1, most):
                setter(threads)
                times[shape, threads] += run(args.reps)
    setter(most)
    print(f"{blas_threads._blas.describe()}; {mx.default_device()}; context {args.context}")
    rows = []
    for shape in shapes:
        one = statistics.median(times[shape, 1]) * 1e3
        every = statistics.median(times[shape, most]) * 1e3
        rows.append({"rows": shape[0], "tokens": shape[1], "one_thread_ms": one,
                     "all_threads_ms": every, "ratio": one / every})  # fmt: skip
        print(
            f"B={shape[0]} n={shape[1]} (width {shape[0] * shape[1]:2d}): 1 thread {one:6.2f} ms,"
            f" {most} threads {every:6.2f} ms, ratio {one / every:4.2f}"
        )
    picks = []
    for _ in range(args.processes):
        out = subprocess.run(
            [sys.executable, "-c", CALIBRATE, args.model],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        picks.append(json.loads(out.stdout.strip().splitlines()[-1]))
    widths = [pick["one_thread"] for pick in picks]
    layouts = [pick["layout"] for pick in picks]
    given = sum(1 for w in widths if w)
    print(f"{args.processes} fresh processes: widths given one thread {widths}; layouts {layouts}")
    print(f"processes that gave any width one thread: {given} of {args.processes}")
    for layout in sorted(set(layouts), key=str):
        print(f"processes that kept the layout {layout}: {layouts.count(layout)}")
    if args.json:
        record = {
            "command": "thread_passes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "blas": blas_threads._blas.describe(), "mlx": mx.__version__,
            "context": args.context, "passes": rows, "calibrations": picks,
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
