"""What a verifying pass costs at lengths the backend has not seen: MLX's attention against
short-query attention (`mlx_spec/platform/short_attention.py`).

A target pass of W tokens over a cache of L tokens, repeated with L one token longer each
time (the cache cut back by W - 1 after each pass, as a round that accepted nothing leaves
it), so that every pass meets a (queries, keys) shape it has not met before; then the same
lengths again (shapes already met). Milliseconds per pass, median of the passes, for W = 1
(a plain step) and the verifying widths, with MLX's own attention and with short-query
attention (on a backend where it is not on, `--force` routes it there anyway). On MLX's CUDA
backend a multi-query attention builds a kernel per shape: the first column shows it.

With `--prefill`, the same for prompts: a prompt of a length not seen before prefilled in one
pass into an empty cache (ms per prompt, median over `--passes` lengths from 40 to ~700
tokens), then the same lengths again, with MLX's attention, short-query attention for verifying
passes only (`short_only()`: prompt chunks to MLX's), and prompt chunks routed too (up to
`short_attention.MAX_SCORES` scores).

Run: `python benchmarks/attention_shapes.py --widths 1 2 3 5 9 --rows 1 8`
     `python benchmarks/attention_shapes.py --prefill --rows 1`
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import mlx_spec  # first: loads the optimized BLAS before anything imports mlx
from mlx_spec.bench.harness import machine_info
from mlx_spec.embedded import converted_pair
from mlx_spec.platform import short_attention

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def pass_ms(model, rows: int, width: int, passes: int, start: int) -> tuple[float, float]:
    """(median ms of passes at new lengths, median ms of the same lengths again)."""
    out = []
    for _ in range(2):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.ones((rows, start), dtype=mx.int32), cache=cache))
        times = []
        for _ in range(passes):
            x = mx.full((rows, width), 7, dtype=mx.int32)
            tic = time.perf_counter()
            mx.eval(model(x, cache=cache))
            times.append((time.perf_counter() - tic) * 1e3)
            if width > 1:
                for c in cache:
                    c.trim(width - 1)
        out.append(statistics.median(times))
    return out[0], out[1]


def prefill_ms(model, rows: int, lengths: list[int]) -> tuple[float, float]:
    """(median ms of a prompt's prefill at lengths new to the backend, at the same again)."""
    out = []
    for _ in range(2):
        times = []
        for length in lengths:
            cache = make_prompt_cache(model)
            x = mx.full((rows, length), 7, dtype=mx.int32)
            tic = time.perf_counter()
            mx.eval(model(x, cache=cache))
            times.append((time.perf_counter() - tic) * 1e3)
        out.append(statistics.median(times))
    return out[0], out[1]


def prefill_rows(model, args) -> list[dict]:
    modes = {
        "mlx": short_attention.disabled,
        "short_only": short_attention.short_only,
        "routed": contextlib.nullcontext,
    }
    if args.force:
        modes["routed"] = short_attention.forced
    results, shift = [], 0
    for rows in args.rows:
        row = {"rows": rows, "prefill": True}
        for name, context in modes.items():
            # 40 .. ~700 tokens, new lengths for every mode (a length seen is a shape built)
            lengths = [40 + 67 * i + shift for i in range(args.passes)]
            shift += 1
            with context():
                new, seen = prefill_ms(model, rows, lengths)
            row[f"{name}_new_ms"], row[f"{name}_seen_ms"] = new, seen
        results.append(row)
        print(
            f"B={rows:<2} prefill  "
            + "   ".join(
                f"{name}: {row[f'{name}_new_ms']:6.1f} ms new / {row[f'{name}_seen_ms']:6.1f} seen"
                for name in modes
            ),
            flush=True,
        )
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--passes", type=int, default=10)
    p.add_argument("--force", action="store_true", help="short-query attention on any device")
    p.add_argument("--prefill", action="store_true", help="prompts' prefill instead of passes")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    model, _ = mlx_spec.load(str(converted_pair()[0]))
    start = 100
    results = prefill_rows(model, args) if args.prefill else []
    for rows in [] if args.prefill else args.rows:
        for width in args.widths:
            row = {"rows": rows, "width": width}
            for name in ("mlx", "short"):
                if name == "mlx":
                    context = short_attention.disabled()
                elif args.force:
                    context = short_attention.forced()
                else:
                    context = contextlib.nullcontext()
                with context:
                    new, seen = pass_ms(model, rows, width, args.passes, start)
                start += args.passes + 1  # the next lengths are new to the backend
                row[f"{name}_new_ms"], row[f"{name}_seen_ms"] = new, seen
            results.append(row)
            print(
                f"B={rows:<2} W={width:<2}  MLX's attention: {row['mlx_new_ms']:6.1f} ms at new "
                f"lengths, {row['mlx_seen_ms']:6.1f} at lengths seen   short-query: "
                f"{row['short_new_ms']:6.1f} / {row['short_seen_ms']:6.1f}",
                flush=True,
            )
    if args.json:
        record = {"command": " ".join(["attention_shapes.py", *(argv or sys.argv[1:])])}
        record.update(machine_info(), device=str(mx.default_device()), results=results)
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
