"""Conformance matrix: every model family that both transformers and mlx-lm implement, written by
transformers, converted by `mlx-spec convert` (float32, plus 4- and 8-bit for a few families) and
compared with transformers' logits past the sliding window.

    python benchmarks/conformance.py                 # the whole matrix
    python benchmarks/conformance.py --quick         # a fast slice
    python benchmarks/conformance.py --families llama,gemma2 --json out.json

Exit status 1 if any family is a silent mismatch (converted, loaded, logits differ).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import mlx_spec  # noqa: E402, F401  (first: loads the optimized BLAS before mlx)

import conformance_matrix as cm  # noqa: E402

QUICK = ["llama", "gemma2", "qwen3_moe", "gpt2", "gpt_neox", "exaone4", "olmo3", "deepseek_v3"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", help="comma-separated model types (default: all)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--json", type=Path, help="write the matrix as JSON here")
    parser.add_argument("--no-quant", action="store_true", help="skip the quantized conversions")
    args = parser.parse_args(argv)
    known = cm.families()
    selected = args.families.split(",") if args.families else (QUICK if args.quick else known)
    unknown = [f for f in selected if f not in known]
    if unknown:
        parser.error(f"not in both transformers and mlx-lm: {', '.join(unknown)}")

    def progress(i, n, result):
        print(f"[{i:>3}/{n}] {cm.format_row(result)}  ({result.seconds:.1f}s)", flush=True)

    print(f"{'family':<20} {'result':<9} {'max|diff|':>8} {'pos':>4}  reason / quantized error")
    start = time.perf_counter()
    results = cm.run_matrix(selected, quant=not args.no_quant, progress=progress)
    seconds = time.perf_counter() - start
    counts = cm.summary(results)
    print(
        f"\n{len(results)} families in {seconds:.0f}s: "
        + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    )
    if args.json:
        cm.to_json(results, args.json, seconds)
        print(f"wrote {args.json}")
    return 1 if counts.get("MISMATCH") else 0


if __name__ == "__main__":
    sys.exit(main())
