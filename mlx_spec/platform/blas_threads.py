"""BLAS threads per pass width, measured on the model's own matmul shapes.

On a CPU, MLX's float32 matmuls run in the BLAS (OpenBLAS on Linux, see `blas.py`), and OpenBLAS
splits every product over all its threads. For the skinny products of decoding (a few tokens
times a weight matrix) that split can cost more than it saves, and how much depends on the
width and the machine in a way no rule of thumb predicts: on one 2-core x86 machine, a pass
over 4, 8, 12 or 24 tokens ran 0.59-0.93x as long on one thread as on two, one over 16 or 32
tokens about 1.5x longer (the split only pays when it falls on the kernel's own blocks); on
another, two threads ran every width 1.2-1.6x faster. A long prompt chunk wants every
thread. A batch of 8 rows decoding plainly is a pass over 8 tokens; verifying one draft each
makes it 16.

`BlasThreads.calibrate(model)` times the model's largest matmul pair (its MLP, by weight mass)
at every width from 1 to `MAX_WIDTH` tokens with one thread and with all of them, interleaved,
once per process and shape; `use(tokens)` then sets the count before a pass. Wider passes use
every thread. A width gets one thread only on strong evidence (`_measure`): a wrong one costs
far more than it can gain (a pass on one thread where two ran it 1.2-1.4x faster), and a
single round of timings at start-up, with the machine still busy loading, picked one thread
for widths where two were faster in most processes (12 of 16 on one machine). Nothing is
tuned (calibrate returns None) on a GPU, without OpenBLAS, on one core, or for quantized
weights (their matmuls are MLX's own kernels). `MLX_SPEC_BLAS_THREADS=all` turns it off;
`=1` (or any count) pins one count.
"""

from __future__ import annotations

import ctypes
import functools
import os
import statistics
import time
from collections import Counter

from mlx_spec.platform import blas

import mlx.core as mx
import mlx.nn as nn

ENV = "MLX_SPEC_BLAS_THREADS"
MAX_WIDTH = 80  # widths above this are prefill chunks: every thread
REPEATS = 5  # interleaved pairs of runs per width in the first round
# One thread is kept for a width where, in the first round, its median time was under MARGIN
# of all threads' and, in a second round of CONFIRM more interleaved pairs, it again was and it
# won at least AGREE of the pairs (it also leaves the other cores to the host, which builds the
# next pass while this one runs). On a machine where one thread gained, it did so at time
# ratios of 0.59-0.93; a single round at ratios near 1 flipped from run to run.
MARGIN = 0.95
CONFIRM = 9
AGREE = 7

_calibrated: dict[tuple, dict[int, int]] = {}  # (shapes, threads) -> {width: threads}
# The count last set through each setter: the library's setting is one for the process, however
# many engines use it (None: not known, the next `use` sets it).
_current: dict[int, tuple] = {}  # id(setter) -> (setter, count)


def _now(setter) -> int | None:
    held = _current.get(id(setter))
    return held[1] if held is not None and held[0] is setter else None


@functools.cache
def _openblas():
    """(threads, set) of the OpenBLAS that serves MLX's cblas_sgemm, or None: `threads` is its
    own count, read once, before anything here set one."""
    provider = blas.provider_of(b"cblas_sgemm")
    if provider is None or "openblas" not in os.path.basename(provider).lower():
        return None
    try:
        lib = ctypes.CDLL(provider)
        return int(lib.openblas_get_num_threads()), lib.openblas_set_num_threads
    except (OSError, AttributeError):
        return None


def _shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The two float weight shapes of `nn.Linear`s holding the most weights in all (a
    transformer's MLP pair), largest first; [] when there are none (quantized, or none)."""
    mass: Counter = Counter()
    for _, module in model.named_modules():
        if type(module) is nn.Linear and mx.issubdtype(module.weight.dtype, mx.floating):
            shape = tuple(module.weight.shape)
            mass[shape] += shape[0] * shape[1]
    return [shape for shape, _ in mass.most_common(2)]


class BlasThreads:
    """The BLAS thread count for each pass width (tokens in the pass); see the module."""

    def __init__(self, best: dict[int, int], most: int, setter):
        self.best, self.most, self._set = best, most, setter

    @classmethod
    def calibrate(cls, model: nn.Module) -> BlasThreads | None:
        """Measure the model's matmuls (once per process and shapes); None if nothing to tune."""
        choice = os.environ.get(ENV, "").strip().lower()
        if choice == "all" or mx.default_device() != mx.cpu:
            return None
        functions = _openblas()
        if functions is None:
            return None
        most, setter = functions
        if choice.isdigit() and int(choice) >= 1:
            return cls({}, int(choice), setter)
        shapes = _shapes(model)
        if most < 2 or not shapes:
            return None
        key = (tuple(shapes), most)
        if key not in _calibrated:
            _calibrated[key] = _measure(shapes, most, setter)
        setter(most)
        _current[id(setter)] = (setter, most)
        return cls(_calibrated[key], most, setter)

    def use(self, tokens: int) -> None:
        """Set the thread count for a pass over `tokens` tokens (rows times width)."""
        want = self.best.get(tokens, self.most)
        if want != _now(self._set):
            self._set(want)
            _current[id(self._set)] = (self._set, want)

    def reset(self) -> None:
        """Every thread again (the library's own default)."""
        self.use(MAX_WIDTH + 1)


def _measure(shapes, most: int, setter) -> dict[int, int]:
    """{width: 1} for the widths where one thread ran clearly faster than `most`, in a first
    round over every width and again in a second, longer one over those it picked."""
    _, second = _rounds(shapes, most, setter)
    return {width: 1 for width, pairs in second.items() if _pick(pairs, most, AGREE) == 1}


def _rounds(shapes, most: int, setter) -> tuple[dict, dict]:
    """The timings of the first round (every width) and of the second (the widths the first
    gave one thread), as `_timings` returns them."""
    first = _timings(shapes, most, setter, range(1, MAX_WIDTH + 1), REPEATS)
    picked = [width for width, pairs in first.items() if _pick(pairs, most) == 1]
    return first, _timings(shapes, most, setter, picked, CONFIRM)


def _pick(pairs: list[tuple[float, float]], most: int, agree: int = 0) -> int:
    """The thread count for a width whose interleaved runs took `pairs` (seconds on one
    thread, on `most`): one where its median is under MARGIN of the other's and it won at
    least `agree` of the pairs."""
    one = statistics.median(a for a, _ in pairs)
    every = statistics.median(b for _, b in pairs)
    wins = sum(a < b for a, b in pairs)
    return 1 if one < MARGIN * every and wins >= agree else most


def _timings(shapes, most: int, setter, widths, repeats: int) -> dict[int, list]:
    """{width: [(seconds on one thread, on `most`), ...]}: `repeats` interleaved runs of the
    matmul pair over each of `widths` tokens."""
    weights = [mx.random.normal(shape) * 0.02 for shape in shapes]
    if len(weights) == 2 and weights[0].shape[0] != weights[1].shape[1]:
        weights = weights[:1]
    mx.eval(weights)

    def run(x):
        for w in weights:
            x = x @ w.T
        return x

    out = {}
    for width in widths:
        x = mx.random.normal((width, weights[0].shape[1]))
        mx.eval(x)
        pairs = []
        for _ in range(repeats):
            pair = {}
            for threads in (1, most):
                setter(threads)
                tic = time.perf_counter()
                mx.eval(run(x))
                pair[threads] = time.perf_counter() - tic
            pairs.append((pair[1], pair[most]))
        out[width] = pairs
    setter(most)
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the measurement for a model (default: the embedded pair's target)."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m mlx_spec.platform.blas_threads",
        description="Time a model's MLP matmul pair at every pass width on one BLAS thread "
        "and on all of them (what the batch engine measures when it starts).",
    )
    p.add_argument("--model", help="MLX model directory (default: the embedded demo target)")
    args = p.parse_args(argv)
    from mlx_spec import load
    from mlx_spec.embedded import converted_pair

    model, _ = load(args.model or str(converted_pair()[0]))
    functions = _openblas()
    if functions is None or mx.default_device() != mx.cpu:
        print("nothing to tune: no OpenBLAS behind MLX's CPU matmuls, or not on the CPU")
        return 1
    most, setter = functions
    shapes = _shapes(model)
    print(f"{blas.describe()}; {most} threads; matmul pair {shapes}")
    first, second = _rounds(shapes, most, setter)
    for width, pairs in first.items():
        one = statistics.median(a for a, _ in pairs)
        every = statistics.median(b for _, b in pairs)
        line = (
            f"{width:3d} tokens: 1 thread {one * 1e6:7.0f} us, {most} threads "
            f"{every * 1e6:7.0f} us, ratio {one / every:4.2f}"
        )
        if width in second:
            again = second[width]
            wins = sum(a < b for a, b in again)
            ratio = statistics.median(a for a, _ in again) / statistics.median(b for _, b in again)
            line += f"; again: ratio {ratio:4.2f}, one thread won {wins} of {len(again)}"
        print(f"{line} -> {_pick(second[width], most, AGREE) if width in second else most}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
