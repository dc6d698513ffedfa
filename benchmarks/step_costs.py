"""What the batch policy's cost model believes against what its steps cost, at N rows.

Three looks at one question (why a batch of 8 rows decodes plainly where its speculative steps
emit more tokens per millisecond), each on the embedded pair's target, N clients sending their
requests one after another (`batch_engine.run_engine`, EOS off), after a warm-up run:

- `predict`: the policy's own run (its guard off) and runs with K forced (0: plain, 1, 2, 3)
  at N rows; per mode the K it chose at N rows, its mean predicted milliseconds and tokens
  for K = 0..3, the steps' measured medians per (rows, K, catch-up) and the cost model's state
  at the end (plain seconds per B, the line's weights, the cells' mean extra seconds).
- `switch`: fixed patterns of plain and speculative steps at N rows (`--patterns P/S`: P plain
  steps then S speculative ones, K = `--k`), each speculative step's cost by its place in its
  run of them (does the first after plain steps cost more?), with where its time went
  (`StepTrace`: draft build, draft queue, verify build, verify, host).
- `probe`: plain requests and the policy's own runs (guard on and off) in one process, with
  every speculative step that came after plain ones or after rows joined or left (`disturbed`)
  listed, the host time of the policy's calls, and the cost model's switch and turnover
  estimates (`step_costs.StepCosts`).

Run: `python benchmarks/step_costs.py probe`, `python benchmarks/step_costs.py predict --k 1 2`,
`python benchmarks/step_costs.py switch --patterns 0/1 1/0 7/1 8/4`.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import mlx_spec  # noqa: F401  (first: loads the optimized BLAS before anything imports mlx)
from mlx_spec.decoding.batch_policy import BatchChoice
from mlx_spec.decoding.engine import BatchEngine
from mlx_spec.drafters.batch import BatchMTP, BatchNgram

sys.path.insert(0, str(Path(__file__).parent))
from batch_engine import embedded_pair, run_engine  # noqa: E402

SPANS = ("draft_build", "draft_queue", "verify_build", "verify", "host")


def total(step) -> float:
    return sum(getattr(step, name) for name in SPANS)


def ms(x: float) -> float:
    return round(float(x) * 1e3, 2)


def engine_for(pair, drafters, rows: int) -> BatchEngine:
    return BatchEngine(
        pair.model, pair.tokenizer, pair.vocab, drafters, max_batch=rows, prefill_step=4096
    )


def cost_state(policy) -> str:
    c = policy.costs
    cells = {(b, k): ms(s / w) for (_, b, k), (s, w) in c.cells.items() if w}
    return (
        f"plain { ({b: ms(v) for b, v in sorted(c.plain.items())}) } cells {cells} "
        f"switch { ({a: ms(v) for a, v in c.switch.items()}) } "
        f"turnover { ({b: ms(v) for b, v in c.turnover.items()}) }"
    )


def predict(pair, clients, args) -> None:
    for mode in args.modes:
        drafters = (
            {"ngram": BatchNgram()} if mode == "ngram" else {"mtp": BatchMTP(pair.head.module)}
        )
        for force in [None, *args.k]:
            engine = engine_for(pair, drafters, args.rows)
            run_engine(engine, clients, args.max_tokens, mode, 0.0)  # warm-up
            policy, log = engine.policy, []
            own = policy._choose

            def choose(asks, policy=policy, own=own, force=force, log=log):
                if len(asks) != args.rows or policy._plain_seen < 2:
                    return own(asks)
                gains, costs = policy._gains(), policy.costs
                predicted = [costs.seconds(args.rows, k, (0,)) for k in range(4)]
                tokens = [policy._plan(asks, k, gains)[1] for k in range(4)]
                if force is None:
                    choice = own(asks)
                elif force == 0:
                    choice = BatchChoice(0, [(None, 0)] * len(asks))
                else:
                    choice = policy._choice(asks, force, policy._plan(asks, force, gains)[0])
                log.append((predicted, tokens, choice.num_draft))
                return choice

            policy._choose = choose
            engine.trace = []
            tok, sec, _ = run_engine(engine, clients, args.max_tokens, mode, 0.0, guard=False)
            chosen = dict(collections.Counter(k for *_, k in log))
            print(
                f"== {mode} K={'policy' if force is None else force}: {tok / sec:.0f} tok/s, "
                f"K chosen at {args.rows} rows {chosen}",
                flush=True,
            )
            if log:
                pred = [ms(statistics.mean(p[i] for p, _, _ in log)) for i in range(4)]
                toks = [round(statistics.mean(t[i] for _, t, _ in log), 2) for i in range(4)]
                print(f"   predicted ms K = 0..3 {pred}, tokens {toks}")
            cells = collections.defaultdict(list)
            for s in engine.trace:
                cells[(s.rows, s.num_draft, s.catch_up > 0)].append((total(s), s.tokens))
            measured = {
                key: (
                    len(v),
                    ms(statistics.median(t for t, _ in v)),
                    round(statistics.mean(n for _, n in v), 1),
                )
                for key, v in sorted(cells.items())
                if key[0] >= args.rows - 2
            }
            print(f"   measured (rows, K, catch-up): (steps, median ms, tokens) {measured}")
            print(f"   {cost_state(policy)}", flush=True)


def switch(pair, clients, args) -> None:
    engine = engine_for(pair, {"ngram": BatchNgram()}, args.rows)
    policy, own = engine.policy, engine.policy._choose
    state = {"step": 0, "pattern": (0, 1)}
    k = next((k for k in args.k if k > 0), 1)

    def choose(asks):
        if len(asks) < args.rows or policy._plain_seen < 2:
            return own(asks)
        plain, spec = state["pattern"]
        state["step"] += 1
        if (state["step"] - 1) % (plain + spec) >= plain:
            return policy._choice(asks, k, policy._plan(asks, k, policy._gains())[0])
        return BatchChoice(0, [(None, 0)] * len(asks))

    policy._choose = choose
    for warm in ((0, 1), (1, 0)):
        state["pattern"] = warm
        run_engine(engine, clients, args.max_tokens, "ngram", 0.0, guard=False)
    for text in args.patterns:
        state["pattern"], state["step"] = tuple(int(x) for x in text.split("/")), 0
        engine.trace = []
        tok, sec, _ = run_engine(engine, clients, args.max_tokens, "ngram", 0.0, guard=False)
        places, run, last = collections.defaultdict(list), 0, None
        for s in (s for s in engine.trace if s.rows == args.rows):
            kind = "spec" if s.num_draft else "plain"
            run = run + 1 if kind == last else 1
            places[(kind, min(run, 4))].append(s)
            last = kind
        print(
            f"== pattern plain {text.split('/')[0]} / speculative {text.split('/')[1]}, "
            f"K = {k}: {tok / sec:.0f} tok/s, {len(engine.trace)} steps",
            flush=True,
        )
        for key in sorted(places):
            v = places[key]
            spans = [ms(statistics.median(getattr(s, n) for s in v)) for n in SPANS]
            print(
                f"   {key}: {len(v)} steps, median {ms(statistics.median(map(total, v)))} ms, "
                f"tokens {statistics.mean(s.tokens for s in v):.1f}, spans {spans}"
            )


def probe(pair, clients, args) -> None:
    for variant in args.variants:
        engine = engine_for(pair, {"ngram": BatchNgram()}, args.rows)
        mode = "plain" if variant == "plain" else "ngram"
        guard = variant == "policy"
        run_engine(engine, clients, args.max_tokens, mode, 0.0, guard=guard)
        policy, times, disturbed = engine.policy, collections.defaultdict(list), []
        observe = policy.observe

        def record(*a, observe=observe, marks=disturbed, **kw):
            marks.append(kw.get("disturbed", False))
            return observe(*a, **kw)

        policy.observe = record
        for name in ("choose", "barred", "observe"):
            timed = getattr(policy, name)

            def wrap(*a, timed=timed, name=name, times=times, **kw):
                tic = time.perf_counter()
                out = timed(*a, **kw)
                times[name].append(time.perf_counter() - tic)
                return out

            setattr(policy, name, wrap)
        engine.trace = []
        tok, sec, _ = run_engine(engine, clients, args.max_tokens, mode, 0.0, guard=guard)
        trace = engine.trace
        plain = [total(s) for s in trace if not s.num_draft and s.rows == args.rows]
        print(
            f"== {variant}: {tok / sec:.0f} tok/s, {len(trace)} steps, "
            f"{sum(1 for s in trace if s.num_draft)} speculative, plain step at "
            f"{args.rows} rows {ms(statistics.median(plain)) if plain else '-'} ms",
            flush=True,
        )
        print(f"   {cost_state(policy)}; disturbed steps {sum(disturbed)} of {len(disturbed)}")
        print(f"   host ms per call: { ({k: ms(statistics.mean(v)) for k, v in times.items()}) }")
        since = 0
        for i, s in enumerate(trace):
            if not s.num_draft:
                since += 1
                continue
            if since or (i < len(disturbed) and disturbed[i]):
                spans = [ms(getattr(s, n)) for n in SPANS]
                print(
                    f"   step {i} after {since} plain, disturbed {disturbed[i]}: B={s.rows} "
                    f"K={s.num_draft} tokens {s.tokens} columns {s.columns} "
                    f"{ms(total(s))} ms, spans {spans}"
                )
            since = 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("look", choices=["predict", "switch", "probe"])
    p.add_argument("--rows", type=int, default=8, help="clients, and the batch's rows")
    p.add_argument("--requests", type=int, default=3, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--modes", nargs="+", default=["ngram", "mtp"], help="predict: drafters")
    p.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=[0, 1, 2, 3],
        help="predict: the forced K runs; switch: K (the first above 0)",
    )
    p.add_argument("--patterns", nargs="+", default=["0/1", "1/0", "7/1", "8/4", "3/3"])
    p.add_argument(
        "--variants", nargs="+", default=["plain", "policy", "plain", "policy", "no-guard"]
    )
    args = p.parse_args(argv)
    pair = embedded_pair(args.prompt_tokens)
    prompts = pair.prompts
    clients = [
        [prompts[(i * 3 + j) % len(prompts)] for j in range(args.requests)]
        for i in range(args.rows)
    ]
    {"predict": predict, "switch": switch, "probe": probe}[args.look](pair, clients, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
