"""Where the time of a speculative round goes, against the bare model passes it contains.

For each drafter at a fixed k (greedy and temperature 1.0), the embedded pair (or --model /
--draft-model) decodes the held-out prompts through mlx-spec's own loop with a
`profile.PhaseTimer`, which evaluates each phase's arrays at its end so that lazily queued work
is charged to the phase that queued it:

- policy: choosing k and recording the round;
- drafter catch-up: tokens a drafter had not seen (none at a fixed k);
- drafting: the drafter's k steps, graph building and compute;
- building the verify graph: the target's forward over last + k drafts, the verification math;
- target pass + verification: waiting for that graph to run;
- reading the result: the accepted count and tokens to the host;
- rollback + drafter update: cache rollback (trim, or restore + replay), the drafter's accept;
- other: the generator and bookkeeping (the round total minus the phases).

Beside each configuration: the bare target pass over k + 1 tokens (evaluated alone, median of
micro-benchmarks at the same cache length) and the plain decoding step (mlx-lm's pipelined
step, the baseline), so the table shows what a round costs beyond its model compute. The
phase timer adds synchronisations, so its rounds are slightly slower than unprofiled ones;
`unprofiled ms/round` is measured in the same run without it.

    python benchmarks/round_breakdown.py --json benchmarks/results/round_breakdown.json
    python benchmarks/round_breakdown.py --quick
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time

import mlx_spec  # first: loads the optimized BLAS before anything imports mlx
from mlx_spec import embedded
from mlx_spec.bench import harness as bench
from mlx_spec.bench.profile import PhaseTimer
from mlx_spec.core.compat import scored_vocab
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.core.stats import SpecStats
from mlx_spec.decoding.chain import speculative_rounds
from mlx_spec.decoding.policy import FixedDraftLength
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.drafters.ngram import NgramDrafter

import mlx.core as mx

PHASES = (
    "policy",
    "drafter catch-up",
    "drafting",
    "building the verify graph",
    "target pass + verification",
    "reading the result",
    "rollback + drafter update",
)
CONFIGS = (("draft-model", 1), ("draft-model", 2), ("mtp", 1), ("mtp", 2), ("ngram", 4))


def decode(model, vocab, drafter, ids, k, temperature, max_tokens, phases=None):
    """Rounds of one generation through the decode loop: (rounds, tokens, seconds)."""
    target = ModelRunner(model, vocab, keep_hidden=drafter.needs_hidden)
    hidden = target.prefill(ids[:-1])
    drafter.bind_target(target)
    drafter.begin(ids, vocab, hidden)
    mx.random.seed(0)
    rounds = tokens = 0
    tic = time.perf_counter()
    for rnd in speculative_rounds(
        target,
        drafter,
        ids[-1],
        policy=FixedDraftLength(k),
        sampling=SamplingConfig(temperature=temperature),
        max_tokens=max_tokens,
        stats=SpecStats(),
        phases=phases,
    ):
        rounds += 1
        tokens += len(rnd.tokens)
    return rounds, tokens, time.perf_counter() - tic


def measure(model, vocab, drafter, prompts, k, temperature, max_tokens, repeats) -> dict:
    """Profiled and unprofiled rounds of one configuration, interleaved; ms per round."""
    timer, profiled, plain = PhaseTimer(), [0, 0, 0.0], [0, 0, 0.0]
    for _ in range(repeats):
        for ids in prompts:
            for phases, acc in ((timer, profiled), (None, plain)):
                gc.collect()
                r, n, s = decode(model, vocab, drafter, ids, k, temperature, max_tokens, phases)
                acc[0], acc[1], acc[2] = acc[0] + r, acc[1] + n, acc[2] + s
    per_round = {p: timer.seconds.get(p, 0.0) / profiled[0] * 1e3 for p in PHASES}
    per_round["other"] = profiled[2] / profiled[0] * 1e3 - sum(per_round.values())
    return {
        "phases_ms": per_round,
        "profiled_ms_per_round": profiled[2] / profiled[0] * 1e3,
        "unprofiled_ms_per_round": plain[2] / plain[0] * 1e3,
        "tokens_per_round": plain[1] / plain[0],
        "unprofiled_tokens_per_sec": plain[1] / plain[2],
    }


def plain_step_ms(model, tokenizer, prompts, max_tokens) -> float:
    """mlx-lm's pipelined plain decoding step (ms), through mlx_spec.generate."""
    seconds = tokens = 0
    for ids in prompts:
        stats = mlx_spec.generate(model, tokenizer, ids, max_tokens=max_tokens).stats
        seconds, tokens = seconds + stats.decode_seconds, tokens + stats.generated_tokens
    return seconds / tokens * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target (default: the embedded pair)")
    parser.add_argument("--draft-model", help="draft model (default: the embedded pair's)")
    parser.add_argument("--max-tokens", type=int, help="default 128 (--quick: 64)")
    parser.add_argument("--num-prompts", type=int, help="default 10 (--quick: 3)")
    parser.add_argument("--repeats", type=int, help="default 2 (--quick: 1)")
    parser.add_argument("--quick", action="store_true", help="fewer prompts, tokens, timed passes")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    defaults = (64, 3, 1) if args.quick else (128, 10, 2)
    for name, default in zip(("max_tokens", "num_prompts", "repeats"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    target_dir, draft_dir = embedded.converted_pair() if args.model is None else (args.model, None)
    model, tokenizer = mlx_spec.load(str(target_dir))
    tokenizer = copy.copy(tokenizer)
    tokenizer.eos_token_ids = set()  # every generation runs max_tokens
    vocab = scored_vocab(model, tokenizer)
    drafters = {"ngram": NgramDrafter()}
    draft_path = args.draft_model or draft_dir
    if draft_path is not None:
        drafters["draft-model"] = mlx_spec.load_drafter(str(draft_path))
    try:
        drafters["mtp"] = mlx_spec.load_mtp_drafter(str(target_dir), model)
    except (FileNotFoundError, ValueError):
        pass
    prompts = [p.ids for p in bench.builtin_prompts(tokenizer, 128)][: args.num_prompts]
    context = len(prompts[0]) + args.max_tokens // 2
    passes = bench.PassTimer(model, vocab, prompts[0], context, range(1, 6), (0.0, 1.0))
    passes.sample(5 if args.quick else 20)
    bare = passes.medians()
    plain = plain_step_ms(model, tokenizer, prompts, args.max_tokens)
    rows = []
    for temperature in (0.0, 1.0):
        for name, k in CONFIGS:
            if name not in drafters:
                continue
            drafter = drafters[name]
            decode(model, vocab, drafter, prompts[0], k, temperature, 16)  # warm-up
            row = measure(model, vocab, drafter, prompts, k, temperature, args.max_tokens,
                          args.repeats)  # fmt: skip
            row.update(drafter=name, k=k, temperature=temperature,
                       bare_target_pass_ms=bare[temperature][k + 1] * 1e3)  # fmt: skip
            rows.append(row)
            print(f"{name} k={k} T={temperature:g}: {row['unprofiled_ms_per_round']:.2f} ms/round",
                  file=sys.stderr, flush=True)  # fmt: skip
    report = {
        "benchmark": "round breakdown",
        "header": {**bench.machine_info(), "target": str(target_dir)},
        "plain_step_ms": plain,
        "bare_one_token_pass_ms": bare[0.0][1] * 1e3,
        "rows": rows,
    }
    print(to_markdown(report))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


def to_markdown(report: dict) -> str:
    head = ["drafter", "k", "T", *PHASES, "other", "round (profiled)", "round", "bare pass"]
    lines = [
        f"plain decoding step (pipelined): {report['plain_step_ms']:.2f} ms; bare 1-token "
        f"target pass: {report['bare_one_token_pass_ms']:.2f} ms",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + " |",
    ]
    for r in report["rows"]:
        cells = [r["drafter"], str(r["k"]), f"{r['temperature']:g}"]
        cells += [f"{r['phases_ms'][p]:.2f}" for p in (*PHASES, "other")]
        cells += [f"{r['profiled_ms_per_round']:.2f}", f"{r['unprofiled_ms_per_round']:.2f}",
                  f"{r['bare_target_pass_ms']:.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
