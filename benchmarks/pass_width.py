"""What a wider target pass costs: the price of verifying drafts inside a batch.

A batch of B rows, each holding a `--context`-token prefix, runs one pass over n tokens per row
(n = 1: a plain step; n = K + 1: verifying K drafts); the median seconds of `--reps` passes
are printed for every n, through mlx-spec's `BatchCache` and through mlx-lm's `KVCache` (the
same model, the same rows). Where a pass of K + 1 tokens costs about what a pass of one does
(memory-bound: a Mac, a GPU), speculation inside a batch pays; where it costs K + 1 times as
much (compute-bound), it cannot.

Examples:
    python benchmarks/pass_width.py                  # the embedded pair's target, B = 8
    python benchmarks/pass_width.py --rows 1 4 8 --widths 1 2 4 8 --model ./target
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx_spec  # first: loads the optimized BLAS before anything imports mlx
from mlx_spec.batch_cache import BatchCache

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def ours(model, prefix: mx.array, n: int, reps: int) -> float:
    """Median seconds of a pass over n tokens per row through a `BatchCache`."""
    b, length = prefix.shape
    cache = BatchCache(model, b)
    cache.begin([length] * b)
    model(prefix, cache=cache.layers)
    cache.end([length] * b)
    mx.eval(cache.state)
    tokens = mx.zeros((b, n), mx.uint32)
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        cache.begin([n] * b)
        logits = model(tokens, cache=cache.layers)
        cache.end([n] * b)
        mx.eval(logits)
        times.append(time.perf_counter() - tic)
        cache.truncate([x - n for x in cache.lengths])
        cache.compact()
        mx.eval(cache.state)
    return statistics.median(times)


def theirs(model, prefix: mx.array, n: int, reps: int) -> float:
    """The same through mlx-lm's `KVCache` (rows of equal length)."""
    cache = make_prompt_cache(model)
    model(prefix, cache=cache)
    mx.eval([c.state for c in cache])
    tokens = mx.zeros((prefix.shape[0], n), mx.uint32)
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(model(tokens, cache=cache))
        times.append(time.perf_counter() - tic)
        for c in cache:
            c.trim(n)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="target MLX directory (default: the embedded pair's target)")
    p.add_argument("--rows", type=int, nargs="+", default=[8], help="batch sizes B")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 8], help="tokens n")
    p.add_argument("--context", type=int, default=100, help="prefix tokens per row")
    p.add_argument("--reps", type=int, default=40, help="passes per measurement (median)")
    args = p.parse_args(argv)
    if args.model is None:
        from mlx_spec.embedded import converted_pair

        args.model = str(converted_pair()[0])
    model, _ = mlx_spec.load(args.model)
    print(f"{args.model}, {mx.default_device()}, context {args.context}: ms per pass")
    for b in args.rows:
        prefix = mx.random.randint(0, 1000, (b, args.context)).astype(mx.uint32)
        for name, fn in (("BatchCache", ours), ("mlx-lm KVCache", theirs)):
            cells = []
            for n in args.widths:
                fn(model, prefix, n, 3)  # warm-up
                cells.append(f"n={n}: {1000 * fn(model, prefix, n, args.reps):.1f}")
            print(f"B={b:<2} {name:>14}  " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
