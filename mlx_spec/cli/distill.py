"""`mlx-spec distill`: train a drafter (draft model, MTP, Medusa, EAGLE-3, DFlash)."""

from __future__ import annotations

import os

from mlx_spec.platform import blas
from mlx_spec.training.config import KINDS, DistillConfig

GENERATE_FLAG = {  # the `generate` flag that loads each kind
    "mtp": "--mtp",
    "medusa": "--medusa",
    "eagle3": "--eagle",
    "dflash": "--dflash",
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "distill",
        help="train a drafter (draft model or MTP head) for a target",
        description="Distill a drafter that matches the frozen target's next-token distribution "
        "(KL to the target's probabilities) on your text, or on text the target writes itself. "
        "Checkpoints while it trains; run the same command again to resume after an "
        "interruption. Reports held-out KL and acceptance before and after.",
    )
    p.add_argument("--model", required=True, help="target: MLX model directory")
    p.add_argument("--out", required=True, help="drafter directory to write")
    p.add_argument(
        "--kind",
        choices=KINDS,
        default="draft-model",
        help="a small draft model (default), an MTP head on the target's states, Medusa "
        "heads (a tree of guesses of the next --heads tokens from the target's states), an "
        "EAGLE-3 head (one layer over features of three target layers) or a DFlash block "
        "drafter (--layers layers drafting 7 tokens per pass)",
    )
    _add_text_flags(p)
    _add_teacher_flags(p)
    _add_training_flags(p)
    p.set_defaults(func=run)


def _add_text_flags(p) -> None:
    """What the drafter trains on: files, or the target's answers to chat prompts."""
    p.add_argument(
        "--data",
        nargs="+",
        default=[],
        metavar="PATH",
        help="text files or folders to train on (default: text the target writes)",
    )
    p.add_argument(
        "--holdout",
        nargs="+",
        default=[],
        metavar="PATH",
        help="text kept for evaluation (default: the last tenth of --data)",
    )
    p.add_argument(
        "--prompts",
        metavar="FILE",
        help="train on the target's own answers to these chat prompts (JSON lines with "
        '"prompt", or one per line), each rendered with its chat template; the last tenth '
        "is held out",
    )
    p.add_argument(
        "--answers",
        metavar="FILE",
        help="with --prompts: where the answers are kept (default: OUT/answers.jsonl); answers "
        "already there are reused, so an interrupted run, or another drafter's, goes on",
    )
    p.add_argument(
        "--answer-tokens", type=int, default=256, help="with --prompts: tokens per answer"
    )
    p.add_argument(
        "--answer-temperatures",
        default="0,0.7",
        metavar="T,T",
        help="with --prompts: each prompt is answered once at each (default 0,0.7)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="--kind eagle3: draft over the N target tokens most frequent in the training "
        "text (a smaller, faster output head; default: the whole vocabulary)",
    )


def _add_teacher_flags(p) -> None:
    """The target's part (its cached answers, the text it writes) and a drafter to start from."""
    p.add_argument(
        "--teacher-cache",
        metavar="DIR",
        help="keep the target's answers (top tokens, features) here, to share between "
        "drafters trained on the same text and settings (default: inside --out, removed "
        "when done)",
    )
    p.add_argument(
        "--teacher-layers",
        default="",
        metavar="I,J",
        help="with --teacher-cache: also keep these target layers' features (Hugging Face "
        "hidden_states ids, the last: the final state), for a drafter trained next",
    )
    p.add_argument(
        "--generate-tokens",
        type=int,
        default=50_000,
        help="without --data: tokens the target writes to train on (default 50000)",
    )
    p.add_argument(
        "--target-tokens",
        type=int,
        default=0,
        metavar="N",
        help="with --data: also train on about N tokens of the target's own continuations "
        "of windows of the data, half greedy and half sampled at temperature 1, so the "
        "drafter learns what the target itself writes (default 0)",
    )
    p.add_argument(
        "--target-batch",
        type=int,
        default=16,
        metavar="ROWS",
        help="with --target-tokens: rows the target continues at once (default 16; a GPU "
        "writes them much faster with 256)",
    )
    p.add_argument(
        "--init",
        metavar="DIR",
        help="train this drafter further (a directory distill or convert wrote; its size "
        "flags are taken from it) instead of starting from scratch",
    )


def _add_training_flags(p) -> None:
    """Optimisation and the drafter's size."""
    defaults = DistillConfig()
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--lr", type=float, default=defaults.learning_rate, help="peak learning rate")
    p.add_argument(
        "--hidden-size", type=int, default=defaults.hidden_size, help="draft model width"
    )
    p.add_argument(
        "--layers", type=int, default=defaults.num_layers, help="draft model or DFlash depth"
    )
    p.add_argument(
        "--mtp-family",
        choices=("mimo", "deepseek_v3", "qwen3_5"),
        default=defaults.mtp_family,
        help="layout an MTP head is stored in",
    )
    p.add_argument(
        "--heads", type=int, default=defaults.heads, help="Medusa heads (default %(default)s)"
    )
    p.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--force", action="store_true", help="overwrite a finished output directory")


def run(args) -> int:
    from mlx_spec.training.distill import run_distill

    config = DistillConfig(
        kind=args.kind,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        learning_rate=args.lr,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        mtp_family=args.mtp_family,
        heads=args.heads,
    )
    chat = _chat_data(args)
    if args.draft_vocab is not None and args.kind != "eagle3":
        raise ValueError(
            "--draft-vocab sizes an EAGLE-3 head's vocabulary: use it with --kind eagle3"
        )
    blas.warn_if_slow()
    report = run_distill(
        args.model,
        args.out,
        config,
        data_paths=tuple(args.data),
        holdout_paths=tuple(args.holdout),
        generate=args.generate_tokens,
        target_tokens=args.target_tokens,
        target_batch=args.target_batch,
        init=args.init,
        force=args.force,
        chat=chat,
        draft_vocab=args.draft_vocab,
        teacher_cache=args.teacher_cache,
        teacher_layers=tuple(int(i) for i in args.teacher_layers.split(",") if i.strip()),
    )
    _print_report(args, report)
    return 0


def _chat_data(args):
    """`--prompts`: the target's answers to chat prompts as the training text; else None."""
    from mlx_spec.training.chat_data import ChatData

    if not args.prompts:
        return None
    if args.data:
        raise ValueError("--prompts and --data are two sources of text: give one")
    temperatures = tuple(float(t) for t in args.answer_temperatures.split(","))
    answers = args.answers or os.path.join(args.out, "answers.jsonl")
    return ChatData(args.prompts, answers, temperatures, args.answer_tokens)


def _print_report(args, report: dict) -> None:
    """Each held-out measure before -> after, and how to use the drafter written."""
    before, after = report["before"] or {}, report["after"]
    for key in after:
        was = f"{before[key]:.3f} -> " if key in before else ""
        print(f"{key}: {was}{after[key]:.3f}")
    flag = GENERATE_FLAG.get(args.kind, "--draft-model")
    print(
        f"wrote {args.out}; use it with: mlx-spec generate --model {args.model} {flag} {args.out}"
    )
