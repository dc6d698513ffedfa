"""What rows joining and leaving cost the batch engine: two A/Bs under steady turnover.

Engines on the embedded pair's target (float32) serve 8 clients each, every client sending its
next request (an 80-token prompt, 64 tokens, EOS off) as soon as its last one ends, and take
turns of `--chunk-steps` steps, each turn timed to the end of its queued work (as
`batch_ab.py` does: a shared machine's drift falls on all of them alike):

- `--part squeeze`, plain decoding: rows in step (every request ends at the same step, and
  the next ones join together), rows out of step (the first requests end at different steps,
  so every later one does too) with the columns squeezed only once they reach twice the
  longest row's (as before), and out of step with them squeezed at a tenth over it (now).
  Tokens per second over rows in step.
- `--part place`, requests of different lengths (16-112 tokens, prompts of 40-120, the same
  draws for both): a joining request takes the row a request left (`BatchCache.place`), or
  (as before) the row is dropped from the batch's cache and the new one appended, each a copy
  of the whole cache. Tokens per second of the first over the second, per mode.

Run: `python benchmarks/batch_rows.py --json benchmarks/results/batch_rows.json`
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx_spec  # noqa: F401  (first: loads the optimized BLAS before anything imports mlx)
from mlx_spec.batch_drafters import BatchDraftModel, BatchMTP, BatchNgram
from mlx_spec.engine import BatchEngine

sys.path.insert(0, str(Path(__file__).parent))
from batch_ab import Clients  # noqa: E402
from batch_engine import embedded_pair, write_record  # noqa: E402


def interleaved(clients: dict, args) -> dict:
    """Tokens per second of each engine over the counted turns (turn order rotated)."""
    names = list(clients)
    for c in clients.values():
        c.turn(args.chunk_steps * args.warm_chunks)
    tokens, seconds = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
    for chunk in range(args.chunks):
        order = names[chunk % len(names) :] + names[: chunk % len(names)]
        for name in order:
            before = clients[name].tokens
            seconds[name] += clients[name].turn(args.chunk_steps)
            tokens[name] += clients[name].tokens - before
    return {name: tokens[name] / seconds[name] for name in names}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", nargs="+", default=["squeeze", "place"], choices=["squeeze", "place"])
    p.add_argument("--modes", nargs="+", default=["plain", "ngram", "all"])
    p.add_argument("--chunk-steps", type=int, default=40)
    p.add_argument("--chunks", type=int, default=24, help="turns of each engine counted")
    p.add_argument("--warm-chunks", type=int, default=5)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    pair = embedded_pair(120)
    results = []

    def engine(**settings) -> BatchEngine:
        drafters = {
            "ngram": BatchNgram(),
            "draft-model": BatchDraftModel(pair.draft),
            "mtp": BatchMTP(pair.head.module),
        }
        e = BatchEngine(
            pair.model, pair.tokenizer, pair.vocab, drafters, max_batch=8, prefill_step=4096
        )
        for name, value in settings.items():
            setattr(e, name, value)
        return e

    if "squeeze" in args.part:
        prompts = [p[:80] for p in pair.prompts]
        clients = {}
        for name, stagger, slack in (
            ("in step", False, 0.1),
            ("out of step, squeezed at 2x", True, 1.0),
            ("out of step, squeezed at 1.1x", True, 0.1),
        ):
            c = Clients(engine(columns_slack=slack), prompts, 0, None, 64)
            if stagger:  # the first requests end 7 tokens apart: out of step for good
                c.shapes[:8] = [(None, 64 - 7 * i) for i in range(8)]
            for i in range(8):
                c.submit(i, i)
            clients[name] = c
        rates = interleaved(clients, args)
        for name, rate in rates.items():
            over = rate / rates["in step"]
            results.append({"part": "squeeze", "case": name, "tokens_per_sec": rate, "over": over})
            print(f"plain decoding, {name:>30}: {rate:7.1f} tok/s  {over:.3f}x", flush=True)
    if "place" in args.part:
        for mode in args.modes:
            drafter = None if mode == "plain" else mode
            clients = {
                reuse: Clients(engine(reuse_rows=reuse), pair.prompts, 8, drafter, 64, (16, 112))
                for reuse in (True, False)
            }
            rates = interleaved(clients, args)
            over = rates[True] / rates[False]
            results.append(
                {"part": "place", "mode": mode, "tokens_per_sec": rates[True],
                 "copied_tokens_per_sec": rates[False], "over": over}
            )  # fmt: skip
            print(
                f"{mode:>6}: rows taken over {rates[True]:7.1f} tok/s, dropped and appended "
                f"{rates[False]:7.1f}: {over:.3f}x",
                flush=True,
            )
    if args.json:
        write_record(
            args.json, argv, results, chunk_steps=args.chunk_steps, chunks=args.chunks
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
