"""`mlx-spec bench`: tokens/s of every decoding mode, mlx-lm's speculative decoding beside."""

from __future__ import annotations

import sys

from mlx_spec.cli.common import add_shard_flag, check_shard
from mlx_spec.platform import blas


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure tokens/s of every decoding mode, with mlx-lm's speculative decoding beside",
        description="A/B benchmark: plain decoding, each drafter (draft model, n-gram, MTP) "
        "over a sweep of k and with k chosen every round ('auto'; also all drafters as one "
        "group: mode 'all'), greedy and temperature 1.0, and mlx-lm's own speculative "
        "decoding with the same draft model, on the same prompts and settings (EOS off, "
        "same seeds). Reports decode tokens/s, speedup over plain, acceptance (by draft "
        "position), mean accepted length, target passes per token, per-token latency "
        "p50/p95, prefill tokens/s, peak memory, time in rollback, the k chosen by 'auto', "
        "and the analytic speedup bound from the measured acceptance and costs. Warm-up, "
        "interleaved repeats, medians. Without --model: the embedded demo pair on held-out "
        "standard-library code.",
    )
    _add_input_flags(p)
    _add_sweep_flags(p)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    add_shard_flag(p)
    p.set_defaults(func=run)


def _add_input_flags(p) -> None:
    """The models and the prompts."""
    p.add_argument("--model", help="target: MLX model directory or hub id (default: the demo pair)")
    p.add_argument(
        "--draft-model", help="draft model for draft-model and mlx-lm modes (default: the pair's)"
    )
    p.add_argument(
        "--mtp",
        nargs="?",
        const="",
        metavar="DIR",
        help="MTP drafter directory (default: MODEL/mtp when it exists)",
    )
    p.add_argument(
        "--prompts",
        metavar="FILE",
        help='prompts, one per line or JSON lines {"prompt": ...} (default: the first '
        "--prompt-tokens tokens of each held-out standard-library file)",
    )
    p.add_argument("--max-tokens", type=int, help="tokens generated per prompt (default 128)")
    p.add_argument("--prompt-tokens", type=int, help="length of the built-in prompts (128)")
    p.add_argument("--num-prompts", type=int, help="use only the first N prompts")


def _add_sweep_flags(p) -> None:
    """The modes, draft lengths, temperatures and repeats measured."""
    p.add_argument(
        "--modes",
        help="comma-separated subset of plain,draft-model,ngram,mtp,eagle3,dflash,all,mlx-lm "
        "(default: "
        "all); "
        "tree modes, run only when named: medusa,lookahead,draft-tree,mtp-tree,eagle3-tree",
    )
    p.add_argument("--num-draft", help="k sweep, comma-separated (default 1,2,4,8)")
    p.add_argument(
        "--max-draft", type=int, help="K of the 'auto' rows, which choose k in 0..K (default 8)"
    )
    p.add_argument("--no-auto", action="store_true", help="skip the 'auto' rows")
    p.add_argument("--temperatures", help="comma-separated (default 0,1.0)")
    p.add_argument("--repeats", type=int, help="measured repeats; medians reported (default 3)")
    p.add_argument("--seed", type=int, help="base seed (default 0)")
    p.add_argument("--no-peer", action="store_true", help="skip mlx-lm's speculative decoding")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a run of a few minutes: 3 prompts, 64 tokens, k 2,4, 2 repeats",
    )


def run(args) -> int:
    from pathlib import Path

    from mlx_spec.bench import harness as bench

    config = bench.BenchConfig.preset(
        quick=args.quick,
        peer=not args.no_peer,
        auto=not args.no_auto,
        **{key: value for key, value in _overrides(args, bench).items() if value is not None},
    )
    config.validate()
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise FileNotFoundError(f"--json {args.json}: no such directory")
    blas.warn_if_slow()
    report = bench.run_bench(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.to_markdown())
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _overrides(args, bench) -> dict:
    """The settings the flags give (None: the preset's), parsed by the harness `bench`."""
    overrides = {
        "model": args.model,
        "draft_model": args.draft_model,
        "mtp": args.mtp,
        "prompts_file": args.prompts,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "num_prompts": args.num_prompts,
        "repeats": args.repeats,
        "seed": args.seed,
        "modes": bench.parse_modes(args.modes) if args.modes is not None else None,
        "num_draft": bench.parse_int_list(args.num_draft) if args.num_draft is not None else None,
        "max_draft": args.max_draft,
        "temperatures": (
            bench.parse_float_list(args.temperatures) if args.temperatures is not None else None
        ),
    }
    check_shard(args.shard, args.group)
    if args.group is not None:
        overrides["shard"] = args.shard or "auto"
    return overrides
