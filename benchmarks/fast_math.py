"""What mlx-spec's CPU fast paths save per pass, each on and off in one process.

`--part exp` (default): the vectorized exp (mlx_spec/platform/fastmath.py); `--part ops`: RoPE
and RMSNorm in fewer, fused ops (mlx_spec/platform/fused.py); `--part layout`: linear weights
stored column-major (mlx_spec/platform/weight_layout.py) against a second copy of the model
stored as loaded.
Times the embedded target's pass over B rows x S tokens each (a batch's plain step: S = 1; a
verifying pass of S - 1 drafts: S > 1) and the MTP head's drafting pass, against a batch cache
of `--context` tokens per row, without and with the fast path, interleaved (A, B, A, B, ...)
so that the machine's drift falls on both; medians of `--repeats` timings each. The other
fast paths stay on.

    python benchmarks/fast_math.py --json benchmarks/results/fast_math.json
    python benchmarks/fast_math.py --part ops --json benchmarks/results/fused_ops.json
    python benchmarks/fast_math.py --part layout --json benchmarks/results/weight_layout.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx_spec  # first: loads the optimized BLAS before anything imports mlx
from mlx_spec.bench.harness import machine_info
from mlx_spec.caches.batch import BatchCache
from mlx_spec.embedded import converted_pair
from mlx_spec.platform import fastmath, fused, weight_layout
from mlx_spec.platform.blas_threads import BlasThreads

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


PARTS = {  # part: (name of MLX's own, name of the fast path)
    "exp": ("MLX exp", "fast exp"),
    "ops": ("MLX ops", "fused ops"),
    "layout": ("row-major", "column-major"),
}


def _key(label: str) -> str:
    return label.lower().replace(" ", "_").replace("-", "_") + "_ms"


def _switched_off(once, module):
    def off(tokens: int) -> float:
        with module.disabled():
            return once(tokens)

    return off


def measure(slow, fast, tokens: int, repeats: int, threads, rows: int, part: str) -> dict:
    """Interleaved timings of `slow` (MLX's own) and `fast` (the fast path)."""
    off, on = PARTS[part]
    if threads is not None:
        threads.use(rows * tokens)
    for _ in range(3):
        fast(tokens)
        slow(tokens)
    a, b = [], []
    for _ in range(repeats):
        a.append(slow(tokens))
        b.append(fast(tokens))
    a, b = statistics.median(a) * 1e3, statistics.median(b) * 1e3
    return {_key(off): round(a, 3), _key(on): round(b, 3), "speedup": round(a / b, 3)}


def _load(target_dir, layout: str | None = None):
    """The target and its MTP head, its weights in the layout the loader picks (None), as
    stored ("0") or column-major ("column")."""
    before = os.environ.get(weight_layout.ENV)
    if layout is not None:
        os.environ[weight_layout.ENV] = layout
    try:
        model, _ = mlx_spec.load(str(target_dir))
        head = mlx_spec.load_mtp_drafter(str(target_dir), model).module
    finally:
        if before is None:
            os.environ.pop(weight_layout.ENV, None)
        else:
            os.environ[weight_layout.ENV] = before
    return model, head


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 6])
    p.add_argument("--context", type=int, default=150, help="tokens per row in the cache")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--part", choices=list(PARTS), default="exp", help="which fast path (exp)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    off, on = PARTS[args.part]
    switch = {"exp": fastmath, "ops": fused}.get(args.part)
    if switch is not None and not switch.install():
        print(f"the {on} path is not installed here (Linux only; {switch.ENV}=0?)")
        return 1
    if switch is None and not weight_layout.enabled():
        print(f"the weights stay as stored here (not the CPU, or {weight_layout.ENV}=0)")
        return 1
    target_dir, _ = converted_pair()
    model, head = _load(target_dir, "column" if switch is None else None)
    twin, twin_head = _load(target_dir, "0") if switch is None else (None, None)
    threads = BlasThreads.calibrate(model)
    results = []
    for name, fast_module, slow_module, hidden in (
        ("target", model, twin, None),
        ("mtp head", head, twin_head, 384),
    ):
        for rows in args.rows:
            fast = _timer(fast_module, rows, args.context, hidden)
            if switch is None:
                slow = _timer(slow_module, rows, args.context, hidden)
            else:
                slow = _switched_off(fast, switch)
            for tokens in args.tokens if name == "target" else [1]:
                row = {"model": name, "rows": rows, "tokens_per_row": tokens}
                row.update(measure(slow, fast, tokens, args.repeats, threads, rows, args.part))
                results.append(row)
                print(
                    f"{name:9s} B={rows} S={tokens}: {off} {row[_key(off)]:7.2f} ms   "
                    f"{on} {row[_key(on)]:7.2f} ms   {row['speedup']:.2f}x",
                    flush=True,
                )
    if args.json:
        record = {
            "command": " ".join(["fast_math.py", *(argv or sys.argv[1:])]),
            **machine_info(),
            "part": args.part,
            "context": args.context,
            "repeats": args.repeats,
            "results": results,
        }
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
