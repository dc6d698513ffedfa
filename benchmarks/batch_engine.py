"""Continuous batching with and without speculation, engine against engine (no HTTP).

N clients (prompts: the openings of the held-out standard-library files, `--prompt-tokens`
each) queue a request each at once on mlx-spec's `BatchEngine`; with `--requests R` each
client sends R in all, the next when its last finished (the engine then keeps a prompt cache
and prompts repeat across clients, as in `server_load.py`: the turnover of a server, without
HTTP; `--arrival-delay-ms D`: each next request D ms after the last one ended, as a
client's round trip to a server puts it; `--keep-prompt-cache`: one prompt cache for the whole
run, as a server keeps across requests, so that a repeat finds the last one's prompts and model
drafters' states). Every request generates exactly `--max-tokens`
tokens (EOS off); throughput is all
generated tokens over the wall time from the first request to the last token (prefill
included). Modes: plain decoding, each drafter of the embedded pair with the
batch policy choosing K every step ("auto"), and all drafters as one group; the peer is
mlx-lm's own `BatchGenerator` (what `mlx_lm.server` batches with) on the same model object and
prompts, plain (it has no speculation under batching). After a warm-up, every repeat runs every
configuration back to back in a rotating order; medians are reported, with each
configuration's throughput over the peer's at the same N.

Run it on any device MLX has (on a GPU the passes are memory-bound, as on a Mac, and verifying
a few drafts per row costs little; on a 2-core CPU a batch of 8 is compute-bound already).

`--compare-threads` adds plain decoding with every BLAS thread on every pass (on a CPU the
engine otherwise sets the BLAS threads per pass width, `mlx_spec.platform.blas_threads`).
`--compare-joins` adds each speculative mode with every joining row taken in by every model
drafter it may use (the policy's `join_pays` off), `--compare-plain-when-full` each with
plain steps forced whenever the batch holds N rows (an experiment: what speculation in a full
batch gains or loses, all its costs counted), and `--compare-guard` each with the policy's
guard off (its windows of plain decoding alone, `drafter_guard.DrafterGuard`).

`--trace` prints, under each mode, where its steps' time went (the engine's `StepTrace`:
building the drafters' graphs, queueing them, building the verifying pass, waiting for it,
and the host's work after it; a plain step's time is all its pass's), per rows and drafts
(K = 0: plain steps), with the tokens the steps emitted per millisecond, and the share of the
wall time (summed over the repeats) in plain, speculative and catch-up steps and outside them
(prefill, joins, the policy's choice), and the speculative steps' share by the policy's
reason for them (`BatchChoice.why`: its best plan, exploring steps, probes, the step after
a switch), each with the share of them that caught up. With several requests per client,
the steps with fewer rows than N are the run's tail: clients whose requests drafted well are
done, the others still run (plain decoding keeps every row in step, so it has none). It also
prints each finished row's decoding time over what plain steps at its batch sizes would have
taken for its tokens, and the share of that its speculative steps show (the engine's
`RowTrace`; the ledger `--pace-slack` bounds): what a row spends beyond both is steps among
rows out of step. `--time-parts` prints, under each mode, a run's mean wall time and the
milliseconds of it in the engine's parts (`PARTS`: its passes, settling their tokens, the
closed batch's choices, late joins, joins, leaving rows, telling the drafters a row's plain
steps, shedding model drafters) and its number of the policy's choices: the host's work a
mode adds.
`--compare-host-work US [US ...]` adds plain decoding with US microseconds of the host's
work (a busy loop) after each settled step: what a step's host work costs the passes (on a
CPU the host shares the cores with them).

Examples:
    python benchmarks/batch_engine.py                      # N = 1, 4, 8
    python benchmarks/batch_engine.py --concurrency 8 --temperature 1.0 --json out.json
    python benchmarks/batch_engine.py --concurrency 8 --modes plain mtp --num-draft 1 --trace
    python benchmarks/batch_engine.py --concurrency 8 --requests 4 --max-tokens 64 \
        --prompt-tokens 80 --compare-threads
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx_spec  # first: loads the optimized BLAS before anything imports mlx
from mlx_spec.bench.harness import machine_info
from mlx_spec.caches.prompt_cache import RowCache
from mlx_spec.core.compat import scored_vocab
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.decoding.batch_policy import BatchChoice
from mlx_spec.decoding.engine import BatchEngine, BatchRequest
from mlx_spec.drafters.batch import (
    BatchDFlash,
    BatchDraftModel,
    BatchEagle3,
    BatchMTP,
    BatchNgram,
)

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

MODES = ["plain", "ngram", "draft-model", "mtp", "eagle3", "dflash", "all"]


def run_engine(
    engine: BatchEngine,
    clients: list[list],
    max_tokens: int,
    mode: str,
    temperature: float,
    k="auto",
    every_thread: bool = False,
    join_share: float | None = None,
    plain_when_full: bool = False,
    delay: float = 0.0,
    guard: bool = True,
    keep_cache: bool = False,
    host_work: float = 0.0,
):
    """Each client's first request queued at once, each next one when the client's last
    finished; step to the end. Returns (tokens generated, seconds, acceptance). With more
    than one request per client the engine gets a fresh prompt cache. `every_thread`: the
    BLAS keeps all its threads for every pass (no `BlasThreads` plan); `join_share`: the
    policy's `min_share` for the run; `plain_when_full`: plain steps whenever the batch is
    full; `delay`: seconds between a request's end and its client's next request (a
    server's round trip; 0: queued at once); `guard`: False turns the policy's guard off;
    `keep_cache`: the engine's prompt cache is kept from run to run (made once), as a
    server keeps it across requests; `host_work`: seconds of the host's work (a busy loop)
    added after each settled plain step."""
    finals = []
    pending: list[tuple[float, list, int]] = []  # (when, client, request) not yet sent
    drafter = None if mode == "plain" else mode
    if keep_cache:
        engine.row_cache = engine.row_cache or RowCache()
    elif max(len(c) for c in clients) > 1:
        engine.row_cache = RowCache()

    def submit(client: list, r: int) -> None:
        def emit(item):
            if isinstance(item, Exception):
                raise item
            if item.token is None:
                finals.append(item.stats)
                if r + 1 < len(client) and delay:
                    pending.append((time.perf_counter() + delay, client, r + 1))
                elif r + 1 < len(client):
                    submit(client, r + 1)

        engine.add(
            BatchRequest(
                client[r], SamplingConfig(temperature=temperature), max_tokens, emit,
                drafter=drafter, num_draft=k if drafter else 0,
            )
        )  # fmt: skip

    plan = engine.threads
    if every_thread and plan is not None:
        engine.threads = None
        plan.reset()
    policy, share, kept = engine.policy, engine.policy.min_share, engine.policy.guard
    if not guard:
        policy.guard = None
    if join_share is not None:
        policy.min_share = join_share
    settle = engine._settle  # (the instance's own where `--time-parts` times it)
    if host_work:

        def busy_settle(*args, **kwargs):
            settle(*args, **kwargs)
            end = time.perf_counter() + host_work
            while time.perf_counter() < end:
                pass

        engine._settle = busy_settle
    chooser = policy.__dict__.get("choose")  # (`--time-parts` counts the choices)
    if plain_when_full:
        full = len(clients)
        policy.choose = lambda asks, own=policy.choose: (
            BatchChoice(0, [(None, 0)] * len(asks)) if len(asks) >= full else own(asks)
        )
    try:
        tic = time.perf_counter()
        for client in clients:
            submit(client, 0)
        while engine.busy or pending:
            now = time.perf_counter()
            for due in [p for p in pending if p[0] <= now]:
                pending.remove(due)
                submit(due[1], due[2])
            if engine.busy:
                engine.step()
            elif pending:
                time.sleep(max(0.0, min(p[0] for p in pending) - now))
        seconds = time.perf_counter() - tic
    finally:
        engine.threads = plan
        policy.min_share, policy.guard = share, kept
        policy.__dict__.pop("choose", None)
        if chooser is not None:
            policy.choose = chooser
        if host_work:
            engine._settle = settle
    drafted = sum(s.drafted for s in finals)
    accepted = sum(s.accepted for s in finals)
    return sum(s.generated_tokens for s in finals), seconds, accepted / drafted if drafted else 0.0


def run_peer(model, clients: list[list], max_tokens: int, temperature: float, delay=0.0):
    """mlx-lm's BatchGenerator over the same clients (no stop tokens; each client's next
    request inserted when its last finished, or `delay` seconds later)."""
    gen = BatchGenerator(
        model,
        max_tokens=max_tokens,
        stop_tokens=[],
        sampler=make_sampler(temp=temperature),
        completion_batch_size=len(clients),
        prefill_batch_size=len(clients),
    )
    tic = time.perf_counter()
    uids = gen.insert([list(c[0]) for c in clients], max_tokens=[max_tokens] * len(clients))
    owner = {uid: (i, 0) for i, uid in enumerate(uids)}
    total = sum(len(c) for c in clients)
    tokens, done = 0, 0
    pending: list[tuple[float, int, int]] = []  # (when, client, request) not yet inserted
    while done < total:
        now = time.perf_counter()
        for due in [p for p in pending if p[0] <= now]:
            pending.remove(due)
            _, i, r = due
            (uid,) = gen.insert([list(clients[i][r])], max_tokens=[max_tokens])
            owner[uid] = (i, r)
        if not owner and pending:  # every client between requests
            time.sleep(max(0.0, min(p[0] for p in pending) - now))
            continue
        for response in gen.next_generated():
            tokens += 1
            if response.finish_reason is None:
                continue
            done += 1
            i, r = owner.pop(response.uid)
            if r + 1 < len(clients[i]):
                pending.append((time.perf_counter() + delay, i, r + 1))
    seconds = time.perf_counter() - tic
    gen.close()
    return tokens, seconds, 0.0


def print_rows(rows: list) -> dict:
    """Each finished row's decoding time over its plain-paced time (`RowTrace`: what plain
    steps at its batch sizes would have taken for its tokens) and the share of that its
    ledger shows (its speculative steps' time beyond their tokens' at plain pace), the
    median, p95 and most over the rows; and the same for the quarter of the rows that kept
    the fewest of their drafts."""
    rows = [r for r in rows if r.paced > 0]
    ratio = [r.seconds / r.paced for r in rows]
    ledger = [r.lag / r.paced for r in rows]
    kept = sorted(rows, key=lambda r: r.accepted / max(r.drafted, 1))[: max(1, len(rows) // 4)]

    def cell(values: list[float], signed: bool = False) -> str:
        values = sorted(values)
        at = values[min(len(values) - 1, int(0.95 * len(values)))]
        fmt = "+.2f" if signed else ".2f"
        return f"{statistics.median(values):{fmt}} / {at:{fmt}} / {values[-1]:{fmt}}"

    few = [r.seconds / r.paced for r in kept]
    print(
        f"      rows ({len(ratio)}): decoding time over plain-paced time (p50 / p95 / max) "
        f"{cell(ratio)}, the ledger's share {cell(ledger, True)}; the quarter that kept the "
        f"fewest drafts {cell(few)}"
    )
    return {"over_paced": ratio, "ledger": ledger, "fewest_kept_over_paced": few}


def print_trace(trace: list, wall: float) -> dict:
    """Per (rows, drafts): the median milliseconds of each part of a step (the engine's
    `StepTrace`; K = 0: plain steps) and the mean tokens it emitted, over the steps without a
    catch-up; then where the `wall` seconds of the runs went: plain steps, speculative steps
    (with a catch-up apart) and the rest (prefill, joins, leaving rows), and the speculative
    steps by the policy's reason for them. Returns those shares (for the JSON record)."""
    parts = ["choose", "draft_build", "draft_queue", "verify_build", "verify", "host"]
    totals: dict[str, list] = {"plain": [0.0, 0], "speculative": [0.0, 0], "catch-up": [0.0, 0]}
    why: dict[str, list] = {}  # the speculative steps by the policy's reason for them
    for step in trace:
        spent = sum(getattr(step, part) for part in parts)
        kind = "catch-up" if step.catch_up else "speculative" if step.num_draft else "plain"
        totals[kind][0] += spent
        totals[kind][1] += step.tokens
        if step.num_draft:
            entry = why.setdefault(step.why, [0.0, 0, 0.0])
            entry[0] += spent
            entry[1] += step.tokens
            entry[2] += spent if step.catch_up else 0.0
    rest = wall - sum(s for s, _ in totals.values())
    cells = "  ".join(
        f"{kind} {s / wall:4.0%} ({n / s if s else 0:.0f} tok/s)" for kind, (s, n) in totals.items()
    )
    print(f"      wall {wall:.2f} s: {cells}  other (prefill, joins) {rest / wall:4.0%}")
    if why:
        cells = "  ".join(
            f"{name} {s / wall:4.0%} ({n / s:.0f} tok/s; catching up {up / wall:4.0%})"
            for name, (s, n, up) in sorted(why.items(), key=lambda kv: -kv[1][0])
        )
        print(f"      speculative steps by the policy's reason: {cells}")
    shares = {kind: s / wall for kind, (s, _) in totals.items()}
    shares["other"] = rest / wall
    reasons = {
        name: {"share": s / wall, "tokens_per_sec": n / s, "catching_up": up / wall}
        for name, (s, n, up) in why.items()
    }
    if trace:  # rows out of step attend over the longest row's columns, and over holes
        columns = statistics.mean(s.columns for s in trace)
        held = statistics.mean(s.held for s in trace)
        print(f"      the target's cache after a step: {columns:.0f} columns in use, rows "
              f"holding {held:.0f} tokens on average")  # fmt: skip
    shapes: dict[tuple, list] = {}
    for step in trace:
        if not step.catch_up:
            shapes.setdefault((step.rows, step.num_draft), []).append(step)
    for (rows, k), steps in sorted(shapes.items()):
        ms = [1e3 * statistics.median(getattr(s, part) for s in steps) for part in parts]
        cells = "  ".join(f"{part} {v:5.2f}" for part, v in zip(parts, ms, strict=True))
        tokens = statistics.mean(s.tokens for s in steps)
        print(
            f"      B={rows} K={k} ({len(steps)} steps): {cells}  total {sum(ms):5.1f}  "
            f"tokens {tokens:4.1f} ({tokens / sum(ms):.2f}/ms)"
        )
    return {"wall_shares": shares, "speculative_by_reason": reasons}


def configurations(engine, model, batch, args) -> list:
    """(name, run) for each mode and the peer, each run returning (tokens, seconds, acceptance)."""
    out = []
    delay, keep = args.arrival_delay_ms / 1e3, args.keep_prompt_cache
    for mode in args.modes:
        out.append(
            (
                mode,
                lambda m=mode: run_engine(
                    engine, batch, args.max_tokens, m, args.temperature, args.num_draft,
                    delay=delay, keep_cache=keep,
                ),
            )
        )  # fmt: skip
    if args.compare_threads and engine.threads is not None:
        out.append(
            (
                "plain, every BLAS thread",
                lambda: run_engine(
                    engine,
                    batch,
                    args.max_tokens,
                    "plain",
                    args.temperature,
                    every_thread=True,
                    delay=delay,
                    keep_cache=keep,
                ),  # fmt: skip
            )
        )
    spec = [m for m in args.modes if m != "plain"]
    run = lambda m, **kw: run_engine(  # noqa: E731
        engine, batch, args.max_tokens, m, args.temperature, args.num_draft, delay=delay,
        keep_cache=keep, **kw,
    )  # fmt: skip
    if args.compare_joins:
        out += [(f"{m}, every join", lambda m=m: run(m, join_share=0.0)) for m in spec]
    if args.compare_plain_when_full:
        out += [(f"{m}, plain when full", lambda m=m: run(m, plain_when_full=True)) for m in spec]
    if args.compare_guard:
        out += [(f"{m}, no guard", lambda m=m: run(m, guard=False)) for m in spec]
    for us in args.compare_host_work:
        out.append((f"plain, +{us:g} us a step", lambda us=us: run("plain", host_work=us / 1e6)))
    peer = lambda: run_peer(model, batch, args.max_tokens, args.temperature, delay)  # noqa: E731
    out.append(("mlx-lm", peer))
    return out


# The engine's parts `--time-parts` times (each call's wall time, nested calls within it:
# `_settle` holds each row's emit; `_remove` the drafters' leaving and the prompt cache's put;
# `_tell`, telling the drafters a row's plain steps, is within `_closed_choice` and `_remove`;
# `_shed`, a closed batch's rows leaving their model drafters).
PARTS = (
    "_launch", "_settle", "_closed_choice", "_join_late", "_join_drafters", "_remove", "_tell",
    "_shed",
)  # fmt: skip


class PartTimer:
    """Wall time per run in each of the engine's `PARTS` (wrapped on the instance), and the
    policy's choices (`choices`: each a host's work over every row's ask)."""

    def __init__(self, engine: BatchEngine):
        self.spent: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.choices = 0
        for name in PARTS:
            setattr(engine, name, self._timed(name, getattr(engine, name)))
        choose = engine.policy.choose

        def counted(asks):
            self.choices += 1
            return choose(asks)

        engine.policy.choose = counted

    def _timed(self, name: str, method):
        def timed(*args, **kwargs):
            tic = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - tic

        return timed

    def take(self) -> dict[str, float]:
        """The seconds since the last take, per part, and the choices (`choices`)."""
        spent, self.spent = self.spent, dict.fromkeys(PARTS, 0.0)
        spent["choices"], self.choices = self.choices, 0
        return spent


def print_parts(runs: list[dict[str, float]], wall: float) -> dict[str, float]:
    """The mean milliseconds a run spent in each part (`wall`: the runs' seconds in all), and
    its mean number of the policy's choices."""
    means = {name: 1e3 * statistics.mean(r[name] for r in runs) for name in PARTS}
    cells = "  ".join(f"{name.lstrip('_')} {ms:.1f}" for name, ms in means.items())
    choices = statistics.mean(r["choices"] for r in runs)
    print(
        f"      ms a run: wall {1e3 * wall / len(runs):.0f}, in the engine's parts: {cells}; "
        f"{choices:.1f} choices"
    )
    return {**means, "choices": choices}


@dataclass
class EmbeddedPair:
    """The embedded pair as the engine benchmarks use it: the target (its tokenizer with EOS
    off, so that every request generates exactly max_tokens), the draft model, the MTP head,
    prompts from the held-out files and the vocabulary the target scores."""

    target_dir: Path
    model: object
    tokenizer: object
    draft: object
    head: object
    prompts: list
    vocab: int


def embedded_pair(prompt_tokens: int, prompt_chars: int | None = None) -> EmbeddedPair:
    """The embedded pair, its MTP head and the prompts: each held-out file's first
    `prompt_tokens` tokens, or its first `prompt_chars` characters (server_load.py's)."""
    from mlx_spec.embedded import converted_pair, stdlib_files

    target_dir, draft_dir = converted_pair()
    model, tokenizer = mlx_spec.load(str(target_dir))
    draft, _ = mlx_spec.load(str(draft_dir))
    head = mlx_spec.load_mtp_drafter(str(target_dir), model)
    tokenizer = copy.copy(tokenizer)
    tokenizer.eos_token_ids = set()
    texts = [f.read_text(errors="replace") for f in stdlib_files()[1]]
    if prompt_chars:
        prompts = [tokenizer.encode(t[:prompt_chars]) for t in texts]
    else:
        prompts = [tokenizer.encode(t)[:prompt_tokens] for t in texts]
    vocab = scored_vocab(model, tokenizer)
    return EmbeddedPair(target_dir, model, tokenizer, draft, head, prompts, vocab)


def write_record(path: str, argv, results: list, **settings) -> None:
    """A results file: the command, the machine, the run's settings and its results."""
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        **machine_info(),
        "device": str(mx.default_device()),
        **settings,
        "results": results,
    }
    Path(path).write_text(json.dumps(record, indent=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument(
        "--modes",
        nargs="+",
        default=["plain", "ngram", "draft-model", "mtp", "all"],
        choices=MODES,
        help="plain, ngram, draft-model, mtp, all (default) and eagle3, dflash",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument(
        "--prompt-chars",
        type=int,
        help="prompts of each held-out file's first N characters instead (server_load.py "
        "sends 200: text the n-gram lookup finds less in, acceptance about 0.5 against 0.7)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--num-draft",
        default="auto",
        type=lambda v: v if v == "auto" else int(v),
        help="k of every drafting row: auto (the batch policy's K, default) or a fixed k",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--pace-slack",
        type=float,
        default=None,
        metavar="SHARE",
        help="the engine keeps each row's pace against plain decoding with this slack (as "
        "`serve --pace-slack`; default: off)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="also print where the steps' time went, per rows and drafts (medians "
        "over the steps without a catch-up, ms)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=1,
        help="requests per client, each sent when the client's last one finished (default 1; "
        "more: the engine keeps a prompt cache, and prompts repeat across clients as in "
        "server_load.py)",
    )
    p.add_argument(
        "--arrival-delay-ms",
        type=float,
        default=0.0,
        help="with --requests > 1: milliseconds between a request's end and its client's next "
        "one (a server's round trip, as in server_load.py; default 0: queued at once)",
    )
    p.add_argument(
        "--keep-prompt-cache",
        action="store_true",
        help="keep one prompt cache for the whole run, as a server does across requests: a "
        "repeat's prompts, and the model drafters' states with them, are the last repeat's "
        "(a row then takes its drafters in for nothing; default: a fresh cache per run)",
    )
    p.add_argument(
        "--compare-threads",
        action="store_true",
        help="also run plain decoding with every BLAS thread on every pass (no per-width plan)",
    )
    p.add_argument(
        "--compare-joins",
        action="store_true",
        help="also run each speculative mode with every row joining every model drafter",
    )
    p.add_argument(
        "--compare-plain-when-full",
        action="store_true",
        help="also run each speculative mode with plain steps whenever the batch is full",
    )
    p.add_argument(
        "--compare-guard",
        action="store_true",
        help="also run each speculative mode with the policy's guard off (no windows of plain "
        "decoding alone to check its choices against)",
    )
    p.add_argument(
        "--compare-host-work",
        type=float,
        nargs="+",
        default=[],
        metavar="US",
        help="also run plain decoding with US microseconds of the host's work (a busy loop) "
        "after each settled step: what a step's host work costs the passes (an experiment)",
    )
    p.add_argument(
        "--time-parts",
        action="store_true",
        help="also print the mean milliseconds a run spent in the engine's parts (its "
        "passes, settling the tokens, the closed batch's choices, late joins, joins, "
        "leaving rows, telling the drafters, shedding), with each mode's mean wall time and "
        "number of the policy's choices a run",
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    pair = embedded_pair(args.prompt_tokens, args.prompt_chars)
    target_dir, model, tokenizer = pair.target_dir, pair.model, pair.tokenizer
    draft, head, prompts, vocab = pair.draft, pair.head, pair.prompts, pair.vocab
    drafters = {
        "ngram": BatchNgram(),
        "draft-model": BatchDraftModel(draft),
        "mtp": BatchMTP(head.module),
    }
    # The EAGLE-3 head and the DFlash drafter join (and join "all") when a mode names them.
    if "eagle3" in args.modes:
        drafters["eagle3"] = BatchEagle3(
            mlx_spec.load_eagle3_drafter(str(target_dir), model).module
        )
    if "dflash" in args.modes:
        drafters["dflash"] = BatchDFlash(mlx_spec.load_dflash_drafter(str(target_dir), model).model)
    results = []
    for n in args.concurrency:
        r = args.requests
        batch = [[prompts[(i * r + j) % len(prompts)] for j in range(r)] for i in range(n)]
        engine = BatchEngine(
            model, tokenizer, vocab, drafters, max_batch=n, prefill_step=4096,
            pace_slack=args.pace_slack,
        )  # fmt: skip
        configs = configurations(engine, model, batch, args)
        runs: dict[str, list] = {name: [] for name, _ in configs}
        traces: dict[str, list] = {}
        row_traces: dict[str, list] = {}
        walls: dict[str, float] = {}
        for _, fn in configs:  # warm-up (and the policy's first measurements)
            fn()
        timer = PartTimer(engine) if args.time_parts else None
        parts: dict[str, list] = {}
        for r in range(args.repeats):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for name, fn in order:
                engine.trace = traces.setdefault(name, []) if args.trace else None
                engine.row_trace = row_traces.setdefault(name, []) if args.trace else None
                if timer is not None:
                    timer.take()
                tokens, seconds, acceptance = fn()
                if timer is not None and name != "mlx-lm":
                    parts.setdefault(name, []).append(timer.take())
                walls[name] = walls.get(name, 0.0) + seconds
                runs[name].append((tokens / seconds, acceptance))
        peer = statistics.median(t for t, _ in runs["mlx-lm"])
        for name, values in runs.items():
            rate = statistics.median(t for t, _ in values)
            row = {
                "concurrency": n, "mode": name, "tokens_per_sec": rate,
                "over_mlx_lm": rate / peer, "acceptance": statistics.median(a for _, a in values),
            }  # fmt: skip
            plain = ""
            if "plain" in runs:  # each repeat over that repeat's plain run, the median
                pairs = zip(values, runs["plain"], strict=True)
                row["over_plain"] = statistics.median(a / b for (a, _), (b, _) in pairs)
                plain = f"  {row['over_plain']:5.2f}x plain (paired)"
            results.append(row)
            print(
                f"N={n:<2} {name:>12}: {rate:7.1f} tok/s  {rate / peer:5.2f}x mlx-lm{plain}  "
                f"acceptance {row['acceptance']:.2f}",
                flush=True,
            )
            if traces.get(name):
                row["trace"] = print_trace(traces[name], walls[name])
            if row_traces.get(name):
                row["rows"] = print_rows(row_traces[name])
            if parts.get(name):
                row["wall_ms"] = 1e3 * walls[name] / len(values)
                row["parts_ms"] = print_parts(parts[name], walls[name])
    if args.json:
        write_record(
            args.json, argv, results, max_tokens=args.max_tokens,
            prompt_tokens=args.prompt_tokens, prompt_chars=args.prompt_chars,
            requests=args.requests,
            temperature=args.temperature, repeats=args.repeats,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
