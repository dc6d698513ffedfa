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
"""

from __future__ import annotations

from mlx_spec.fastmath import env_allows

import mlx.core as mx
import mlx.nn as nn

ENV = "MLX_SPEC_WEIGHT_LAYOUT"  # 0: keep the weights as loaded


def enabled() -> bool:
    return env_allows(ENV) and mx.default_device().type == mx.cpu


def column_major(module: nn.Module) -> int:
    """Store `module`'s linear weights column-major (see the module's docstring); returns how
    many were rewritten."""
    if not enabled():
        return 0
    done: dict[int, tuple[mx.array, mx.array]] = {}  # id(old) -> (old, new): tied weights
    for _, layer in module.named_modules():
        if not isinstance(layer, nn.Linear) or "weight" not in layer:
            continue
        weight = layer["weight"]
        if weight.ndim != 2 or not mx.issubdtype(weight.dtype, mx.floating):
            continue
        if id(weight) not in done:
            new = mx.contiguous(weight.T).T  # no copy when it is column-major already
            mx.eval(new)
            done[id(weight)] = (weight, new)
        layer["weight"] = done[id(weight)][1]
    return len(done)
