"""What a batched plain step costs as its cache widens: the attention's share of a step.

Every pass of a batch attends over the columns its cache has in use, the same for every row:
the longest row's tokens (rows out of step: one near its end beside one just joined). This
times pipelined plain steps of B rows of the embedded pair's target (float32) over caches of
each width, so that what a column costs can be set against what rows out of step add
(`batch_engine.py --trace` prints the columns in use and the tokens the rows hold).

Example:
    python benchmarks/attention_width.py --rows 8 --widths 16 80 112 160 200 300
"""

from __future__ import annotations

import argparse
import json
import time

import mlx_spec  # first: loads the optimized BLAS before anything imports mlx
from mlx_spec.batch_cache import BatchCache
from mlx_spec.bench import machine_info
from mlx_spec.blas_threads import BlasThreads

import mlx.core as mx


def step_ms(model, rows: int, width: int, steps: int, threads) -> float:
    """Milliseconds per pipelined plain step of `rows` rows over a cache of `width` tokens."""
    cache = BatchCache(model, rows)
    cache.begin([width] * rows)
    model(mx.zeros((rows, width), mx.uint32), cache=cache.layers)
    cache.end([width] * rows)
    mx.eval(cache.state)
    if threads is not None:
        threads.use(rows)

    def launch() -> mx.array:
        cache.begin([1] * rows)
        out = model(mx.zeros((rows, 1), mx.uint32), cache=cache.layers)[:, 0].argmax(-1)
        cache.end([1] * rows)
        mx.async_eval(out)
        return out

    for _ in range(3):
        launch().tolist()
    cache.truncate([width] * rows)
    last = launch()
    tic = time.perf_counter()
    for _ in range(steps):
        nxt = launch()
        last.tolist()
        last = nxt
        cache.truncate([width] * rows)  # every step over the same width
    last.tolist()
    return (time.perf_counter() - tic) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--widths", type=int, nargs="+", default=[16, 80, 112, 160, 200, 300])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    from mlx_spec.embedded import converted_pair

    target_dir, _ = converted_pair()
    model, _ = mlx_spec.load(str(target_dir))
    threads = BlasThreads.calibrate(model)
    times: dict[int, list[float]] = {w: [] for w in args.widths}
    for _ in range(args.repeats):  # interleaved: the machine drifts
        for width in args.widths:
            times[width].append(step_ms(model, args.rows, width, args.steps, threads))
    results = []
    for width in args.widths:
        ms = min(times[width])
        results.append({"columns": width, "step_ms": round(ms, 2)})
        print(f"B={args.rows} over {width:4d} columns: {ms:6.2f} ms a step")
    if args.json:
        out = {**machine_info(), "rows": args.rows, "results": results}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
