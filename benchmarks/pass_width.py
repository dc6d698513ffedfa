"""What a wider target pass costs: the price of verifying drafts inside a batch.

A batch of B rows, each holding a `--context`-token prefix, runs one pass over n tokens per row
(n = 1: a plain step; n = K + 1: verifying K drafts); the median seconds of `--reps` passes
(taken in rounds over every configuration) are printed for every n, through mlx-spec's
`BatchCache` and through mlx-lm's `KVCache` (the same model, the same rows). Where a pass of
K + 1 tokens costs about what a pass of one does (memory-bound: a Mac, a GPU), speculation
inside a batch pays; where it costs K + 1 times as much (compute-bound), it cannot.

With `--drafter` (a target with an MTP head), the MTP head's drafting pass is timed as the
batched drafter runs it after a step that kept a draft: two pairs per row fed, the head
projected at one position, the argmax taken. Then, for each `--acceptance` a of one draft, the
most a speculative step verifying one MTP draft per row can emit per second over a plain step,
if nothing but its two passes cost time: (1 + a) P(1) / (P(2) + D).

With `--overhead`, the same passes also run through a copy of the model's architecture with
its widths shrunk (8 dimensions a head, an MLP of 16, random weights; the same layers, heads,
vocabulary and cache): its passes do next to no arithmetic, so their time is what a pass
costs whatever its weights, building its graph and running its ops one by one; each is
printed with its share of the model's own pass.

Examples:
    python benchmarks/pass_width.py                  # the embedded pair's target, B = 8
    python benchmarks/pass_width.py --overhead --rows 1 8 --widths 1 4
    python benchmarks/pass_width.py --rows 1 4 8 --widths 1 2 4 8 --model ./target
    python benchmarks/pass_width.py --drafter --acceptance 0.7 0.8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx_spec  # first: loads the optimized BLAS before anything imports mlx
from mlx_spec.caches.batch import BatchCache

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes


def ours(model, prefix: mx.array, n: int):
    """A timer of passes over n tokens per row through a `BatchCache`: `run(reps)` -> seconds
    of each pass."""
    b, length = prefix.shape
    cache = BatchCache(model, b)
    cache.begin([length] * b)
    model(prefix, cache=cache.layers)
    cache.end([length] * b)
    mx.eval(cache.state)
    tokens = mx.zeros((b, n), mx.uint32)

    def run(reps: int) -> list[float]:
        times = []
        for _ in range(reps):
            tic = time.perf_counter()
            cache.begin([n] * b)
            logits = model(tokens, cache=cache.layers)
            cache.end([n] * b)
            mx.eval(logits)
            times.append(time.perf_counter() - tic)
            # Rolled back in place: the next pass writes the same columns (a compaction
            # here would leave the keys exactly as wide as the rows, and every pass would
            # pay for growing them again).
            cache.truncate([x - n for x in cache.lengths])
            mx.eval(cache.state)
        return times

    return run


def theirs(model, prefix: mx.array, n: int):
    """The same through mlx-lm's `KVCache` (rows of equal length)."""
    cache = make_prompt_cache(model)
    model(prefix, cache=cache)
    mx.eval([c.state for c in cache])
    tokens = mx.zeros((prefix.shape[0], n), mx.uint32)

    def run(reps: int) -> list[float]:
        times = []
        for _ in range(reps):
            tic = time.perf_counter()
            mx.eval(model(tokens, cache=cache))
            times.append(time.perf_counter() - tic)
            for c in cache:
                c.trim(n)
        return times

    return run


def mtp_draft(model_dir: str, model, prefix: mx.array):
    """A timer of the MTP head's drafting pass over B rows (see the module's text)."""
    head = mlx_spec.load_mtp_drafter(model_dir, model).module
    b, length = prefix.shape
    width = head.layers[0].input_layernorm.weight.shape[0]
    cache = BatchCache(head, b)
    cache.begin([length] * b)
    head(prefix, cache=cache.layers, hidden=mx.random.normal((b, length, width)))
    cache.end([length] * b)
    mx.eval(cache.state)
    pairs, hidden = mx.zeros((b, 2), mx.uint32), mx.random.normal((b, 2, width))
    at = mx.ones((b,), mx.int32)

    def run(reps: int) -> list[float]:
        times = []
        for _ in range(reps):
            tic = time.perf_counter()
            cache.begin([2] * b)
            logits = head(pairs, cache=cache.layers, hidden=hidden, at=at)
            cache.end([2] * b)
            mx.eval(mx.argmax(logits[:, 0], axis=-1))
            times.append(time.perf_counter() - tic)
            cache.truncate([x - 2 for x in cache.lengths])
            mx.eval(cache.state)
        return times

    return run


def shrunk(model_dir: str):
    """The model's architecture with its widths shrunk (see the module's text), random
    weights in float32."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config.get("num_attention_heads", 1)
    config.update(hidden_size=8 * heads, intermediate_size=16)
    if "head_dim" in config:
        config["head_dim"] = 8
    config.pop("quantization", None)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="target MLX directory (default: the embedded pair's target)")
    p.add_argument("--rows", type=int, nargs="+", default=[8], help="batch sizes B")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 8], help="tokens n")
    p.add_argument("--context", type=int, default=100, help="prefix tokens per row")
    p.add_argument("--reps", type=int, default=40, help="passes per measurement (median)")
    p.add_argument("--drafter", action="store_true", help="also time the MTP head's draft pass")
    p.add_argument(
        "--overhead",
        action="store_true",
        help="also time the passes of the architecture with its widths shrunk (what a pass "
        "costs whatever its weights)",
    )
    p.add_argument(
        "--acceptance", type=float, nargs="+", default=[0.7, 0.8],
        help="acceptance of one draft for the bound (with --drafter)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.drafter and not {1, 2} <= set(args.widths):
        p.error("--drafter needs widths 1 and 2 (a plain pass and one verifying one draft)")
    if args.model is None:
        from mlx_spec.embedded import converted_pair

        args.model = str(converted_pair()[0])
    model, _ = mlx_spec.load(args.model)
    small = shrunk(args.model) if args.overhead else None
    print(f"{args.model}, {mx.default_device()}, context {args.context}: ms per pass")
    for b in args.rows:
        prefix = mx.random.randint(0, 1000, (b, args.context)).astype(mx.uint32)
        timers = {}
        for name, make in (("BatchCache", ours), ("mlx-lm KVCache", theirs)):
            for n in args.widths:
                timers[name, n] = make(model, prefix, n)
        if small is not None:
            for n in args.widths:
                timers["shrunk", n] = ours(small, prefix, n)
        if args.drafter:
            timers["MTP draft", 0] = mtp_draft(args.model, model, prefix)
        times = {key: [] for key in timers}
        for timer in timers.values():
            timer(3)  # warm-up
        # Rounds over every configuration, so that a burst of noise on a shared machine falls
        # on all of them rather than on one.
        rounds = max(1, args.reps // 10)
        for _ in range(rounds):
            for key, timer in timers.items():
                times[key] += timer(max(1, args.reps // rounds))
        ms = {key: 1000 * statistics.median(t) for key, t in times.items()}
        for name in ("BatchCache", "mlx-lm KVCache"):
            cells = "  ".join(f"n={n}: {ms[name, n]:.1f}" for n in args.widths)
            print(f"B={b:<2} {name:>14}  {cells}", flush=True)
        if small is not None:
            cells = "  ".join(
                f"n={n}: {ms['shrunk', n]:.1f} ({ms['shrunk', n] / ms['BatchCache', n]:.0%})"
                for n in args.widths
            )
            print(f"B={b:<2} {'widths shrunk':>14}  {cells}", flush=True)
        if args.drafter:
            draft = ms["MTP draft", 0]
            plain, verify = ms["BatchCache", 1], ms["BatchCache", 2]
            bounds = "  ".join(
                f"a={a:.2f}: {(1 + a) * plain / (verify + draft):.2f}x" for a in args.acceptance
            )
            print(f"B={b:<2} {'MTP draft':>14}  {draft:.1f} ms; bound over plain  {bounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
