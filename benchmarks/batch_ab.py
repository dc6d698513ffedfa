"""Batched speculation against batched plain decoding, interleaved chunk by chunk.

Two batch engines on the same target (the embedded pair's, float32) serve N clients each under
steady turnover: every client sends its next request (an 80-token prompt from the held-out
files, 64 tokens, EOS off) as soon as its last one ends. Engine A's requests decode plainly,
engine B's with a drafter (draft length `auto`: the batch policy and its guard choose). The
two take turns of `--chunk-steps` steps, each turn timed to the end of its work (the queued
pass included), so that the machine's drift (a shared 2-core CPU drifts by a quarter between
runs and more within one) falls on both alike; the first `--warm-chunks` turns of each are not
counted. Reported: B's tokens per second over A's (over all counted turns, and the median of
the turns' ratios), the share of B's steps that drafted, that ran in the guard's plain
windows (every drafter the rows had barred), and that were the policy's own plain steps, and
each engine's host time per step (the main thread's CPU time: building the passes, the
engine's and the drafters' bookkeeping). On a GPU, where a small model's step takes a few
milliseconds, the host's time is what bounds a pipelined plain step: it is the figure a CPU
run can show of what speculation's bookkeeping costs there.

With `--vary-tokens LO HI` each request's budget is drawn from LO..HI instead (the same
draws, request by request, for both engines) and its prompt's length from 40..120 tokens:
requests of different lengths, as real traffic. With equal lengths plain decoding keeps its
rows in step (they join and leave together, and every row's pass attends over as many
columns as it holds); a single speculative step puts them out of step for good, and each
pass then attends over the longest row's columns: a cost of the set-up's symmetry that real
traffic does not have.

Run: `python benchmarks/batch_ab.py --concurrency 1 4 8 --json benchmarks/results/batch_ab.json`.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import time
from pathlib import Path

import mlx_spec  # noqa: F401  (first: loads the optimized BLAS before anything imports mlx)
from mlx_spec.caches.prompt_cache import RowCache
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.decoding.engine import BatchEngine, BatchRequest
from mlx_spec.drafters.batch import BatchDraftModel, BatchMTP, BatchNgram

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from batch_engine import embedded_pair, write_record  # noqa: E402

MODES = ["ngram", "draft-model", "mtp", "all"]


class Clients:
    """An engine serving `n` clients under steady turnover; counts the tokens streamed, and
    (with a drafter) the steps by kind."""

    def __init__(
        self, engine: BatchEngine, prompts: list, n: int, drafter, max_tokens: int, vary=None
    ):
        self.engine, self.prompts, self.drafter = engine, prompts, drafter
        self.max_tokens = max_tokens
        # Request k's (prompt length, budget): drawn alike for both engines.
        rng = random.Random(0)
        self.shapes = [
            (rng.randint(40, 120), rng.randint(*vary)) if vary else (None, max_tokens)
            for _ in range(4096)
        ]
        self.tokens, self.host_seconds = 0, 0.0
        self.steps: collections.Counter = collections.Counter()
        engine.row_cache = RowCache()
        if drafter is not None:
            choose, barred = engine.policy.choose, engine.policy.barred

            def count(choice, offered) -> None:
                shut = bool(choice.window) and all(choice.window >> a & 1 for a in offered)
                kind = "plain window" if shut else (
                    "drafted" if choice.num_draft else "policy plain"
                )  # fmt: skip
                self.steps[kind] += 1

            def counted(asks):
                choice = choose(asks)
                count(choice, {arm for ask in asks for arm in ask.arms})
                return choice

            def counted_barred(size, offered, free):
                choice = barred(size, offered, free)
                if choice is not None:
                    count(choice, offered)
                return choice

            engine.policy.choose, engine.policy.barred = counted, counted_barred
        for i in range(n):
            self.submit(i, i)

    def submit(self, client: int, k: int) -> None:
        def emit(item):
            if isinstance(item, Exception):
                raise item
            if item.token is not None:
                self.tokens += 1
            else:
                self.submit(client, k + len(self.prompts) // 2)

        length, budget = self.shapes[k % len(self.shapes)]
        self.engine.add(
            BatchRequest(
                self.prompts[k % len(self.prompts)][:length], SamplingConfig(temperature=0.0),
                budget, emit, drafter=self.drafter, num_draft="auto" if self.drafter else 0,
            )
        )  # fmt: skip

    def turn(self, steps: int) -> float:
        """Run `steps` steps; seconds, to the end of the work they queued. The host's share
        (this thread's CPU time: building passes, the engine's and the drafters' bookkeeping)
        is added to `host_seconds`."""
        tic, host = time.perf_counter(), time.thread_time()
        # The other engine's turn is no step's time (as an engine's idle time is not).
        self.engine._last_settle = tic
        for _ in range(steps):
            self.engine.step()
        mx.synchronize()
        self.host_seconds += time.thread_time() - host
        return time.perf_counter() - tic


def measure(model, tokenizer, vocab, drafters, prompts, n: int, mode: str, args) -> dict:
    engines = []
    for drafter in (None, mode):
        engine = BatchEngine(model, tokenizer, vocab, drafters(), max_batch=n, prefill_step=4096)
        engines.append(Clients(engine, prompts, n, drafter, args.max_tokens, args.vary_tokens))
    seconds = [0.0, 0.0]
    tokens = [0, 0]
    per_chunk = []
    for chunk in range(args.warm_chunks + args.chunks):
        order = (0, 1) if chunk % 2 else (1, 0)
        spent = [0.0, 0.0]
        before = [c.tokens for c in engines]
        if chunk == args.warm_chunks:
            for c in engines:
                c.host_seconds = 0.0
        for i in order:
            spent[i] = engines[i].turn(args.chunk_steps)
        if chunk >= args.warm_chunks:
            for i in (0, 1):
                seconds[i] += spent[i]
                tokens[i] += engines[i].tokens - before[i]
            made = [engines[i].tokens - before[i] for i in (0, 1)]
            per_chunk.append((made[1] / spent[1]) / (made[0] / spent[0]))
    rates = [t / s for t, s in zip(tokens, seconds, strict=True)]
    steps = engines[1].steps
    total = sum(steps.values()) or 1
    return {
        "concurrency": n,
        "mode": mode,
        "plain_tokens_per_sec": rates[0],
        "tokens_per_sec": rates[1],
        "over_plain": rates[1] / rates[0],
        "over_plain_per_turn_median": statistics.median(per_chunk),
        # the host's milliseconds per step (see `Clients.turn`), plain decoding's and B's
        "plain_host_ms_per_step": 1e3 * engines[0].host_seconds / (args.chunks * args.chunk_steps),
        "host_ms_per_step": 1e3 * engines[1].host_seconds / (args.chunks * args.chunk_steps),
        "steps": {kind: count / total for kind, count in sorted(steps.items())},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=80)
    p.add_argument(
        "--vary-tokens", type=int, nargs=2, metavar=("LO", "HI"),
        help="each request's budget drawn from LO..HI, its prompt 40..120 tokens",
    )  # fmt: skip
    p.add_argument("--chunk-steps", type=int, default=40, help="steps per turn (default 40)")
    p.add_argument("--chunks", type=int, default=30, help="turns of each engine counted")
    p.add_argument("--warm-chunks", type=int, default=6, help="turns of each not counted")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    if args.vary_tokens and not 1 <= args.vary_tokens[0] <= args.vary_tokens[1]:
        p.error("--vary-tokens needs 1 <= LO <= HI")
    pair = embedded_pair(120 if args.vary_tokens else args.prompt_tokens)
    model, tokenizer, prompts, vocab = pair.model, pair.tokenizer, pair.prompts, pair.vocab

    def drafters() -> dict:
        return {
            "ngram": BatchNgram(),
            "draft-model": BatchDraftModel(pair.draft),
            "mtp": BatchMTP(pair.head.module),
        }

    results = []
    for n in args.concurrency:
        for mode in args.modes:
            row = measure(model, tokenizer, vocab, drafters, prompts, n, mode, args)
            results.append(row)
            shares = "  ".join(f"{k} {v:.0%}" for k, v in row["steps"].items())
            print(
                f"N={n:<2} {mode:>12}: {row['tokens_per_sec']:7.1f} tok/s against plain "
                f"{row['plain_tokens_per_sec']:7.1f}: {row['over_plain']:.3f}x  "
                f"(per turn, median {row['over_plain_per_turn_median']:.3f})  host "
                f"{row['host_ms_per_step']:.2f} ms/step against {row['plain_host_ms_per_step']:.2f}"
                f"  steps: {shares}",
                flush=True,
            )
    if args.json:
        write_record(
            args.json, argv, results, max_tokens=args.max_tokens,
            prompt_tokens=args.prompt_tokens, vary_tokens=args.vary_tokens,
            chunk_steps=args.chunk_steps, chunks=args.chunks,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
