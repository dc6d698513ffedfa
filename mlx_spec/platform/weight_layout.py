"""Linear weights stored column-major on the CPU, where the BLAS reads them faster.

`nn.Linear` computes `x @ weight.T`. With the weight stored as loaded (row-major `[out, in]`),
MLX hands OpenBLAS a transposed operand; stored column-major (the same logical array, its
transpose's memory), `weight.T` is row-major and the product runs untransposed. On a 2-core
x86 CPU, OpenBLAS 0.3.21, the untransposed product of a decoding pass's few rows was faster
at every width measured and never slower (one thread: 13-25% for 1-16 rows, 2% at 256; two
threads: 2-15%; the demo target's MLP and head shapes); the values are the same, only the
order of the BLAS's sums differs (last-bit differences, as between any two BLAS kernels).

`column_major(module)` rewrites every floating-point `nn.Linear` weight of `module` that way,
one at a time (one weight's copy at a time in memory), when the default device is the CPU and
`MLX_SPEC_WEIGHT_LAYOUT` is not 0. Embeddings stay row-major (their lookups read rows), and so
do quantized layers (MLX's own kernels). Anything that reads the weights (saving, slicing,
training) sees the same values. The loaders call it after casting to float32 (a later cast
makes the copy row-major again: it is only a layout).

Which layout is faster depends on the machine: on another 2-core x86 CPU (a Xeon with a large
shared L3, the same OpenBLAS) whole passes of the demo target ran 1-6% faster with the weights
as loaded, at every width measured (`benchmarks/fast_math.py --part layout`). So the first
model `mlx_spec.load` loads in a process is timed both ways (`decide`: passes of 8 rows x 4
tokens, interleaved, each layout's median) and the faster layout is kept for every model and
drafter loaded after it (a tie within 1%: column-major). Rewriting the weights wants a second
round to agree: a single round at start-up picked column-major in 1 of 8 processes on the
second machine, where it was 4-7% slower at 8 rows. Models too small for the
timing to mean anything (under 4 MiB of linear weights, such as the tests') and too large to
hold twice for it (over 2 GiB) are not timed: column-major. `MLX_SPEC_WEIGHT_LAYOUT=0` keeps
the weights as loaded, `=column` rewrites them without timing.
"""

from __future__ import annotations

import os
import statistics
import time

from mlx_spec.platform.fastmath import env_allows

import mlx.core as mx
import mlx.nn as nn

ENV = "MLX_SPEC_WEIGHT_LAYOUT"  # 0: keep the weights as loaded; column: no timing
MIN_TIMED, MAX_TIMED = 4 << 20, 2 << 30  # bytes of linear weights a timed model holds
PASS_LIMIT = 0.25  # seconds: a model whose pass takes longer is not timed
ROUNDS = 7

_decision: dict[str, str | None] = {"layout": None}  # "column" or "row", once timed


def enabled() -> bool:
    if mx.default_device().type != mx.cpu or not env_allows(ENV):
        return False
    return _decision["layout"] != "row" or _pinned()


def _pinned() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "column")


def _linears(module: nn.Module) -> list[nn.Linear]:
    return [
        layer
        for _, layer in module.named_modules()
        if isinstance(layer, nn.Linear)
        and "weight" in layer
        and layer["weight"].ndim == 2
        and mx.issubdtype(layer["weight"].dtype, mx.floating)
    ]


def decide(model: nn.Module) -> str | None:
    """Time `model` with its weights as loaded and column-major (see the module's docstring),
    once per process; the layout kept ("column" or "row"), or None where nothing was timed."""
    if _decision["layout"] is not None or not env_allows(ENV) or _pinned():
        return _decision["layout"]
    if mx.default_device().type != mx.cpu:
        return None
    layers = _linears(model)
    size = sum(layer["weight"].nbytes for layer in {id(x["weight"]): x for x in layers}.values())
    if not MIN_TIMED <= size <= MAX_TIMED:
        return None
    try:
        row, column = _measure(model, layers)
        if row is not None and not _row_faster(row, column):
            # A change of layout wants a second round to agree (one round of a process's
            # first seconds, the machine still busy loading, can read either way).
            row, column = _measure(model, layers)
    except Exception:  # a model that cannot run without its cache: not timed
        return None
    if row is None:
        return None
    _decision["layout"] = "row" if _row_faster(row, column) else "column"
    return _decision["layout"]


def _row_faster(row: float, column: float) -> bool:
    """Whether passes with the weights as loaded took `row` seconds, clearly under the
    column-major `column` (a tie within 1% goes to column-major)."""
    return row < 0.99 * column


def _measure(model: nn.Module, layers: list[nn.Linear]) -> tuple[float | None, float]:
    """Seconds of a pass (no cache) with the weights as loaded and column-major: each
    layout's median over `ROUNDS` interleaved rounds. (None, 0) where one pass takes longer
    than `PASS_LIMIT`. The weights are left as loaded."""
    stored = [layer["weight"] for layer in layers]
    copies: dict[int, mx.array] = {}
    for weight in stored:
        if id(weight) not in copies:
            copies[id(weight)] = mx.contiguous(weight.T).T
    mx.eval(list(copies.values()))
    layouts = {"row": stored, "column": [copies[id(w)] for w in stored]}
    # One width: 8 rows of 4 tokens (a batch verifying 3 drafts a row). Adding passes of 1 and
    # 8 tokens made the choice noisier, not better (on the demo target the ratio of 5 timings
    # each: 8 x 4 alone 0.92-0.95, with them 0.97-1.02).
    ids = mx.zeros((8, 4), mx.int32)
    times: dict[str, list[float]] = {name: [] for name in layouts}

    def run(name: str) -> float:
        for layer, weight in zip(layers, layouts[name], strict=True):
            layer["weight"] = weight
        tic = time.perf_counter()
        mx.eval(model(ids))
        return time.perf_counter() - tic

    try:
        if any(run(name) > PASS_LIMIT for name in layouts):  # warm-up (and the limit)
            return None, 0.0
        for r in range(ROUNDS):
            for name in ("row", "column") if r % 2 else ("column", "row"):
                times[name].append(run(name))
    finally:
        for layer, weight in zip(layers, stored, strict=True):
            layer["weight"] = weight
    return statistics.median(times["row"]), statistics.median(times["column"])


def column_major(module: nn.Module) -> int:
    """Store `module`'s linear weights column-major (see the module's docstring); returns how
    many were rewritten."""
    if not enabled():
        return 0
    done: dict[int, tuple[mx.array, mx.array]] = {}  # id(old) -> (old, new): tied weights
    for layer in _linears(module):
        weight = layer["weight"]
        if id(weight) not in done:
            new = mx.contiguous(weight.T).T  # no copy when it is column-major already
            mx.eval(new)
            done[id(weight)] = (weight, new)  # the old one kept alive: its id stays its own
        layer["weight"] = done[id(weight)][1]
    return len(done)
