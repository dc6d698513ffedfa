"""What the vectorized exp (mlx_spec/fastmath.py) saves per pass, on and off in one process.

Times the embedded target's pass over B rows x S tokens each (a batch's plain step: S = 1; a
verifying pass of S - 1 drafts: S > 1) and the MTP head's drafting pass, against a batch cache
of `--context` tokens per row, with MLX's own exp and with the fast one, interleaved (A, B, A,
B, ...) so that the machine's drift falls on both; medians of `--repeats` timings each.

    python benchmarks/fast_math.py --json benchmarks/results/fast_math.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx_spec  # first: loads the optimized BLAS before anything imports mlx
from mlx_spec import fastmath
from mlx_spec.batch_cache import BatchCache
from mlx_spec.bench import machine_info
from mlx_spec.blas_threads import BlasThreads
from mlx_spec.embedded import converted_pair

import mlx.core as mx


def _timer(model, rows: int, context: int, hidden: int | None):
    """A function timing one pass of `tokens` per row (the cache cut back after each)."""
    cache = BatchCache(model, rows)
    cache.begin([context] * rows)
    ids = mx.random.randint(0, 4000, (rows, context)).astype(mx.uint32)
    extra = {} if hidden is None else {"hidden": mx.random.normal((rows, context, hidden))}
    model(ids, cache=cache.layers, **extra)
    cache.end([context] * rows)
    mx.eval(cache.state)

    def once(tokens: int) -> float:
        x = mx.random.randint(0, 4000, (rows, tokens)).astype(mx.uint32)
        kw = {} if hidden is None else {"hidden": mx.random.normal((rows, tokens, hidden))}
        mx.eval(x, *kw.values())
        tic = time.perf_counter()
        cache.begin([tokens] * rows)
        out = model(x, cache=cache.layers, **kw)
        cache.end([tokens] * rows)
        mx.eval(out)
        seconds = time.perf_counter() - tic
        cache.truncate([context] * rows)
        cache.compact()
        mx.eval(cache.state)
        return seconds

    return once


def measure(once, tokens: int, repeats: int, threads: BlasThreads | None, rows: int) -> dict:
    if threads is not None:
        threads.use(rows * tokens)
    for _ in range(3):
        once(tokens)
        with fastmath.disabled():
            once(tokens)
    fast, slow = [], []
    for _ in range(repeats):
        with fastmath.disabled():
            slow.append(once(tokens))
        fast.append(once(tokens))
    a, b = statistics.median(slow) * 1e3, statistics.median(fast) * 1e3
    return {"mlx_exp_ms": round(a, 3), "fast_exp_ms": round(b, 3), "speedup": round(a / b, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 6])
    p.add_argument("--context", type=int, default=150, help="tokens per row in the cache")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not fastmath.install():
        print("the fast exp is not installed here (Linux only; MLX_SPEC_FAST_MATH=0?)")
        return 1
    target_dir, _ = converted_pair()
    model, _ = mlx_spec.load(str(target_dir))
    head = mlx_spec.load_mtp_drafter(str(target_dir), model).module
    threads = BlasThreads.calibrate(model)
    results = []
    for name, module, hidden in (("target", model, None), ("mtp head", head, 384)):
        for rows in args.rows:
            once = _timer(module, rows, args.context, hidden)
            for tokens in args.tokens if name == "target" else [1]:
                row = {"model": name, "rows": rows, "tokens_per_row": tokens}
                row.update(measure(once, tokens, args.repeats, threads, rows))
                results.append(row)
                print(
                    f"{name:9s} B={rows} S={tokens}: MLX exp {row['mlx_exp_ms']:7.2f} ms   "
                    f"fast exp {row['fast_exp_ms']:7.2f} ms   {row['speedup']:.2f}x",
                    flush=True,
                )
    if args.json:
        record = {
            "command": " ".join(["fast_math.py", *(argv or sys.argv[1:])]),
            **machine_info(),
            "context": args.context,
            "repeats": args.repeats,
            "results": results,
        }
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
